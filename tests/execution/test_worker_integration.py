"""The whole path on real ``celery worker`` processes: publish, dispatch, execute, act.

Never eager mode, never in-test threads only: each test starts a worker subprocess
(``celery -A tasks.app worker``, prefork) on a queue of its own, runs the dispatcher in the test
process, publishes the example application's events, and counts what the rules and the agent
wrote, with the same tally the demo prints (:mod:`relayr.demo`). Brokers: the embedded one
(``filesystem://``) and Redis; storage: SQLite and PostgreSQL.
"""

import asyncio
import json
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from relayr.cli.demo import run_scenario
from relayr.core.run_messages import RunMessage
from relayr.demo import Plan
from relayr.dispatch.dispatcher import Dispatcher
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.app import create_celery
from tasks.runs import send_runs
from tests.execution.apps import TURN_RELEASE_FILE
from tests.services import forgetting_redis_queue
from tests.workers import RelayrProcess, log_records, relayr_environment, running_worker

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(900)]
"""Bounded well above what a scenario needs on a quiet machine (under a minute for 220 runs):
a shared CI host with other suites running can be several times slower."""

ALL_STATUSES = ("pending", "running", "retrying", "succeeded", "dead", "cancelled", "skipped")

SCENARIO_TIMEOUT_S = 600.0
"""How long a scenario may take to end every run and turn; far above what it needs."""

type Serve = Callable[[Runtime, asyncio.Event], Coroutine[Any, Any, None]]


def serve_enqueueing(copies: int) -> Serve:
    """A dispatcher loop that sends every run's task ``copies`` times: duplicate deliveries."""

    async def serve(runtime: Runtime, stop: asyncio.Event) -> None:
        app = create_celery(runtime.settings)

        async def enqueue(batch: RunMessage) -> None:
            for _ in range(copies):
                send_runs(app, runtime.settings.queue, batch)

        await Dispatcher(runtime).serve(enqueue, stop)

    return serve


def scenario(
    environment: dict[str, str], plan: Plan, *, copies: int = 1, concurrency: int = 2
) -> dict[str, Any]:
    """Run ``plan`` against a worker started on ``environment``; return the summary."""
    settings = Settings.from_env(environment)
    with running_worker(environment, settings.home, concurrency=concurrency) as worker:
        result = asyncio.run(
            run_scenario(
                settings, plan, timeout_s=SCENARIO_TIMEOUT_S, serve=serve_enqueueing(copies)
            )
        )
        assert worker.alive(), worker.log()
        summary = dict(result.summary)
        print(json.dumps({"plan": plan.__dict__, "copies": copies, **summary}))
        if summary["problems"]:
            print(worker.log()[-20000:])
    return summary


def assert_counts(summary: dict[str, Any], plan: Plan) -> None:
    assert summary["problems"] == []
    assert summary["runs_succeeded"] == plan.all_runs  # the inbound rules' runs included
    assert summary["notices"] == plan.deploys + plan.follow_ups
    assert summary["messages"] == plan.incidents
    assert summary["turns"] == plan.incidents
    assert summary["duplicates"] == 0
    assert summary["bridged_events"] == plan.bridged_events
    assert summary["tool_calls"] == plan.tool_calls


DEPLOYS = Plan(deploys=200, incidents=0)
INCIDENTS = Plan(deploys=0, incidents=20)


@pytest.fixture
def embedded(tmp_path: Path) -> dict[str, str]:
    """Embedded defaults: the filesystem broker and SQLite, in the test's own home."""
    return relayr_environment(tmp_path)


@pytest.fixture
def on_redis(tmp_path: Path, redis_url: str) -> Iterator[dict[str, str]]:
    """The shared Redis, on a queue of the test's own, whose keys go with the test."""
    environment = relayr_environment(tmp_path, broker_url=redis_url)
    with forgetting_redis_queue(environment["RELAYR_QUEUE"], url=redis_url):
        yield environment


# ─── embedded: filesystem broker, SQLite ─────────────────────────────────────


@pytest.mark.parametrize("plan", [DEPLOYS, INCIDENTS], ids=["200-deploys", "20-incidents"])
def test_embedded_every_run_acts_once(embedded: dict[str, str], plan: Plan) -> None:
    assert_counts(scenario(embedded, plan), plan)


def test_embedded_every_message_delivered_twice_changes_nothing(
    embedded: dict[str, str],
) -> None:
    plan = Plan(deploys=100, incidents=10)
    assert_counts(scenario(embedded, plan, copies=2), plan)


# ─── Redis broker ─────────────────────────────────────────────────────────────


@pytest.mark.redis
@pytest.mark.parametrize("plan", [DEPLOYS, INCIDENTS], ids=["200-deploys", "20-incidents"])
def test_redis_every_run_acts_once(on_redis: dict[str, str], plan: Plan) -> None:
    assert_counts(scenario(on_redis, plan), plan)


