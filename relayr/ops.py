"""What ops do with runs: list them, show one whole, and retry, cancel or skip them safely.

reflexr's store is the truth about a run (ADR-0001), so every command here reads and
changes it through reflexr's own operator operations, across every workspace unless one is
named. A retry is reflexr's operator retry (the run is due now, its attempts start again from
zero) followed by an enqueue, so ops need not wait for the dispatcher's next pass. The enqueue
is only that shortcut: when it fails after reflexr's retry (the broker is down,
:class:`relayr.core.errors.BrokerUnavailable` after its bounded retries, or refused the message)
the run stays retried, due now, for the dispatcher to enqueue, and the remaining runs are
retried without trying the broker again (ADR-0034). Retrying is always safe, because the run's
writes have derived ids: a notice an earlier attempt posted is not posted again, and a send
whose message was committed but whose turn was never asked gets its turn (ADR-0026).

Runs are listed newest created first, the order reflexr's storage keeps and cuts a workspace's
runs by (:func:`list_runs`). The command line and the console find the runs they are named
(:func:`find_runs`) and the followers they report on (:func:`followers_of`) here too, so both
refuse and read alike.
"""

import heapq
import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

import structlog
from reflexr import UserActor
from reflexr.core import (
    InvalidState,
    NotFound,
    Rejection,
    Run,
    RunCancelled,
    RunDeadLettered,
    RunRequeued,
    RunRetrying,
    RunSkipped,
    RunSucceeded,
)
from reflexr.core import RunStarted as RunAttempted
from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.core import reasons
from relayr.core.emissions import EmissionRecord
from relayr.core.errors import BrokerUnavailable
from relayr.ledger.port import Ledger, WorkspaceKey

if TYPE_CHECKING:
    from artifactr import Workspaces as ArtifactWorkspaces

    from relayr.follow.follower import Followers
    from relayr.runtime import Runtime

logger = structlog.get_logger("relayr.ops")

OPERATOR: Final = UserActor(id="relayr-ops", name="relayr ops")
"""Who retries, cancels and skips runs from the CLI, as reflexr's facts record it."""

READER_NAME: Final = "relayr-ops"
"""Who reads threads to find the turns a run's messages started (an artifactr system actor;
artifactr is imported only by :func:`show_run`, so that listing and changing runs loads reflexr
alone: ADR-0050)."""

RUN_FACTS: Final = (
    "reflexr:run_started",
    "reflexr:run_retrying",
    "reflexr:run_succeeded",
    "reflexr:run_dead_lettered",
    "reflexr:run_cancelled",
    "reflexr:run_requeued",
    "reflexr:run_skipped",
)

ENQUEUE_FAILED: Final = "enqueue_failed"
""":attr:`Done.enqueue_error` of a retried run whose enqueue failed otherwise than with the broker
unavailable (:attr:`relayr.core.errors.BrokerUnavailable.code`): a message the broker refused,
credentials it refused, a folder that cannot be written."""

type EnqueueRun = Callable[[str, str, str], Awaitable[None]]
"""Hands one retried run to the queue: ``await enqueue(tenant_id, workspace_id, run_id)``
(a message of one run; :data:`relayr.dispatch.Enqueue` hands a whole batch)."""
type TurnStatus = Literal["completed", "failed", "stopped", "running", "stalled", "untaken"]

STALLED_AFTER: Final = timedelta(minutes=2)
"""How long a turn may go without an event before ``runs show`` calls it stalled. artifactr
does not redo a turn whose process died (its message counts as taken), so ops must see it:
far longer than the Runner's claim TTL (30 s), which a live turn renews."""


@dataclass(frozen=True)
class RunRow:
    """One run as ``runs list`` shows it."""

    tenant_id: str
    workspace_id: str
    id: str
    rule: str
    status: str
    attempts: int
    reason: str | None
    error: str | None
    next_attempt_at: datetime
    created_at: datetime
    updated_at: datetime
    fired_seq: int
    """The seq of the event that made the run's rule fire: its facts come after it."""

    @classmethod
    def of(cls, ref: WorkspaceRef, run: Run) -> "RunRow":
        return cls(
            tenant_id=ref.tenant_id,
            workspace_id=ref.workspace_id,
            id=run.id,
            rule=run.rule,
            status=run.status,
            attempts=run.attempts,
            reason=run.reason,
            error=run.error,
            next_attempt_at=run.next_attempt_at,
            created_at=run.created_at,
            updated_at=run.updated_at,
            fired_seq=run.fired_seq,
        )

    @property
    def workspace(self) -> WorkspaceKey:
        return WorkspaceKey(self.tenant_id, self.workspace_id)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for moment in ("next_attempt_at", "created_at", "updated_at"):
            data[moment] = getattr(self, moment).isoformat()
        return data


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run, from reflexr's facts: when it started and how it ended."""

    attempt: int
    started_at: datetime
    outcome: str = "running"
    error: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "started_at": self.started_at.isoformat()}


