"""What ops see of the operators' limits: why a run waits (each limit's use now is
:func:`relayr.ledger.limits.limit_uses`).

``relayr limits`` (and ``relayr runs list``) read it from the limit store the workers count in
(:mod:`relayr.ledger.limits`), against the allowlist file's limits (:mod:`relayr.core.limits`).
"""

from collections.abc import Sequence
from dataclasses import replace

from relayr.ledger.limits import LimitStore, RunKey
from relayr.ops.rows import RunRow


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
