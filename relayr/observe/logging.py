"""Logs: structlog, configured once per process by :func:`configure_logging`.

Every relayr process (a worker and its pool children, the dispatcher, the CLI) calls
:func:`configure_logging` once, with ``RELAYR_LOG_FORMAT``: ``json`` writes one JSON object per
line (for machines: each line carries ``run_id``, ``rule``, ``attempt``, ``tenant``,
``workspace``, ``thread_id``, ``message_id``, ``outcome``, ``reason`` where they apply),
``console`` a readable line (for people). structlog renders through the standard library's
logging, so Celery's own lines and relayr's come out in the same format, on stderr.

Loggers are never cached on first use: ``structlog.testing.capture_logs`` then sees every line,
so tests check what is logged without mocks.

With tracing on (``traced``), every line also carries the current span's ``trace_id`` and
``span_id``, so a log line finds its trace and a trace its lines (ADR-0080).
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
