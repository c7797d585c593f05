"""Dispatchers on real processes: two ``relayr dispatch`` sharing the work while one is
SIGKILLed again and again, and one whose change notifications were cut.

1. Redis and PostgreSQL, a real worker, two dispatchers: 400 ``deploy:finished`` events over 8
   workspaces; one dispatcher is SIGKILLed three times while the runs go on (each time once a
   further quarter of the runs succeeded, read from the store, so on any machine's speed) and
   started again. Every run succeeds in exactly one attempt, and every notice is posted once.
2. SQLite with the embedded broker, and PostgreSQL: a dispatcher whose triggers were dropped
   after it started listening hears nothing; its sweep (every 2 s here) still finds the events
   and every run succeeds.
3. Both brokers: a flood's messages wait in the broker, then a quiet workspace's one; the
   worker started after them runs the quiet workspace's run first (ADR-0114).
"""

import asyncio
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from artifactr import UserActor
from artifactr.core import MessagePosted
from reflexr import SourceActor

from relayr import broker
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import DeployFinished
from tests.services import REDIS_URL, forgetting_redis_queue
from tests.workers import (
    RelayrProcess,
    log_records,
    relayr_environment,
    running_dispatcher,
    running_worker,
    until,
)

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(900)]

TENANT = "acme"
WORKSPACES = [f"ws{index}" for index in range(8)]
EVENTS = 400
KILLS = 3
WAIT_S = 240.0
"""How long any one step may take: far above what it needs on a quiet machine."""

LEASE_TTL_S = 5.0
"""The dispatchers' shard leases (and runs' leases): a killed dispatcher's shards are taken
over this long (and a third) after its last renewal."""

LISTENING = '"dispatcher listening for changes"'


def _sql(url: str, query: str) -> Any:
    """The first value ``query`` returns on PostgreSQL, on a connection of its own."""

    async def fetch() -> Any:
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return await connection.fetchval(query)
        finally:
            await connection.close()

    return asyncio.run(fetch())


def _succeeded(url: str) -> int:
    return int(_sql(url, "SELECT count(*) FROM reflexr_runs WHERE status = 'succeeded'"))


async def _publish(environment: dict[str, str], counts: Mapping[str, int], *, prefix: str) -> None:
    """``counts[w]`` deploys into a thread of each workspace ``w``, each a service of its own."""
    runtime = await Runtime.start(Settings.from_env(environment), role="cli")
    async with runtime:
        for workspace, count in counts.items():
            handle = await runtime.application.artifacts.open(
                TENANT, workspace, actor=UserActor(id="alice")
            )
            thread = (await handle.create_thread("deploys")).id
            source = await runtime.application.rules.open(
                TENANT, workspace, actor=SourceActor(name="test")
            )
            await source.publish_many(
                [
                    DeployFinished(
                        service=f"{prefix}{workspace}-{index}", status="ok", thread_id=thread
                    )
                    for index in range(count)
                ]
            )


