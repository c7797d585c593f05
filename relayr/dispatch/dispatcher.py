"""The dispatcher: decide which runs exist, and hand each due run to a queue, once per attempt.

Each pass follows every workspace's artifactr log into reflexr (ADR-0065), ticks schedules,
evaluates the rules (:mod:`relayr.dispatch.evaluation`), then enqueues the due runs of each
workspace, up to :data:`relayr.core.run_messages.MAX_BATCH_RUNS` per message (a run whose last
attempt was abandoned goes alone). The store is the truth (ADR-0001): the dispatcher remembers
only which attempt it enqueued, and enqueues again a run whose message it presumes lost,
:attr:`~relayr.settings.Settings.requeue_after_s` after the queue shows it (ADR-0003). A
duplicate costs one declined claim, never a second attempt; any number of dispatchers can run.
"""

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Final

import structlog
from reflexr.core import Run, RunStatus
from reflexr.workspace import Reactor, RunPolicy, WorkspaceRef

from relayr import broker
from relayr.core import reasons
from relayr.core.run_messages import MAX_BATCH_RUNS, RunMessage
from relayr.dispatch.evaluation import evaluate_all
from relayr.observe import telemetry
from relayr.runtime.process import Runtime
from relayr.settings import Settings

if TYPE_CHECKING:
    from relayr.follow.follower import Followers

type Enqueue = Callable[[RunMessage], Awaitable[None]]
"""Hands one message to the queue: ``await enqueue(batch)``."""

type QueueDepth = Callable[[], Awaitable[int | None]]
"""How many messages wait in the queue now, or None if the broker cannot say."""

type _RunKey = tuple[str, str, str]
type _Attempt = tuple[RunStatus, int, int]
type _Order = tuple[datetime, str, str]

DUE_READ_INTERVAL_S: Final = 2.0
"""How often the store's due runs are read at least. Reading them decodes every run due (up to
DUE_LIMIT: 45 ms of CPU for 1,000 on the 2-core test machines), which a burst pays every pass
while the queue drains. A pass that fired runs of rules that order none enqueues them from its
own evaluation, which made them; the due list (retries come due, leases lapsed, messages lost,
scopes' heads) is read every pass when the application has a rule ordered by scope, else at
this interval."""

DUE_LIMIT: Final = 1000
"""How many due runs one pass reads. More wait for the next pass, which reads the due runs
again whatever DUE_READ_INTERVAL_S says, and comes at once when this one enqueued some; the
bound keeps one pass's read and memory small."""

MESSAGES_PER_BURST: Final = 4
"""Into how many messages at least a pass's due runs are split (up to MAX_BATCH_RUNS runs
each, one workspace each), so a handful of due runs still reaches several worker processes."""

logger = structlog.get_logger("relayr.dispatch")


@dataclass(frozen=True)
class DispatchPass:
    """What one dispatcher pass did.

    Attributes:
        ticks: Schedule ticks published.
        firings: Times rules fired, each creating a run.
        due: Runs found due.
        enqueued: Runs handed to the queue.
        messages: Messages they went in.
        waiting: Due runs not enqueued again: their message waits in the queue.
        again: Runs enqueued again because their message was presumed lost.
        failed: Runs the queue refused; the next pass tries them again.
        bridged: Events the followers bridged from artifactr at the start of the pass.
    """

    ticks: int = 0
    firings: int = 0
    due: int = 0
    enqueued: int = 0
    messages: int = 0
    waiting: int = 0
    again: int = 0
    failed: int = 0
    bridged: int = 0


@dataclass
class _Message:
    """A message this dispatcher sent, and what it knows of its fate."""

    seq: int
    runs: set[_RunKey]
    taken_at: float | None = None
    passed_at: float | None = None
    """When the queue was first seen to have gone past it without a worker taking it."""


@dataclass
class _Queued:
    """A run this dispatcher enqueued: at which attempt, in which message, in which order."""

    attempt: _Attempt
    message: _Message
    order: _Order


@dataclass
class _Ledger:
    """The messages in flight and the runs they named."""

    runs: dict[_RunKey, _Queued] = field(default_factory=dict)
    messages: dict[int, _Message] = field(default_factory=dict)
    next_seq: int = 1
    latest_taken: int = 0
    """The newest message a worker is known to have taken: the queue is past every older one."""


