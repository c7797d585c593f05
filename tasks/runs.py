"""The run task: ids in, one call into :mod:`relayr.executor`, an outcome out, in the log.

A task is like a web view (Celery's own advice): it checks its arguments, makes one call into
the library, and maps typed outcomes to what the worker does and says. It carries three ids
and nothing else; the run is re-read from reflexr's store, which decides whether anything
happens (DESIGN contract 7). So a duplicated or redelivered message is harmless: a run that is
not due, or that another worker holds, does nothing and the log says so.

- Malformed arguments (not three non-empty strings of bounded length, without NUL or lone
  surrogates, each given once): one log line, no write, no retry: the message is rejected,
  never requeued (:class:`InvalidTask`).
- A delivery past ``max_redeliveries`` (its task killed its worker that often): the run is
  failed with reason ``worker_lost`` instead of being run again (ADR-0011).
- The runs of the same rule and scope that became due when this run ended are enqueued at
  once, so a scope advances at the pace of its runs, not of the dispatcher's passes.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog
from celery import shared_task
from celery.exceptions import Reject, SoftTimeLimitExceeded

from relayr import executor, metrics
from relayr.errors import InvalidTask
from relayr.executor import Executed
from tasks.worker import process

logger = structlog.get_logger("relayr.tasks")

TASK_NAME: Final = "relayr.execute_run"
"""The run task's name, stable across releases: messages queued by an older dispatcher must
still find their task."""

MAX_ID_LENGTH: Final = 256
"""The longest tenant, workspace or run id a task accepts. reflexr's run ids are 20 characters;
the bound keeps a garbage message from reaching storage."""

ID_NAMES: Final = ("tenant_id", "workspace_id", "run_id")

OUTCOMES: Final[Mapping[str, tuple[int, str]]] = {
    "succeeded": (logging.INFO, "run succeeded"),
    "retrying": (logging.WARNING, "run failed; reflexr will retry it"),
    "dead": (logging.ERROR, "run failed for good"),
    "cancelled": (logging.INFO, "run cancelled: its rule is gone"),
    "missing": (logging.WARNING, "run not found: nothing to do"),
    "not_due": (logging.INFO, "run not due: nothing to do"),
    "contended": (logging.INFO, "run held by another worker: nothing to do"),
    "dropped": (logging.WARNING, "attempt no longer current: its outcome was dropped"),
    "interrupted": (logging.WARNING, "attempt interrupted"),
    "abandoned": (logging.WARNING, "an abandoned attempt was recorded as failed"),
}
"""What each of :class:`relayr.executor.Executed`'s outcomes means, at what level."""


@dataclass(frozen=True)
class RunIds:
    """What a run task is about: one reflexr run in one tenant's workspace."""

    tenant_id: str
    workspace_id: str
    run_id: str

    def as_args(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.workspace_id, self.run_id)


def parse_ids(args: Sequence[object], kwargs: Mapping[str, object]) -> RunIds:
    """Read a task's arguments as :class:`RunIds`, by position or by name (not both).

    Raises:
        InvalidTask: Naming what is wrong, for anything but three ids.
    """
    unknown = sorted(set(kwargs) - set(ID_NAMES))
    if unknown:
        raise InvalidTask(f"unexpected task arguments: {', '.join(unknown)}")
    if len(args) > len(ID_NAMES):
        raise InvalidTask(f"expected 3 task arguments, got {len(args)}")
    values = dict(zip(ID_NAMES, args, strict=False))
    twice = [name for name in values if name in kwargs]
    if twice:
        raise InvalidTask(f"task argument {twice[0]} is given twice, by position and by name")
    for name in ID_NAMES[len(args) :]:
        if name not in kwargs:
            raise InvalidTask(f"task argument {name} is missing")
        values[name] = kwargs[name]
    for name, value in values.items():
        if not isinstance(value, str):
            raise InvalidTask(f"task argument {name} must be a string, not {type(value).__name__}")
        if not value.strip():
            raise InvalidTask(f"task argument {name} is empty")
        if len(value) > MAX_ID_LENGTH:
            raise InvalidTask(f"task argument {name} is longer than {MAX_ID_LENGTH} characters")
        if "\x00" in value:
            raise InvalidTask(f"task argument {name} contains a NUL character")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidTask(
                    f"task argument {name} is not text that storage can hold (a lone surrogate)"
                ) from None
    return RunIds(**{name: str(value) for name, value in values.items()})


def outcome_fields(executed: Executed) -> dict[str, Any]:
    """The log fields an outcome adds: the run's rule, attempt and reason, when it was read."""
    fields: dict[str, Any] = {"outcome": executed.outcome}
    if executed.detail:
        fields["detail"] = executed.detail
    run = executed.run
    if run is not None:
        fields.update(rule=run.rule, attempt=run.attempts, status=run.status, reason=run.reason)
    return fields


def log_outcome(executed: Executed) -> None:
    level, message = OUTCOMES.get(executed.outcome, (logging.WARNING, "unknown outcome"))
    logger.log(level, message, **outcome_fields(executed))


def send_run(app: Any, queue: str, ids: RunIds) -> None:
    """Queue one run task (the dispatcher's and this task's way to hand a run to a worker)."""
    app.send_task(TASK_NAME, args=ids.as_args(), queue=queue)
    metrics.record_enqueued()


def _execute_run(self: Any, *args: object, **kwargs: object) -> str:
    """Execute reflexr run ``run_id`` of ``tenant_id``/``workspace_id`` (the task's 3 args).

    Returns the outcome's name (Celery discards it: there is no result backend).
    """
    request = self.request
    try:
        ids = parse_ids(args, kwargs)
    except InvalidTask as invalid:
        logger.error("task refused", task_id=request.id, code=invalid.code, reason=invalid.message)
        raise Reject(invalid, requeue=False) from None
    settings = process.settings
    assert settings is not None, "tasks.app.create_celery configures the process"
    delivery = request.retries + 1
    if request.retries or (request.delivery_info or {}).get("redelivered"):
        metrics.record_redelivery()
    with structlog.contextvars.bound_contextvars(
        run_id=ids.run_id,
        tenant=ids.tenant_id,
        workspace=ids.workspace_id,
        task_id=request.id,
        delivery=delivery,
    ):
        try:
            runtime = process.runtime()
            if request.retries > settings.max_redeliveries:
                logger.error(
                    "run's task killed its worker too often: failing the run",
                    outcome="worker_lost",
                    reason="worker_lost",
                    max_redeliveries=settings.max_redeliveries,
                )
                executed = process.call(
                    executor.fail_run(
                        runtime,
                        *ids.as_args(),
                        reason="worker_lost",
                        error=f"the task of this run was delivered {delivery} times and its "
                        f"worker was lost each time (max_redeliveries={settings.max_redeliveries})",
                    )
                )
            else:
                logger.debug("run received")
                executed = process.call(executor.execute_run(runtime, *ids.as_args()))
        except SoftTimeLimitExceeded:
            logger.warning(
                "run interrupted by the task's soft time limit",
                outcome="interrupted",
                reason="soft_time_limit",
                soft_time_limit_s=settings.soft_time_limit_s,
            )
            return "interrupted"
        log_outcome(executed)
        for run_id in executed.next_runs:
            send_run(self.app, settings.queue, RunIds(ids.tenant_id, ids.workspace_id, run_id))
            logger.info("next run of the scope enqueued", next_run_id=run_id)
        return executed.outcome


execute_run: Final = shared_task(name=TASK_NAME, bind=True, typing=False)(_execute_run)
"""The Celery task ``relayr.execute_run(tenant_id, workspace_id, run_id)``."""
