"""The dispatcher: decide which runs exist, and hand each due run to a queue, once per attempt.

Woken by the store (:mod:`relayr.dispatch.changes`, ADR-0091), a pass evaluates the reflexr
workspaces that moved (:mod:`relayr.dispatch.evaluation`), those without a backlog first, and
follows the artifactr logs that moved into reflexr (ADR-0065); a workspace with nothing waiting
whose log moves during a pass is decided beside it (ADR-0127); a slow sweep catches a lost
notification. Due runs go out fairly between tenants and workspaces, at most ``fair_messages``
messages of a workspace in the broker, a backlog's behind the others (ADR-0093, ADR-0114). In
:meth:`Dispatcher.serve` a dispatcher decides only the workspaces of the shards it holds
(:mod:`relayr.dispatch.shards`, ADR-0092), so any number can run. The store is the truth
(ADR-0001): a run whose message is presumed lost is enqueued again
(:attr:`~relayr.settings.Settings.requeue_after_s`, ADR-0003); a duplicate costs one declined
claim, never a second attempt.
"""

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Final

import structlog
from reflexr.core import Run, RunStatus
from reflexr.workspace import Reactor, RunPolicy, WorkspaceRef

from relayr import broker
from relayr.core import reasons
from relayr.core.errors import InvalidAllowlist
from relayr.core.fairness import FairQueue, Message
from relayr.core.run_messages import MAX_BATCH_RUNS, RunMessage
from relayr.dispatch.changes import ChangeFeed, Changes, Workspace, feed_for, set_within
from relayr.dispatch.evaluation import BATCH_ENVELOPES, evaluate_each
from relayr.dispatch.shards import InMemoryShardStore, Shards, SqlShardStore
from relayr.ledger.limits import limit_uses
from relayr.observe import hooks, telemetry
from relayr.observe.hooks import LimitsUsed
from relayr.runtime.allowlist_file import load_allowlist
from relayr.runtime.process import Runtime
from relayr.settings import Settings

if TYPE_CHECKING:
    from relayr.follow.follower import Followers

type Enqueue = Callable[[RunMessage], Awaitable[None]]
"""Hands one message to the queue: ``await enqueue(batch)``."""

type QueueDepth = Callable[[], Awaitable[int | None]]
"""How many messages wait in the queue now, or None if the broker cannot say."""

type Owns = Callable[[str, str], bool]
"""Whether this dispatcher decides a workspace now (its shard's lease): ``owns(tenant, ws)``."""

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
"""Into how many messages at least a workspace's due runs are split (up to MAX_BATCH_RUNS runs
each), so a handful of due runs still reaches several worker processes."""

LIMITS_REPORT_S: Final = 15.0
"""How often a dispatcher reads what the operators' limits use, for the gauges
``relayr_limit_used`` and ``relayr_limit_waiting`` (a scrape's usual interval)."""

EVALUATION_BATCH: Final = 100
"""How many workspaces one pass evaluates (and follows) at most: a burst of changes across
many workspaces is decided in passes of this many, each handing out what it fired before the
next begins. A pass evaluates one transaction of envelopes of each
(:data:`relayr.dispatch.evaluation.BATCH_ENVELOPES`): first those without a backlog (no
envelopes left from the last pass, no due runs held back), whose runs go out at once, then,
after following, the others; a backlog never holds another workspace's new event for longer
than the pass under way."""

LONE_BATCH_ENVELOPES: Final = 100
"""How many envelopes one evaluation transaction reads of a backlog that no other workspace
waits behind (ADR-0120): the transaction's own cost, about 25 ms on PostgreSQL, is paid for
five times the envelopes, and a workspace that moves meanwhile waits for one transaction of
these at most, as it would for one of :data:`~relayr.dispatch.evaluation.BATCH_ENVELOPES`
of each of several backlogs."""

ONE_WRITER_PAUSE_S: Final = 0.1
"""On a store that lets one process write at a time (SQLite), the least pause between two passes
that each evaluate a transaction of a backlog: SQLite's busy handler sleeps up to 100 ms
between a waiting writer's tries, so a pause this long lets every waiting worker in before the
backlog's next transaction (ADR-0131). A longer transaction is followed by a pause as long."""

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
        withheld: Due runs kept back for fairness: their workspace has ``fair_messages``
            messages waiting in the broker already.
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
    withheld: int = 0


