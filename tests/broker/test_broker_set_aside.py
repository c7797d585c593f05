"""What the broker sets aside, and what it keeps: not the message's fault is not set aside.

On real files and a real Redis, through kombu's own API (ADR-0013). A file or Redis entry that
is not a kombu message, a file that is not a regular file, and a message its callback raises on
are set aside with one log line while the consumer goes on; a rejected Redis message goes to its
queue's dead letters whatever its routing key. What is not the message's fault is not set aside:
a message that cannot be read for want of a descriptor goes back whole, one whose dead letters
cannot be made stays with its consumer, and an OSError in the callback is raised.
"""

import contextlib
import errno
import os
import resource
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from structlog.testing import capture_logs

from relayr.broker import layout, queue_depth
from relayr.broker.dead_letters import SET_ASIDE
from relayr.broker.redis import dead_letter_list
from relayr.settings import Settings
from tests.broker.broker_files import QUEUE, connect, held, publish, set_aside, take, waiting
from tests.broker.broker_samples import GARBAGE
from tests.services import forget_redis_queue


@contextlib.contextmanager
def no_descriptor_left() -> Iterator[None]:
    """Every file descriptor this process may open is in use: the next ``open`` fails with
    EMFILE (the limit lowered to what is open, the gaps below it filled)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    fillers: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        while True:
            try:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as error:
                if error.errno != errno.EMFILE:
                    raise
                break
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_message_that_cannot_be_read_for_want_of_a_descriptor_goes_back_whole(
    conn: Connection, folder: Path
) -> None:
    """EMFILE is the process's trouble, not the message's: the message goes back to its queue
    and the error is raised (a connection error of the transport: Celery reconnects)."""
    publish(conn, "first", "second")
    assert take(conn).payload == "first"  # the listing is done: "second" is a candidate
    with no_descriptor_left(), pytest.raises(OSError, match="Too many open files") as raised:
        take(conn)
    assert raised.value.errno == errno.EMFILE
    assert set_aside(folder) == []
    assert len(waiting(folder)) == 1
    assert take(conn).payload == "second"
    assert isinstance(raised.value, conn.connection_errors)


def test_a_file_that_is_not_a_regular_file_is_set_aside_without_blocking(
    conn: Connection, folder: Path
) -> None:
    """A FIFO would block a reader until someone writes to it; a folder cannot be read."""
    queue_folder = layout.queue_path(folder, QUEUE)
    os.mkfifo(queue_folder / f"{1:020d}-fifo.msg")
    (queue_folder / f"{2:020d}-folder.msg").mkdir()
    publish(conn, "after them")
    with capture_logs() as logs:
        assert take(conn).payload == "after them"
    problems = [line["problem"] for line in logs if line["event"] == SET_ASIDE]
    assert problems == ["not a regular file", "not a regular file"]
    assert sorted(os.listdir(layout.dead_path(folder, QUEUE))) == [
        f"{1:020d}-fifo.msg",
        f"{2:020d}-folder.msg",
    ]


def test_a_message_that_cannot_be_set_aside_is_kept_not_deleted(
    conn: Connection, folder: Path
) -> None:
    """Its dead letters' folder cannot be made (a file is where it should be): the message
    stays with its consumer, and is back in its queue once that consumer is gone."""
    layout.dead_path(folder, QUEUE).parent.mkdir(parents=True, exist_ok=True)
    layout.dead_path(folder, QUEUE).write_bytes(b"in the way")
    publish(conn, "unwanted", "next")
    message = take(conn)
    with capture_logs() as logs:
        message.reject(requeue=False)
    (line,) = [line for line in logs if line["event"] == SET_ASIDE]
    assert "stays with its consumer" in line["problem"]
    (kept,) = held(folder)
    assert line["path"] == str(kept)
    assert take(conn).payload == "next"
    conn.default_channel.close()
    assert held(folder) == []
    with connect(folder) as again:
        back = take(again)
        assert (back.payload, back.delivery_info["redelivered"]) == ("unwanted", True)


def test_an_os_error_in_the_consumer_s_callback_is_raised_not_set_aside(
    conn: Connection, folder: Path
) -> None:
    """An OSError in Celery's handling (a pool's pipe, say) is the connection's trouble, not
    the message's: it propagates, and the message is kept for the next consumer."""
    publish(conn, "fine")

    def on_message(body: str, message: Any) -> None:
        raise BrokenPipeError("the pool's pipe is closed")

    with (
        Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], callbacks=[on_message], accept=["json"]),
        pytest.raises(BrokenPipeError),
    ):
        conn.drain_events(timeout=5)
    assert set_aside(folder) == []
    conn.default_channel.close()
    with connect(folder) as again:
        assert take(again).payload == "fine"


# ─── what is not a kombu message ──────────────────────────────────────────────


