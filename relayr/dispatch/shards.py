"""Several dispatchers share the work: workspaces in shards, each held under a lease (ADR-0092).

A workspace's shard is a stable hash of its tenant and id (:func:`shard_of`). Each dispatcher
beats, holds about ``ceil(shards / alive)`` shards under leases of ``lease_ttl_s`` renewed
with each beat, takes every shard whose lease lapsed (a dead dispatcher's), and decides only
the workspaces of shards whose lease has more than a third left, so no workspace is decided by
two at once. :class:`InMemoryShardStore` and :class:`SqlShardStore` (tables
``relayr_dispatch_shards`` and ``relayr_dispatchers``, made by relayr's migrations) keep one
contract.
"""

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

from sqlalchemy import Column, DateTime, Integer, MetaData, Table, Text, delete, func, or_, select
from sqlalchemy import update as sql_update
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.ledger.sql import SqlStore


def shard_of(tenant_id: str, workspace_id: str, shards: int) -> int:
    """The shard of a workspace: a stable hash of its tenant and id, modulo ``shards``."""
    digest = hashlib.sha256(f"{tenant_id}\x00{workspace_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


@dataclass(frozen=True)
class Holding:
    """Who holds a shard, until when."""

    shard: int
    holder: str
    held_until: datetime


class ShardStore(Protocol):
    """Dispatchers alive and shards' leases. Adapters: in memory and SQL."""

    async def beat(self, holder: str, *, until: datetime, now: datetime) -> int:
        """Say ``holder`` is alive until ``until``; return how many are alive at ``now``."""
        ...

    async def holdings(self) -> list[Holding]:
        """Every shard someone holds or held."""
        ...

    async def renew(self, holder: str, shards: set[int], *, until: datetime) -> set[int]:
        """Renew ``holder``'s leases on ``shards`` up to ``until``; return those it still held."""
        ...

    async def take(
        self, shards: set[int], holder: str, *, until: datetime, now: datetime
    ) -> set[int]:
        """Take those of ``shards`` that are free, lapsed at ``now``, or ``holder``'s own;
        return them."""
        ...

    async def release(self, holder: str, shards: set[int]) -> None:
        """Give shards up, so another may take them at once."""
        ...

    async def leave(self, holder: str) -> None:
        """``holder`` stops: it is no longer counted alive."""
        ...


class InMemoryShardStore:
    """The contract in one process's memory: for ``memory://`` and tests."""

    def __init__(self) -> None:
        self._alive: dict[str, datetime] = {}
        self._held: dict[int, Holding] = {}

    async def beat(self, holder: str, *, until: datetime, now: datetime) -> int:
        self._alive[holder] = until
        return sum(1 for seen in self._alive.values() if seen > now)

    async def holdings(self) -> list[Holding]:
        return sorted(self._held.values(), key=lambda holding: holding.shard)

    async def renew(self, holder: str, shards: set[int], *, until: datetime) -> set[int]:
        kept = {s for s in shards if s in self._held and self._held[s].holder == holder}
        for shard in kept:
            self._held[shard] = Holding(shard, holder, until)
        return kept

    async def take(
        self, shards: set[int], holder: str, *, until: datetime, now: datetime
    ) -> set[int]:
        taken = set()
        for shard in shards:
            found = self._held.get(shard)
            if found is not None and found.holder != holder and found.held_until > now:
                continue
            self._held[shard] = Holding(shard, holder, until)
            taken.add(shard)
        return taken

    async def release(self, holder: str, shards: set[int]) -> None:
        for shard in shards:
            found = self._held.get(shard)
            if found is not None and found.holder == holder:
                del self._held[shard]

    async def leave(self, holder: str) -> None:
        self._alive.pop(holder, None)


metadata = MetaData()

shards_table = Table(
    "relayr_dispatch_shards",
    metadata,
    Column("shard", Integer, primary_key=True, autoincrement=False),
    Column("holder", Text, nullable=False),
    Column("held_until", DateTime(timezone=True), nullable=False),
)

dispatchers_table = Table(
    "relayr_dispatchers",
    metadata,
    Column("holder", Text, primary_key=True),
    Column("seen_until", DateTime(timezone=True), nullable=False),
)


class SqlShardStore(SqlStore):
    """The contract in SQLite or PostgreSQL: one short transaction per call."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine, refusal="the dispatchers' shards store")

    async def beat(self, holder: str, *, until: datetime, now: datetime) -> int:
        table = dispatchers_table
        beat = (
            self._insert(table)
            .values(holder=holder, seen_until=until)
            .on_conflict_do_update(index_elements=["holder"], set_={"seen_until": until})
        )
        async with self._transaction() as connection:
            await connection.execute(beat)
            await connection.execute(delete(table).where(table.c.seen_until < now - _FORGET))
            alive = await connection.scalar(
                select(func.count()).select_from(table).where(table.c.seen_until > now)
            )
        return int(alive or 0)

    async def holdings(self) -> list[Holding]:
        table = shards_table
        async with self._transaction() as connection:
            rows = (await connection.execute(select(table).order_by(table.c.shard))).all()
        return [Holding(int(row.shard), row.holder, _utc(row.held_until)) for row in rows]

    async def renew(self, holder: str, shards: set[int], *, until: datetime) -> set[int]:
        if not shards:
            return set()
        table = shards_table
        renewed = (
            sql_update(table)
            .where(table.c.holder == holder, table.c.shard.in_(sorted(shards)))
            .values(held_until=until)
            .returning(table.c.shard)
        )
        async with self._transaction() as connection:
            return {int(shard) for shard in (await connection.execute(renewed)).scalars()}

    async def take(
        self, shards: set[int], holder: str, *, until: datetime, now: datetime
    ) -> set[int]:
        table = shards_table
        taken: set[int] = set()
        async with self._transaction() as connection:
            for shard in sorted(shards):
                took = (
                    self._insert(table)
                    .values(shard=shard, holder=holder, held_until=until)
                    .on_conflict_do_update(
                        index_elements=["shard"],
                        set_={"holder": holder, "held_until": until},
                        where=or_(table.c.holder == holder, table.c.held_until <= now),
                    )
                    .returning(table.c.shard)
                )
                if (await connection.execute(took)).scalar() is not None:
                    taken.add(shard)
        return taken

    async def release(self, holder: str, shards: set[int]) -> None:
        if not shards:
            return
        table = shards_table
        released = delete(table).where(table.c.holder == holder, table.c.shard.in_(sorted(shards)))
        async with self._transaction() as connection:
            await connection.execute(released)

    async def leave(self, holder: str) -> None:
        table = dispatchers_table
        async with self._transaction() as connection:
            await connection.execute(delete(table).where(table.c.holder == holder))


SHORT_RETRY_S: Final = 1.0
"""How often a dispatcher looks for shards to take between beats (one read of the leases): the
others give their extra shards up at their next beat, and a dead one's lapse in between."""

_FORGET = timedelta(hours=1)
"""How long a dispatcher's row stays after it stopped beating: long enough to read who it was."""


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def utc_now() -> datetime:
    return datetime.now(UTC)


async def _every_shard(store: ShardStore, shards: int) -> dict[int, Holding | None]:
    """Each shard, with who holds or held it (None: no one, or it was given up)."""
    found = {holding.shard: holding for holding in await store.holdings()}
    return {shard: found.get(shard) for shard in range(shards)}


class Shards:
    """One dispatcher's share of the shards, kept by :meth:`keep`.

    Args:
        store: Where the leases are.
        holder: This dispatcher's name in them.
        shards: How many shards there are (``dispatch_shards``).
        lease_ttl_s: How long a lease lasts unless renewed.
        clock: The wall clock leases are stamped with.
        monotonic: The clock renewals are timed on.
    """

    def __init__(
        self,
        store: ShardStore,
        *,
        holder: str,
        shards: int,
        lease_ttl_s: float,
        clock: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._holder = holder
        self._shards = shards
        self._ttl = timedelta(seconds=lease_ttl_s)
        self._clock = clock
        self._monotonic = monotonic
        self._held: dict[int, datetime] = {}
        self._kept_at: float | None = None
        self._looked_at: float | None = None
        self._target = shards

    @property
    def held(self) -> frozenset[int]:
        """The shards held now (with enough of their lease left to decide in)."""
        now = self._clock()
        return frozenset(s for s, until in self._held.items() if until - now > self._ttl / 3)

    def owns(self, tenant_id: str, workspace_id: str) -> bool:
        """Whether this dispatcher decides the workspace now."""
        until = self._held.get(shard_of(tenant_id, workspace_id, self._shards))
        return until is not None and until - self._clock() > self._ttl / 3

    async def due(self) -> bool:
        """Whether :meth:`keep` has something to do: a third of the lease passed, or (looked at
        every :data:`SHORT_RETRY_S`) this dispatcher holds fewer shards than its share, or a
        shard's lease lapsed: a dead dispatcher's shards are taken within a second of that."""
        now = self._monotonic()
        if self._kept_at is None or now - self._kept_at >= self._ttl.total_seconds() / 3:
            return True
        if self._looked_at is not None and now - self._looked_at < SHORT_RETRY_S:
            return False
        self._looked_at = now
        if len(self._held) < self._target:
            return True
        wall = self._clock()
        return any(h.held_until <= wall for h in await self._store.holdings())

    async def keep(self) -> set[int]:
        """Beat, renew the leases held, give up what is beyond this dispatcher's share and take
        free or lapsed shards up to it; return the shards gained."""
        now = self._clock()
        until = now + self._ttl
        self._kept_at = self._monotonic()
        alive = max(1, await self._store.beat(self._holder, until=until, now=now))
        self._target = math.ceil(self._shards / alive)
        kept = await self._store.renew(self._holder, set(self._held), until=until)
        self._held = dict.fromkeys(kept, until)
        if len(self._held) > self._target:
            extra = set(sorted(self._held)[self._target :])
            await self._store.release(self._holder, extra)
            for shard in extra:
                del self._held[shard]
        wanted: set[int] = set()
        room = self._target - len(self._held)
        for shard, found in (await _every_shard(self._store, self._shards)).items():
            if shard in self._held or (found is not None and found.held_until > now):
                continue
            # a free shard only up to this dispatcher's share; a lapsed one (its holder died
            # or stalled) whatever the share, so no workspace stays undecided
            if found is None:
                if room <= 0:
                    continue
                room -= 1
            wanted.add(shard)
        gained = (
            await self._store.take(wanted, self._holder, until=until, now=now) if wanted else set()
        )
        for shard in gained:
            self._held[shard] = until
        return gained

    async def release(self) -> None:
        """Give every shard up and stop counting as alive, so others take over at once."""
        await self._store.release(self._holder, set(self._held))
        await self._store.leave(self._holder)
        self._held.clear()
