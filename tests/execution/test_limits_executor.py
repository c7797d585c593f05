"""The executor under the operators' limits: a run over one waits, never fails, runs once.

A worker's runtime on real reflexr storage (in memory, SQLite, PostgreSQL) with the limit store
it opens on the same database, a clock the test moves, and runs made as the dispatcher makes
them (tests/execution/executor_harness.py). Nothing sleeps: gates say when an action runs.
"""

from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Self

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import event

from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.ledger.limits import RunKey
from relayr.runtime.application import Application, open_storage
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.execution.executor_harness import TENANT, WORKSPACE, Asked, Harness, database_url
from tests.services import SQL_STORAGES

__all__ = ["database_url"]

START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LEASE_TTL_S = 5


@dataclass
class Clock:
    """The time reflexr and the limits read: it moves only when the test moves it."""

    now: datetime = START

    def __call__(self) -> datetime:
        return self.now

    def move(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class Limited(Harness):
    """The executor's harness with a clock the test moves and an allowlist it can change."""

    clock: Clock
    text: list[str]

    @classmethod
    async def start(cls, settings: Settings, text: str) -> Self:
        clock = Clock()
        current = [text]
        storage = await open_storage(settings)
        application = Application(
            artifacts=ArtifactWorkspaces(storage.artifacts),
            rules=RuleWorkspaces(storage.rules, events=cls.EVENTS, rules=cls.RULES, clock=clock),
            actions=cls.ACTIONS,
            app_deps=Gates(),
            engines=storage.engines,
        )
        parsed: dict[str, Allowlists] = {}

        def allowlists() -> Allowlists:
            if current[0] not in parsed:
                parsed[current[0]] = parse_allowlist(current[0])
            return parsed[current[0]]

        runtime = await Runtime.start(
            settings, role="worker", application=application, allowlists=allowlists
        )
        harness = cls(settings, storage, runtime)
        harness.clock = clock
        harness.text = current
        return harness

    async def waiting(self) -> list[str]:
        return [wait.describe() for wait in await self.runtime.bridge.limits.waiting()]


@pytest.fixture
def limited(database_url: str, tmp_path: Path) -> Callable[[str], "AsyncIterator[Limited]"]:
    settings = Settings(
        home=tmp_path, database_url=database_url, lease_ttl_s=LEASE_TTL_S, turn_grace_s=0
    )

    async def opened(text: str) -> AsyncIterator[Limited]:
        harness = await Limited.start(settings, text)
        try:
            yield harness
        finally:
            await harness.aclose()

    return opened


IN_FLIGHT = """
[limits.work]
rules = ["exec:work"]
runs_in_flight = 1
"""


async def test_a_run_over_runs_in_flight_waits_and_goes_when_the_slot_is_freed(
    limited: Callable[[str], AsyncIterator[Limited]],
) -> None:
    async for harness in limited(IN_FLIGHT):
        first = await harness.fire(Asked(mode="wait"))
        second = await harness.fire(Asked(mode="ok"))
        import asyncio

        running = asyncio.create_task(harness.execute(first))
        await asyncio.wait_for(harness.gates.started.wait(), 30)

        held = await harness.execute(second)
        assert held.outcome == "limited"
        assert "runs_in_flight 1 of limits.work" in held.detail
        waiting = await harness.run(second)
        assert (waiting.status, waiting.attempts, waiting.epoch) == ("pending", 0, 0)
        assert waiting.next_attempt_at == harness.clock.now + timedelta(seconds=LEASE_TTL_S)
        assert await harness.waiting() == [
            "waiting: runs_in_flight 1 of limits.work, until a slot is free"
        ]
        assert await harness.facts(second) == []  # not attempted: no fact, no failure

        harness.gates.release.set()
        assert (await running).outcome == "succeeded"
        woken = await harness.run(second)
        assert woken.next_attempt_at <= harness.clock.now  # due now: the freed slot woke it
        done = await harness.execute(second)
        assert done.outcome == "succeeded"
        assert (await harness.run(second)).attempts == 1
        assert await harness.facts(second) == ["run_requeued", "run_started", "run_succeeded"]
        assert await harness.waiting() == []


TURNS_PER = """
[rules."exec:work"]
turns = true

[limits.work]
rules = ["exec:work"]
turns_per = "2/1m"
"""


async def test_turns_per_lets_a_window_hold_its_count_and_the_rest_wait_for_it_to_move(
    limited: Callable[[str], AsyncIterator[Limited]],
) -> None:
    async for harness in limited(TURNS_PER):
        runs = [await harness.fire(Asked(mode="ok")) for _ in range(3)]
        assert [(await harness.execute(run_id)).outcome for run_id in runs[:2]] == [
            "succeeded",
            "succeeded",
        ]
        harness.clock.move(20)
        held = await harness.execute(runs[2])
        assert held.outcome == "limited"
        next_at = START + timedelta(minutes=1)
        assert (await harness.run(runs[2])).next_attempt_at == next_at
        assert await harness.waiting() == [
            f"waiting: turns_per 2/1m of limits.work, next at {next_at.isoformat()}"
        ]
        assert (await harness.execute(runs[2])).outcome == "not_due"  # nothing before its time
        harness.clock.move(40)
        assert (await harness.execute(runs[2])).outcome == "succeeded"
        assert (await harness.run(runs[2])).attempts == 1


async def test_turn_limits_do_not_bind_a_rule_without_turns(
    limited: Callable[[str], AsyncIterator[Limited]],
) -> None:
    text = TURNS_PER.replace("turns = true", "turns = false")
    async for harness in limited(text):
        runs = [await harness.fire(Asked(mode="ok")) for _ in range(3)]
        assert {(await harness.execute(run_id)).outcome for run_id in runs} == {"succeeded"}


async def test_raising_a_limit_lets_the_next_claim_go(
    limited: Callable[[str], AsyncIterator[Limited]],
) -> None:
    async for harness in limited(TURNS_PER):
        runs = [await harness.fire(Asked(mode="ok")) for _ in range(3)]
        for run_id in runs:
            await harness.execute(run_id)
        assert (await harness.run(runs[2])).status == "pending"
        harness.text[0] = TURNS_PER.replace("2/1m", "3/1m")
        await harness.runtime.bridge.limits.forget_waiting([RunKey(TENANT, WORKSPACE, runs[2])])
        from relayr.execution.limiting import Limiter

        limiter = Limiter(
            harness.rules,
            harness.runtime.bridge.limits,
            harness.runtime.bridge.allowlists,
            timedelta(seconds=LEASE_TTL_S),
        )
        await limiter.wake([RunKey(TENANT, WORKSPACE, runs[2])])
        assert (await harness.execute(runs[2])).outcome == "succeeded"


BOTH_KINDS = """
[rules."exec:work"]
turns = true

[limits.work]
rules = ["exec:work"]
runs_in_flight = 5
turns_per = "100/1h"
"""


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_a_limited_run_costs_one_sql_transaction_more_than_an_unlimited_one(
    limited: Callable[[str], AsyncIterator[Limited]],
) -> None:
    """The admission rides the transaction that reads the runs, the slot's release the one
    that records the outcome: only that read is a transaction more."""
    begun = Counter[str]()

    async def transactions(harness: Limited, run_id: str) -> int:
        before = begun["begin"]
        assert (await harness.execute(run_id)).outcome == "succeeded"
        return begun["begin"] - before

    async for harness in limited(""):
        for engine in harness.storage.engines:
            event.listen(engine.sync_engine, "begin", lambda _: begun.update(["begin"]))
        free, bound = [await harness.fire(Asked(mode="ok")) for _ in range(2)]
        await harness.waiting()  # the limits' tables are made once, at the store's first call

        unlimited = await transactions(harness, free)
        harness.text[0] = BOTH_KINDS
        assert await transactions(harness, bound) == unlimited + 1
        usage = await harness.runtime.bridge.limits.usage(
            now=harness.clock.now, windows={"work/turns_per": timedelta(hours=1)}
        )
        # the run's use of the window is counted, and its slot given back
        assert {use.bucket: use.used for use in usage} == {"work/turns_per": 1}
