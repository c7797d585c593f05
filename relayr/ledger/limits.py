"""The counts behind the operators' limits, shared by every worker: in SQL or in memory.

:meth:`LimitStore.admit_all` checks every limit that binds each of a message's runs and, only
if all allow a run, takes what it uses (an in-flight slot under a lease, or a use of a window),
in one transaction for the message; a run refused is recorded as waiting, with its limit and
when it expects to go. :meth:`LimitStore.release_all` gives back a group's slots in one.
Two admissions into one limit never interleave (row locks on PostgreSQL, ``BEGIN IMMEDIATE`` on
SQLite; ADR-0106). The SQLite engine has one connection: never call the store while holding it.
"""

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    and_,
    delete,
    func,
    select,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from relayr.core.limits import (
    MAX_WINDOW,
    Limit,
    LimitKind,
    Rate,
    turn_in_window,
    window_admits,
)
from relayr.ledger.sql import SqlStore
from relayr.ledger.with_the_write import riding


@dataclass(frozen=True, order=True)
class RunKey:
    """A run, as the limits know it: ``tenant/workspace/run``."""

    tenant_id: str
    workspace_id: str
    run_id: str

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.workspace_id}/{self.run_id}"


@dataclass(frozen=True)
class Check:
    """One bound a run must fit in: ``bucket`` is what is counted together (a limit's name and
    kind, and a chain's correlation id for ``chain_runs_per``); ``use`` the key its use of a
    window is counted once under (the run), with ``amount`` (0 for ``tokens_per``: the row only
    says which token windows the run's turns count in as they end,
    :meth:`LimitStore.turn_ended`)."""

    limit: str
    kind: LimitKind
    bucket: str
    bound: int | Rate
    use: str | None
    amount: int = 1

    def describe(self) -> str:
        return f"{self.kind} {self.bound} of limits.{self.limit}"


@dataclass(frozen=True)
class Refusal:
    """Why a run may not start now, and when it expects to (None: when a slot is freed)."""

    check: Check
    next_at: datetime | None

    def describe(self) -> str:
        when = "" if self.next_at is None else f", next at {self.next_at.isoformat()}"
        return f"waiting: {self.check.describe()}{when}"


@dataclass(frozen=True)
class Waiting:
    """A run the limits hold back: by which limit, since when, and when it expects to go."""

    run: RunKey
    limit: str
    kind: str
    bound: str
    since: datetime
    next_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "kind": self.kind,
            "bound": self.bound,
            "since": self.since.isoformat(),
            "next_at": None if self.next_at is None else self.next_at.isoformat(),
        }

    def describe(self) -> str:
        """``waiting: turns_per 20/1m of limits.triage, next at 2026-...``, as ops read it."""
        when = (
            "until a slot is free"
            if self.next_at is None
            else f"next at {self.next_at.isoformat()}"
        )
        return f"waiting: {self.kind} {self.bound} of limits.{self.limit}, {when}"


@dataclass(frozen=True)
class Use:
    """How much of one bucket is used now."""

    bucket: str
    kind: str
    used: int
    waiting: int


@dataclass
class Admission:
    """Runs to admit with a storage transaction (:meth:`LimitStore.admitting`): ``asked`` is
    set in it, before it commits; ``refused`` is the decision after the block."""

    now: datetime
    lease_until: datetime
    asked: dict[RunKey, Sequence[Check]] = field(default_factory=dict)
    refused: dict[RunKey, Refusal] = field(default_factory=dict)


@dataclass
class Release:
    """Slots to give back with a storage transaction (:meth:`LimitStore.releasing`), as
    :meth:`LimitStore.release_all` takes them; ``woken`` is its answer after the block."""

    held: Mapping[RunKey, datetime | None]
    woken: list[RunKey] = field(default_factory=list)


