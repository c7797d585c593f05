"""What the steps of executing a run hand each other and return.

A claim starts attempts (:class:`Claimed`, with the scope's order for a rule ordered by scope,
:class:`ScopeOrder`); an action ends (:class:`Ended`, then :class:`Finished` with the run its scope
may go on with); a completion records them (:class:`Completion`). What executing each run did is an
:class:`Executed`, one of the outcomes of :data:`RunOutcome`. The transactions that make them are in
:mod:`relayr.execution.attempts`; all of them are frozen values but a scope's order, which its later
claims in one message keep up to date.
"""

from dataclasses import dataclass, field
from typing import Literal

from pydantic import JsonValue
from reflexr.core import WAITING, Envelope, Rule, Run
from reflexr.workspace import RunFailure, WorkspaceRef

type RunOutcome = Literal[
    "succeeded",
    "retrying",
    "dead",
    "cancelled",
    "missing",
    "not_due",
    "contended",
    "dropped",
    "interrupted",
    "abandoned",
    "limited",
]
"""What executing a run did.

``succeeded``, ``retrying`` and ``dead``: an attempt ran and its outcome was recorded.
``abandoned``: a leftover attempt was recorded as failed; none ran. ``cancelled``: the run's
rule is gone, so the run was cancelled. ``missing``, ``not_due``, ``contended``: nothing was
done. ``interrupted``: the attempt stopped being current while its action ran, which was
cancelled; ``dropped``: it stopped being current before its outcome was recorded. In both,
nothing was recorded: whoever made it not current decided. ``limited``: an operator's limit
held the run back; it was not attempted and waits, due again when the limit expects to allow it.
"""


@dataclass(frozen=True)
class Executed:
    """What executing (or failing) one run did.

    Attributes:
        outcome: What happened (see :data:`RunOutcome`).
        run: The run as this call left it or found it, or None if it was not read.
        detail: For people: why, naming the run.
        run_id: The run's id, which ``run`` also has when it was read.
    """

    outcome: RunOutcome
    run: Run | None = None
    detail: str = ""
    run_id: str = ""


@dataclass(frozen=True)
class Ended:
    """How an action ended, before it is recorded."""

    kind: Literal["succeeded", "failed", "interrupted"]
    output: JsonValue = None
    error: str = ""
    reason: str | None = None
    permanent: bool = False

    @classmethod
    def failed(cls, failure: RunFailure) -> "Ended":
        return cls(
            "failed", error=failure.message, reason=failure.reason, permanent=failure.permanent
        )


@dataclass
class ScopeOrder:
    """The unfinished runs of one scope of a rule ordered by scope, in firing order, as read
    when its first run was claimed, and the runs since known to have succeeded."""

    runs: list[Run]
    succeeded: set[str] = field(default_factory=set)

    def after(self, run_id: str) -> str | None:
        """The run that comes after ``run_id`` in the scope and was waiting when read."""
        ids = [run.id for run in self.runs]
        if run_id not in ids:
            return None
        later = self.runs[ids.index(run_id) + 1 :]
        return next((run.id for run in later if run.status in WAITING), None)

    def before(self, run_id: str) -> list[str]:
        """The runs before ``run_id`` that may still hold it back: every one not known to
        have succeeded."""
        earlier: list[str] = []
        for run in self.runs:
            if run.id == run_id:
                return earlier
            if run.id not in self.succeeded:
                earlier.append(run.id)
        return earlier


@dataclass(frozen=True)
class Claimed:
    """An attempt that started: the run, the rule it runs as the claim read it, the envelopes
    that made it fire, and its scope's order for a rule ordered by scope."""

    run: Run
    rule: Rule
    events: tuple[Envelope, ...]
    order: ScopeOrder | None = None


@dataclass(frozen=True)
class Finished:
    """An attempt whose action ended, and the run the same scope may go on with."""

    claimed: Claimed
    ended: Ended
    successor: str | None = None


@dataclass(frozen=True)
class Completion:
    """What :func:`relayr.execution.attempts.complete` did: each ended attempt's outcome, the
    successors it started, and the successors it found ``running`` under a lease that had lapsed, so
    recorded ``abandoned`` (none of them ran)."""

    executed: dict[str, Executed]
    started: list[Claimed]
    abandoned: dict[str, Executed]


def missing(ref: WorkspaceRef, run_id: str) -> Executed:
    """What executing a run that does not exist did: nothing."""
    return Executed(
        "missing",
        None,
        f"run {run_id} does not exist in {ref.tenant_id}/{ref.workspace_id}",
        run_id,
    )
