"""Limits on what rules spend, as the operators' allowlist file states them (pure: no clock).

A limit is a named entry of the file (``[limits.triage]``) over the runs of the rules its
``rules`` patterns match, in the workspaces its ``workspaces`` patterns match (every workspace
when left out). Everything one entry matches counts together, under the entry's name, across
every worker: a limit for one rule names that rule; a limit for a tenant names its workspaces
(``acme/*``) and every rule (``*``). A run is bound by every entry that matches it, and starts
only when all of them allow it. What each kind counts, and when, is the ADR's ("limits on what
rules spend"); :func:`window_admits` is the one decision on a window, shared by every store.
"""

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Literal

type LimitKind = Literal[
    "runs_in_flight", "turns_in_flight", "turns_per", "tokens_per", "chain_runs_per"
]

IN_FLIGHT_KINDS: Final[tuple[LimitKind, ...]] = ("runs_in_flight", "turns_in_flight")
"""Limits on how many things run at once: a number."""

WINDOW_KINDS: Final[tuple[LimitKind, ...]] = ("turns_per", "tokens_per", "chain_runs_per")
"""Limits on how much happens per window: ``"20/1m"``."""

LIMIT_KINDS: Final[tuple[LimitKind, ...]] = (*IN_FLIGHT_KINDS, *WINDOW_KINDS)

TURN_KINDS: Final[frozenset[LimitKind]] = frozenset({"turns_in_flight", "turns_per", "tokens_per"})
"""Limits that bind only runs of rules granted turns: the others start no turn to count."""

_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW: Final = timedelta(days=1)
"""The longest window: a window's use is kept that long, and a day bounds a budget well."""

_RATE = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]*)\s*([smhd])\s*")
_RULE_PATTERN = re.compile(r"[a-z0-9_:.*-]+")
_WORKSPACE_PATTERN = re.compile(r"[^/\s]+/[^/\s]+")


@dataclass(frozen=True)
class Rate:
    """``count`` per ``window``, as the file writes it (``text``)."""

    count: int
    window: timedelta
    text: str

    def __str__(self) -> str:
        return self.text


def parse_rate(text: str) -> Rate:
    """``"20/1m"`` as a :class:`Rate`; raise ``ValueError`` saying what is wrong.

    A window is a whole number of seconds, minutes, hours or days (``30s``, ``1m``, ``1h``,
    ``1d``; ``/m`` is ``/1m``), at most a day; the count is a whole number of at least 1.
    """
    found = _RATE.fullmatch(text)
    if found is None:
        raise ValueError(
            f'must be a count per window, such as "20/1m" or "500/1h" (s, m, h or d), not {text!r}'
        )
    count, amount, unit = int(found.group(1)), int(found.group(2) or "1"), found.group(3)
    if count < 1:
        raise ValueError(f"the count of {text!r} must be at least 1")
    window = timedelta(seconds=amount * _UNITS[unit])
    if not timedelta(0) < window <= MAX_WINDOW:
        raise ValueError(f"the window of {text!r} must be longer than 0 and at most 1d")
    return Rate(count, window, f"{count}/{amount}{unit}")


def pattern_problem(pattern: str, *, workspace: bool) -> str | None:
    """Why ``pattern`` is not a rule pattern (or a ``tenant/workspace`` one), or None."""
    if workspace:
        if _WORKSPACE_PATTERN.fullmatch(pattern) is None:
            return f'malformed workspace pattern {pattern!r}; write "tenant/workspace", "acme/*"'
        return None
    if _RULE_PATTERN.fullmatch(pattern) is None:
        return (
            f'malformed rule pattern {pattern!r}; a rule name such as "ops:triage", '
            'with * for any characters ("ops:*", "*")'
        )
    return None


def _matcher(patterns: Sequence[str]) -> re.Pattern[str]:
    return re.compile(
        "|".join(
            "(?:" + ".*".join(re.escape(part) for part in p.split("*")) + ")" for p in patterns
        )
    )


