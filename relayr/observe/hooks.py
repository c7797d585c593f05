"""What the path emits: facts about runs, writes and turns, and the observers that record them.

The stages say what happened with :func:`emit`, one fact at a time, and never call metrics or
traces themselves; observers subscribe (ADR-0096). An observer that raises is logged and skipped:
observing never fails a run. Observers run in the emitting thread, in the order they subscribed;
:func:`subscribe` returns the function that unsubscribes (tests use it to watch).
"""

from collections.abc import Callable
from dataclasses import dataclass

import structlog


@dataclass(frozen=True)
class RunClaimed:
    """A run's attempt started, ``lag_s`` after it was due."""

    lag_s: float


@dataclass(frozen=True)
class RunEnded:
    """The executor ended a run with ``outcome``; ``duration_s`` when its action ran."""

    rule: str | None
    outcome: str
    duration_s: float | None = None


@dataclass(frozen=True)
class WriteRefused:
    """A rule's write was refused for good (relayr's own check or artifactr's), by reason."""

    reason: str


@dataclass(frozen=True)
class EmissionMade:
    """A notice or a send left its emission record (``turn_id`` of the turn it started)."""

    kind: str
    outcome: str
    policy: str
    turn_id: str | None = None


@dataclass(frozen=True)
class TurnStarted:
    """An agent turn started by a run's message."""


@dataclass(frozen=True)
class TurnsDrained:
    """``count`` turns ended within a stopping worker's grace period."""

    count: int


@dataclass(frozen=True)
class RunsEnqueued:
    """A run message naming ``count`` runs reached the queue."""

    count: int


@dataclass(frozen=True)
class RunLimited:
    """An operator's limit held a run of ``rule`` back (``limit``: its name and kind)."""

    rule: str
    limit: str


@dataclass(frozen=True)
class MessageRedelivered:
    """A run message was delivered again (its worker died, or it was requeued)."""


@dataclass(frozen=True)
class LimitsUsed:
    """What each bound of each operator's limit uses now, and the runs waiting on it: one
    ``(limit, kind, used, waiting)`` per bound (``used`` None for a chain's, counted per chain).
    """

    uses: tuple[tuple[str, str, int | None, int], ...]


type Fact = (
    RunClaimed
    | RunEnded
    | WriteRefused
    | EmissionMade
    | TurnStarted
    | TurnsDrained
    | RunsEnqueued
    | RunLimited
    | MessageRedelivered
    | LimitsUsed
)
type Observer = Callable[[Fact], None]

logger = structlog.get_logger("relayr.hooks")
_observers: list[Observer] = []


def subscribe(observer: Observer) -> Callable[[], None]:
    """Call ``observer`` with every fact emitted from now on; returns its unsubscribe."""
    _observers.append(observer)

    def unsubscribe() -> None:
        if observer in _observers:
            _observers.remove(observer)

    return unsubscribe


def emit(fact: Fact) -> None:
    """Hand ``fact`` to every observer; one that raises is logged and the rest still see it."""
    for observer in tuple(_observers):
        try:
            observer(fact)
        except Exception as error:
            logger.warning("observer failed", fact=type(fact).__name__, error=repr(error))