def test_a_file_that_is_not_a_kombu_message_is_set_aside_and_the_consumer_goes_on(
    conn: Connection, folder: Path
) -> None:
    queue_folder = layout.queue_path(folder, QUEUE)
    for index, raw in enumerate(GARBAGE.values()):
        (queue_folder / f"{index:020d}-garbage.msg").write_bytes(raw)
    publish(conn, "after the garbage")
    with capture_logs() as logs:
        message = take(conn)
    assert message.payload == "after the garbage"
    lines = [line for line in logs if line["event"] == SET_ASIDE]
    dead = set_aside(folder)
    assert [line["path"] for line in lines] == [str(path) for path in dead]
    assert len(dead) == len(GARBAGE)
    assert [path.read_bytes() for path in dead] == list(GARBAGE.values())
    assert all(line["problem"] and line["queue"] == QUEUE for line in lines)


def test_a_message_its_callback_raises_on_is_set_aside_and_consuming_goes_on(
    conn: Connection, folder: Path
) -> None:
    publish(conn, "poison", "fine")
    seen: list[str] = []

    def on_message(body: str, message: Any) -> None:
        if body == "poison":
            raise TypeError("unhashable type: 'list'")
        seen.append(body)
        message.ack()

    with (
        capture_logs() as logs,
        Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], callbacks=[on_message], accept=["json"]),
    ):
        conn.drain_events(timeout=5)
        conn.drain_events(timeout=5)
    assert seen == ["fine"]
    (line,) = [line for line in logs if line["event"] == SET_ASIDE]
    assert "TypeError: unhashable type" in line["problem"]
    (dead,) = set_aside(folder)
    assert line["path"] == str(dead)
    assert held(folder) == []


@pytest.fixture
def redis_queue(redis_url: str) -> Iterator[str]:
    queue = f"relayr.test.broker.{uuid.uuid4().hex[:12]}"
    yield queue
    forget_redis_queue(queue, redis_url)


@pytest.mark.redis
def test_a_redis_entry_that_is_not_a_kombu_message_is_set_aside_and_the_consumer_goes_on(
    redis_url: str, redis_queue: str
) -> None:
    settings = Settings(broker_url=redis_url, queue=redis_queue)
    client = redis.Redis.from_url(redis_url)
    seen: list[Any] = []
    with Connection(redis_url, transport="relayr.broker.redis:Transport") as conn:
        queue = Queue(redis_queue, routing_key=redis_queue)
        queue(conn.default_channel).declare()
        for raw in GARBAGE.values():
            client.lpush(redis_queue, raw)
        Producer(conn.default_channel, serializer="json").publish(
            "after the garbage", exchange="", routing_key=redis_queue
        )
        assert queue_depth(settings) == len(GARBAGE) + 1
        with (
            capture_logs() as logs,
            Consumer(
                conn,
                [queue],
                callbacks=[lambda body, message: (seen.append(body), message.ack())],
                accept=["json"],
            ),
        ):
            deadline = time.monotonic() + 30
            while not seen:
                assert time.monotonic() < deadline
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    assert seen == ["after the garbage"]
    lines = [line for line in logs if line["event"] == SET_ASIDE]
    assert len(lines) == len(GARBAGE)
    assert {line["path"] for line in lines} == {f"redis list {dead_letter_list(redis_queue)}"}
    # byte for byte, oldest at the tail as in the queue
    assert client.lrange(dead_letter_list(redis_queue), 0, -1)[::-1] == [
        raw for raw in GARBAGE.values()
    ]
    assert queue_depth(settings) == 0
    client.close()


@pytest.mark.redis
def test_a_redis_message_rejected_goes_to_its_queue_s_dead_letters_whatever_its_routing_key(
    redis_url: str, redis_queue: str
) -> None:
    """Bound by a routing key that is not its name, the queue still names the dead letters a
    rejected message goes to, as it does for a message its callback raised on."""
    exchange = Exchange(f"{redis_queue}.exchange", type="direct")
    routing_key = f"{redis_queue}.key"
    client = redis.Redis.from_url(redis_url)
    try:
        with Connection(redis_url, transport="relayr.broker.redis:Transport") as conn:
            queue = Queue(redis_queue, exchange=exchange, routing_key=routing_key)
            queue(conn.default_channel).declare()
            Producer(conn.default_channel, serializer="json").publish(
                "unwanted", exchange=exchange, routing_key=routing_key
            )
            Producer(conn.default_channel, serializer="json").publish(
                "poison", exchange=exchange, routing_key=routing_key
            )

            def on_message(body: str, message: Any) -> None:
                if body == "poison":
                    raise TypeError("unhashable type: 'list'")
                message.reject(requeue=False)

            with (
                capture_logs() as logs,
                Consumer(conn, [queue], callbacks=[on_message], accept=["json"]),
            ):
                deadline = time.monotonic() + 30
                while len([line for line in logs if line["event"] == SET_ASIDE]) < 2:
                    assert time.monotonic() < deadline, logs
                    with contextlib.suppress(TimeoutError):
                        conn.drain_events(timeout=1)
        assert client.llen(dead_letter_list(redis_queue)) == 2
        assert client.exists(dead_letter_list(routing_key)) == 0
        assert {line["path"] for line in logs if line["event"] == SET_ASIDE} == {
            f"redis list {dead_letter_list(redis_queue)}"
        }
    finally:
        client.delete(dead_letter_list(routing_key))  # none, unless the test fails
        client.close()
