"""The dispatcher: decide which runs exist, and hand each due run to a queue, once per attempt.

Each pass ticks reflexr's schedules and evaluates the rules of every workspace (reflexr's
``Reactor`` does both, under its per-workspace evaluation lease, so any number of dispatchers
can run), then reads the runs that are due from the store: pending and retrying runs whose time
has come and that are first in their scope, and ``running`` runs whose lease lapsed because
their worker died. Each is handed to ``enqueue`` with its ids only.

The store, not the queue, is the truth about a run (DESIGN contract 7), so the dispatcher keeps
only a hint in memory: which attempt of each run it enqueued, and when. A run still due at the
same attempt (status, attempts, epoch) is not enqueued again until ``requeue_after_s`` has
passed: by then its message is presumed lost (a broker that lost it, a worker killed before it
claimed the run) and it is enqueued again. A run whose attempt changed is enqueued at once. A
duplicate costs one claim that is declined (``contended`` or ``not_due``), never a second
attempt; a lost message costs ``requeue_after_s``. Each further re-enqueue of the same attempt
waits twice as long as the one before (up to :data:`MAX_REQUEUE_FACTOR` times), because a run
still due after a re-enqueue most likely waits behind a backlog rather than being lost: without
the doubling a queue that is minutes behind would fill with copies of its own runs. A restarted
dispatcher knows nothing and enqueues every due run once more, the same harmless duplicate.
"""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import structlog
from reflexr.core import RunStatus
from reflexr.workspace import Reactor, RunPolicy

from relayr.runtime import Runtime

type Enqueue = Callable[[str, str, str], Awaitable[None]]
"""Hands one run to the queue: ``await enqueue(tenant_id, workspace_id, run_id)``."""

type _RunKey = tuple[str, str, str]
type _Attempt = tuple[RunStatus, int, int]

MAX_REQUEUE_FACTOR: Final = 16
"""The longest wait before the same attempt is enqueued again, in ``requeue_after_s``: 16 min
at the default, so even a run whose every message is lost is found again within that."""

DUE_LIMIT: Final = 1000
"""How many due runs one pass reads. More wait for the next pass, which comes as soon as the
queue has taken these; the bound keeps one pass's read and memory small."""

logger = structlog.get_logger("relayr.dispatch")


@dataclass(frozen=True)
class DispatchPass:
    """What one dispatcher pass did.

    Attributes:
        ticks: Schedule ticks published.
        firings: Times rules fired, each creating a run.
        due: Runs found due.
        enqueued: Runs handed to the queue.
        waiting: Due runs not enqueued again: their attempt was enqueued less than
            ``requeue_after_s`` ago.
        failed: Runs the queue refused; the next pass tries them again.
    """

    ticks: int = 0
    firings: int = 0
    due: int = 0
    enqueued: int = 0
    waiting: int = 0
    failed: int = 0


class Dispatcher:
    """Evaluates rules and enqueues due runs, once per attempt.

    Args:
        runtime: The process's runtime; its holder names this dispatcher's leases.
        monotonic: The clock ``requeue_after_s`` is measured on.
        limit: How many due runs one pass reads.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        limit: int = DUE_LIMIT,
    ) -> None:
        application = runtime.application
        self._rules = application.rules
        self._reactor = Reactor(
            application.rules,
            actions=application.actions,
            deps=runtime.bridge,
            holder=runtime.holder,
            lease_ttl=timedelta(seconds=runtime.settings.lease_ttl_s),
        )
        self._requeue_after_s = runtime.settings.requeue_after_s
        self._interval_s = runtime.settings.dispatch_interval_s
        self._monotonic = monotonic
        self._limit = limit
        self._queued: dict[_RunKey, tuple[_Attempt, float, float]] = {}
        """Per run: the attempt enqueued, when, and how long to wait before enqueueing it again."""

    async def pass_once(self, enqueue: Enqueue) -> DispatchPass:
        """Tick, evaluate, and enqueue every due run whose attempt is not queued already.

        Raises:
            Exception: What the storage raised while ticking, evaluating or reading due runs;
                the next pass starts over. A failing ``enqueue`` is counted, not raised.
        """
        ticks = await self._reactor.tick()
        firings = await self._reactor.evaluate()
        policy = RunPolicy.of(self._rules.rules.values())
        due = await self._rules.storage.due_runs(
            now=self._rules.clock(), limit=self._limit, policy=policy
        )
        now = self._monotonic()
        enqueued = waiting = failed = 0
        listed: set[_RunKey] = set()
        for ref, run in due:
            key = (ref.tenant_id, ref.workspace_id, run.id)
            attempt: _Attempt = (run.status, run.attempts, run.epoch)
            listed.add(key)
            queued = self._queued.get(key)
            wait_s = self._requeue_after_s
            if queued is not None and queued[0] == attempt:
                if now - queued[1] < queued[2]:
                    waiting += 1
                    continue
                wait_s = min(queued[2] * 2, self._requeue_after_s * MAX_REQUEUE_FACTOR)
                logger.info(
                    "run still due: enqueued again",
                    run_id=run.id,
                    status=run.status,
                    key=key,
                    next_in_s=wait_s,
                )
            try:
                await enqueue(*key)
            except Exception:
                logger.exception("enqueueing a run failed", run_id=run.id, key=key)
                failed += 1
                continue
            self._queued[key] = (attempt, now, wait_s)
            enqueued += 1
        self._forget(listed, now)
        done = DispatchPass(ticks, firings, len(due), enqueued, waiting, failed)
        if ticks or firings or enqueued or failed:
            logger.info("dispatch pass", **vars(done))
        return done

    async def serve(self, enqueue: Enqueue, stop: asyncio.Event) -> None:
        """Run passes every ``dispatch_interval_s`` until ``stop`` is set.

        A pass that fails is logged and the next one starts over; a pass that filled its limit
        is followed at once by the next.
        """
        while not stop.is_set():
            full = False
            try:
                done = await self.pass_once(enqueue)
                full = done.due >= self._limit and done.enqueued > 0
            except Exception:
                logger.exception("a dispatch pass failed; the next one starts over")
            if full:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await stop.wait()

    def _forget(self, listed: set[_RunKey], now: float) -> None:
        """Forget runs that are no longer due once their hint could no longer hold one back.

        A run that is running under its lease is not listed, but is kept until
        ``requeue_after_s`` passes, so a pass that reads a page without it does not enqueue
        it again meanwhile; memory holds at most the runs of that long.
        """
        self._queued = {
            key: queued
            for key, queued in self._queued.items()
            if key in listed or now - queued[1] < queued[2]
        }
