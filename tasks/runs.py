"""The run tasks: ids in, one call into :mod:`relayr.execution.executor`, outcomes out, in the log.

``relayr.execute_runs(tenant_id, workspace_id, run_ids)`` names up to
:data:`relayr.core.run_messages.MAX_BATCH_RUNS` runs of one workspace (``relayr.execute_run``, one
run, is still served). A task carries ids only and re-reads each run, so a duplicate is harmless
(ADR-0001). Malformed arguments are rejected, never requeued (:class:`InvalidTask`). A message
redelivered because its worker died is split into one-run messages, and a one-run message past
``max_redeliveries`` fails its run ``worker_lost`` (ADR-0011).
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog
from celery import shared_task
from celery.exceptions import Reject, SoftTimeLimitExceeded
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from relayr.core import reasons
from relayr.core.errors import InvalidTask
from relayr.core.run_messages import MAX_BATCH_RUNS, MAX_ID_LENGTH, RunMessage
from relayr.execution import executor, limiting
from relayr.execution.executor import Executed
from relayr.observe import hooks
from relayr.observe.hooks import MessageRedelivered, RunsEnqueued
from relayr.runtime.process import Runtime
from tasks.worker import process

logger = structlog.get_logger("relayr.tasks")

TASK_NAME: Final = "relayr.execute_runs"
"""The run task's name, stable across releases: messages queued by an older dispatcher must
still find their task."""

LEGACY_TASK_NAME: Final = "relayr.execute_run"
"""The one-run task of earlier releases, still served so their queued messages run."""

BACKLOG_PRIORITY: Final = 6
"""The priority of a message of a backlog (``RunMessage.behind``); others have none. Both
brokers deliver a message without one (0, the highest) before any with one (ADR-0114)."""

ID_NAMES: Final = ("tenant_id", "workspace_id", "run_id")
"""The one-run task's arguments, in order."""

BATCH_NAMES: Final = ("tenant_id", "workspace_id", "run_ids")
"""The run task's arguments, in order."""

RUN_OUTCOME_LINES: Final[Mapping[str, tuple[int, str]]] = {
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
    "limited": (logging.INFO, "run waits: a limit holds it back"),
}
"""What each of :class:`relayr.execution.executor.Executed`'s outcomes means, at what level."""


@dataclass(frozen=True)
class RunIds:
    """One reflexr run in one tenant's workspace: what a one-run message names."""

    tenant_id: str
    workspace_id: str
    run_id: str

    def as_args(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.workspace_id, self.run_id)

    def as_batch(self) -> RunMessage:
        return RunMessage(
            tenant_id=self.tenant_id, workspace_id=self.workspace_id, run_ids=(self.run_id,)
        )


def parse_ids(args: Sequence[object], kwargs: Mapping[str, object]) -> RunIds:
    """Read a one-run task's arguments as :class:`RunIds`, by position or by name (not both).

    Raises:
        InvalidTask: Naming what is wrong, for anything but three ids.
    """
    values = _by_name(args, kwargs, ID_NAMES)
    batch = _validated(
        {
            "tenant_id": values["tenant_id"],
            "workspace_id": values["workspace_id"],
            "run_ids": (values["run_id"],),
        },
        {"run_ids": "run_id"},
    )
    return RunIds(batch.tenant_id, batch.workspace_id, batch.run_ids[0])


def parse_batch(args: Sequence[object], kwargs: Mapping[str, object]) -> RunMessage:
    """Read the run task's arguments as a :class:`RunMessage`, by position or by name.

    Raises:
        InvalidTask: Naming what is wrong.
    """
    return _validated(_by_name(args, kwargs, BATCH_NAMES), {})


def _by_name(
    args: Sequence[object], kwargs: Mapping[str, object], names: tuple[str, ...]
) -> dict[str, object]:
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise InvalidTask(f"unexpected task arguments: {', '.join(unknown)}")
    if len(args) > len(names):
        raise InvalidTask(f"expected {len(names)} task arguments, got {len(args)}")
    values = dict(zip(names, args, strict=False))
    twice = [name for name in values if name in kwargs]
    if twice:
        raise InvalidTask(f"task argument {twice[0]} is given twice, by position and by name")
    for name in names[len(args) :]:
        if name not in kwargs:
            raise InvalidTask(f"task argument {name} is missing")
        values[name] = kwargs[name]
    return values


