"""The broker's promises under a real ``celery worker`` (prefork), on the embedded broker and
Redis: a message a worker cannot use is set aside and the worker goes on; a worker SIGKILLed
while it holds a message loses it not; Celery's remote control still reaches the worker.

Workers are started as every worker test starts them (:mod:`tests.workers`). The kill happens
while the run is known to hold its message: its action waits on a gate file the test opens
only after the kill (:mod:`tests.broker.broker_app`).
"""

import asyncio
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pytest
import redis
from reflexr import SourceActor

from relayr.broker import layout, queue_depth
from relayr.broker.dead_letters import SET_ASIDE
from relayr.broker.redis import dead_letter_list
from relayr.cli.demo import run_scenario
from relayr.core.run_messages import RunMessage
from relayr.demo import Plan
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.app import create_celery
from tasks.runs import send_runs
from tests.broker.broker_app import Gated, gate_path
from tests.broker.broker_samples import GARBAGE, NOT_TASKS
from tests.services import forget_redis_queue
from tests.workers import RelayrProcess, relayr_environment, running_worker, start_worker

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(600)]

SAMPLES: Final = {**GARBAGE, **NOT_TASKS}
WAIT_S: Final = 120.0
"""How long a test waits for what a worker does in well under ten seconds on a quiet host."""

RECOVERED: Final = "messages of a dead consumer went back to their queues"


def log_lines(worker: RelayrProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]


def wait_for(worker: RelayrProcess, predicate: Any, *, count: int = 1) -> list[dict[str, Any]]:
    """The worker's log lines that match, once there are ``count`` of them."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [line for line in log_lines(worker) if predicate(line)]
        if len(found) >= count:
            return found
        assert worker.alive(), worker.log()[-5000:]
        assert time.monotonic() < deadline, worker.log()[-5000:]
        time.sleep(0.1)


def until_answered[T](ask: Callable[[], T], worker: RelayrProcess) -> T:
    """``ask`` again (a broadcast that waits for replies) until it gets one, within
    :data:`WAIT_S`: a busy host may let one broadcast's wait pass before the worker answers."""
    deadline = time.monotonic() + WAIT_S
    while not (answer := ask()):
        assert worker.alive(), worker.log()[-5000:]
        assert time.monotonic() < deadline, worker.log()[-5000:]
    return answer


def quick_scenario(settings: Settings) -> dict[str, Any]:
    plan = Plan(deploys=3, incidents=0)
    summary = dict(asyncio.run(run_scenario(settings, plan, timeout_s=WAIT_S)).summary)
    assert summary["problems"] == []
    assert summary["runs_succeeded"] == plan.runs
    return summary


# ─── a message the worker cannot use ──────────────────────────────────────────


def test_embedded_files_that_are_not_tasks_are_set_aside_and_the_worker_goes_on(
    tmp_path: Path,
) -> None:
    """Half-written and garbage files dropped into the queue folder of a running worker."""
    environment = relayr_environment(tmp_path)
    settings = Settings.from_env(environment)
    with running_worker(environment, tmp_path, concurrency=1) as worker:
        queue_folder = layout.queue_path(settings.broker_folder, settings.queue)
        queue_folder.mkdir(parents=True, exist_ok=True)
        for index, raw in enumerate(SAMPLES.values()):
            staged = settings.broker_folder / layout.INCOMING / f"sample-{index}"
            staged.write_bytes(raw)
            staged.rename(queue_folder / f"{index:020d}-sample.msg")
        lines = wait_for(worker, lambda line: line.get("event") == SET_ASIDE, count=len(SAMPLES))
        quick_scenario(settings)
        assert worker.alive()
    dead = sorted((settings.broker_folder / layout.DEAD).rglob("*.msg"))
    assert [path.read_bytes() for path in dead] == list(SAMPLES.values())
    assert sorted(line["path"] for line in lines) == [str(path) for path in dead]
    assert "Unrecoverable error" not in worker.log()
    assert "Connection to broker lost" not in worker.log()


@pytest.mark.redis
def test_redis_entries_that_are_not_tasks_are_set_aside_and_the_worker_goes_on(
    tmp_path: Path, redis_url: str
) -> None:
    environment = relayr_environment(tmp_path, broker_url=redis_url)
    settings = Settings.from_env(environment)
    client = redis.Redis.from_url(redis_url)
    try:
        with running_worker(environment, tmp_path, concurrency=1) as worker:
            for raw in SAMPLES.values():
                client.lpush(settings.queue, raw)
            lines = wait_for(
                worker, lambda line: line.get("event") == SET_ASIDE, count=len(SAMPLES)
            )
            quick_scenario(settings)
            assert worker.alive()
        dead = client.lrange(dead_letter_list(settings.queue), 0, -1)[::-1]
    finally:
        client.close()
        forget_redis_queue(settings.queue, redis_url)
    # the entries that are not kombu messages byte for byte; the others as kombu's JSON
    assert dead[: len(GARBAGE)] == list(GARBAGE.values())
    assert len(dead) == len(SAMPLES)
    assert {line["path"] for line in lines} == {f"redis list {dead_letter_list(settings.queue)}"}
    assert "Unrecoverable error" not in worker.log()
    assert "Connection to broker lost" not in worker.log()


# ─── a worker killed while it holds a message ─────────────────────────────────


def held_messages(settings: Settings) -> list[Path]:
    consumers = settings.broker_folder / layout.CONSUMERS
    queue_folder = layout.queue_folder_name(settings.queue)
    return sorted(consumers.glob(f"*/{queue_folder}/*"))