@dataclass(frozen=True)
class Limit:
    """One ``[limits.NAME]`` entry: which runs it binds, and its bounds (None: not bounded)."""

    name: str
    rules: tuple[str, ...]
    workspaces: tuple[str, ...] = ("*/*",)
    runs_in_flight: int | None = None
    turns_in_flight: int | None = None
    turns_per: Rate | None = None
    tokens_per: Rate | None = None
    chain_runs_per: Rate | None = None
    line: int | None = None

    @property
    def key(self) -> str:
        """Its path in the file: ``limits.triage``."""
        return f"limits.{self.name}"

    def matches_rule(self, rule: str) -> bool:
        """Whether runs of ``rule`` are bound by this limit in some workspace."""
        return _matcher(self.rules).fullmatch(rule) is not None

    def matches(self, rule: str, tenant_id: str, workspace_id: str) -> bool:
        """Whether a run of ``rule`` in ``tenant_id/workspace_id`` is bound by this limit."""
        return (
            self.matches_rule(rule)
            and _matcher(self.workspaces).fullmatch(f"{tenant_id}/{workspace_id}") is not None
        )

    def bounds(self) -> list[tuple[LimitKind, int | Rate]]:
        """The bounds it sets, in the order of :data:`LIMIT_KINDS`."""
        found: list[tuple[LimitKind, int | Rate]] = []
        for kind in LIMIT_KINDS:
            value = getattr(self, kind)
            if value is not None:
                found.append((kind, value))
        return found

    def to_json(self) -> dict[str, Any]:
        """The entry as ``relayr allowlist explain --json`` and ``relayr limits`` print it."""
        return {
            "name": self.name,
            "key": self.key,
            "line": self.line,
            "rules": list(self.rules),
            "workspaces": list(self.workspaces),
            **{
                kind: str(value) if isinstance(value, Rate) else value
                for kind, value in self.bounds()
            },
        }


def describe(limit: Limit, kind: LimitKind) -> str:
    """``turns_per 20/1m of limits.triage``: a bound as people read it."""
    return f"{kind} {getattr(limit, kind)} of {limit.key}"


def limits_for(
    limits: Iterable[Limit], rule: str, tenant_id: str, workspace_id: str
) -> list[Limit]:
    """The limits that bind a run of ``rule`` in the workspace, in file order."""
    return [limit for limit in limits if limit.matches(rule, tenant_id, workspace_id)]


def window_admits(
    used: Sequence[tuple[datetime, int]], rate: Rate, amount: int, now: datetime
) -> tuple[bool, datetime | None]:
    """Whether ``amount`` more fits in the window that ends at ``now``, and if not, when.

    ``used`` is what was counted in the window (time, amount), oldest first. The window slides:
    at no moment may the last ``rate.window`` hold more than ``rate.count``. When it does not
    fit, the time returned is when enough of ``used`` has left the window for it to fit (None
    if it never can: ``amount`` alone is over the count, as a budget already spent may be).
    """
    since = now - rate.window
    inside = [(at, spent) for at, spent in used if at > since]
    total = sum(spent for _, spent in inside)
    if total + amount <= rate.count:
        return True, None
    excess = total + amount - rate.count
    for at, spent in inside:
        excess -= spent
        if excess <= 0:
            return False, at + rate.window
    return False, (inside[-1][0] + rate.window) if inside else now + rate.window


def turn_in_window(
    used: Sequence[tuple[datetime, int]], rate: Rate, ahead: int, now: datetime
) -> datetime | None:
    """When one more use can expect to fit for a run with ``ahead`` runs waiting before it,
    each taking, in turn, the next use the window frees (and its own use freeing again a
    window later); None if one fits now.

    The window's uses leave it oldest first: the first waiter takes the first that leaves, the
    ``count``-th the ``count``-th, the next the first one's again a window later, and so on. A
    time this gives is never later than the use could come, if the runs ahead take theirs.
    """
    fits, next_at = window_admits(used, rate, 1, now)
    if fits:
        return None
    inside = [at for at, spent in used if at > now - rate.window for _ in range(spent)]
    if len(inside) < rate.count or rate.count < 1:
        return next_at
    rounds, place = divmod(ahead, rate.count)
    return inside[len(inside) - rate.count + place] + rate.window * (rounds + 1)