def _validated(values: Mapping[str, object], renamed: Mapping[str, str]) -> RunMessage:
    try:
        return RunMessage.model_validate(values)
    except ValidationError as invalid:
        raise InvalidTask(_problem(invalid.errors()[0], renamed)) from None


def _problem(error: ErrorDetails, renamed: Mapping[str, str]) -> str:
    """One line for the first thing wrong, naming the argument as the task's caller knows it."""
    field, *index = error["loc"]
    name = renamed.get(str(field), str(field))
    if index and name == "run_ids":
        name = f"run_ids[{index[0]}]"
    kind, given = error["type"], error["input"]
    if kind == "string_type":
        return f"task argument {name} must be a string, not {type(given).__name__}"
    if kind == "string_unicode":
        return f"task argument {name} is not text that storage can hold (a lone surrogate)"
    if kind == "string_too_short":
        return f"task argument {name} is empty"
    if kind == "string_too_long":
        return f"task argument {name} is longer than {MAX_ID_LENGTH} characters"
    if kind == "tuple_type":
        return f"task argument {name} must be a list of ids, not {type(given).__name__}"
    if kind == "too_short":
        return f"task argument {name} names no run"
    if kind == "too_long":
        return f"task argument {name} names more than {MAX_BATCH_RUNS} runs"
    if kind == "value_error":
        return f"task argument {name} {error['ctx']['error']}"
    return f"task argument {name} is invalid: {error['msg'].lower()}"


def outcome_fields(executed: Executed) -> dict[str, Any]:
    """The log fields an outcome adds: the run's rule, attempt and reason, when it was read."""
    fields: dict[str, Any] = {"outcome": executed.outcome}
    run = executed.run
    if executed.run_id or run is not None:
        fields["run_id"] = executed.run_id or (run.id if run is not None else "")
    if executed.detail:
        fields["detail"] = executed.detail
    if run is not None:
        fields.update(rule=run.rule, attempt=run.attempts, status=run.status, reason=run.reason)
    return fields


def log_outcome(executed: Executed) -> None:
    level, message = RUN_OUTCOME_LINES.get(executed.outcome, (logging.WARNING, "unknown outcome"))
    logger.log(level, message, **outcome_fields(executed))


def send_runs(app: Any, queue: str, batch: RunMessage) -> None:
    """Queue one run message (the dispatcher's, ``runs retry``'s and this task's way to hand
    runs to a worker). Celery retries a publish that meets a connection error, a bounded
    number of times (``task_publish_retry_policy``); what still fails is raised."""
    app.send_task(
        TASK_NAME,
        args=(batch.tenant_id, batch.workspace_id, list(batch.run_ids)),
        queue=queue,
        priority=BACKLOG_PRIORITY if batch.behind else None,
    )
    hooks.emit(RunsEnqueued(len(batch.run_ids)))


def send_run(app: Any, queue: str, ids: RunIds) -> None:
    """Queue one message naming one run."""
    send_runs(app, queue, ids.as_batch())