@pytest.mark.redis
def test_redis_every_message_delivered_twice_changes_nothing(on_redis: dict[str, str]) -> None:
    plan = Plan(deploys=200, incidents=20)
    assert_counts(scenario(on_redis, plan, copies=2), plan)


# ─── PostgreSQL storage ───────────────────────────────────────────────────────


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.parametrize("copies", [1, 2], ids=["once", "twice"])
def test_postgres_every_run_acts_once(
    tmp_path: Path, redis_url: str, postgres_url: str, copies: int
) -> None:
    environment = relayr_environment(tmp_path, broker_url=redis_url, database_url=postgres_url)
    plan = Plan(deploys=200, incidents=20)
    with forgetting_redis_queue(environment["RELAYR_QUEUE"], url=redis_url):
        assert_counts(scenario(environment, plan, copies=copies), plan)


@pytest.mark.postgres
def test_postgres_with_the_embedded_broker(tmp_path: Path, postgres_url: str) -> None:
    environment = relayr_environment(tmp_path, database_url=postgres_url)
    plan = Plan(deploys=40, incidents=5)
    assert_counts(scenario(environment, plan), plan)


# ─── malformed messages ───────────────────────────────────────────────────────


def test_a_malformed_message_is_refused_in_one_line_and_the_worker_goes_on(
    embedded: dict[str, str],
) -> None:
    settings = Settings.from_env(embedded)
    app = create_celery(settings)
    with running_worker(embedded, settings.home, concurrency=1) as worker:
        app.send_task("relayr.execute_run", args=("acme", "", "fir_1"), queue=settings.queue)
        app.send_task("relayr.execute_run", args=(1, 2), queue=settings.queue)
        refused = wait_for_lines(worker, "task refused", count=2)
        # one line each: Celery's own warning with a traceback is left out
        assert sum("task argument" in line for line in worker.log().splitlines()) == 2
        summary = asyncio.run(
            run_scenario(settings, Plan(deploys=3, incidents=1), timeout_s=SCENARIO_TIMEOUT_S)
        ).summary
    assert [line["reason"] for line in refused] == [
        "task argument workspace_id is empty",
        "task argument run_id is missing",
    ]
    assert summary["problems"] == []


def wait_for_lines(
    worker: RelayrProcess, event: str, *, count: int, timeout_s: float = 30
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in log_records(worker.log()) if line.get("event") == event]
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) >= count, worker.log()
            return found
        time.sleep(0.1)


# ─── warm shutdown ────────────────────────────────────────────────────────────


TURNS_WAITED_FOR = "letting running turns finish"
"""What a stopping pool process logs when it waits for its turns (tasks/worker.py)."""


def test_sigterm_lets_running_turns_finish_within_the_grace_period(tmp_path: Path) -> None:
    """Turns outlive the task that started them; a warm shutdown waits for them (ADR-0010)."""
    environment = relayr_environment(
        tmp_path, app="tests.execution.apps:create_slow_app", turn_grace_s=30
    )
    settings = Settings.from_env(environment)
    plan = Plan(deploys=0, incidents=3)
    with running_worker(environment, settings.home) as worker:
        result = asyncio.run(run_until_turns_started(settings, plan, worker))
    assert result["turns_running_at_sigterm"] == plan.incidents
    assert result["turns_waited_for"] >= 1
    assert result["exit_code"] == 0
    assert result["turns_completed"] == plan.incidents
    assert result["stopped_in_s"] < settings.turn_grace_s


async def run_until_turns_started(
    settings: Settings, plan: Plan, worker: RelayrProcess
) -> dict[str, Any]:
    """Publish, wait until every turn runs (each waits for the release), SIGTERM the worker,
    release the turns once a pool process waits for them, then count completed turns."""
    from artifactr.core import RunEnded, RunStarted

    from relayr.demo import CLI_USER, DEMO_PUBLISHER, TENANT, WORKSPACE, publish_scenario

    runtime = await Runtime.start(settings, role="dispatcher")
    async with runtime:
        stop = asyncio.Event()
        dispatcher = asyncio.create_task(serve_enqueueing(1)(runtime, stop))
        try:
            await publish_scenario(runtime, TENANT, WORKSPACE, plan)
            artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=CLI_USER)
            rules = await runtime.application.rules.open(TENANT, WORKSPACE, actor=DEMO_PUBLISHER)

            async def turns(kind: type) -> int:
                return sum(isinstance(e.event, kind) for e in await artifacts.read())

            deadline = time.monotonic() + 60
            while await turns(RunStarted) < plan.incidents or any(
                run.status != "succeeded" for run in await rules.runs()
            ):
                assert time.monotonic() < deadline, worker.log()
                await asyncio.sleep(0.1)
            running = await turns(RunStarted) - await turns(RunEnded)
        finally:
            stop.set()
            await dispatcher
        worker.signal(signal.SIGTERM)
        sent = time.monotonic()
        waiting = await asyncio.to_thread(
            wait_for_lines, worker, TURNS_WAITED_FOR, count=1, timeout_s=settings.turn_grace_s
        )
        (settings.home.absolute() / TURN_RELEASE_FILE).touch()
        exit_code = await asyncio.to_thread(worker.wait, settings.turn_grace_s + 30)
        stopped_in_s = time.monotonic() - sent
        ended = [e.event for e in await artifacts.read() if isinstance(e.event, RunEnded)]
    return {
        "turns_running_at_sigterm": running,
        "turns_waited_for": sum(int(line["turns"]) for line in waiting),
        "turns_completed": sum(event.status == "completed" for event in ended),
        "exit_code": exit_code,
        "stopped_in_s": stopped_in_s,
    }


