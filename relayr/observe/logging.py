"""Logs: structlog, configured once per process by :func:`configure_logging` (ADR-0014).

``RELAYR_LOG_FORMAT`` is ``json`` (one object per line, with ``run_id``, ``rule``, ``outcome``
and the like where they apply) or ``console``; Celery's lines and relayr's share it, on stderr.
Loggers are never cached, so ``structlog.testing.capture_logs`` sees every line. With tracing on,
each line carries the current ``trace_id`` and ``span_id`` (ADR-0080).
"""

import logging
import sys
from typing import Final, TextIO

import structlog
from structlog.typing import Processor

from relayr.settings import LogFormat

QUIET_LOGGERS: Final = {
    "celery.app.trace": logging.WARNING,
    "celery.worker.strategy": logging.WARNING,
    "alembic": logging.WARNING,
}
"""Lines that say nothing relayr's own do not: Celery's per-task lines ("received", "succeeded
in 0.01s"; relayr's say the same with the run's ids and outcome) and Alembic's chatter at every
start of every process ("Context impl SQLiteImpl."). Their warnings and errors still show."""


def configure_logging(
    format: LogFormat = "console",
    *,
    level: int | str = logging.INFO,
    stream: TextIO | None = None,
    traced: bool = False,
) -> None:
    """Send structlog's and the standard library's logs to ``stream`` (stderr) in one format.

    Calling it again replaces the previous configuration (the root logger's handlers included),
    so it is safe in a process that configured logging already.

    Args:
        format: ``json`` (one object per line) or ``console``.
        level: The lowest level written.
        stream: Where lines go; stderr when None.
        traced: Whether lines carry the current span's ``trace_id`` and ``span_id``.
    """
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if traced:
        from relayr.observe.telemetry import add_trace_ids  # OpenTelemetry's API: only when traced

        shared.append(add_trace_ids)
    renderer: Processor
    if format == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(quiet)