def _execute(self: Any, batch: RunMessage) -> list[str]:
    """Execute ``batch``'s runs; return their outcomes' names (Celery discards them: there is
    no result backend)."""
    request = self.request
    settings = process.settings
    assert settings is not None, "tasks.app.create_celery configures the process"
    if request.retries or (request.delivery_info or {}).get("redelivered"):
        hooks.emit(MessageRedelivered())
    with structlog.contextvars.bound_contextvars(
        tenant=batch.tenant_id,
        workspace=batch.workspace_id,
        task_id=request.id,
        delivery=request.retries + 1,
    ):
        if request.retries and len(batch.run_ids) > 1:
            _split(self.app, settings.queue, batch)
            return []
        try:
            if request.retries > settings.max_redeliveries:
                results = [_fail_lost(batch, request.retries + 1, settings.max_redeliveries)]
            else:
                runtime = process.runtime()
                if runtime.requeue is None:
                    runtime.requeue = _requeuer(self.app, settings.queue)
                    process.call(_watching(runtime))
                results = process.call(
                    executor.execute_runs(
                        runtime, batch.tenant_id, batch.workspace_id, batch.run_ids
                    )
                )
        except SoftTimeLimitExceeded:
            for run_id in batch.run_ids:
                logger.warning(
                    "run interrupted by the task's soft time limit",
                    run_id=run_id,
                    outcome="interrupted",
                    reason=reasons.SOFT_TIME_LIMIT,
                    soft_time_limit_s=settings.soft_time_limit_s,
                )
            return ["interrupted"]
        for executed in results:
            log_outcome(executed)
        return [executed.outcome for executed in results]


def _requeuer(app: Any, queue: str) -> Callable[[RunMessage], Awaitable[None]]:
    """Queues runs from the worker's loop: the runs a limit frees go at once."""

    async def requeue(batch: RunMessage) -> None:
        await asyncio.to_thread(send_runs, app, queue, batch)

    return requeue


async def _watching(runtime: Runtime) -> None:
    limiting.watch_reloads(runtime)


def _fail_lost(batch: RunMessage, delivery: int, max_redeliveries: int) -> Executed:
    (run_id,) = batch.run_ids
    logger.error(
        "run's task killed its worker too often: failing the run",
        run_id=run_id,
        outcome=reasons.WORKER_LOST,
        reason=reasons.WORKER_LOST,
        max_redeliveries=max_redeliveries,
    )
    return process.call(
        executor.fail_run(
            process.runtime(),
            batch.tenant_id,
            batch.workspace_id,
            run_id,
            reason=reasons.WORKER_LOST,
            error=f"the task of this run was delivered {delivery} times and its worker was "
            f"lost each time (max_redeliveries={max_redeliveries})",
        )
    )


def _split(app: Any, queue: str, batch: RunMessage) -> None:
    """Send each run of a message whose worker died as a message of its own."""
    for run_id in batch.run_ids:
        send_runs(app, queue, batch.model_copy(update={"run_ids": (run_id,)}))
    logger.warning(
        "a message whose worker died was split into one message per run",
        run_ids=list(batch.run_ids),
    )


def _refused(request: Any, invalid: InvalidTask) -> Reject:
    logger.error("task refused", task_id=request.id, code=invalid.code, reason=invalid.message)
    return Reject(invalid, requeue=False)


def _execute_runs(self: Any, *args: object, **kwargs: object) -> list[str]:
    """Execute the runs ``run_ids`` of ``tenant_id``/``workspace_id`` (the task's 3 args)."""
    try:
        batch = parse_batch(args, kwargs)
    except InvalidTask as invalid:
        raise _refused(self.request, invalid) from None
    return _execute(self, batch)


def _execute_run(self: Any, *args: object, **kwargs: object) -> list[str]:
    """Execute reflexr run ``run_id`` of ``tenant_id``/``workspace_id`` (earlier releases'
    one-run message)."""
    try:
        ids = parse_ids(args, kwargs)
    except InvalidTask as invalid:
        raise _refused(self.request, invalid) from None
    return _execute(self, ids.as_batch())


execute_runs: Final = shared_task(name=TASK_NAME, bind=True, typing=False)(_execute_runs)
"""The Celery task ``relayr.execute_runs(tenant_id, workspace_id, run_ids)``."""

execute_run: Final = shared_task(name=LEGACY_TASK_NAME, bind=True, typing=False)(_execute_run)
"""The Celery task ``relayr.execute_run(tenant_id, workspace_id, run_id)`` of earlier releases."""


def task_names() -> Iterable[str]:
    """Every run task's name, for the app's routes and annotations."""
    return (TASK_NAME, LEGACY_TASK_NAME)
