"""A message the broker lost is sent again within a bound that does not grow (ADR-0003).

On the embedded broker and on Redis, with a real worker: the dispatcher enqueues a run, the
test deletes its message from the broker (as a broker that lost it, or a worker killed before
it claimed the run), and the run still reaches a worker once, the dispatcher having sent it
again ``requeue_after_s`` after it saw the queue go past the message (a later message taken)
or empty. A message merely waiting is never sent twice: the run succeeds in one attempt and
the dispatcher re-sent exactly one message.
"""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import redis
from artifactr import UserActor
from reflexr import SourceActor

from relayr.broker.layout import is_message, queue_path
from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import Dispatcher, DispatchPass, Enqueue
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import DeployFinished
from tasks.app import create_celery
from tasks.runs import send_runs
from tests.services import REDIS_HOST, REDIS_PORT, REDIS_URL, forgetting_redis_queue
from tests.workers import relayr_environment, start_worker

pytestmark = [pytest.mark.worker, pytest.mark.slow]

REQUEUE_AFTER_S = 2.0
"""Short, so the test waits little; the mechanism is the default's."""

SETTLE_TIMEOUT_S = 120.0
TENANT, WORKSPACE = "acme", "lost"

type Broker = Literal["embedded", "redis"]


class Counting(Dispatcher):
    """The dispatcher, adding up what its passes did."""

    again = 0

    async def pass_once(self, enqueue: Enqueue) -> DispatchPass:
        done = await super().pass_once(enqueue)
        self.again += done.again
        return done


@contextmanager
def broker_settings(kind: Broker, home: Path) -> Iterator[dict[str, str]]:
    if kind == "embedded":
        yield relayr_environment(home, requeue_after_s=REQUEUE_AFTER_S)
        return
    environment = relayr_environment(home, requeue_after_s=REQUEUE_AFTER_S, broker_url=REDIS_URL)
    with forgetting_redis_queue(environment["RELAYR_QUEUE"]):
        yield environment


def lose_the_oldest_message(kind: Broker, settings: Settings) -> None:
    """Delete the message the queue would hand out next, as a broker that lost it would."""
    if kind == "redis":
        # kombu pushes on the left and workers pop from the right: the right end is the oldest
        assert redis.Redis(host=REDIS_HOST, port=REDIS_PORT).rpop(settings.queue) is not None
        return
    folder = queue_path(settings.broker_folder, settings.queue)
    oldest = min(name for name in (p.name for p in folder.iterdir()) if is_message(name))
    (folder / oldest).unlink()


@pytest.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis)])
def broker(request: pytest.FixtureRequest) -> Broker:
    if request.param == "redis":
        request.getfixturevalue("redis_url")  # skips, or fails in CI, when Redis is down
    kind: Broker = request.param
    return kind


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["a later message taken", "an emptied queue"])
def test_a_lost_message_reaches_a_worker_again(tmp_path: Path, broker: Broker, case: str) -> None:
    with broker_settings(broker, tmp_path) as environment:
        runs, again = asyncio.run(
            _lose_one(broker, environment, tmp_path, later=case.startswith("a later"))
        )
    assert len(runs) == (2 if case.startswith("a later") else 1)
    assert [(run.status, run.attempts) for run in runs] == [("succeeded", 1)] * len(runs)
    assert again == 1


async def _lose_one(
    broker: Broker, environment: dict[str, str], log_dir: Path, *, later: bool
) -> tuple[list[Any], int]:
    settings = Settings.from_env(environment)
    runtime = await Runtime.start(settings, role="dispatcher")
    app = create_celery(settings)
    try:
        handle = await runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        thread = (await handle.create_thread("lost")).id
        source = await runtime.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )
        dispatcher = Counting(runtime)
        sent: list[RunMessage] = []

        async def enqueue(batch: RunMessage) -> None:
            send_runs(app, settings.queue, batch)
            sent.append(batch)

        # no worker yet: the message is lost before anyone could take it
        await source.publish(DeployFinished(service="lost", status="ok", thread_id=thread))
        assert (await dispatcher.pass_once(_losing(broker, settings, enqueue))).enqueued == 1
        if later:
            await source.publish(DeployFinished(service="later", status="ok", thread_id=thread))
        worker = await asyncio.to_thread(start_worker, environment, log_dir, concurrency=1)
        stop = asyncio.Event()
        serving = asyncio.create_task(dispatcher.serve(enqueue, stop))
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT_S):
                while True:
                    runs = await source.runs()
                    if runs and all(run.status == "succeeded" for run in runs):
                        break
                    await asyncio.sleep(0.2)
        finally:
            stop.set()
            await serving
            await asyncio.to_thread(worker.stop)
        return list(await source.runs()), dispatcher.again
    finally:
        app.close()
        await runtime.aclose()


def _losing(broker: Broker, settings: Settings, enqueue: Enqueue) -> Enqueue:
    """An enqueue whose message is lost right after it was sent."""

    async def lose(batch: RunMessage) -> None:
        await enqueue(batch)
        lose_the_oldest_message(broker, settings)

    return lose
