"""Limits on real worker processes: turns per minute, turns in flight, tokens per hour.

Two ``celery worker`` processes and ``relayr dispatch`` run the example's incident triage
(tests/execution/limits_app.py) on a clock the test moves, with ``turns_per = "10/1m"``. Every
incident has a thread of its own, so each triage message starts one agent turn. The test moves
the clock a minute at a time, only once every run is settled (done, or waiting for a time after
the clock), and counts the turns each minute asked for (relayr's emission records): never more
than ten; and the turns each minute started (artifactr's ``run_started``): never more than ten
but for those artifactr's recovery started for the killed worker (ADR-0117). At the end every
incident's thread had its turn, and no message was sent twice. One worker is SIGKILLed while a
minute's runs go, and started again (a turn it ran when killed stays running in artifactr: it is
counted as started). Embedded default (filesystem broker, SQLite), and Redis with PostgreSQL.

With a slow agent (tests/execution/limits_app.py: each turn takes half a second) and the
dispatcher following artifactr, so a turn's end frees what it held: ``turns_in_flight``
keeps at most two turns running at once (artifactr's ``run_started`` and ``run_ended``, in log
order), and ``tokens_per`` lets turns start while the hour's tokens are under the budget, the
rest waiting for the hour to move; the tokens counted are the sum of the turns' ``usage``.
"""

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import UserActor
from artifactr.core import MessagePosted, RunEnded, RunStarted
from reflexr import SourceActor
from reflexr.core import WAITING
from sqlalchemy import DateTime, column, func, select, table

from relayr.ledger.limits import SqlLimitStore
from relayr.runtime.application import Application
from relayr.settings import Settings
from rules.example.events import IncidentOpened
from tests.execution.limits_app import create_clocked_app, create_looping_app, set_clock
from tests.services import forgetting_redis_queue
from tests.workers import (
    RelayrProcess,
    relayr_environment,
    relayr_here,
    relayr_json,
    running_dispatcher,
    start_worker,
)

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(900)]

TENANT, WORKSPACE = "acme", "ops"
MINUTE = timedelta(minutes=1)
T0 = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0) + timedelta(days=1)
"""Where the test's clock starts: ahead of real time, and it must stay ahead. reflexr keeps a
run's lease on its storage's own clock (real time), while the dispatcher asks for the runs whose
lease lapsed by the application's clock (the test's): a clock behind real time would keep a
killed worker's claimed runs ``running`` until the test moved it, past every lease."""
INCIDENTS = 50
PER_MINUTE = 10
STAGE_TIMEOUT_S = 120.0
KILL_AT_STAGE = 2
FAIR_BATCH = 5
"""Runs per message: the most sends a killed worker can leave to artifactr's recovery."""
RULE_AUTHOR = "external_agent:reflexr:ops:incident-triage"

ALLOWLIST = f"""
[rules."ops:incident-triage"]
turns = true

[limits.triage]
rules = ["ops:incident-triage"]
turns_per = "{PER_MINUTE}/1m"
"""


def environment_for(tmp_path: Path, **settings: object) -> dict[str, str]:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(ALLOWLIST)
    set_clock(tmp_path, T0)
    return relayr_environment(
        tmp_path,
        app="tests.execution.limits_app:create_clocked_app",
        allowlist=allowlist,
        lease_ttl_s=3,
        requeue_after_s=2,
        fair_batch=FAIR_BATCH,
        **settings,
    )


