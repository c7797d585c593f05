"""What following reports: a pass's counts, where each workspace's follower stands, what a
replay of dead letters did, and why an envelope was dead-lettered (ADR-0065).

:class:`relayr.follow.follower.Followers` returns them; ``relayr follow`` and the console show
them.
"""

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Final, Self

from relayr.follow.store import DeadLetter
from relayr.ledger.port import WorkspaceKey

PROJECTION_FAILED: Final = "projection_failed"
"""A dead letter's reason: the projection raised (or returned something else than an event)."""

CAUSE_MISSING: Final = "cause_missing"
"""A dead letter's reason: a rule wrote the envelope but the ledger holds no cause for it;
bridged as a chain of its own, it would escape the depth limit."""

DEPTH_EXCEEDED: Final = "depth_exceeded"
"""A dead letter's reason: the envelope would continue its chain past reflexr's depth limit,
which reflexr refuses to publish."""


@dataclass
class Followed:
    """What following did, summed over workspaces and batches.

    Attributes:
        workspaces: Workspaces followed (their lease held).
        elsewhere: Workspaces another follower holds.
        failed: Workspaces whose pass raised (logged; the next pass starts over).
        read: Envelopes read from artifactr.
        bridged: Events appended to reflexr.
        duplicates: Events already in reflexr's log (published before the cursor moved).
        skipped: Envelopes no projection bridges (threads, turn starts, tool calls, ...).
        dead: Envelopes dead-lettered.
        batches: Batches published.
        behind: Workspaces left with more to bridge after
            :data:`~relayr.follow.follower.BATCHES_PER_PASS` batches.
    """

    workspaces: int = 0
    elsewhere: int = 0
    failed: int = 0
    read: int = 0
    bridged: int = 0
    duplicates: int = 0
    skipped: int = 0
    dead: int = 0
    batches: int = 0
    behind: int = 0

    def __iadd__(self, other: "Followed") -> Self:
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


@dataclass(frozen=True)
class WorkspaceStatus:
    """Where a workspace's follower stands.

    Attributes:
        workspace: The workspace.
        cursor: The last artifactr seq bridged (0: none yet).
        head: artifactr's last seq: ``head - cursor`` envelopes wait.
        holder: Who holds its lease (maybe lapsed), or None.
        held_until: When that lease lapses.
        dead_letters: Its dead letters waiting for a replay.
    """

    workspace: WorkspaceKey
    cursor: int
    head: int
    holder: str | None
    held_until: datetime | None
    dead_letters: int

    @property
    def lag(self) -> int:
        return max(self.head - self.cursor, 0)


@dataclass(frozen=True)
class Replayed:
    """What a replay of dead letters did.

    Attributes:
        bridged: Envelope ids bridged now (appended, or found in reflexr's log already); their
            letters are marked replayed.
        failed: Dead letters that failed again, with their new reason and error.
        unknown: Envelope ids asked for that are not waiting dead letters of the workspace.
        skipped: Envelope ids no projection bridges now (none for their type, or it returned
            None): nothing published, their letters still wait.
        not_found: Envelope ids artifactr's log did not give back at their seq: nothing
            published, their letters still wait.
    """

    bridged: tuple[str, ...]
    failed: tuple[DeadLetter, ...]
    unknown: tuple[str, ...]
    skipped: tuple[str, ...] = ()
    not_found: tuple[str, ...] = ()