@dataclass
class _Message:
    """A message this dispatcher sent, and what it knows of its fate."""

    seq: int
    workspace: Workspace
    runs: set[_RunKey]
    behind: bool = False
    """Sent behind the messages of workspaces with nothing else waiting (a backlog's)."""
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
    """The newest message a worker is known to have taken: the broker delivered every older
    message not sent ``behind``, since it delivers those first."""
    latest_taken_behind: int = 0
    """The newest message sent ``behind`` a worker is known to have taken: the broker
    delivered every older one (each kind comes in the order it was sent)."""

    def taken(self, message: _Message, now: float) -> None:
        """A worker took ``message`` (``now``, unless known before)."""
        if message.taken_at is None:
            message.taken_at = now
        self.latest_taken = max(self.latest_taken, message.seq)
        if message.behind:
            self.latest_taken_behind = max(self.latest_taken_behind, message.seq)

    def passed(self, message: _Message) -> bool:
        """Whether the broker delivered a message sent after ``message`` that it would have
        delivered later."""
        latest = self.latest_taken_behind if message.behind else self.latest_taken
        return message.seq < latest

    def in_broker(self) -> dict[Workspace, int]:
        """How many messages of each workspace wait in the broker, as far as this dispatcher
        knows: none a worker took, nor one the queue went past (presumed lost, its runs are
        sent again: a lost message must not hold its workspace's place)."""
        counted: dict[Workspace, int] = {}
        for message in self.messages.values():
            if message.taken_at is None and message.passed_at is None:
                counted[message.workspace] = counted.get(message.workspace, 0) + 1
        return counted


@dataclass
class _Due:
    """A due run waiting in the fair queue."""

    key: _RunKey
    run: Run