def _spread(events: int) -> dict[str, int]:
    """``events`` spread evenly over the workspaces."""
    return {workspace: events // len(WORKSPACES) for workspace in WORKSPACES}


async def _outcome(environment: dict[str, str]) -> dict[str, Any]:
    runtime = await Runtime.start(Settings.from_env(environment), role="cli")
    async with runtime:
        runs: list[Any] = []
        notices: list[str] = []
        for workspace in WORKSPACES:
            source = await runtime.application.rules.open(
                TENANT, workspace, actor=SourceActor(name="test")
            )
            runs += [r for r in await source.runs() if r.rule == "ops:deploy-notice"]
            handle = await runtime.application.artifacts.open(
                TENANT, workspace, actor=UserActor(id="alice")
            )
            for envelope in await handle.read():
                event = envelope.event
                if isinstance(event, MessagePosted) and event.kind == "notice":
                    notices.append(event.content)
    return {
        "runs": len(runs),
        "outcomes": sorted({(r.status, r.attempts) for r in runs}),
        "notices": len(notices),
        "distinct_notices": len(set(notices)),
    }


def _shards_taken(process: RelayrProcess) -> int:
    return sum(
        1 for line in log_records(process.log()) if line.get("event") == "dispatch shards taken"
    )


@pytest.mark.redis
@pytest.mark.postgres
def test_two_dispatchers_one_killed_three_times_every_run_once(
    tmp_path: Path, redis_url: str, postgres_url: str
) -> None:
    environment = relayr_environment(
        tmp_path / "home",
        broker_url=REDIS_URL,
        database_url=postgres_url,
        lease_ttl_s=LEASE_TTL_S,
        turn_grace_s=5,
    )
    with ExitStack() as stack:
        stack.enter_context(forgetting_redis_queue(environment["RELAYR_QUEUE"]))
        worker = stack.enter_context(running_worker(environment, tmp_path, concurrency=2))
        steady = stack.enter_context(
            running_dispatcher(environment, tmp_path, "--no-follow", name="steady")
        )
        until(
            "steady listening",
            lambda: True if LISTENING in steady.log() else None,
            steady,
            timeout_s=WAIT_S,
        )
        killed: RelayrProcess | None = None
        asyncio.run(_publish(environment, _spread(EVENTS), prefix="deploy-"))
        for kill in range(KILLS):
            victim = stack.enter_context(
                running_dispatcher(environment, tmp_path, "--no-follow", name=f"victim{kill}")
            )
            # it holds shards of its own before it dies: it took some, under a lease
            until(
                f"victim{kill} holding shards",
                lambda victim=victim: _shards_taken(victim) or None,  # type: ignore[misc]
                victim,
                steady,
                timeout_s=WAIT_S,
            )
            target = EVENTS * (kill + 1) // (KILLS + 1)
            until(
                f"{target} runs succeeded",
                lambda target=target: _succeeded(postgres_url) >= target or None,  # type: ignore[misc]
                steady,
                worker,
                timeout_s=WAIT_S,
            )
            victim.kill()
            killed = victim
        assert killed is not None
        until(
            "every run succeeded",
            lambda: _succeeded(postgres_url) >= EVENTS or None,
            steady,
            worker,
            timeout_s=WAIT_S,
        )
        outcome = asyncio.run(_outcome(environment))

    assert outcome == {
        "runs": EVENTS,
        "outcomes": [("succeeded", 1)],
        "notices": EVENTS,
        "distinct_notices": EVENTS,
    }


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def cut_environment(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    settings: dict[str, object] = {"dispatch_sweep_s": 2.0, "dispatch_interval_s": 0.5}
    if request.param == "postgres":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    return relayr_environment(tmp_path / "home", **settings)


def _drop_triggers(environment: dict[str, str]) -> None:
    url = Settings.from_env(environment).database_url
    if url.startswith("sqlite"):
        connection = sqlite3.connect(url.partition(":///")[2], timeout=30)
        try:
            for name in (
                "relayr_reflexr_moved",
                "relayr_reflexr_created",
                "relayr_artifactr_moved",
                "relayr_artifactr_created",
            ):
                connection.execute(f"DROP TRIGGER IF EXISTS {name}")
            connection.commit()
        finally:
            connection.close()
        return
    for table in ("reflexr_workspaces", "artifactr_workspaces"):
        _sql(url, f"DROP TRIGGER IF EXISTS relayr_log_moved ON {table}")


def test_a_dispatcher_that_hears_nothing_still_finds_the_events(
    tmp_path: Path, cut_environment: dict[str, str]
) -> None:
    environment = cut_environment
    with (
        running_worker(environment, tmp_path, concurrency=1) as worker,
        running_dispatcher(environment, tmp_path) as dispatcher,
    ):
        until(
            "listening",
            lambda: True if LISTENING in dispatcher.log() else None,
            dispatcher,
            timeout_s=WAIT_S,
        )
        _drop_triggers(environment)
        asyncio.run(_publish(environment, _spread(16), prefix="unheard-"))

        def settled() -> dict[str, Any] | None:
            found = asyncio.run(_outcome(environment))
            done = found["runs"] == 16 and found["outcomes"] == [("succeeded", 1)]
            return found if done else None

        outcome = until(
            "every run succeeded", settled, dispatcher, worker, timeout_s=WAIT_S, poll_s=1.0
        )

    assert outcome["notices"] == outcome["distinct_notices"] == 16


@pytest.fixture(
    params=["embedded", pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.postgres])]
)
def both_brokers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    settings: dict[str, object] = {"fair_messages": 2, "fair_batch": 5}
    if request.param == "redis":
        settings.update(broker_url=REDIS_URL, database_url=request.getfixturevalue("postgres_url"))
    environment = relayr_environment(tmp_path / "home", **settings)
    with (
        forgetting_redis_queue(environment["RELAYR_QUEUE"])
        if request.param == "redis"
        else (nullcontext())
    ):
        yield environment


def test_a_quiet_workspaces_run_goes_before_a_floods_messages_already_waiting(
    tmp_path: Path, both_brokers: dict[str, str]
) -> None:
    environment = both_brokers
    settings = Settings.from_env(environment)

    def queued(count: int) -> Callable[[], bool | None]:
        return lambda: True if broker.queue_depth(settings) == count else None

    with running_dispatcher(environment, tmp_path, "--no-follow") as dispatcher:
        until(
            "listening", lambda: LISTENING in dispatcher.log() or None, dispatcher, timeout_s=WAIT_S
        )
        asyncio.run(_publish(environment, {"flood": 40}, prefix="deploy-"))
        until("the flood's two messages", queued(2), dispatcher, timeout_s=WAIT_S)
        asyncio.run(_publish(environment, {"quiet": 1}, prefix="deploy-"))
        until("the quiet workspace's message", queued(3), dispatcher, timeout_s=WAIT_S)
        with running_worker(environment, tmp_path, concurrency=1) as worker:

            def started() -> list[str] | None:
                found = [
                    str(line["workspace"])
                    for line in log_records(worker.log())
                    if line.get("event") == "attempt started"
                ]
                return found if "quiet" in found else None

            order = until("the quiet run started", started, worker, dispatcher, timeout_s=WAIT_S)

    assert order[0] == "quiet", order