@pytest.fixture
def embedded(tmp_path: Path) -> dict[str, str]:
    # a minute's waiting runs all go to the broker at once: the limit, not the hand-out's share
    # of one workspace, decides which start, and a kill finds sends mid-batch. (Not on Redis:
    # there a worker's prefetched messages look passed, and with requeue_after_s at 2 s the
    # dispatcher sends them again, which only makes the test slower.)
    return environment_for(tmp_path, fair_messages=INCIDENTS // FAIR_BATCH)


@pytest.fixture
def on_redis_and_postgres(
    tmp_path: Path, redis_url: str, postgres_url: str
) -> Iterator[dict[str, str]]:
    environment = environment_for(tmp_path, broker_url=redis_url, database_url=postgres_url)
    with forgetting_redis_queue(environment["RELAYR_QUEUE"], url=redis_url):
        yield environment


class World:
    """What the test reads: the runs in reflexr, the turns and messages in artifactr."""

    def __init__(self, application: Application, incidents: int = INCIDENTS) -> None:
        self.application = application
        self.incidents = incidents

    async def publish_incidents(self, count: int) -> None:
        threads = await self.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        source = await self.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )
        for number in range(count):
            thread = await threads.create_thread(f"incident {number}")
            await source.publish(IncidentOpened(title=f"incident {number}", thread_id=thread.id))

    async def settled(self) -> bool:
        """Every run is done, or waits for a time after the clock (none can start now)."""
        source = await self.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )
        now = self.application.rules.clock()
        runs = await source.runs(limit=10 * self.incidents)
        return len(runs) == self.incidents and all(
            run.status == "succeeded" or (run.status in WAITING and run.next_attempt_at > now)
            for run in runs
        )

    async def succeeded(self) -> int:
        return await self._with_status("succeeded")

    async def retrying(self) -> int:
        """How many runs wait to try again: only these can have sent a message with no turn."""
        return await self._with_status("retrying")

    async def _with_status(self, status: str) -> int:
        source = await self.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )
        runs = await source.runs(limit=10 * self.incidents)
        return sum(run.status == status for run in runs)

    async def envelopes(self) -> list[Any]:
        threads = await self.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return list(await threads.read())

    async def log(self) -> list[Any]:
        return [envelope.event for envelope in await self.envelopes()]

    async def no_claims(self) -> bool:
        """Whether no agent turn holds a thread (artifactr's ``thread:`` leases): the killed
        worker's have lapsed, and the live worker is between turns."""
        leases = table(
            "artifactr_leases", column("key"), column("expires_at", DateTime(timezone=True))
        )
        query = (
            select(func.count())
            .select_from(leases)
            .where(leases.c.key.like("thread:%"), leases.c.expires_at > datetime.now(UTC))
        )
        async with self.application.engines[0].connect() as connection:
            return (await connection.scalar(query)) == 0

    async def sent(self) -> int:
        """How many messages the rule sent (each thread's first starts its one turn)."""
        return sum(
            isinstance(envelope.event, MessagePosted) and envelope.actor.participant == RULE_AUTHOR
            for envelope in await self.envelopes()
        )

    async def state(self) -> str:
        """What a timed-out wait saw: the runs by status, the turns and the messages sent."""
        source = await self.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )
        now = self.application.rules.clock()
        runs = await source.runs(limit=10 * self.incidents)
        due = {run.id for run in runs if run.status in WAITING and run.next_attempt_at <= now}
        statuses = Counter(f"{run.status}{' (due)' if run.id in due else ''}" for run in runs)
        return (
            f"runs {dict(statuses)}, turns (started, ended) {await self.turns()}, "
            f"sent {await self.sent()}, clock {now.isoformat()}"
        )

    async def asks(self) -> list[tuple[datetime, str]]:
        """Each message the rule sent or asked a turn for (relayr's emission records): when,
        on the application's clock, and into which thread."""
        emissions = table(
            "relayr_emissions", column("record"), column("emitted_at", DateTime(timezone=True))
        )
        async with self.application.engines[0].connect() as connection:
            rows = (
                await connection.execute(select(emissions.c.emitted_at, emissions.c.record))
            ).all()
        return [
            (at if at.tzinfo else at.replace(tzinfo=UTC), json.loads(record)["thread_id"])
            for at, record in rows
        ]

    async def turned(self) -> set[str]:
        """The threads whose turn started."""
        return {e.thread_id for e in await self.envelopes() if isinstance(e.event, RunStarted)}

    async def turns(self) -> tuple[int, int]:
        events = await self.log()
        started = sum(isinstance(event, RunStarted) for event in events)
        ended = sum(isinstance(event, RunEnded) for event in events)
        return started, ended


