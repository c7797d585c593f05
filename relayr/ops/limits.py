"""What ops see of the operators' limits: each limit's use now, and why a run waits.

``relayr limits`` (and ``relayr runs list``) read it from the limit store the workers count in
(:mod:`relayr.ledger.limits`), against the allowlist file's limits (:mod:`relayr.core.limits`).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from relayr.core.limits import Limit, Rate
from relayr.ledger.limits import LimitStore, RunKey
from relayr.ops.rows import RunRow


@dataclass(frozen=True)
class LimitUse:
    """One bound of one limit, and its use now (chains' use is per chain: not summed)."""

    limit: Limit
    kind: str
    bound: int | Rate
    used: int | None
    waiting: int

    def to_json(self) -> dict[str, Any]:
        return {
            "limit": self.limit.key,
            "line": self.limit.line,
            "rules": list(self.limit.rules),
            "workspaces": list(self.limit.workspaces),
            "kind": self.kind,
            "bound": str(self.bound),
            "used": self.used,
            "waiting": self.waiting,
        }

    def describe(self) -> str:
        used = "per chain" if self.used is None else f"{self.used} used"
        return f"{self.kind} {self.bound}: {used}, {self.waiting} waiting"


async def limit_uses(
    limits: Sequence[Limit], store: LimitStore, *, now: datetime
) -> list[LimitUse]:
    """Each bound of each limit, in file order, with what it uses now and how many runs wait."""
    windows = {
        f"{limit.name}/{kind}": bound.window
        for limit in limits
        for kind, bound in limit.bounds()
        if isinstance(bound, Rate) and kind != "chain_runs_per"
    }
    uses = {use.bucket: use for use in await store.usage(now=now, windows=windows)}
    waiting: dict[str, int] = {}
    for wait in await store.waiting():
        bucket = f"{wait.limit}/{wait.kind}"
        waiting[bucket] = waiting.get(bucket, 0) + 1
    found: list[LimitUse] = []
    for limit in limits:
        for kind, bound in limit.bounds():
            bucket = f"{limit.name}/{kind}"
            use = uses.get(bucket)
            used = None if kind == "chain_runs_per" else (use.used if use is not None else 0)
            found.append(LimitUse(limit, kind, bound, used, waiting.get(bucket, 0)))
    return found


async def with_waits(rows: Sequence[RunRow], store: LimitStore) -> list[RunRow]:
    """The rows, each waiting run's with why it waits and when it expects to go."""
    keys = [
        RunKey(row.tenant_id, row.workspace_id, row.id)
        for row in rows
        if row.status in ("pending", "retrying")
    ]
    if not keys:
        return list(rows)
    waits = {wait.run: wait for wait in await store.waiting(keys)}
    return [
        replace(row, waiting=waits[key].describe())
        if (key := RunKey(row.tenant_id, row.workspace_id, row.id)) in waits
        else row
        for row in rows
    ]