class LimitStore(Protocol):
    """The counts behind the limits; every call is atomic across every process."""

    def admitting(self, admission: Admission) -> AbstractAsyncContextManager[None]:
        """Decide ``admission`` (:meth:`admit_all`) in the block's first commit on the store's
        engine: in the storage's own transaction, when the two share their engine (relayr's
        wiring); else in a transaction of its own after a block that raised nothing."""
        ...

    def releasing(self, release: Release) -> AbstractAsyncContextManager[None]:
        """Give back ``release`` (:meth:`release_all`) as :meth:`admitting` decides."""
        ...

    async def admit_all(
        self, runs: Mapping[RunKey, Sequence[Check]], *, now: datetime, lease_until: datetime
    ) -> dict[RunKey, Refusal]:
        """For each run in turn, take what it uses if every check allows it, else nothing (its
        refusal, and the run is recorded as waiting). Admitting an attempt again takes nothing
        more. One transaction: a run is checked with the uses of the runs before it."""
        ...

    async def admit(
        self, run: RunKey, checks: Sequence[Check], *, now: datetime, lease_until: datetime
    ) -> Refusal | None:
        """:meth:`admit_all` for one run: its refusal, or None."""
        ...

    async def release(self, run: RunKey, *, kinds: Sequence[LimitKind] = ()) -> list[RunKey]:
        """Free the run's in-flight slots (of ``kinds``, or all); return the runs waiting on
        their buckets, oldest first."""
        ...

    async def release_all(self, runs: Mapping[RunKey, datetime | None]) -> list[RunKey]:
        """Free the runs' in-flight slots in one transaction; a run mapped to a time keeps its
        ``turns_in_flight`` slots until then (its attempt started a turn, whose end frees
        them). Return the runs waiting on the freed buckets, oldest first."""
        ...

    async def renew(
        self, run: RunKey, *, lease_until: datetime, kinds: Sequence[LimitKind] = ()
    ) -> None:
        """Keep the run's slots (of ``kinds``, or all) until ``lease_until``."""
        ...

    async def turn_ended(
        self, run: RunKey, turn_id: str, tokens: int, at: datetime
    ) -> list[RunKey]:
        """A turn the run started ended: free its ``turns_in_flight`` slots and count the
        turn's ``tokens`` in the run's token windows, once per turn; return the runs waiting on
        the limits whose slots were freed, oldest first."""
        ...

    async def waiting(self, runs: Sequence[RunKey] | None = None) -> list[Waiting]:
        """The runs recorded as waiting (of ``runs``, or all), oldest first."""
        ...

    async def forget_waiting(self, runs: Sequence[RunKey]) -> None:
        """Stop recording these runs as waiting (they finished, or were woken)."""
        ...

    async def usage(self, *, now: datetime, windows: dict[str, timedelta]) -> list[Use]:
        """Each bucket's use now: slots held, or the sum over its window (``windows`` by bucket)."""
        ...

    async def aclose(self) -> None: ...


class _FromBatches(ABC):
    """What a store derives from its calls on many runs: :meth:`LimitStore.admit` of one, and
    :meth:`LimitStore.admitting` and :meth:`LimitStore.releasing` as calls of their own after
    the block (a store with no engine to ride)."""

    @abstractmethod
    async def admit_all(
        self, runs: Mapping[RunKey, Sequence[Check]], *, now: datetime, lease_until: datetime
    ) -> dict[RunKey, Refusal]: ...

    @abstractmethod
    async def release_all(self, runs: Mapping[RunKey, datetime | None]) -> list[RunKey]: ...

    @asynccontextmanager
    async def admitting(self, admission: Admission) -> AsyncIterator[None]:
        yield
        admission.refused = await self.admit_all(
            admission.asked, now=admission.now, lease_until=admission.lease_until
        )

    @asynccontextmanager
    async def releasing(self, release: Release) -> AsyncIterator[None]:
        yield
        release.woken = await self.release_all(release.held)

    async def admit(
        self, run: RunKey, checks: Sequence[Check], *, now: datetime, lease_until: datetime
    ) -> Refusal | None:
        refused = await self.admit_all({run: checks}, now=now, lease_until=lease_until)
        return refused.get(run)


# --- in memory -----------------------------------------------------------------------------