@dataclass(frozen=True)
class Turn:
    """An agent turn that one of the run's messages started, or ``untaken``."""

    message_id: str
    thread_id: str
    turn_id: str | None
    status: TurnStatus
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunReport:
    """Everything ``runs show`` says about one run."""

    run: RunRow
    attempts: list[Attempt]
    emissions: list[EmissionRecord]
    turns: list[Turn]

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run.to_json(),
            "attempts": [attempt.to_json() for attempt in self.attempts],
            "emissions": [record.to_json() for record in self.emissions],
            "turns": [turn.to_json() for turn in self.turns],
        }


@dataclass(frozen=True)
class Done:
    """What an operation did to one run: changed it, or refused, and why.

    ``enqueued`` is a retry's: whether the run was handed to the broker at once (False: the
    enqueue failed, and the dispatcher will enqueue it); None for other operations.
    ``enqueue_error`` says why it was not: ``broker_unavailable`` or :data:`ENQUEUE_FAILED` (the
    detail names the error).
    """

    run_id: str
    workspace: str
    ok: bool
    detail: str
    status: str | None = None
    enqueued: bool | None = None
    enqueue_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunFilter:
    """Which runs ``runs list`` and ``runs retry --dead`` take."""

    status: str | None = None
    rule: str | None = None
    workspace: WorkspaceKey | None = None
    since: datetime | None = None
    limit: int | None = 100


async def list_runs(rules: Workspaces, query: RunFilter) -> list[RunRow]:
    """Runs across every workspace (or the one named), newest created first, filtered.

    reflexr's storage returns a workspace's runs newest created first and cuts them there
    (``runs(limit=N)`` keeps the N created last), so the workspaces' lists are merged in that
    order: the first N of the merge are the runs created last across every workspace, whatever
    limit another read used, and a page never skips a run another page would show. An order by
    last change would need every run of every workspace (one created long ago may have changed
    just now); ``since`` reads them all, and keeps those that changed within it.
    """
    lists: list[list[RunRow]] = []
    storage = rules.storage
    for ref in await _refs(rules, query.workspace):
        runs = await storage.runs(
            ref,
            rule=query.rule,
            status=query.status,  # type: ignore[arg-type]
            limit=None if query.since else query.limit,
        )
        lists.append(
            [
                RunRow.of(ref, run)
                for run in runs
                if query.since is None or run.updated_at >= query.since
            ]
        )
    merged = heapq.merge(*lists, key=lambda row: row.created_at, reverse=True)
    return list(itertools.islice(merged, query.limit))


class AmbiguousRun(ValueError):
    """A run id that several workspaces hold, named without its workspace.

    reflexr's run ids are unique within a workspace only (the same event id fired in two
    workspaces makes the same run id), so acting on "the first that has it" could change a
    run the operator did not mean.
    """

    def __init__(self, run_id: str, workspaces: Sequence[WorkspaceKey]) -> None:
        names = ", ".join(sorted(str(workspace) for workspace in workspaces))
        super().__init__(
            f"run {run_id} is in {len(workspaces)} workspaces ({names}): name one with --workspace"
        )


async def find_run(
    rules: Workspaces, run_id: str, workspace: WorkspaceKey | None = None
) -> RunRow | None:
    """The run with this id in the workspace named, or in the one workspace that has it.

    Raises:
        AmbiguousRun: No workspace named, and more than one has a run of this id.
    """
    rows = []
    for ref in await _refs(rules, workspace):
        run = await rules.storage.run(ref, run_id)
        if run is not None:
            rows.append(RunRow.of(ref, run))
    if len(rows) > 1:
        raise AmbiguousRun(run_id, [row.workspace for row in rows])
    return rows[0] if rows else None


async def find_runs(
    rules: Workspaces, named: Iterable[tuple[WorkspaceKey | None, str]]
) -> tuple[list[RunRow], list[Done]]:
    """The runs named (each in its workspace, or the one workspace that has it), and a refusal
    that names each one that does not exist (``no run fir_... in acme/ops``) or that several
    workspaces hold (:class:`AmbiguousRun`)."""
    found: list[RunRow] = []
    missing: list[Done] = []
    for workspace, run_id in named:
        try:
            row = await find_run(rules, run_id, workspace)
        except AmbiguousRun as error:
            missing.append(Done(run_id, "*", False, str(error)))
            continue
        if row is not None:
            found.append(row)
            continue
        where = "" if workspace is None else f" in {workspace}"
        missing.append(Done(run_id, str(workspace or "*"), False, f"no run {run_id}{where}"))
    return found, missing