async def dispatching_until(settings: Settings, done: Any, *, publish: bool = False) -> Any:
    """Run the dispatcher (as ``relayr run`` does) until ``done(run)`` holds for the gated
    workspace's run; publish the gated event first if told to. Returns that run."""
    from relayr.cli.serve import serve_dispatcher

    runtime = await Runtime.start(settings, role="dispatcher")
    async with runtime:
        rules = await runtime.application.rules.open("acme", "gates", actor=SourceActor(name="t"))
        if publish:
            await rules.publish(Gated(label="held"))
        stop = asyncio.Event()
        dispatcher = asyncio.create_task(serve_dispatcher(runtime, stop))
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                runs = await rules.runs()
                if runs and done(runs[0]):
                    return runs[0]
                assert time.monotonic() < deadline, runs
                assert not dispatcher.done(), dispatcher
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await dispatcher


@pytest.mark.parametrize("killed", ["main process and pool", "main process"])
def test_a_worker_sigkilled_while_it_holds_a_message_gets_it_delivered_again(
    tmp_path: Path, killed: str
) -> None:
    """The worker dies while its run waits on the gate: all of it, as an out-of-memory kill of
    its container, or its main process alone (the one that holds the message), leaving its
    pool process behind; the next worker is handed the same message."""
    # the dispatcher does not send the run again while the test runs (requeue_after_s)
    environment = relayr_environment(
        tmp_path, app="tests.broker.broker_app:create_gated_app", lease_ttl_s=2, requeue_after_s=600
    )
    settings = Settings.from_env(environment)
    first = start_worker(environment, tmp_path, concurrency=1)
    try:
        running = asyncio.run(
            dispatching_until(settings, lambda run: run.status == "running", publish=True)
        )
        (held,) = held_messages(settings)  # the worker's main process holds it, unacknowledged
        if killed == "main process":
            first.process.send_signal(signal.SIGKILL)
            first.process.wait()
    finally:
        if killed != "main process":
            first.kill()
    try:
        assert held_messages(settings) == [held]  # still there: nobody acknowledged it
        task_id = json.loads(held.read_bytes())["headers"]["id"]
        gate_path(settings).touch()
        with running_worker(environment, tmp_path, concurrency=1) as second:
            (recovered,) = wait_for(second, lambda line: line.get("event") == RECOVERED)
            # the same message, delivered to the new worker's task
            wait_for(second, lambda line: line.get("task_id") == task_id)
            ended = asyncio.run(dispatching_until(settings, lambda run: run.status == "succeeded"))
    finally:
        first.kill()  # the pool process left behind, if any
    assert recovered["messages"] == 1
    assert ended.id == running.id
    assert held_messages(settings) == []
    assert queue_depth(settings) == 0


# ─── a message published is taken at once ─────────────────────────────────────


def test_an_idle_embedded_worker_takes_a_message_without_waiting_for_its_poll(
    tmp_path: Path,
) -> None:
    """The worker looks at its queue every 30 s only, and is woken by the notification that a
    message landed: it takes the message well within a third of that (ADR-0095). A message
    published right after the worker is ready would wait about 30 s for the poll."""
    long_poll_s, within_s = 30.0, 10.0
    environment = relayr_environment(tmp_path, broker_poll_interval_s=long_poll_s)
    settings = Settings.from_env(environment)
    app = create_celery(settings)
    batch = RunMessage(tenant_id="acme", workspace_id="wake", run_ids=("fir_0000000000000001",))
    try:
        with running_worker(environment, tmp_path, concurrency=1) as worker:
            send_runs(app, settings.queue, batch)
            published = time.monotonic()
            while queue_depth(settings) > 0:
                assert time.monotonic() - published < within_s, worker.log()[-5000:]
                time.sleep(0.02)
            # and it ran: a run that does not exist is nothing to do
            (line,) = wait_for(worker, lambda line: line.get("run_id") == batch.run_ids[0])
    finally:
        app.close()
    assert line["outcome"] == "missing"


# ─── remote control ───────────────────────────────────────────────────────────


def test_celery_remote_control_and_events_work_on_the_embedded_broker(tmp_path: Path) -> None:
    """``celery inspect ping`` goes through a fanout exchange, events through a topic exchange:
    bindings every process reads."""
    environment = relayr_environment(tmp_path)
    settings = Settings.from_env(environment)
    app = create_celery(settings)
    events: list[str] = []
    with running_worker(environment, tmp_path, concurrency=1) as worker:
        replies = until_answered(lambda: app.control.ping(timeout=5.0), worker)
        queues = until_answered(
            lambda: app.control.inspect(timeout=5.0).active_queues() or {}, worker
        )
        # and task events: a receiver's queue, bound to the events exchange, gets them
        with app.connection_for_read() as connection:
            receiver = app.events.Receiver(
                connection, handlers={"*": lambda event: events.append(event["type"])}
            )
            receiver.capture(limit=1, timeout=30, wakeup=True)
    prefix = worker.name.split("@")[0]
    assert [list(reply.values()) for reply in replies] == [[{"ok": "pong"}]]
    assert next(name for reply in replies for name in reply).startswith(prefix)
    ((name, consumed),) = queues.items()
    assert name.startswith(prefix)
    assert [queue["name"] for queue in consumed] == [settings.queue]
    assert events == ["worker-heartbeat"]