async def until(
    what: str, probe: Any, *processes: RelayrProcess, world: World | None = None
) -> None:
    deadline = asyncio.get_running_loop().time() + STAGE_TIMEOUT_S
    while not await probe():
        for process in processes:
            assert process.alive(), f"{process.name} died waiting for {what}:\n{process.log()}"
        if asyncio.get_running_loop().time() > deadline:
            logs = "\n".join(f"== {p.name}\n{p.log()[-4000:]}" for p in processes)
            seen = "" if world is None else f"; {await world.state()}"
            raise AssertionError(f"timed out waiting for {what}{seen}\n{logs}")
        await asyncio.sleep(0.3)


def ops_see_the_first_minute(environment: dict[str, str]) -> None:
    """After the first minute: ten turns used, the forty others wait, each saying why and
    when its turn in the line comes: ten at each of the next four minutes (ADR-0118)."""
    [use] = relayr_here(environment, "limits")
    assert (use["limit"], use["kind"], use["bound"]) == ("limits.triage", "turns_per", "10/1m")
    assert (use["used"], use["waiting"]) == (PER_MINUTE, INCIDENTS - PER_MINUTE)
    waiting = relayr_here(environment, "runs", "list", "--status", "pending", "--limit", "1000")
    assert len(waiting) == INCIDENTS - PER_MINUTE
    assert Counter(row["waiting"] for row in waiting) == {
        f"waiting: turns_per 10/1m of limits.triage, next at {at.isoformat()}": PER_MINUTE
        for at in (T0 + MINUTE * (1 + n) for n in range(INCIDENTS // PER_MINUTE - 1))
    }
    assert {row["attempts"] for row in waiting} == {0}


async def scenario(environment: dict[str, str]) -> None:
    settings = Settings.from_env(environment)
    home = settings.home
    application = await create_clocked_app(settings)
    world = World(application)
    workers: list[RelayrProcess] = []
    try:
        await world.publish_incidents(INCIDENTS)
        workers = [
            await asyncio.to_thread(start_worker, environment, home, concurrency=1)
            for _ in range(2)
        ]
        with running_dispatcher(environment, home, "--no-follow") as dispatcher:
            started_by_minute: list[int] = []
            recovered_by_minute: list[int] = []
            turned: set[str] = set()
            now = T0
            alive = list(workers)
            stage = 0
            while True:
                if stage == KILL_AT_STAGE:
                    before = (await world.turns())[0]

                    async def some_started(before: int = before) -> bool:
                        return (await world.turns())[0] > before

                    await until("a turn of the minute", some_started, *alive, dispatcher)
                    workers[1].kill()
                    # started again, as `relayr run` or a process manager would, once the dead
                    # worker's claims on threads lapsed: it takes the turns they held back
                    await until("the dead worker's thread claims to lapse", world.no_claims)
                    workers.append(
                        await asyncio.to_thread(start_worker, environment, home, concurrency=1)
                    )
                    alive = [workers[0], workers[2]]

                async def settled_and_taken() -> bool:
                    if not await world.settled():
                        return False
                    # every message sent started its turn, but a run's whose worker died
                    # between its send and its turn: it asks for the turn when the limit lets
                    # it try again
                    started, _ = await world.turns()
                    untaken = await world.sent() - started
                    return started >= await world.succeeded() and (
                        0 <= untaken <= await world.retrying()
                    )

                await until(
                    f"minute {stage} to settle", settled_and_taken, *alive, dispatcher, world=world
                )
                started, _ = await world.turns()
                started_by_minute.append(started - sum(started_by_minute))
                asks = await world.asks()
                asked = [(at, thread) for at, thread in asks if now <= at < now + MINUTE]
                assert len(asked) <= PER_MINUTE, asked
                # a turn asked for by the killed worker and never taken is started by the next
                # worker's recovery (artifactr's): in this minute, though asked for before it
                newly = await world.turned() - turned
                turned |= newly
                recovered = newly - {thread for _, thread in asked}
                recovered_by_minute.append(len(recovered))
                if recovered:
                    earlier = {thread for at, thread in asks if at < now}
                    assert stage >= KILL_AT_STAGE, (stage, recovered)
                    assert recovered <= earlier, (stage, recovered)
                if stage == 0:
                    await asyncio.to_thread(ops_see_the_first_minute, environment)
                if await world.succeeded() == INCIDENTS:
                    break
                assert stage < INCIDENTS // PER_MINUTE + 3, started_by_minute
                stage += 1
                now += timedelta(minutes=1)
                set_clock(home, now)

            print("turns started by minute:", started_by_minute, "recovered:", recovered_by_minute)
            asked_by_minute = [
                a - r for a, r in zip(started_by_minute, recovered_by_minute, strict=True)
            ]
            assert max(asked_by_minute) <= PER_MINUTE, (started_by_minute, recovered_by_minute)
            assert sum(recovered_by_minute) <= FAIR_BATCH, recovered_by_minute
            assert sum(started_by_minute) == INCIDENTS
            envelopes = await world.envelopes()
            turned = Counter(e.thread_id for e in envelopes if isinstance(e.event, RunStarted))
            assert len(turned) == INCIDENTS  # every incident's thread had its turn
            assert set(turned.values()) == {1}
            sent = Counter(
                e.thread_id
                for e in envelopes
                if isinstance(e.event, MessagePosted) and e.actor.participant == RULE_AUTHOR
            )
            assert len(sent) == INCIDENTS  # one triage message in each thread, none twice
            assert set(sent.values()) == {1}
            logs = "".join(worker.log() for worker in workers)
            assert '"limit hit: runs wait"' in logs
            assert '"outcome": "limited"' in logs or '"outcome":"limited"' in logs
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await application.aclose()


def test_turns_per_across_two_workers_one_killed_embedded(embedded: dict[str, str]) -> None:
    asyncio.run(scenario(embedded))


@pytest.mark.redis
@pytest.mark.postgres
def test_turns_per_across_two_workers_one_killed_on_redis_and_postgres(
    on_redis_and_postgres: dict[str, str],
) -> None:
    asyncio.run(scenario(on_redis_and_postgres))


def slow_environment(tmp_path: Path, allowlist: str, **settings: object) -> dict[str, str]:
    environment = environment_for(tmp_path, **settings)
    Path(environment["RELAYR_ALLOWLIST"]).write_text(allowlist)
    return {**environment, "RELAYR_APP": "tests.execution.limits_app:create_slow_clocked_app"}


IN_FLIGHT = """
[rules."ops:incident-triage"]
turns = true

[limits.triage]
rules = ["ops:incident-triage"]
turns_in_flight = 2
"""

TOKEN_BUDGET = 200
"""An hour's tokens: a turn of the slow agent spends some 80 (pydantic-ai's estimate of the
offline model's usage), so two or three turns an hour."""

TOKENS = f"""
[rules."ops:incident-triage"]
turns = true

[limits.triage]
rules = ["ops:incident-triage"]
turns_in_flight = 1
tokens_per = "{TOKEN_BUDGET}/1h"
"""


def turns_at_once(events: list[Any]) -> int:
    """The most turns running at once, in log order."""
    running = most = 0
    for event in events:
        if isinstance(event, RunStarted):
            running += 1
            most = max(most, running)
        elif isinstance(event, RunEnded):
            running -= 1
    return most


async def in_flight_scenario(environment: dict[str, str], incidents: int) -> None:
    settings = Settings.from_env(environment)
    application = await create_clocked_app(settings)
    world = World(application, incidents)
    workers: list[RelayrProcess] = []
    try:
        await world.publish_incidents(incidents)
        workers = [
            await asyncio.to_thread(start_worker, environment, settings.home, concurrency=2)
            for _ in range(2)
        ]
        with running_dispatcher(environment, settings.home) as dispatcher:

            async def every_turn_ended() -> bool:
                return await world.turns() == (incidents, incidents)

            await until("every turn to end", every_turn_ended, *workers, dispatcher)
        events = await world.log()
        assert turns_at_once(events) == 2
        assert await world.succeeded() == incidents
        sent = Counter(
            event.message_id
            for event in events
            if isinstance(event, MessagePosted) and event.kind == "message"
        )
        assert len(sent) == 2 * incidents
        assert set(sent.values()) == {1}
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await application.aclose()


async def tokens_scenario(environment: dict[str, str]) -> None:
    incidents = 6
    settings = Settings.from_env(environment)
    application = await create_clocked_app(settings)
    world = World(application, incidents)
    store = SqlLimitStore(application.engines[0])
    workers: list[RelayrProcess] = []
    try:
        await world.publish_incidents(incidents)
        workers = [await asyncio.to_thread(start_worker, environment, settings.home)]
        with running_dispatcher(environment, settings.home) as dispatcher:
            done = 0
            for hour in range(incidents):

                async def hour_spent(before: int = done) -> bool:
                    waits = await store.waiting()
                    succeeded = await world.succeeded()
                    return (
                        succeeded > before
                        and await world.turns() == (succeeded, succeeded)
                        and all(wait.kind == "tokens_per" for wait in waits)
                        and len(waits) == incidents - succeeded
                    )

                await until(f"hour {hour}'s budget to be spent", hour_spent, *workers, dispatcher)
                ended = [e.usage for e in await world.log() if isinstance(e, RunEnded)]
                spent = [u.input_tokens + u.output_tokens for u in ended if u is not None]
                done, hours = len(spent), spent[done:]
                # the hour's turns started while its tokens were under the budget: each but
                # its last found them under, and the last spent them (unless none was left)
                assert sum(hours[:-1]) < TOKEN_BUDGET
                assert done == incidents or sum(hours) >= TOKEN_BUDGET

                async def counted(spent: int = sum(hours)) -> bool:
                    """``relayr limits`` says the hour used what its turns' usage says they
                    spent: the follower counts a turn's tokens once it follows the turn's end,
                    which may come after its run succeeded."""
                    [tokens] = [
                        use
                        for use in await asyncio.to_thread(relayr_here, environment, "limits")
                        if use["kind"] == "tokens_per"
                    ]
                    return bool(tokens["used"] == spent)

                await until(
                    f"hour {hour}'s {sum(hours)} tokens counted", counted, *workers, dispatcher
                )
                if done == incidents:
                    break
                set_clock(settings.home, T0 + timedelta(hours=hour + 1))
            assert hour >= 1  # the budget held turns back until the hour moved
        assert turns_at_once(await world.log()) == 1
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await application.aclose()


def test_turns_in_flight_embedded(tmp_path: Path) -> None:
    asyncio.run(in_flight_scenario(slow_environment(tmp_path, IN_FLIGHT), 12))


@pytest.mark.redis
@pytest.mark.postgres
def test_turns_in_flight_on_redis_and_postgres(
    tmp_path: Path, redis_url: str, postgres_url: str
) -> None:
    environment = slow_environment(
        tmp_path, IN_FLIGHT, broker_url=redis_url, database_url=postgres_url
    )
    with forgetting_redis_queue(environment["RELAYR_QUEUE"], url=redis_url):
        asyncio.run(in_flight_scenario(environment, 12))


def test_tokens_per_embedded(tmp_path: Path) -> None:
    asyncio.run(tokens_scenario(slow_environment(tmp_path, TOKENS)))


CHAIN = """
[rules."ops:incident-triage"]
turns = true

[rules."loop:answer"]
turns = true

[limits.chains]
rules = ["*"]
chain_runs_per = "3/1h"
"""


async def chain_scenario(environment: dict[str, str]) -> None:
    settings = Settings.from_env(environment)
    application = await create_looping_app(settings)
    world = World(application, 1)
    store = SqlLimitStore(application.engines[0])
    workers: list[RelayrProcess] = []

    async def notices() -> list[str]:
        return [
            event.content
            for event in await world.log()
            if isinstance(event, MessagePosted)
            and event.kind == "notice"
            and event.content.startswith("relayr stopped this chain")
        ]

    async def refusals(run_id: str) -> int:
        logs = "".join(worker.log() for worker in workers)
        return sum(
            1
            for line in logs.splitlines()
            if '"run waits: a limit holds it back"' in line and run_id in line
        )

    try:
        await world.publish_incidents(1)
        workers = [await asyncio.to_thread(start_worker, environment, settings.home)]
        with running_dispatcher(environment, settings.home) as dispatcher:

            async def stopped() -> bool:
                waits = await store.waiting()
                return len(waits) == 1 and len(await notices()) == 1

            await until("the chain to be stopped", stopped, *workers, dispatcher)
            [wait] = await store.waiting()
            assert wait.kind == "chain_runs_per"
            source = await application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="t"))
            runs = await source.runs(limit=100)
            assert sorted(run.status for run in runs) == ["pending", *["succeeded"] * 3]
            assert {run.correlation_id for run in runs} == {runs[0].correlation_id}
            [notice] = await notices()
            assert f"relayr runs cancel {wait.run.run_id}" in notice

            # an operator's retry makes it due now: refused again, and no second notice
            await asyncio.to_thread(relayr_json, environment, "runs", "retry", wait.run.run_id)

            async def refused_again() -> bool:
                return await refusals(wait.run.run_id) >= 2 and len(await store.waiting()) == 1

            await until("the retried run to be refused again", refused_again, *workers)
            assert len(await notices()) == 1
            assert (await source.run(wait.run.run_id)).attempts == 0
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await application.aclose()