async def show_run(
    rules: Workspaces,
    artifacts: "ArtifactWorkspaces",
    ledger: Ledger,
    row: RunRow,
) -> RunReport:
    """A run's attempts, its emission records, and the turns its messages started.

    The run's facts come after the event that made it fire, so the log is read from there, not
    from the workspace's start (a long history of other runs' facts is not read).
    """
    ref = WorkspaceRef(row.tenant_id, row.workspace_id)
    facts = await rules.storage.read(ref, after_seq=row.fired_seq, types=RUN_FACTS)
    attempts = _attempts(
        (envelope.event, envelope.ts)
        for envelope in facts
        if getattr(envelope.event, "run_id", None) == row.id  # the workspace's other runs' too
    )
    emissions = await ledger.emissions(row.workspace, row.id)
    turns = await _turns(artifacts, row.workspace, emissions, now=rules.clock())
    return RunReport(run=row, attempts=attempts, emissions=emissions, turns=turns)


async def retry(
    rules: Workspaces, targets: Sequence[RunRow], enqueue: EnqueueRun, *, dry_run: bool = False
) -> list[Done]:
    """reflexr's operator retry of each run, then an enqueue, so it runs at once.

    When ``enqueue`` fails, with :class:`BrokerUnavailable` or any other error (logged), that
    run and the rest are retried in reflexr but not enqueued (``enqueued=False``, the error in
    the detail): each stays due for the dispatcher, and every run gets its result. The enqueue
    is not tried again for the rest: a broker that failed one run in this call fails the next.
    """
    failed: tuple[str, str] | None = None  # once the enqueue failed: its code and message

    async def retry_one(row: RunRow) -> Done:
        nonlocal failed
        if dry_run:
            current = await rules.storage.run(_ref(row), row.id)
            if current is None or current.status in ("succeeded", "running"):
                status = "gone" if current is None else current.status
                return Done(row.id, str(row.workspace), False, f"cannot retry a {status} run")
            return Done(row.id, str(row.workspace), True, "would retry", current.status)
        handle = await rules.open(row.tenant_id, row.workspace_id, actor=OPERATOR)
        retried = await handle.retry_run(row.id)
        if failed is None:
            try:
                await enqueue(row.tenant_id, row.workspace_id, row.id)
            except BrokerUnavailable as unavailable:
                failed = (unavailable.code, unavailable.message)
            except Exception as error:  # the run changed: its result must still be reported
                failed = (ENQUEUE_FAILED, f"{type(error).__name__}: {error}")
                logger.error(
                    "a retried run was not enqueued; the dispatcher will enqueue it",
                    run_id=row.id,
                    workspace=str(row.workspace),
                    error=failed[1],
                )
            else:
                done = "retried and enqueued"
                return Done(row.id, str(row.workspace), True, done, retried.status, True)
        code, why = failed
        detail = f"retried, not enqueued ({why}); the dispatcher will enqueue it"
        return Done(row.id, str(row.workspace), True, detail, retried.status, False, code)

    return [await _guarded(row, retry_one) for row in targets]


def not_enqueued(results: Sequence[Done], broker: str) -> str | None:
    """One line for ops when a retry reached reflexr but not the broker ``broker`` (already
    redacted), naming each run left for the dispatcher (ADR-0034); None when all went through."""
    left = [result for result in results if result.enqueued is False]
    if not left:
        return None
    listed = ", ".join(f"{result.run_id} ({result.workspace})" for result in left)
    them = "it" if len(left) == 1 else "them"
    if all(result.enqueue_error == BrokerUnavailable.code for result in left):
        return (
            f"broker {broker} is unavailable: retried in reflexr but not enqueued: {listed}; "
            f"the dispatcher will enqueue {them} once it reaches the broker"
        )
    return (
        f"the enqueue on broker {broker} failed (each run's detail says why): retried in "
        f"reflexr but not enqueued: {listed}; the dispatcher will enqueue {them}"
    )


async def cancel(rules: Workspaces, targets: Sequence[RunRow], *, reason: str) -> list[Done]:
    """reflexr's operator cancel of each run; a running attempt is fenced off."""

    async def cancel_one(row: RunRow) -> Done:
        handle = await rules.open(row.tenant_id, row.workspace_id, actor=OPERATOR)
        cancelled = await handle.cancel_run(row.id, reason=reason)
        return Done(row.id, str(row.workspace), True, "cancelled", cancelled.status)

    return [await _guarded(row, cancel_one) for row in targets]