# ─── bounded redelivery ───────────────────────────────────────────────────────


def test_a_task_that_kills_its_worker_is_not_run_again_past_the_bound(tmp_path: Path) -> None:
    """Its pool process dies (as on an OOM kill): the run is failed, not redelivered forever."""
    environment = relayr_environment(
        tmp_path, app="tests.execution.apps:create_crashing_app", max_redeliveries=0, lease_ttl_s=2
    )
    settings = Settings.from_env(environment)
    with running_worker(environment, settings.home) as worker:
        run = asyncio.run(crash_once(settings, worker))
        lost = wait_for_lines(
            worker, "run's task killed its worker too often: failing the run", count=1
        )
    assert (run.status, run.reason, run.attempts) == ("dead", "worker_lost", 1)
    assert lost[0]["delivery"] == 2
    assert "signal 9 (SIGKILL)" in worker.log()


async def crash_once(settings: Settings, worker: RelayrProcess) -> Any:
    from reflexr import SourceActor

    from tests.execution.apps import Crash

    runtime = await Runtime.start(settings, role="dispatcher")
    async with runtime:
        app = create_celery(settings)

        async def enqueue(batch: RunMessage) -> None:
            send_runs(app, settings.queue, batch)

        rules = await runtime.application.rules.open(
            "acme", "crashes", actor=SourceActor(name="test")
        )
        await rules.publish(Crash(label="out of memory"))
        assert (await Dispatcher(runtime).pass_once(enqueue)).enqueued == 1
        deadline = time.monotonic() + 90
        while True:
            runs = await rules.runs()
            if runs and runs[0].status == "dead":
                return runs[0]
            assert time.monotonic() < deadline, worker.log()
            await asyncio.sleep(0.2)


# ─── soft time limit ──────────────────────────────────────────────────────────


def test_the_soft_time_limit_interrupts_a_run_and_the_process_goes_on(tmp_path: Path) -> None:
    """The limit's signal reaches the waiting task, which cancels the run on the loop."""
    environment = relayr_environment(
        tmp_path,
        app="tests.execution.apps:create_crashing_app",
        soft_time_limit_s=2,
        time_limit_s=20,
        lease_ttl_s=3,
    )
    settings = Settings.from_env(environment)
    with running_worker(environment, settings.home, concurrency=1) as worker:
        stuck, quick = asyncio.run(sleep_twice(settings, worker))
        interrupted = wait_for_lines(
            worker, "run interrupted by the task's soft time limit", count=1
        )
    assert interrupted[0]["run_id"] == stuck.id
    # left running with its lease released: the next claim records the attempt abandoned
    assert (stuck.status, stuck.attempts) == ("running", 1)
    assert (quick.status, quick.output) == ("succeeded", {"slept_s": 0.0})
    assert "signal 9" not in worker.log()  # the hard limit never fired


async def sleep_twice(settings: Settings, worker: RelayrProcess) -> tuple[Any, Any]:
    """One run that sleeps past the soft limit, then one that does not, in one pool process."""
    from reflexr import SourceActor

    from tests.execution.apps import Sleep

    runtime = await Runtime.start(settings, role="dispatcher")
    async with runtime:
        app = create_celery(settings)
        rules = await runtime.application.rules.open("acme", "naps", actor=SourceActor(name="t"))
        dispatcher = Dispatcher(runtime)

        async def enqueue(batch: RunMessage) -> None:
            send_runs(app, settings.queue, batch)

        deadline = time.monotonic() + 60

        async def run_of(index: int, *statuses: str) -> Any:
            """The index-th run fired, once its status is one of ``statuses``."""
            while True:
                runs = sorted(await rules.runs(), key=lambda run: run.fired_seq)
                if len(runs) > index and runs[index].status in statuses:
                    return runs[index]
                assert time.monotonic() < deadline, worker.log()
                await asyncio.sleep(0.2)

        await rules.publish(Sleep(seconds=60), id="stuck")
        assert (await dispatcher.pass_once(enqueue)).enqueued == 1
        await run_of(0, "running")
        await rules.publish(Sleep(seconds=0), id="quick")
        assert (await dispatcher.pass_once(enqueue)).enqueued == 1
        quick = await run_of(1, "succeeded")
        stuck = await run_of(0, *ALL_STATUSES)
        return stuck, quick