@dataclass
class InMemoryLimitStore(_FromBatches):
    """The store's contract in one process's memory (tests, and the in-memory application)."""

    slots: dict[tuple[str, RunKey], tuple[LimitKind, datetime]] = field(default_factory=dict)
    uses: dict[tuple[str, str], tuple[LimitKind, datetime, int]] = field(default_factory=dict)
    waits: dict[RunKey, Waiting] = field(default_factory=dict)
    now: datetime | None = None

    def _held(self, bucket: str, now: datetime, run: RunKey) -> int:
        return sum(
            1
            for (held_bucket, holder), (_, until) in self.slots.items()
            if held_bucket == bucket and until > now and holder != run
        )

    def _used(self, bucket: str) -> list[tuple[datetime, int]]:
        return sorted(
            (at, amount)
            for (used_bucket, _), (_, at, amount) in self.uses.items()
            if used_bucket == bucket
        )

    async def admit_all(
        self, runs: Mapping[RunKey, Sequence[Check]], *, now: datetime, lease_until: datetime
    ) -> dict[RunKey, Refusal]:
        refused: dict[RunKey, Refusal] = {}
        for run, checks in runs.items():
            refusal = self._admit(run, checks, now, lease_until)
            if refusal is not None:
                refused[run] = refusal
        return refused

    def _admit(
        self, run: RunKey, checks: Sequence[Check], now: datetime, lease_until: datetime
    ) -> Refusal | None:
        for check in checks:
            refusal = self._refusal(run, check, now)
            if refusal is not None:
                self._wait(run, refusal, now)
                return refusal
        for check in checks:
            if isinstance(check.bound, int):
                self.slots[(check.bucket, run)] = (check.kind, lease_until)
            elif check.use is not None:
                self.uses.setdefault((check.bucket, check.use), (check.kind, now, check.amount))
        self.waits.pop(run, None)
        return None

    def _refusal(self, run: RunKey, check: Check, now: datetime) -> Refusal | None:
        if isinstance(check.bound, int):
            if (check.bucket, run) in self.slots or self._held(
                check.bucket, now, run
            ) < check.bound:
                return None
            return Refusal(check, None)
        if check.use is not None and (check.bucket, check.use) in self.uses:
            return None
        used = self._used(check.bucket)
        fits, next_at = window_admits(used, check.bound, 1, now)
        if fits:
            return None
        if check.kind == "turns_per":
            mine = self.waits.get(run)
            ahead = sum(
                1
                for wait in self.waits.values()
                if (wait.limit, wait.kind) == (check.limit, check.kind)
                and (mine is None or (wait.since, wait.run) < (mine.since, run))
            )
            next_at = turn_in_window(used, check.bound, ahead, now)
        return Refusal(check, next_at)

    def _wait(self, run: RunKey, refusal: Refusal, now: datetime) -> None:
        since = self.waits[run].since if run in self.waits else now
        check = refusal.check
        self.waits[run] = Waiting(
            run, check.limit, check.kind, str(check.bound), since, refusal.next_at
        )

    async def release(self, run: RunKey, *, kinds: Sequence[LimitKind] = ()) -> list[RunKey]:
        freed = {
            bucket
            for (bucket, holder), (kind, _) in self.slots.items()
            if holder == run and (not kinds or kind in kinds)
        }
        for bucket in freed:
            del self.slots[(bucket, run)]
        return self._waiting_on({bucket.rsplit("/", 1)[0] for bucket in freed})

    async def release_all(self, runs: Mapping[RunKey, datetime | None]) -> list[RunKey]:
        freed: set[str] = set()
        for (bucket, holder), (kind, _) in list(self.slots.items()):
            if holder not in runs:
                continue
            kept = runs[holder]
            if kept is not None and kind == "turns_in_flight":
                self.slots[(bucket, holder)] = (kind, kept)
            else:
                del self.slots[(bucket, holder)]
                freed.add(bucket)
        return self._waiting_on({bucket.rsplit("/", 1)[0] for bucket in freed})

    def _waiting_on(self, limits: set[str]) -> list[RunKey]:
        found = [wait for wait in self.waits.values() if wait.limit in limits]
        return [wait.run for wait in sorted(found, key=lambda wait: (wait.since, wait.run))]

    async def renew(
        self, run: RunKey, *, lease_until: datetime, kinds: Sequence[LimitKind] = ()
    ) -> None:
        for key, (kind, _) in list(self.slots.items()):
            if key[1] == run and (not kinds or kind in kinds):
                self.slots[key] = (kind, lease_until)

    async def turn_ended(
        self, run: RunKey, turn_id: str, tokens: int, at: datetime
    ) -> list[RunKey]:
        for (bucket, use), (kind, _, _) in list(self.uses.items()):
            if use == str(run) and kind == "tokens_per":
                self.uses.setdefault((bucket, f"turn:{turn_id}"), (kind, at, tokens))
        return await self.release(run, kinds=("turns_in_flight",))

    async def waiting(self, runs: Sequence[RunKey] | None = None) -> list[Waiting]:
        found = [wait for wait in self.waits.values() if runs is None or wait.run in runs]
        return sorted(found, key=lambda wait: (wait.since, wait.run))

    async def forget_waiting(self, runs: Sequence[RunKey]) -> None:
        for run in runs:
            self.waits.pop(run, None)

    async def usage(self, *, now: datetime, windows: dict[str, timedelta]) -> list[Use]:
        buckets: dict[str, Use] = {}
        for (bucket, _), (kind, until) in self.slots.items():
            if until > now:
                old = buckets.get(bucket, Use(bucket, kind, 0, 0))
                buckets[bucket] = Use(bucket, kind, old.used + 1, 0)
        for (bucket, _), (kind, at, amount) in self.uses.items():
            window = windows.get(bucket)
            if window is not None and at > now - window:
                old = buckets.get(bucket, Use(bucket, kind, 0, 0))
                buckets[bucket] = Use(bucket, kind, old.used + amount, 0)
        return _with_waiting(buckets, self.waits.values())

    async def aclose(self) -> None:
        return None