class Dispatcher:
    """Evaluates rules and enqueues due runs, once per attempt.

    Args:
        runtime: The process's runtime; its holder names this dispatcher's leases.
        monotonic: The clock ``requeue_after_s`` is measured on.
        limit: How many due runs one pass reads.
        queue_depth: How many messages wait in the broker's queue (see the module); by default
            the settings' broker is asked (:func:`relayr.broker.queue_depth`).
        follow: Whether each pass follows artifactr's logs first; False where ``relayr
            follow`` runs the followers apart.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        limit: int = DUE_LIMIT,
        queue_depth: QueueDepth | None = None,
        follow: bool = True,
    ) -> None:
        application = runtime.application
        self._followers: Followers | None = None
        if follow:  # artifactr loads only for a dispatcher that follows
            from relayr.follow.follower import followers_of

            self._followers = followers_of(runtime)
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
        self._queue_depth = queue_depth or _asking(runtime.settings)
        self._sent = _Ledger()
        self._due_read_at: float | None = None
        self._evaluated_to: dict[WorkspaceRef, int] = {}

    async def pass_once(self, enqueue: Enqueue) -> DispatchPass:
        """Tick, evaluate, and enqueue every due run whose message is not in the queue.

        Raises:
            Exception: What the storage raised while ticking, evaluating or reading due runs;
                the next pass starts over. A failing ``enqueue`` is counted, not raised.
        """
        bridged = (await self._followers.follow_all()).bridged if self._followers else 0
        ticks = await self._reactor.tick() if self._rules.schedules else 0
        fired = await evaluate_all(self._rules, evaluated_to=self._evaluated_to)
        policy = RunPolicy.of(self._rules.rules.values())
        now = self._monotonic()
        if (
            self._due_read_at is None
            or policy.ordered
            or ticks
            or (now - self._due_read_at >= DUE_READ_INTERVAL_S)
        ):
            due = await self._rules.storage.due_runs(
                now=self._rules.clock(), limit=self._limit, policy=policy
            )
            self._due_read_at = now = self._monotonic()
            listed = {_key(ref, run): run for ref, run in due}
            window = _order(*due[-1]) if len(due) >= self._limit else None
            if window is not None:  # more are due: the next pass, at once, reads them
                self._due_read_at = None
            await self._observe(listed, window, now)
        else:
            # the runs this pass fired are due at once (no rule orders them): enqueue them
            # without reading every due run again (see DUE_READ_INTERVAL_S)
            due = fired
            listed = {_key(ref, run): run for ref, run in fired}
        firings = len(fired)
        fresh: list[tuple[_RunKey, Run]] = []
        waiting = again = 0
        for key, run in listed.items():
            queued = self._sent.runs.get(key)
            if queued is None or queued.attempt != _attempt(run):
                fresh.append((key, run))
            elif self._lost(queued.message, now):
                logger.info(
                    "run's message presumed lost: enqueued again",
                    run_id=run.id,
                    key=key,
                    message=queued.message.seq,
                )
                fresh.append((key, run))
                again += 1
            else:
                waiting += 1
        enqueued = messages = failed = 0
        for batch, runs in _batches(fresh):
            try:
                with telemetry.enqueuing(batch.tenant_id, batch.workspace_id, batch.run_ids):
                    await enqueue(batch)
            except Exception:
                logger.exception("enqueueing runs failed", run_ids=list(batch.run_ids))
                failed += len(runs)
                continue
            self._sent_now(runs)
            enqueued += len(runs)
            messages += 1
        done = DispatchPass(
            ticks, firings, len(due), enqueued, messages, waiting, again, failed, bridged
        )
        if ticks or firings or enqueued or failed or bridged:
            logger.info("dispatch pass", **vars(done))
        return done

    async def serve(self, enqueue: Enqueue, stop: asyncio.Event) -> None:
        """Run passes every ``dispatch_interval_s`` until ``stop`` is set.

        A pass that fails is logged and the next one starts over; a pass that filled its limit
        and enqueued something is followed at once by the next. Stopping gives up the
        followers' leases.
        """
        try:
            await self._serve(enqueue, stop)
        finally:
            if self._followers is not None:
                await self._followers.release()

    async def _serve(self, enqueue: Enqueue, stop: asyncio.Event) -> None:
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

    async def _observe(self, listed: dict[_RunKey, Run], window: _Order | None, now: float) -> None:
        """Learn from the due list which messages workers took, and forget what is done.

        A run this dispatcher enqueued that is no longer listed, though the list would show
        it (it comes before the list's end when the list was cut at the limit), left the due
        list: its message was taken. A listed run whose attempt changed was taken too.
        """
        sent = self._sent
        for key, queued in list(sent.runs.items()):
            run = listed.get(key)
            if run is not None and _attempt(run) == queued.attempt:
                continue
            if run is None and window is not None and queued.order >= window:
                continue  # past the list's end: the list says nothing about it
            if queued.message.taken_at is None:
                queued.message.taken_at = now
            sent.latest_taken = max(sent.latest_taken, queued.message.seq)
            queued.message.runs.discard(key)
            del sent.runs[key]
        outstanding = sorted(
            (m for m in sent.messages.values() if m.taken_at is None), key=lambda m: m.seq
        )
        if outstanding:
            depth = await self._queue_depth()
            head = outstanding[0]
            for message in outstanding:
                passed = message.seq < sent.latest_taken or (
                    message is head and (depth is None or depth == 0)
                )
                if passed and message.passed_at is None:
                    message.passed_at = now
                elif not passed:
                    message.passed_at = None
        sent.messages = {seq: m for seq, m in sent.messages.items() if m.runs}

    def _lost(self, message: _Message, now: float) -> bool:
        since = message.taken_at if message.taken_at is not None else message.passed_at
        return since is not None and now - since >= self._requeue_after_s

    def _sent_now(self, runs: Sequence[tuple[_RunKey, Run]]) -> None:
        sent = self._sent
        message = _Message(sent.next_seq, {key for key, _ in runs})
        sent.next_seq += 1
        sent.messages[message.seq] = message
        for key, run in runs:
            previous = sent.runs.get(key)
            if previous is not None:
                previous.message.runs.discard(key)
            sent.runs[key] = _Queued(_attempt(run), message, _order_of(key, run))
        sent.messages = {seq: m for seq, m in sent.messages.items() if m.runs}


def _batches(
    runs: Sequence[tuple[_RunKey, Run]],
) -> Iterator[tuple[RunMessage, list[tuple[_RunKey, Run]]]]:
    """Group runs into messages of one workspace each, in order, sized so the pass's runs make
    at least :data:`MESSAGES_PER_BURST` messages of at most MAX_BATCH_RUNS runs; a run whose
    last attempt was abandoned goes alone."""
    by_workspace: dict[tuple[str, str], list[tuple[_RunKey, Run]]] = {}
    groups: list[list[tuple[_RunKey, Run]]] = []
    for key, run in runs:
        if run.reason == reasons.ABANDONED:
            groups.append([(key, run)])
        else:
            by_workspace.setdefault(key[:2], []).append((key, run))
    size = min(MAX_BATCH_RUNS, max(1, math.ceil(len(runs) / MESSAGES_PER_BURST)))
    for members in by_workspace.values():
        groups.extend(members[index : index + size] for index in range(0, len(members), size))
    for group in groups:
        tenant_id, workspace_id, _ = group[0][0]
        batch = RunMessage(
            tenant_id=tenant_id,
            workspace_id=workspace_id,
            run_ids=tuple(run.id for _, run in group),
        )
        yield batch, group


def _asking(settings: Settings) -> QueueDepth:
    """How many messages wait in the settings' queue, as its broker says; None if it cannot."""

    async def depth() -> int | None:
        try:
            return await asyncio.to_thread(broker.queue_depth, settings)
        except Exception:  # an unreachable broker, or one that keeps no count (memory://)
            logger.debug("the broker could not say how many messages wait", exc_info=True)
            return None

    return depth


def _key(ref: WorkspaceRef, run: Run) -> _RunKey:
    return (ref.tenant_id, ref.workspace_id, run.id)


def _attempt(run: Run) -> _Attempt:
    return (run.status, run.attempts, run.epoch)


def _order(ref: WorkspaceRef, run: Run) -> _Order:
    """Where a run comes in the store's due list (by due time, then workspace)."""
    return (run.next_attempt_at, ref.tenant_id, ref.workspace_id)


def _order_of(key: _RunKey, run: Run) -> _Order:
    return (run.next_attempt_at, key[0], key[1])
