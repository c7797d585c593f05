"""One run shown whole, as ``runs show`` and the console's run page say it: its attempts, its
emission records, and the turns its messages started.

The attempts come from reflexr's facts, read from the event that made the run fire, not from the
workspace's start (:func:`show_run`); the emission records from the ledger; the turns from
artifactr's threads. artifactr does not redo a turn whose process died, so a turn without an
event for far longer than a live one goes quiet is shown stalled (:data:`STALLED_AFTER`).
artifactr is imported only when a run is shown, so that listing and changing runs loads reflexr
alone (ADR-0050).
"""

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

from reflexr.core import (
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
from relayr.ledger.port import Ledger, WorkspaceKey
from relayr.ops.rows import RunRow

if TYPE_CHECKING:
    from artifactr import Workspaces as ArtifactWorkspaces

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

type TurnStatus = Literal["completed", "failed", "stopped", "running", "stalled", "untaken"]

type TurnTook = Literal["started", "steered"]
"""How a turn took a message: it ``started`` with it (artifactr's ``run_started`` names it), or
it was running and took it on the way (``steered``: its watcher delivered it; see
:func:`who_took`)."""

TOOK: Final[dict[str, str]] = {
    "started": "started the turn",
    "steered": "steered the running turn",
}
"""How ``runs show`` and the console say :data:`TurnTook`."""

TAKEN_CURSOR: Final = "artifactr.runner/{thread}/taken"
"""artifactr's Runner cursor: every message of the thread up to this seq was taken by a turn."""

STALLED_AFTER: Final = timedelta(minutes=2)
"""How long a turn may go without an event before ``runs show`` calls it stalled. artifactr
does not redo a turn whose process died (its message counts as taken), so ops must see it:
far longer than the Runner's claim TTL (30 s), which a live turn renews."""


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run, from reflexr's facts: when it started and how it ended.

    ``attempt`` counts every attempt of the run, 1 first, across operator retries; ``of_budget``
    is reflexr's own number, which an operator retry starts again from 1 (a fresh retry
    budget). ``ended_at`` is None while it runs.
    """

    attempt: int
    started_at: datetime
    outcome: str = "running"
    error: str | None = None
    reason: str | None = None
    of_budget: int = 1
    ended_at: datetime | None = None

    @property
    def duration_s(self) -> float | None:
        """How long it ran, in seconds; None while it runs."""
        if self.ended_at is None:
            return None
        return max((self.ended_at - self.started_at).total_seconds(), 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "started_at": self.started_at.isoformat(),
            "ended_at": None if self.ended_at is None else self.ended_at.isoformat(),
            "duration_s": self.duration_s,
        }


@dataclass(frozen=True)
class OperatorAction:
    """What a person did to a run (retry, cancel, skip), as reflexr's facts record it: who (the
    fact's actor), when, and why (the reason a cancel or skip gave)."""

    action: Literal["retry", "cancel", "skip"]
    at: datetime
    who: str
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "at": self.at.isoformat()}


