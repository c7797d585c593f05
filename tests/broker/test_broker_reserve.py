"""A worker's reserve: a backlog's messages fill at most ``--concurrency`` pool processes.

Through kombu's own API on both transports, a consumer given ``behind_at_most`` holds at most
that many messages of a lower priority and still takes one of the highest; then a real
``relayr worker --concurrency 1 --reserve 1`` runs a workspace's only message while its one
other process holds a backlog's message, held on a gate (:mod:`tests.broker.broker_app`), and
leaves the backlog's next message in the queue. A worker keeps no reserve by default on SQLite
(ADR-0128).
"""

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, Final

import pytest
from kombu import Connection, Consumer, Message, Producer, Queue
from reflexr import SourceActor

from relayr.broker import FILESYSTEM_TRANSPORT, REDIS_TRANSPORT, queue_depth
from relayr.broker.reserve import BEHIND_AT_MOST
from relayr.cli.helpers import DEFAULT_RESERVE, reserve_for
from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.core.run_messages import RunMessage
from relayr.dispatch.evaluation import evaluate_all
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.app import create_celery
from tasks.runs import BACKLOG_PRIORITY, send_runs
from tests.broker.broker_app import Gated, gate_path
from tests.services import forgetting_redis_queue
from tests.workers import REPO, relayr_environment

BROKERS: Final = ["embedded", "redis"]
NOTHING_COMES_S: Final = 1.0
"""How long a consumer is given to take a message it must not: a consumer without the limit
takes it at once."""
WAIT_S: Final = 120.0


def kombu_connection(broker: str, folder: Path, **options: Any) -> Connection:
    if broker == "embedded":
        return Connection(
            "filesystem://localhost/",
            transport=FILESYSTEM_TRANSPORT,
            transport_options={"folder": str(folder), **options},
        )
    return Connection(
        "redis://127.0.0.1:6379/0", transport=REDIS_TRANSPORT, transport_options=options
    )


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        request.getfixturevalue("redis_url")  # skips by hand, fails under CI, if Redis is down
    return str(request.param)


@pytest.fixture
def queue(broker: str) -> Iterator[str]:
    """A queue of the test's own; on Redis, its keys removed after the test."""
    name = f"relayr.test.{uuid.uuid4().hex[:12]}"
    if broker != "redis":
        yield name
        return
    with forgetting_redis_queue(name):
        yield name


def test_a_consumer_holding_its_backlog_messages_takes_only_the_highest_priority(
    broker: str, queue: str, tmp_path: Path
) -> None:
    with kombu_connection(broker, tmp_path / "broker", **{BEHIND_AT_MOST: 1}) as conn:
        channel = conn.channel()
        declared = Queue(queue, routing_key=queue)(channel)
        declared.declare()
        producer = Producer(conn.channel(), serializer="json")
        for body in ("behind-1", "behind-2"):
            producer.publish(body, exchange="", routing_key=queue, priority=BACKLOG_PRIORITY)
        taken: list[tuple[str, Message]] = []
        consumer = Consumer(
            channel,
            [declared],
            callbacks=[lambda body, message: taken.append((body, message))],
            prefetch_count=3,
        )
        consumer.consume()

        def drain(timeout_s: float) -> None:
            with suppress(TimeoutError):
                conn.drain_events(timeout=timeout_s)

        drain(WAIT_S)
        drain(NOTHING_COMES_S)  # its prefetch would take behind-2: the limit does not
        assert [body for body, _ in taken] == ["behind-1"]
        producer.publish("ahead", exchange="", routing_key=queue)
        drain(WAIT_S)
        assert [body for body, _ in taken] == ["behind-1", "ahead"]
        taken[0][1].ack()  # settled: the limit lets the backlog's next one come
        drain(WAIT_S)
        assert [body for body, _ in taken] == ["behind-1", "ahead", "behind-2"]
        for _, message in taken[1:]:
            message.ack()


def test_a_worker_keeps_a_reserve_by_default_except_on_sqlite(tmp_path: Path) -> None:
    on_sqlite = Settings(home=tmp_path)
    on_postgres = Settings(home=tmp_path, database_url="postgresql+asyncpg://relayr@db/relayr")
    assert reserve_for(on_sqlite, None) == 0
    assert reserve_for(on_postgres, None) == DEFAULT_RESERVE == 1
    assert reserve_for(on_sqlite, 2) == 2
    assert reserve_for(on_postgres, 0) == 0


async def gated_run(settings: Settings) -> str:
    """The gated rule's run, made (due, not sent): its action waits on the gate."""
    runtime = await Runtime.start(settings, role="dispatcher")
    async with runtime:
        rules = await runtime.application.rules.open("acme", "gates", actor=SourceActor(name="t"))
        await rules.publish(Gated(label="held"))
        ((_, run),) = await evaluate_all(runtime.application.rules)
        return run.id


def outcome_of(worker: RelayrProcess, run_id: str) -> str | None:
    """The outcome the worker logged for ``run_id``, or None before it logged one."""
    for line in worker.log().splitlines():
        fields = json.loads(line) if line.startswith("{") else {}
        if fields.get("run_id") == run_id and "outcome" in fields:
            return str(fields["outcome"])
    return None


def until(worker: RelayrProcess, done: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (answer := done()):
        assert worker.alive(), worker.log()[-5000:]
        assert time.monotonic() < deadline, worker.log()[-5000:]
        time.sleep(0.05)
    return answer


@pytest.mark.worker
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_workspaces_only_message_runs_while_a_backlog_holds_every_other_process(
    broker: str, queue: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``--concurrency 1``: a backlog's message holds the worker's one process on the gate; a
    workspace's only message, published after the backlog's next one, runs on the reserve
    process before the gate opens, while the backlog's next one waits for the gate."""
    urls = {"broker_url": request.getfixturevalue("redis_url")} if broker == "redis" else {}
    environment = relayr_environment(
        tmp_path, app="tests.broker.broker_app:create_gated_app", queue=queue, **urls
    )
    settings = Settings.from_env(environment)
    held = asyncio.run(gated_run(settings))
    backlog, alone = "fir_0000000000000001", "fir_0000000000000002"  # no such runs: quick
    app = create_celery(settings)
    worker = RelayrProcess.start(
        relayr_command(
            "worker", "--concurrency", "1", "--reserve", "1", "--hostname", f"{queue}@%h"
        ),
        name="relayr worker",
        environment=environment,
        cwd=REPO,
        log_path=tmp_path / "worker.log",
    ).ready()
    try:
        send_runs(
            app,
            queue,
            RunMessage(tenant_id="acme", workspace_id="gates", run_ids=(held,), behind=True),
        )
        until(worker, lambda: queue_depth(settings) == 0)  # taken: it waits on the gate
        send_runs(
            app,
            queue,
            RunMessage(tenant_id="acme", workspace_id="flood", run_ids=(backlog,), behind=True),
        )
        send_runs(app, queue, RunMessage(tenant_id="acme", workspace_id="quiet", run_ids=(alone,)))

        assert until(worker, lambda: outcome_of(worker, alone)) == "missing"
        assert outcome_of(worker, held) is None  # the gate is shut
        assert outcome_of(worker, backlog) is None
        assert queue_depth(settings) == 1

        gate_path(settings).touch()
        assert until(worker, lambda: outcome_of(worker, backlog)) == "missing"
        assert until(worker, lambda: outcome_of(worker, held)) == "succeeded"
    finally:
        gate_path(settings).touch()
        worker.stop()
        app.close()
