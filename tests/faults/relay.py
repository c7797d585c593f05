"""The one place the fault harness touches relayr's dispatcher and run task.

The harness hands runs to the workers as relayr does (the dispatcher's passes, the run task's
message) and reads the workers' JSON logs for figures. Both are interfaces that change with the
execution design (what a message carries, how outcomes are worded), so everything that knows
them is here: :func:`dispatching` (``Dispatcher.serve`` with an ``enqueue`` that sends the run
task and counts), and the readers of a log line (:func:`outcome_of`, :func:`lost_task`,
:func:`refused`). Faults are triggered by holds and the stores, never by these log lines, except
the one thing only a log shows: a delivery refused because its run is held (``contended``).
"""

import asyncio
import re
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import Dispatcher
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.app import create_celery
from tasks.runs import RUN_OUTCOME_LINES, send_runs
from tests.workers import log_records


@dataclass
class Handed:
    """What the dispatcher handed to the broker so far."""

    messages: int = 0
    enqueued: int = 0
    """Runs handed over, a run counted again each time it is."""
    runs: set[str] = field(default_factory=set)
    failures: int = 0


@asynccontextmanager
async def dispatching(runtime: Runtime, settings: Settings) -> AsyncIterator[Handed]:
    """The dispatcher's passes, in this process, for the block; what they handed, counted."""
    app = create_celery(settings)
    handed = Handed()

    async def enqueue(batch: RunMessage) -> None:
        try:
            await asyncio.to_thread(send_runs, app, settings.queue, batch)
        except Exception:
            handed.failures += 1
            raise
        handed.messages += 1
        handed.enqueued += len(batch.run_ids)
        handed.runs.update(batch.run_ids)

    stop = asyncio.Event()
    dispatcher = asyncio.create_task(Dispatcher(runtime).serve(enqueue, stop))
    try:
        yield handed
    finally:
        stop.set()
        await dispatcher


# ─── reading the workers' logs ───────────────────────────────────────────────

_OUTCOME_MESSAGES: Final = {message: outcome for outcome, (_, message) in RUN_OUTCOME_LINES.items()}

_OTHER_ENDS: Final = {
    "run interrupted by the task's soft time limit": "soft_time_limit",
    "run's task killed its worker too often: failing the run": "worker_lost_bound",
}

_TASK_ID: Final = re.compile(r"\[([0-9a-f-]{36})\]")


def log_lines(log_dir: Path) -> Iterator[dict[str, Any]]:
    """The JSON lines of every worker log in ``log_dir``."""
    for path in sorted(log_dir.glob("worker-*.log")):
        yield from log_records(path.read_text(errors="replace"))


def outcome_of(line: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(task id, run id, outcome) if ``line`` ends one run's part in a delivery of a run
    task (a message names several runs: each ends with its own line; the run id is empty on
    a line that ends them all)."""
    event = str(line.get("event", ""))
    outcome = _OUTCOME_MESSAGES.get(event) or _OTHER_ENDS.get(event)
    if outcome is None or "task_id" not in line:
        return None
    return str(line["task_id"]), str(line.get("run_id", "")), outcome


def lost_task(line: Mapping[str, Any]) -> str | None:
    """The task id (or ``""`` if unnamed) if ``line`` says a task was lost with its process."""
    event = str(line.get("event", ""))
    if "WorkerLostError" not in event:
        return None
    found = _TASK_ID.search(event)
    return found.group(1) if found else ""


def refused(line: Mapping[str, Any], run_ids: set[str]) -> bool:
    """Whether ``line`` says a delivery of one of ``run_ids`` was refused: its run was held."""
    return line.get("outcome") == "contended" and line.get("run_id") in run_ids