@dataclass(frozen=True)
class Turn:
    """An agent turn that one of the run's messages started, or ``untaken``."""

    message_id: str
    thread_id: str
    turn_id: str | None
    status: TurnStatus
    reason: str | None = None
    took: TurnTook | None = None
    """How the turn took the message; None if no turn took it."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunReport:
    """Everything ``runs show`` says about one run."""

    run: RunRow
    attempts: list[Attempt]
    emissions: list[EmissionRecord]
    turns: list[Turn]
    actions: list[OperatorAction] = field(default_factory=list)
    """What people did to the run, oldest first."""

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run.to_json(),
            "attempts": [attempt.to_json() for attempt in self.attempts],
            "emissions": [record.to_json() for record in self.emissions],
            "turns": [turn.to_json() for turn in self.turns],
            "actions": [action.to_json() for action in self.actions],
        }


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
    own = [
        envelope
        for envelope in facts
        if getattr(envelope.event, "run_id", None) == row.id  # the workspace's other runs' too
    ]
    attempts = _attempts((envelope.event, envelope.ts) for envelope in own)
    actions = operator_actions((envelope.event, envelope.ts, envelope.actor) for envelope in own)
    emissions = await ledger.emissions(row.workspace, row.id)
    turns = await _turns(artifacts, row.workspace, emissions, now=rules.clock())
    return RunReport(run=row, attempts=attempts, emissions=emissions, turns=turns, actions=actions)


OPERATOR_FACTS: Final[dict[type, str]] = {
    RunRequeued: "retry",
    RunCancelled: "cancel",
    RunSkipped: "skip",
}
"""reflexr's facts of what a person did to a run, by the action's name."""


def operator_actions(facts: Iterable[tuple[object, datetime, Any]]) -> list[OperatorAction]:
    """The operator actions among a run's facts ``(fact, ts, actor)``: who is the fact's actor
    (its display name, else its participant key)."""
    found = []
    for fact, at, actor in facts:
        action = OPERATOR_FACTS.get(type(fact))
        if action is None:
            continue
        who = getattr(actor, "name", None) or getattr(actor, "participant", str(actor))
        found.append(OperatorAction(action, at, who, getattr(fact, "reason", None)))  # type: ignore[arg-type]
    return found


def _attempts(facts: Iterable[tuple[object, datetime]]) -> list[Attempt]:
    attempts: list[Attempt] = []

    def ended(
        at: datetime, outcome: str, error: str | None = None, reason: str | None = None
    ) -> None:
        if attempts and attempts[-1].outcome == "running":
            last = attempts[-1]
            attempts[-1] = replace(last, outcome=outcome, error=error, reason=reason, ended_at=at)

    for fact, at in facts:
        match fact:
            case RunAttempted():
                ended(at, "abandoned", "a later attempt started", reasons.ABANDONED)
                attempts.append(Attempt(len(attempts) + 1, at, of_budget=fact.attempt))
            case RunRetrying():
                ended(at, "failed", fact.error, fact.reason)
            case RunDeadLettered():
                ended(at, "dead", fact.error, fact.reason)
            case RunSucceeded():
                ended(at, "succeeded")
            case RunCancelled():
                ended(at, "cancelled", None, fact.reason)
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
    from artifactr.core import RunEnded

    sent = {(r.thread_id, r.message_id) for r in emissions if r.kind == "message"}
    if not sent:
        return []
    reader = ArtifactSystemActor(name=READER_NAME)
    threads = {thread for thread, _ in sent}
    try:
        handle = await artifacts.open(workspace.tenant_id, workspace.workspace_id, actor=reader)
        log = await handle.read(threads=threads)
        taken_up_to = {
            thread: await handle.cursor(TAKEN_CURSOR.format(thread=thread)) for thread in threads
        }
    except ArtifactRejection:
        return [Turn(message, thread, None, "untaken") for thread, message in sorted(sent)]
    took = who_took(log, taken_up_to)
    ended: dict[str, RunEnded] = {}
    last_seen: dict[str, datetime] = {}
    for envelope in log:
        if envelope.run_id is not None:
            last_seen[envelope.run_id] = envelope.ts
        if isinstance(envelope.event, RunEnded):
            ended[envelope.event.run_id] = envelope.event
    turns = []
    for thread, message in sorted(sent):
        if message not in took:
            turns.append(Turn(message, thread, None, "untaken"))
            continue
        turn_id, how = took[message]
        if turn_id in ended:
            end = ended[turn_id]
            turns.append(Turn(message, thread, turn_id, end.status, end.reason, how))
        elif now - last_seen.get(turn_id, now) > STALLED_AFTER:
            quiet = int((now - last_seen[turn_id]).total_seconds())
            reason = (
                f"no event from the turn for {quiet} s: if its worker died, artifactr will not "
                "answer this message; post it again"
            )
            turns.append(Turn(message, thread, turn_id, "stalled", reason, how))
        else:
            turns.append(Turn(message, thread, turn_id, "running", None, how))
    return turns


def who_took(log: Sequence[Any], taken_up_to: dict[str, int]) -> dict[str, tuple[str, TurnTook]]:
    """Which turn took each message of the threads' log, and how (:data:`TurnTook`).

    artifactr takes a thread's messages in order, each by one turn. A turn names the messages it
    starts with; the messages before them that no turn named were taken by the turn before it,
    running (its watcher delivered them). After the last turn's start, the messages up to the
    thread's ``taken`` cursor are that turn's too; later ones no turn has taken yet.
    """
    from artifactr.core import MessagePosted, RunStarted

    took: dict[str, tuple[str, TurnTook]] = {}
    waiting: dict[str, list[str]] = {}
    """Per thread, its messages not yet known to be taken, in order, with their seqs."""
    seqs: dict[str, int] = {}
    last: dict[str, str] = {}
    """Per thread, the turn that started last: it takes what waits until the next one starts."""
    for envelope in log:
        event, thread = envelope.event, envelope.thread_id
        if isinstance(event, MessagePosted) and event.kind == "message" and event.run_id is None:
            waiting.setdefault(thread, []).append(event.message_id)
            seqs[event.message_id] = envelope.seq
        elif isinstance(event, RunStarted):
            named = set(event.message_ids)
            queue = waiting.get(thread, [])
            first = min((queue.index(m) for m in named if m in queue), default=len(queue))
            for message_id in queue[:first]:
                if thread in last:
                    took[message_id] = (last[thread], "steered")
            for message_id in named:
                took.setdefault(message_id, (event.run_id, "started"))
            waiting[thread] = [m for m in queue[first:] if m not in named]
            last[thread] = event.run_id
    for thread, queue in waiting.items():
        for message_id in queue:
            if thread in last and seqs[message_id] <= taken_up_to.get(thread, 0):
                took[message_id] = (last[thread], "steered")
    return took