async def skip(rules: Workspaces, targets: Sequence[RunRow], *, reason: str) -> list[Done]:
    """reflexr's operator skip of each run: it will not run, and its scope moves on."""

    async def skip_one(row: RunRow) -> Done:
        handle = await rules.open(row.tenant_id, row.workspace_id, actor=OPERATOR)
        skipped = await handle.skip_run(row.id, reason=reason)
        return Done(row.id, str(row.workspace), True, "skipped", skipped.status)

    return [await _guarded(row, skip_one) for row in targets]


def followers_of(runtime: "Runtime") -> "Followers":
    """The followers of the runtime's application, holding leases as the runtime's process
    (``relayr follow``, the console's health page, and the dispatcher when it follows).
    artifactr is imported here, when called: listing and changing runs loads reflexr alone
    (ADR-0050)."""
    from relayr.follow.follower import Followers

    return Followers.of(
        runtime.application,
        runtime.bridge.ledger,
        holder=runtime.holder,
        lease_ttl_s=runtime.settings.lease_ttl_s,
    )


async def _guarded(row: RunRow, operation: Callable[[RunRow], Awaitable[Done]]) -> Done:
    try:
        return await operation(row)
    except (InvalidState, NotFound) as refused:
        return Done(row.id, str(row.workspace), False, refused.message)
    except Rejection as refused:
        return Done(row.id, str(row.workspace), False, f"{refused.code}: {refused.message}")


def _ref(row: RunRow) -> WorkspaceRef:
    return WorkspaceRef(row.tenant_id, row.workspace_id)


async def _refs(rules: Workspaces, workspace: WorkspaceKey | None) -> list[WorkspaceRef]:
    if workspace is not None:
        return [WorkspaceRef(workspace.tenant_id, workspace.workspace_id)]
    return await rules.storage.workspaces()


def _attempts(facts: Iterable[tuple[object, datetime]]) -> list[Attempt]:
    attempts: list[Attempt] = []

    def ended(outcome: str, error: str | None = None, reason: str | None = None) -> None:
        if attempts and attempts[-1].outcome == "running":
            last = attempts[-1]
            attempts[-1] = Attempt(last.attempt, last.started_at, outcome, error, reason)

    for fact, at in facts:
        match fact:
            case RunAttempted():
                ended("abandoned", "a later attempt started", reasons.ABANDONED)
                attempts.append(Attempt(fact.attempt, at))
            case RunRetrying():
                ended("failed", fact.error, fact.reason)
            case RunDeadLettered():
                ended("dead", fact.error, fact.reason)
            case RunSucceeded():
                ended("succeeded")
            case RunCancelled():
                ended("cancelled", None, fact.reason)
            case RunSkipped() | RunRequeued():
                pass
    return attempts


async def _turns(
    artifacts: "ArtifactWorkspaces",
    workspace: WorkspaceKey,
    emissions: Sequence[EmissionRecord],
    *,
    now: datetime,
) -> list[Turn]:
    from artifactr import SystemActor as ArtifactSystemActor
    from artifactr.core import Rejection as ArtifactRejection
    from artifactr.core import RunEnded, RunStarted

    sent = {(r.thread_id, r.message_id) for r in emissions if r.kind == "message"}
    if not sent:
        return []
    reader = ArtifactSystemActor(name=READER_NAME)
    try:
        handle = await artifacts.open(workspace.tenant_id, workspace.workspace_id, actor=reader)
        log = await handle.read(threads={thread for thread, _ in sent})
    except ArtifactRejection:
        return [Turn(message, thread, None, "untaken") for thread, message in sorted(sent)]
    started: dict[str, str] = {}
    ended: dict[str, RunEnded] = {}
    last_seen: dict[str, datetime] = {}
    for envelope in log:
        if envelope.run_id is not None:
            last_seen[envelope.run_id] = envelope.ts
        event = envelope.event
        if isinstance(event, RunStarted):
            last_seen.setdefault(event.run_id, envelope.ts)
            for message_id in event.message_ids:
                started.setdefault(message_id, event.run_id)
        elif isinstance(event, RunEnded):
            ended[event.run_id] = event
    turns = []
    for thread, message in sorted(sent):
        turn_id = started.get(message)
        if turn_id is None:
            turns.append(Turn(message, thread, None, "untaken"))
        elif turn_id in ended:
            end = ended[turn_id]
            turns.append(Turn(message, thread, turn_id, end.status, end.reason))
        elif now - last_seen.get(turn_id, now) > STALLED_AFTER:
            quiet = int((now - last_seen[turn_id]).total_seconds())
            reason = (
                f"no event from the turn for {quiet} s: if its worker died, artifactr will not "
                "answer this message; post it again"
            )
            turns.append(Turn(message, thread, turn_id, "stalled", reason))
        else:
            turns.append(Turn(message, thread, turn_id, "running"))
    return turns