class Dispatcher:
    """Evaluates rules and enqueues due runs, once per attempt, fairly between workspaces.

    Args:
        runtime: The process's runtime; its holder names this dispatcher's leases.
        monotonic: The clock ``requeue_after_s`` is measured on.
        limit: How many due runs one pass reads.
        queue_depth: How many messages wait in the broker's queue (see the module); by default
            the settings' broker is asked (:func:`relayr.broker.queue_depth`).
        follow: Whether each pass follows artifactr's logs first; False where ``relayr
            follow`` runs the followers apart.
        feed: What wakes :meth:`serve`; by default the application's store's
            (:func:`relayr.dispatch.changes.feed_for`), made when serving starts.
        owns: Which workspaces this dispatcher decides (the others are another's): by default
            all of them in :meth:`pass_once`, and in :meth:`serve` those of the shards it
            holds (:mod:`relayr.dispatch.shards`), unless ``owns`` or ``shards`` is given.
        shards: This dispatcher's share of the shards, kept by :meth:`serve`.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        limit: int = DUE_LIMIT,
        queue_depth: QueueDepth | None = None,
        follow: bool = True,
        feed: ChangeFeed | None = None,
        owns: Owns | None = None,
        shards: Shards | None = None,
    ) -> None:
        application = runtime.application
        settings = runtime.settings
        self._runtime = runtime
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
            lease_ttl=timedelta(seconds=settings.lease_ttl_s),
        )
        self._requeue_after_s = settings.requeue_after_s
        self._interval_s = settings.dispatch_interval_s
        self._sweep_s = settings.dispatch_sweep_s
        self._settle_s = settings.dispatch_settle_s
        self._monotonic = monotonic
        self._limit = limit
        self._queue_depth = queue_depth or _asking(settings)
        self._feed = feed
        self._owns = owns if owns is not None or shards is None else shards.owns
        self._shards = shards
        self._sent = _Ledger()
        self._fair: FairQueue[_Due] = FairQueue(
            per_workspace=settings.fair_messages,
            weights=settings.tenant_weights,
            batch=settings.fair_batch,
            spread=MESSAGES_PER_BURST,
        )
        self._due_read_at: float | None = None
        self._ticked_at: float | None = None
        self._evaluated_to: dict[WorkspaceRef, int] = {}
        self._followed_to: dict[Workspace, int] = {}
        self._swept_heads: dict[Workspace, int] = {}
        """artifactr's heads as the last sweep read them: a workspace followed in a later pass
        is recorded followed to its head then (so the next sweep does not follow it again)."""
        self._to_evaluate: dict[Workspace, None] = {}
        self._backlogged: dict[Workspace, None] = {}
        """Workspaces evaluated one transaction short of their head: each pass evaluates one
        more transaction of each, in turn, after the workspaces without a backlog."""
        self._to_follow: dict[Workspace, None] = {}
        self._evaluating: set[Workspace] = set()
        """Workspaces whose evaluation is under way (a pass's, or one beside it)."""
        self._enqueuing: set[_RunKey] = set()
        """Runs whose message is being handed to the queue, not yet recorded sent."""
        self._limits_read_at: float | None = None
        engines = application.engines
        self._one_writer = bool(engines) and engines[0].dialect.name == "sqlite"
        """Whether the store lets one process write at a time: a backlog's evaluation then
        pauses between its transactions so workers get the lock (ADR-0131)."""
        self._backlog_took_s = 0.0
        """How long the last pass's evaluation of backlogs and changed workspaces took."""

    @property
    def behind(self) -> bool:
        """Whether changed workspaces wait for the next pass (a burst past EVALUATION_BATCH, or
        a backlog past a transaction's envelopes)."""
        return bool(self._to_evaluate or self._backlogged or self._to_follow)

    async def pass_once(self, enqueue: Enqueue, changes: Changes | None = None) -> DispatchPass:
        """Follow and evaluate what changed, tick, and hand out due runs fairly.

        ``changes``: the workspaces whose logs moved (:class:`~relayr.dispatch.changes.Changes`);
        None, or one that says ``everything``, sweeps: every workspace whose head is not where
        this dispatcher last evaluated (or followed) it.

        Raises:
            Exception: What the storage raised while ticking, evaluating or reading due runs;
                the next pass starts over. A failing ``enqueue`` is counted, not raised.
        """
        started = time.perf_counter()
        sweep = changes is None or changes.everything
        if changes is not None:
            self._to_evaluate.update(dict.fromkeys(sorted(changes.rules)))
            self._to_follow.update(dict.fromkeys(sorted(changes.artifacts)))
        policy = RunPolicy.of(self._rules.rules.values())
        # the workspaces without a backlog go first: before following, and before those with
        # events left to evaluate or due runs held back (ADR-0114)
        busy = {w for w in self._to_evaluate if w in self._backlogged or self._fair.waiting(w)}
        first = _first(self._to_evaluate, EVALUATION_BATCH, self._owns, unless=busy)
        fired = await self._evaluate(first)
        await self._check_taken(first, self._monotonic())  # as beside a pass (_decide_fresh)
        early = await self._hand_out_fired(enqueue, fired, policy)
        handed_early = {_key(ref, run) for ref, run in fired} - set(self._fair)

        def taken_early(key: _RunKey) -> bool:
            """Whether a run handed out early in this pass is known taken since (its record
            gone): what this pass fired holds its state before that, not to be sent again."""
            return key in handed_early and key not in self._sent.runs

        following = time.perf_counter()
        bridged, moved = await self._follow(sweep)
        followed = time.perf_counter()
        self._to_evaluate.update(dict.fromkeys(moved))
        now = self._monotonic()
        ticks = 0
        if self._rules.schedules and (
            self._ticked_at is None or now - self._ticked_at >= self._interval_s
        ):
            ticks = await self._reactor.tick()
            self._ticked_at = now
        if sweep:
            await self._sweep_rules()
        done_first = set(first)  # what following moved there waits for the next pass
        chosen = _first(
            self._to_evaluate, EVALUATION_BATCH - len(first), self._owns, unless=done_first
        )
        for workspace in chosen:
            self._backlogged.pop(workspace, None)
        limit = EVALUATION_BATCH - len(first) - len(chosen)
        chosen += _first(self._backlogged, limit, self._owns, unless=done_first)
        lone = len(chosen) == 1 and not (self._to_evaluate or self._backlogged or first)
        evaluating = time.perf_counter()
        fired += await self._evaluate(
            chosen, batch=LONE_BATCH_ENVELOPES if lone else BATCH_ENVELOPES
        )
        decided = time.perf_counter()
        self._backlog_took_s = decided - evaluating
        if sweep:  # a sweep learns of every message taken, as a change would
            await self._check_taken({m.workspace for m in self._sent.messages.values()}, now)
        elif changes is not None:
            await self._check_taken(changes.rules, now)
        now = self._monotonic()
        full_list = False
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
            due = [(ref, run) for ref, run in due if self._decides(ref)]
            listed = {_key(ref, run): run for ref, run in due}
            window = _order(*due[-1]) if len(due) >= self._limit else None
            if window is not None and len(self._fair) < self._limit:
                self._due_read_at = None  # more are due: the next pass, at once, reads them
            full_list = window is None
            await self._observe(listed, window, now)
            for ref, run in fired:  # due at once, though past the list's end in a backlog
                if run.rule not in policy.ordered and not taken_early(_key(ref, run)):
                    listed.setdefault(_key(ref, run), run)
        else:
            # the runs this pass fired are due at once (no rule orders them): enqueue them
            # without reading every due run again (see DUE_READ_INTERVAL_S)
            due = fired
            listed = {_key(ref, run): run for ref, run in fired if not taken_early(_key(ref, run))}
        waiting = 0
        lost: list[tuple[_RunKey, Run]] = []
        for key, run in listed.items():
            queued = self._sent.runs.get(key)
            if key in self._enqueuing:  # handed out beside this pass, its message on its way
                waiting += 1
            elif queued is None or queued.attempt != _attempt(run):
                self._fair.add(key[:2], key, _Due(key, run), alone=_alone(run))
            elif self._lost(queued.message, now):
                logger.info(
                    "run's message presumed lost: enqueued again",
                    run_id=run.id,
                    key=key,
                    message=queued.message.seq,
                )
                self._fair.remove(key)
                lost.append((key, run))
            else:
                waiting += 1
        if full_list:  # what the fair queue holds that is no longer due
            for held in self._fair:
                if held not in listed:
                    self._fair.remove(held)
        enqueued, messages, failed = (
            a + b for a, b in zip(early, await self._hand_out(enqueue, lost), strict=True)
        )
        done = DispatchPass(
            ticks=ticks,
            firings=len(fired),
            due=len(due),
            enqueued=enqueued,
            messages=messages,
            waiting=waiting,
            again=len(lost),
            failed=failed,
            bridged=bridged,
            withheld=len(self._fair),
        )
        if ticks or fired or enqueued or failed or bridged:
            ended = time.perf_counter()
            logger.info(
                "dispatch pass",
                **vars(done),
                follow_ms=round((followed - following) * 1000.0, 1),
                evaluate_ms=round((following - started + decided - followed) * 1000.0, 1),
                pass_ms=round((ended - started) * 1000.0, 1),
            )
        return done

    async def _hand_out_fired(
        self, enqueue: Enqueue, fired: Sequence[tuple[WorkspaceRef, Run]], policy: RunPolicy
    ) -> tuple[int, int, int]:
        """Hand out now the runs ``fired`` made for rules that order none (due at once), before
        the pass goes on to follow and to evaluate the workspaces that keep changing; what
        :meth:`_hand_out` returns (nothing when nothing fired: the pass hands out at its end)."""
        if not fired:
            return 0, 0, 0
        for ref, run in fired:
            key = _key(ref, run)
            if run.rule not in policy.ordered and key not in self._sent.runs:
                self._fair.add(key[:2], key, _Due(key, run), alone=_alone(run))
        return await self._hand_out(enqueue, [])

    async def _evaluate(
        self, chosen: list[Workspace], *, batch: int = BATCH_ENVELOPES
    ) -> list[tuple[WorkspaceRef, Run]]:
        """Evaluate one transaction of ``batch`` envelopes of each workspace of ``chosen``; those
        left short of their head wait in :attr:`_backlogged` for the next pass (the caller took
        ``chosen`` out of it). The runs their firings made."""
        self._evaluating.update(chosen)
        try:
            evaluated = await evaluate_each(
                self._rules,
                [WorkspaceRef(tenant_id, workspace_id) for tenant_id, workspace_id in chosen],
                evaluated_to=self._evaluated_to,
                whole=False,
                batch=batch,
            )
        finally:
            self._evaluating.difference_update(chosen)
        self._backlogged.update(
            dict.fromkeys((ref.tenant_id, ref.workspace_id) for ref in evaluated.behind)
        )
        return evaluated.runs

    async def serve(self, enqueue: Enqueue, stop: asyncio.Event) -> None:
        """Pass whenever the store says a workspace's log moved, until ``stop`` is set.

        A workspace a pass decided less than ``dispatch_settle_s`` ago waits out the rest, what
        moves in it meanwhile decided together in one pass (ADR-0120). Passes also come every
        ``dispatch_interval_s`` (schedules, the due list) and sweep every ``dispatch_sweep_s``.
        While a pass runs, a workspace with nothing waiting whose log moves is decided beside
        it (ADR-0127).
        A pass that fails is logged and the next one starts over; a pass that left work behind
        is followed at once by the next, and the last of such passes (the first sweep's too)
        logs ``dispatcher caught up``, with how many passes and how long they took. A feed that
        cannot start is logged, and every timed pass then sweeps. Stopping gives up the
        followers' leases.
        """
        feed = self._feed
        if feed is None:
            feed = self._feed = feed_for(self._runtime.application.engines, self._rules.storage)
        if self._shards is None and self._owns is None:
            self._shards = _shards_of(self._runtime)
            self._owns = self._shards.owns
        try:
            try:
                await feed.start()
                listening = True
                logger.info("dispatcher listening for changes", feed=type(feed).__name__)
            except Exception:
                logger.exception("change notifications unavailable: every pass sweeps")
                listening = False
            await self._serve(enqueue, stop, feed, listening)
        finally:
            with contextlib.suppress(Exception):
                await feed.aclose()
            if self._shards is not None:
                try:
                    await self._shards.release()
                except Exception:
                    logger.exception("giving up the dispatch shards failed; they lapse instead")
            if self._followers is not None:
                await self._followers.release()

    async def _serve(
        self, enqueue: Enqueue, stop: asyncio.Event, feed: ChangeFeed, listening: bool
    ) -> None:
        swept_at = last_pass_at = -math.inf  # the first pass sweeps
        catching_up: _CatchingUp | None = _CatchingUp(self._monotonic())  # the first sweep
        settling = _Settling(self._settle_s)
        more = timed = False
        while not stop.is_set():
            now = self._monotonic()
            settling.gather(feed.take())
            sweep = not listening or now - swept_at >= self._sweep_s
            timed = timed or now - last_pass_at >= self._interval_s
            if not (more or sweep or timed):
                wait_s = settling.wait_s(now)
                if wait_s is None or wait_s > 0:
                    until_timed = self._interval_s - (now - last_pass_at)
                    until_sweep = self._sweep_s - (now - swept_at)
                    bound = max(0.0, min(until_timed, until_sweep))
                    if wait_s is not None and wait_s < bound:
                        await _first_of(feed, stop, wait_s)
                    else:  # nothing new until the timer: the next pass is a timed one
                        timed = not await _first_of(feed, stop, bound)
                    continue
            changes = settling.take(now, whole=sweep or timed or more)
            timed = False
            changes.everything = changes.everything or sweep
            if changes.everything:
                swept_at = now
            last_pass_at = now
            if await self._keep_shards():
                changes.everything = True
            more = False
            await self.report_limits()
            try:
                done = await self._deciding_fresh(
                    self.pass_once(enqueue, changes), enqueue, feed, settling
                )
                more = self.behind or (self._due_read_at is None and done.enqueued > 0)
            except Exception:
                logger.exception("a dispatch pass failed; the next one starts over")
            if self.behind and catching_up is None:
                catching_up = _CatchingUp(now)
            if catching_up is not None:
                catching_up.passes += 1
                if not self.behind:
                    took_s = round(self._monotonic() - catching_up.since, 1)
                    logger.info("dispatcher caught up", passes=catching_up.passes, took_s=took_s)
                    catching_up = None
            if more and self._one_writer and self._backlogged:
                pause_s = max(ONE_WRITER_PAUSE_S, self._backlog_took_s)
                await self._deciding_fresh(set_within(stop, pause_s), enqueue, feed, settling)
            elif more:
                await asyncio.sleep(0)

    async def _deciding_fresh[T](
        self,
        passing: Awaitable[T],
        enqueue: Enqueue,
        feed: ChangeFeed,
        settling: "_Settling",
    ) -> T:
        """Await a pass (or a pause between two); meanwhile decide at once each workspace whose
        log moves and that is fresh (:meth:`_fresh`), so a new event does not wait for the rest
        of a pass under way, a backlog's long transaction among it (ADR-0127). What is not
        fresh is held for the next pass, as before."""
        task = asyncio.ensure_future(passing)
        try:
            while not task.done():
                woken = asyncio.ensure_future(feed.wait(self._interval_s))
                try:
                    await asyncio.wait((task, woken), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                    await asyncio.gather(woken, return_exceptions=True)
                if task.done() or not feed.woken:
                    continue
                settling.gather(feed.take())
                fresh = settling.take_fresh(self._monotonic(), self._fresh, EVALUATION_BATCH)
                if fresh:
                    await self._decide_fresh(enqueue, fresh)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _fresh(self, workspace: Workspace) -> bool:
        """Whether nothing of ``workspace`` waits in this dispatcher: not queued for a pass's
        evaluation, no backlog, no due runs held back, no evaluation under way, no message on
        its way to the broker (which a new one would overtake); and this dispatcher decides
        it."""
        return (
            workspace not in self._to_evaluate
            and workspace not in self._backlogged
            and workspace not in self._evaluating
            and not self._fair.waiting(workspace)
            and all(key[:2] != workspace for key in self._enqueuing)
            and (self._owns is None or self._owns(*workspace))
        )

    async def _decide_fresh(self, enqueue: Enqueue, fresh: list[Workspace]) -> None:
        """Evaluate ``fresh`` (one transaction of envelopes each) and hand out what fired, beside
        the pass under way; a workspace left behind, or whose evaluation failed, goes to the
        next pass."""
        try:
            fired = await self._evaluate(fresh)
            # their logs moved: a worker may have taken their last messages, and one counted
            # waiting would send the new run behind a backlog's (ADR-0128)
            await self._check_taken(fresh, self._monotonic())
        except Exception:
            logger.exception("deciding workspaces beside a pass failed; the next pass does")
            self._to_evaluate.update(dict.fromkeys(fresh))
            return
        policy = RunPolicy.of(self._rules.rules.values())
        enqueued, messages, failed = await self._hand_out_fired(enqueue, fired, policy)
        if fired:
            logger.info(
                "decided beside a pass",
                workspaces=len(fresh),
                firings=len(fired),
                enqueued=enqueued,
                messages=messages,
                failed=failed,
            )

    async def report_limits(self) -> None:
        """Say what each bound of the allowlist file's limits uses now (a ``LimitsUsed`` fact,
        which the metrics observer turns into gauges), at most every :data:`LIMITS_REPORT_S`.
        A store that fails is logged and read again then."""
        now = self._monotonic()
        if self._limits_read_at is not None and now - self._limits_read_at < LIMITS_REPORT_S:
            return
        self._limits_read_at = now
        try:
            allowlists = load_allowlist(self._runtime.settings.allowlist)
        except InvalidAllowlist:
            return  # the workers say what is wrong with the file (they keep the last good one)
        if not allowlists.limits:
            return
        try:
            store, clock = self._runtime.bridge.limits, self._rules.clock
            uses = await limit_uses(allowlists.limits, store, now=clock())
        except Exception:
            logger.warning("the limits' use could not be read", exc_info=True)
            return
        hooks.emit(LimitsUsed(tuple((u.limit.key, u.kind, u.used, u.waiting) for u in uses)))

    async def _keep_shards(self) -> bool:
        """Keep this dispatcher's shards when it is time; whether it gained some (then the
        pass sweeps them and reads the due list: what their last holder knew is gone)."""
        shards = self._shards
        if shards is None:
            return False
        try:
            if not await shards.due():
                return False
            gained = await shards.keep()
        except Exception:
            logger.exception("keeping the dispatch shards failed; the next pass tries again")
            return False
        for held in self._fair:  # runs of workspaces another dispatcher decides now
            if not shards.owns(*held[:2]):  # type: ignore[index]
                self._fair.remove(held)
        if gained:
            logger.info("dispatch shards taken", shards=sorted(gained), held=len(shards.held))
            self._due_read_at = None
        return bool(gained)

    async def _follow(self, sweep: bool) -> tuple[int, list[Workspace]]:
        """Follow the artifactr workspaces that moved (on a sweep, every one whose head is not
        where it was followed to); return the events bridged and where they went."""
        if self._followers is None:
            self._to_follow.clear()
            return 0, []
        from relayr.ledger.port import WorkspaceKey

        feed = self._feed
        if sweep or feed is None or not feed.sees_artifacts:
            found = await feed.heads() if feed is not None else None
            if found is None or found.artifacts is None:  # no heads: follow every workspace
                done = await self._followers.follow_all()
                self._to_follow.clear()
                return done.bridged, []
            self._swept_heads = found.artifacts
            followed = self._followed_to
            self._to_follow.update(
                dict.fromkeys(w for w, head in found.artifacts.items() if followed.get(w) != head)
            )
        chosen = _first(self._to_follow, EVALUATION_BATCH, self._owns)
        if not chosen:
            return 0, []
        done, moved = await self._followers.follow_these({WorkspaceKey(*w) for w in chosen})
        for workspace in chosen:  # followed to at least the head the last sweep read
            if workspace in self._swept_heads:
                self._followed_to[workspace] = self._swept_heads[workspace]
        behind = [(key.tenant_id, key.workspace_id) for key in moved]
        return done.bridged, behind

    async def _sweep_rules(self) -> None:
        """Queue for evaluation every workspace whose head is not where it was evaluated to."""
        found = await self._feed.heads() if self._feed is not None else None
        if found is None or self._rules.stored_rules is not None:
            refs = await self._rules.storage.workspaces()
            self._to_evaluate.update(dict.fromkeys((r.tenant_id, r.workspace_id) for r in refs))
            return
        for (tenant_id, workspace_id), head in found.rules.items():
            if self._evaluated_to.get(WorkspaceRef(tenant_id, workspace_id)) != head:
                self._to_evaluate[(tenant_id, workspace_id)] = None

    async def _check_taken(self, moved: Iterable[Workspace], now: float) -> None:
        """Learn at once which messages of the workspaces that moved a worker took (its claim
        appended to their logs): the first run of each such message left the attempt it was
        enqueued at. Frees their place in the fair hand-out without waiting for the due list.

        A workspace's messages of a kind (``behind`` or not) are read oldest first, up to the
        first not taken: the broker delivers them in that order, so one read a pass finds what
        is still waiting, and each other read a message newly taken."""
        moved = set(moved)
        sent = self._sent
        waiting: set[tuple[Workspace, bool]] = set()
        for message in sorted(sent.messages.values(), key=lambda m: m.seq):
            kind = (message.workspace, message.behind)
            if (
                message.taken_at is not None
                or message.workspace not in moved
                or not message.runs
                or kind in waiting
            ):
                continue
            key = min(message.runs)
            run = await self._rules.storage.run(WorkspaceRef(key[0], key[1]), key[2])
            queued = sent.runs.get(key)
            if run is None or queued is None or _attempt(run) == queued.attempt:
                waiting.add(kind)
                continue
            sent.taken(message, now)
            message.runs.discard(key)
            del sent.runs[key]
        sent.messages = {seq: m for seq, m in sent.messages.items() if m.runs}

    async def _hand_out(
        self, enqueue: Enqueue, lost: Sequence[tuple[_RunKey, Run]]
    ) -> tuple[int, int, int]:
        """Send the runs of lost messages again, each message in the place of the one lost (so
        outside the fair hand-out, which counted it), then what the fair queue hands out now;
        return runs, messages and runs refused."""
        again: list[Message[_Due]] = []
        for key, run in lost:
            due = _Due(key, run)
            last = again[-1] if again else None
            if (
                last is not None
                and last.workspace == key[:2]
                and len(last.items) < MAX_BATCH_RUNS
                and not _alone(run)
                and not _alone(last.items[-1].run)
            ):
                again[-1] = Message(last.workspace, (*last.items, due))
            else:
                again.append(Message((key[0], key[1]), (due,)))
        enqueued = messages = failed = 0
        for message in [*again, *self._fair.hand_out(self._sent.in_broker())]:
            runs = [(due.key, due.run) for due in message.items]
            tenant_id, workspace_id = message.workspace
            batch = RunMessage(
                tenant_id=tenant_id,
                workspace_id=workspace_id,
                run_ids=tuple(run.id for _, run in runs),
                behind=message.behind,
            )
            keys = [key for key, _ in runs]
            self._enqueuing.update(keys)
            try:
                with telemetry.enqueuing(batch.tenant_id, batch.workspace_id, batch.run_ids):
                    await enqueue(batch)
            except Exception:
                logger.exception("enqueueing runs failed", run_ids=list(batch.run_ids))
                failed += len(runs)
                continue
            finally:
                self._enqueuing.difference_update(keys)
            self._sent_now(message.workspace, runs, behind=message.behind)
            enqueued += len(runs)
            messages += 1
        return enqueued, messages, failed

    def _decides(self, ref: WorkspaceRef) -> bool:
        return self._owns is None or self._owns(ref.tenant_id, ref.workspace_id)

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
            sent.taken(queued.message, now)
            queued.message.runs.discard(key)
            del sent.runs[key]
        outstanding = sorted(
            (m for m in sent.messages.values() if m.taken_at is None), key=lambda m: m.seq
        )
        if outstanding:
            depth = await self._queue_depth()
            head = outstanding[0]
            for message in outstanding:
                passed = sent.passed(message) or (message is head and (depth is None or depth == 0))
                if passed and message.passed_at is None:
                    message.passed_at = now
                elif not passed:
                    message.passed_at = None
        sent.messages = {seq: m for seq, m in sent.messages.items() if m.runs}

    def _lost(self, message: _Message, now: float) -> bool:
        since = message.taken_at if message.taken_at is not None else message.passed_at
        return since is not None and now - since >= self._requeue_after_s

    def _sent_now(
        self, workspace: Workspace, runs: Sequence[tuple[_RunKey, Run]], *, behind: bool
    ) -> None:
        sent = self._sent
        message = _Message(sent.next_seq, workspace, {key for key, _ in runs}, behind)
        sent.next_seq += 1
        sent.messages[message.seq] = message
        for key, run in runs:
            previous = sent.runs.get(key)
            if previous is not None:
                previous.message.runs.discard(key)
            sent.runs[key] = _Queued(_attempt(run), message, _order_of(key, run))
        sent.messages = {seq: m for seq, m in sent.messages.items() if m.runs}


def _shards_of(runtime: Runtime) -> Shards:
    """The shards of a dispatcher on the runtime's store (its first engine's, else memory)."""
    engines = runtime.application.engines
    return Shards(
        SqlShardStore(engines[0]) if engines else InMemoryShardStore(),
        holder=runtime.holder,
        shards=runtime.settings.dispatch_shards,
        lease_ttl_s=runtime.settings.lease_ttl_s,
    )


def _first(
    pending: dict[Workspace, None],
    limit: int,
    owns: Owns | None,
    *,
    unless: Container[Workspace] = (),
) -> list[Workspace]:
    """Take up to ``limit`` workspaces from the front of ``pending``, but those of ``unless``
    (and those this dispatcher does not decide, which are dropped: their owner's feed tells
    it too)."""
    chosen: list[Workspace] = []
    for workspace in list(pending):
        if len(chosen) >= limit:
            break
        if workspace in unless:
            continue
        del pending[workspace]
        if owns is None or owns(*workspace):
            chosen.append(workspace)
    return chosen


class _Settling:
    """Changes held while their workspace settles (ADR-0120).

    A workspace whose changes a pass took less than ``settle_s`` ago waits out the rest, its
    further changes gathered into one pass: a burst's workspace is decided a few times a
    second, not at each of its workers' commits. A change of any other workspace passes at
    once, taking with it only the workspaces that settled.
    """

    def __init__(self, settle_s: float) -> None:
        self._settle_s = settle_s
        self._held = Changes()
        self._taken_at: dict[Workspace, float] = {}

    def gather(self, changes: Changes) -> None:
        """Hold what the feed gathered."""
        self._held.rules |= changes.rules
        self._held.artifacts |= changes.artifacts
        self._held.everything |= changes.everything

    def wait_s(self, now: float) -> float | None:
        """How long until a held change may pass (0: now); None when nothing is held."""
        held = self._held
        if held.everything:
            return 0.0
        if not held:
            return None
        return max(0.0, min(self._settles_at(w) - now for w in held.rules | held.artifacts))

    def _settles_at(self, workspace: Workspace) -> float:
        """When a change of ``workspace`` may pass (minus infinity: at once)."""
        return self._taken_at.get(workspace, -math.inf) + self._settle_s

    def take_fresh(
        self, now: float, fresh: Callable[[Workspace], bool], limit: int
    ) -> list[Workspace]:
        """Up to ``limit`` workspaces whose reflexr log moved, that settled and are ``fresh``,
        their changes now taken (an artifactr change stays held for the pass that follows). A
        change held earlier counts too: its workspace may have settled since."""
        found = (w for w in self._held.rules if self._settles_at(w) <= now and fresh(w))
        chosen = list(itertools.islice(found, limit))
        self._held.rules.difference_update(chosen)
        self._taken_at.update(dict.fromkeys(chosen, now))
        return chosen

    def take(self, now: float, *, whole: bool) -> Changes:
        """The held changes whose workspace settled (all of them if ``whole``), now taken."""
        held = self._held
        if whole or held.everything:
            taken, self._held = held, Changes()
        else:
            settled = {w for w in held.rules | held.artifacts if self._settles_at(w) <= now}
            taken = Changes(rules=held.rules & settled, artifacts=held.artifacts & settled)
            held.rules -= settled
            held.artifacts -= settled
        self._taken_at = {w: at for w, at in self._taken_at.items() if self._settles_at(w) > now}
        self._taken_at.update(dict.fromkeys(taken.rules | taken.artifacts, now))
        return taken


@dataclass
class _CatchingUp:
    """Passes made back to back since ``since`` (monotonic), to work off what was queued."""

    since: float
    passes: int = 0


async def _first_of(feed: ChangeFeed, stop: asyncio.Event, timeout_s: float) -> bool:
    """Wait until the feed has something, ``stop`` is set, or ``timeout_s`` passed; whether it
    was not the timeout that ended the wait."""
    waits = [asyncio.ensure_future(feed.wait(timeout_s)), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return feed.woken or stop.is_set()


def _alone(run: Run) -> bool:
    """A run whose last attempt was abandoned may be what killed its worker: it goes alone."""
    return run.reason == reasons.ABANDONED


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