def test_a_chain_breaker_stops_a_rule_agent_loop_with_one_notice(tmp_path: Path) -> None:
    environment = slow_environment(tmp_path, CHAIN)
    environment["RELAYR_APP"] = "tests.execution.limits_app:create_looping_app"
    asyncio.run(chain_scenario(environment))


RELOADED = """
[rules."ops:incident-triage"]
turns = true

[limits.triage]
rules = ["ops:incident-triage"]
turns_per = "{}/1m"
"""


def save(path: Path, text: str) -> None:
    """Replace a file whole, as an editor saves it: a worker never reads it half-written."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


async def reload_scenario(environment: dict[str, str]) -> None:
    incidents = 4
    settings = Settings.from_env(environment)
    allowlist = Path(environment["RELAYR_ALLOWLIST"])
    application = await create_clocked_app(settings)
    world = World(application, incidents)
    store = SqlLimitStore(application.engines[0])
    workers: list[RelayrProcess] = []
    try:
        await world.publish_incidents(incidents)
        workers = [await asyncio.to_thread(start_worker, environment, settings.home)]
        with running_dispatcher(environment, settings.home, "--no-follow") as dispatcher:

            async def two_wait() -> bool:
                return await world.settled() and len(await store.waiting()) == 2

            await until("two runs to wait", two_wait, *workers, dispatcher)
            await asyncio.to_thread(save, allowlist, RELOADED.format("nine"))  # broken

            async def refused_file() -> bool:
                return "the last good one stays in force" in workers[0].log()

            await until("the worker to refuse the broken file", refused_file, *workers)
            assert await world.succeeded() == 2
            assert len(await store.waiting()) == 2

            await asyncio.to_thread(save, allowlist, RELOADED.format(4))  # raised

            async def all_went() -> bool:
                return await world.succeeded() == incidents

            await until("the waiting runs to go", all_went, *workers, dispatcher)
            assert await store.waiting() == []
            assert application.rules.clock() == T0
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        await application.aclose()


def test_raising_a_limit_lets_waiting_runs_go_and_a_broken_file_changes_nothing(
    tmp_path: Path,
) -> None:
    environment = environment_for(tmp_path)
    Path(environment["RELAYR_ALLOWLIST"]).write_text(RELOADED.format(2))
    asyncio.run(reload_scenario(environment))