def _with_waiting(buckets: dict[str, "Use"], waits: Any) -> list[Use]:
    counts: dict[str, int] = {}
    for wait in waits:
        bucket = f"{wait.limit}/{wait.kind}"
        counts[bucket] = counts.get(bucket, 0) + 1
        buckets.setdefault(bucket, Use(bucket, wait.kind, 0, 0))
    return [
        Use(use.bucket, use.kind, use.used, counts.get(bucket, 0))
        for bucket, use in sorted(buckets.items())
    ]


# --- SQL -----------------------------------------------------------------------------------


@dataclass
class _Carried:
    """Work on the connection of the storage's commit (:func:`riding`)."""

    work: Callable[[Connection], None]
    committed: bool = False

    def carry(self, connection: Connection) -> None:
        self.work(connection)


metadata = MetaData()

locks_table = Table(
    "relayr_limit_locks",
    metadata,
    Column("bucket", Text, primary_key=True),
)

slots_table = Table(
    "relayr_limit_slots",
    metadata,
    Column("bucket", Text, primary_key=True),
    Column("holder", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

uses_table = Table(
    "relayr_limit_uses",
    metadata,
    Column(
        "position",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("bucket", Text, nullable=False),
    Column("use", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("amount", BigInteger, nullable=False),
    UniqueConstraint("bucket", "use", name="relayr_limit_uses_once"),
)

waits_table = Table(
    "relayr_limit_waits",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("workspace_id", Text, primary_key=True),
    Column("run_id", Text, primary_key=True),
    Column("limit_name", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("bound", Text, nullable=False),
    Column("since", DateTime(timezone=True), nullable=False),
    Column("next_at", DateTime(timezone=True), nullable=True),
)


class SqlLimitStore(_FromBatches, SqlStore):
    """The limits' counts in SQLite or PostgreSQL (see the module)."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine, refusal="the limits keep their counts")

    async def admit_all(
        self, runs: Mapping[RunKey, Sequence[Check]], *, now: datetime, lease_until: datetime
    ) -> dict[RunKey, Refusal]:
        if not runs:
            return {}
        async with self._transaction() as connection:
            return await connection.run_sync(self._admit_all, runs, now, lease_until)

    @asynccontextmanager
    async def admitting(self, admission: Admission) -> AsyncIterator[None]:
        def decide(connection: Connection) -> None:
            admission.refused = self._admit_all(
                connection, admission.asked, admission.now, admission.lease_until
            )

        async with self._riding(decide):
            yield

    @asynccontextmanager
    async def releasing(self, release: Release) -> AsyncIterator[None]:
        def free(connection: Connection) -> None:
            release.woken = self._release_all(connection, release.held)

        async with self._riding(free):
            yield

    @asynccontextmanager
    async def _riding(self, work: Callable[[Connection], None]) -> AsyncIterator[None]:
        """Do ``work`` in the block's first commit on the store's engine; else, after a block
        that raised nothing, in a transaction of its own."""
        await self._ensure_tables()
        rider = _Carried(work)
        with riding(self._engine.sync_engine, "limits", rider):
            yield
        if not rider.committed:
            async with self._transaction() as connection:
                await connection.run_sync(work)

    def _admit_all(
        self,
        connection: Connection,
        runs: Mapping[RunKey, Sequence[Check]],
        now: datetime,
        lease_until: datetime,
    ) -> dict[RunKey, Refusal]:
        refused: dict[RunKey, Refusal] = {}
        if not runs:
            return refused
        self._lock(
            connection, sorted({check.bucket for checks in runs.values() for check in checks})
        )
        for run, checks in runs.items():
            refusal = self._admit(connection, run, checks, now, lease_until)
            if refusal is not None:
                refused[run] = refusal
        connection.execute(delete(uses_table).where(uses_table.c.at < now - MAX_WINDOW))
        return refused

    def _admit(
        self,
        connection: Connection,
        run: RunKey,
        checks: Sequence[Check],
        now: datetime,
        lease_until: datetime,
    ) -> Refusal | None:
        holder = str(run)
        for check in checks:
            refusal = self._refusal(connection, run, check, now)
            if refusal is not None:
                self._wait(connection, run, refusal, now)
                return refusal
        for check in checks:
            if isinstance(check.bound, int):
                statement = self._insert(slots_table).values(
                    bucket=check.bucket, holder=holder, kind=check.kind, expires_at=lease_until
                )
                connection.execute(
                    statement.on_conflict_do_update(
                        index_elements=["bucket", "holder"],
                        set_={"expires_at": lease_until},
                    )
                )
            elif check.use is not None:
                connection.execute(
                    self._insert(uses_table)
                    .values(
                        bucket=check.bucket,
                        use=check.use,
                        kind=check.kind,
                        at=now,
                        amount=check.amount,
                    )
                    .on_conflict_do_nothing(index_elements=["bucket", "use"])
                )
        connection.execute(delete(waits_table).where(*_is_run(waits_table, run)))
        return None

    def _lock(self, connection: Connection, buckets: Sequence[str]) -> None:
        if not buckets:
            return
        connection.execute(
            self._insert(locks_table)
            .values([{"bucket": bucket} for bucket in buckets])
            .on_conflict_do_nothing(index_elements=["bucket"])
        )
        if self._dialect == "postgresql":
            connection.execute(
                select(locks_table.c.bucket)
                .where(locks_table.c.bucket.in_(buckets))
                .order_by(locks_table.c.bucket)
                .with_for_update()
            )

    def _refusal(
        self, connection: Connection, run: RunKey, check: Check, now: datetime
    ) -> Refusal | None:
        holder = str(run)
        if isinstance(check.bound, int):
            slots = slots_table.c
            mine = connection.scalar(
                select(func.count()).where(slots.bucket == check.bucket, slots.holder == holder)
            )
            if mine:
                return None
            held = connection.scalar(
                select(func.count()).where(slots.bucket == check.bucket, slots.expires_at > now)
            )
            return None if (held or 0) < check.bound else Refusal(check, None)
        uses = uses_table.c
        if check.use is not None:
            counted = connection.scalar(
                select(func.count()).where(uses.bucket == check.bucket, uses.use == check.use)
            )
            if counted:
                return None
        rows = connection.execute(
            select(uses.at, uses.amount)
            .where(uses.bucket == check.bucket, uses.at > now - check.bound.window)
            .order_by(uses.at)
        )
        used = [(_aware(at), int(amount)) for at, amount in rows.all()]
        fits, next_at = window_admits(used, check.bound, 1, now)
        if fits:
            return None
        if check.kind == "turns_per":
            ahead = self._ahead(connection, run, check)
            next_at = turn_in_window(used, check.bound, ahead, now)
        return Refusal(check, next_at)

    def _ahead(self, connection: Connection, run: RunKey, check: Check) -> int:
        """How many runs wait on the check's limit before ``run``: every one, if it did not
        wait yet; else those that first waited before it (the order :meth:`waiting` lists)."""
        waits = waits_table.c
        where = [waits.limit_name == check.limit, waits.kind == check.kind]
        since = connection.scalar(select(waits.since).where(*_is_run(waits_table, run)))
        if since is not None:
            mine = (since, run.tenant_id, run.workspace_id, run.run_id)
            where.append(
                tuple_(waits.since, waits.tenant_id, waits.workspace_id, waits.run_id)
                < tuple_(*mine)
            )
        return int(connection.scalar(select(func.count()).where(*where)) or 0)

    def _wait(self, connection: Connection, run: RunKey, refusal: Refusal, now: datetime) -> None:
        check = refusal.check
        values = {
            "limit_name": check.limit,
            "kind": check.kind,
            "bound": str(check.bound),
            "next_at": refusal.next_at,
        }
        statement = self._insert(waits_table).values(
            tenant_id=run.tenant_id,
            workspace_id=run.workspace_id,
            run_id=run.run_id,
            since=now,
            **values,
        )
        connection.execute(
            statement.on_conflict_do_update(
                index_elements=["tenant_id", "workspace_id", "run_id"], set_=values
            )
        )

    async def release(self, run: RunKey, *, kinds: Sequence[LimitKind] = ()) -> list[RunKey]:
        slots = slots_table.c
        where = [slots.holder == str(run)]
        if kinds:
            where.append(slots.kind.in_(kinds))
        async with self._transaction() as connection:
            return await connection.run_sync(self._free, where)

    async def release_all(self, runs: Mapping[RunKey, datetime | None]) -> list[RunKey]:
        if not runs:
            return []
        async with self._transaction() as connection:
            return await connection.run_sync(self._release_all, runs)

    def _release_all(
        self, connection: Connection, runs: Mapping[RunKey, datetime | None]
    ) -> list[RunKey]:
        if not runs:
            return []
        slots = slots_table.c
        kept = {str(run): until for run, until in runs.items() if until is not None}
        for holder, until in kept.items():
            connection.execute(
                update(slots_table)
                .where(slots.holder == holder, slots.kind == "turns_in_flight")
                .values(expires_at=until)
            )
        where: list[ColumnElement[bool]] = [slots.holder.in_([str(run) for run in runs])]
        if kept:
            where.append(~and_(slots.holder.in_(kept), slots.kind == "turns_in_flight"))
        return self._free(connection, where)

    def _free(self, connection: Connection, where: Sequence[Any]) -> list[RunKey]:
        """Delete the slots ``where`` says; the runs waiting on their limits, oldest first."""
        slots = slots_table.c
        freed = (
            connection.execute(delete(slots_table).where(*where).returning(slots.bucket))
        ).all()
        limits = sorted({bucket.rsplit("/", 1)[0] for (bucket,) in freed})
        if not limits:
            return []
        waits = waits_table.c
        rows = connection.execute(
            select(waits.tenant_id, waits.workspace_id, waits.run_id)
            .where(waits.limit_name.in_(limits))
            .order_by(waits.since, waits.tenant_id, waits.workspace_id, waits.run_id)
        )
        return [RunKey(*row) for row in rows.all()]

    async def renew(
        self, run: RunKey, *, lease_until: datetime, kinds: Sequence[LimitKind] = ()
    ) -> None:
        where = [slots_table.c.holder == str(run)]
        if kinds:
            where.append(slots_table.c.kind.in_(kinds))
        async with self._transaction() as connection:
            await connection.execute(
                update(slots_table).where(*where).values(expires_at=lease_until)
            )

    async def turn_ended(
        self, run: RunKey, turn_id: str, tokens: int, at: datetime
    ) -> list[RunKey]:
        uses = uses_table.c
        async with self._transaction() as connection:
            buckets = await connection.execute(
                select(uses.bucket).where(uses.use == str(run), uses.kind == "tokens_per")
            )
            rows = [
                {
                    "bucket": bucket,
                    "use": f"turn:{turn_id}",
                    "kind": "tokens_per",
                    "at": at,
                    "amount": tokens,
                }
                for (bucket,) in buckets.all()
            ]
            if rows:
                await connection.execute(
                    self._insert(uses_table)
                    .values(rows)
                    .on_conflict_do_nothing(index_elements=["bucket", "use"])
                )
        return await self.release(run, kinds=("turns_in_flight",))

    async def waiting(self, runs: Sequence[RunKey] | None = None) -> list[Waiting]:
        waits = waits_table.c
        query = select(waits_table).order_by(
            waits.since, waits.tenant_id, waits.workspace_id, waits.run_id
        )
        if runs is not None:
            if not runs:
                return []
            query = query.where(
                tuple_(waits.tenant_id, waits.workspace_id, waits.run_id).in_(
                    [(r.tenant_id, r.workspace_id, r.run_id) for r in runs]
                )
            )
        async with self._transaction() as connection:
            rows = (await connection.execute(query)).all()
        return [
            Waiting(
                RunKey(row.tenant_id, row.workspace_id, row.run_id),
                row.limit_name,
                row.kind,
                row.bound,
                _aware(row.since),
                None if row.next_at is None else _aware(row.next_at),
            )
            for row in rows
        ]

    async def forget_waiting(self, runs: Sequence[RunKey]) -> None:
        if not runs:
            return
        async with self._transaction() as connection:
            for run in runs:
                await connection.execute(delete(waits_table).where(*_is_run(waits_table, run)))

    async def usage(self, *, now: datetime, windows: dict[str, timedelta]) -> list[Use]:
        slots, uses = slots_table.c, uses_table.c
        buckets: dict[str, Use] = {}
        async with self._transaction() as connection:
            held = await connection.execute(
                select(slots.bucket, slots.kind, func.count())
                .where(slots.expires_at > now)
                .group_by(slots.bucket, slots.kind)
            )
            for bucket, kind, count in held.all():
                buckets[bucket] = Use(bucket, kind, int(count), 0)
            for bucket, window in windows.items():
                total = await connection.scalar(
                    select(func.coalesce(func.sum(uses.amount), 0)).where(
                        uses.bucket == bucket, uses.at > now - window
                    )
                )
                kind = bucket.rsplit("/", 1)[-1]
                buckets[bucket] = Use(bucket, kind, int(total or 0), 0)
        return _with_waiting(buckets, await self.waiting())

    async def aclose(self) -> None:
        return None


def _is_run(table: Table, run: RunKey) -> tuple[Any, ...]:
    return (
        table.c.tenant_id == run.tenant_id,
        table.c.workspace_id == run.workspace_id,
        table.c.run_id == run.run_id,
    )


def _aware(at: datetime) -> datetime:
    """SQLite gives times back without their zone: they were stored in UTC."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


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


__all__ = [
    "Check",
    "InMemoryLimitStore",
    "LimitStore",
    "LimitUse",
    "Refusal",
    "RunKey",
    "SqlLimitStore",
    "Use",
    "Waiting",
    "limit_uses",
]
