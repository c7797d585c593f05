"""relayr's transports on real files and a real Redis, through kombu's own API.

The embedded transport's promises one at a time (ADR-0013): a message is published whole,
taken in enqueue order, kept until acknowledged, moved back on requeue, close and a consumer's
death (a SIGKILLed process, with a forked child still holding its descriptors), and a file or
entry that is not a kombu message is set aside with one log line while the consumer goes on.
The same for Redis entries that are not kombu messages. Many processes at full speed:
tests/test_broker_fuzz.py; under a real worker: tests/test_broker_worker.py.
"""

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from structlog.testing import capture_logs

from relayr.broker import FILESYSTEM_TRANSPORT, layout, queue_depth
from relayr.broker.consumers import Holder, own_consumer_ids, recover_dead_consumers
from relayr.broker.dead_letters import SET_ASIDE
from relayr.broker.filesystem import RECOVER_EVERY_S
from relayr.broker.redis import dead_letter_list
from relayr.settings import Settings
from tests.broker_samples import GARBAGE
from tests.services import forget_redis_queue

REPO = Path(__file__).resolve().parent.parent
QUEUE = "relayr.test.broker"


def connect(folder: Path) -> Connection:
    return Connection(
        "filesystem://localhost/",
        transport=FILESYSTEM_TRANSPORT,
        transport_options={"folder": str(folder)},
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "broker"


@pytest.fixture
def conn(folder: Path) -> Iterator[Connection]:
    with connect(folder) as connection:
        Queue(QUEUE, routing_key=QUEUE)(connection.default_channel).declare()
        yield connection


def publish(conn: Connection, *bodies: object, queue: str = QUEUE) -> None:
    producer = Producer(conn.default_channel, serializer="json")
    for each in bodies:
        producer.publish(each, exchange="", routing_key=queue)


def take(conn: Connection, queue: str = QUEUE) -> Any:
    return conn.default_channel.basic_get(queue)


def waiting(folder: Path, queue: str = QUEUE) -> list[str]:
    return sorted(os.listdir(layout.queue_path(folder, queue)))


def held(folder: Path) -> list[Path]:
    """The messages consumers hold (their lock files aside)."""
    return [
        path
        for path in (folder / layout.CONSUMERS).rglob("*")
        if path.is_file() and path.parent != folder / layout.CONSUMERS
    ]


def set_aside(folder: Path) -> list[Path]:
    return sorted(path for path in (folder / layout.DEAD).rglob("*") if path.is_file())


# ─── names ────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "queue", ["relayr.runs", "celery@host.celery.pidbox", "a/b", "..", ".hidden", "", "é" * 300]
)
def test_a_queue_folder_name_stays_in_its_folder(queue: str) -> None:
    name = layout.queue_folder_name(queue)
    assert name
    assert "/" not in name
    assert not name.startswith(".")
    assert len(name.encode()) <= 255


def test_distinct_queues_get_distinct_folders() -> None:
    queues = ["a/b", "a%2Fb", "a.b", "x" * 400, "x" * 399 + "y", "%2E", "."]
    assert len({layout.queue_folder_name(q) for q in queues}) == len(queues)


def test_names_sort_in_enqueue_order() -> None:
    names = [layout.message_name(now_ns=t) for t in (5, 10**18, 3 * 10**18)]
    assert sorted(names) == names
    again = layout.redelivered_name(names[0])
    assert sorted([names[1], again]) == [again, names[1]]
    assert layout.is_redelivered(again)
    assert layout.redelivered_name(again) == again


# ─── publish, take, settle ────────────────────────────────────────────────────


def test_a_published_message_is_whole_in_its_queue_and_nothing_stays_behind(
    conn: Connection, folder: Path
) -> None:
    publish(conn, {"n": 1})
    (name,) = waiting(folder)
    assert json.loads((layout.queue_path(folder, QUEUE) / name).read_bytes())["body"]
    assert os.listdir(folder / layout.INCOMING) == []
    assert queue_depth(Settings(home=folder.parent), QUEUE) == 1


def test_messages_are_taken_in_enqueue_order_across_listings(conn: Connection) -> None:
    publish(conn, *range(1200))  # more than one listing's candidates
    assert [take(conn).payload for _ in range(1200)] == list(range(1200))
    assert take(conn) is None


def test_ack_deletes_the_taken_message(conn: Connection, folder: Path) -> None:
    publish(conn, "a")
    message = take(conn)
    assert waiting(folder) == []
    assert len(held(folder)) == 1
    message.ack()
    assert held(folder) == []
    assert waiting(folder) == []


def test_requeue_puts_the_message_first_marked_redelivered(conn: Connection, folder: Path) -> None:
    publish(conn, "first", "second")
    first = take(conn)
    assert not first.delivery_info.get("redelivered")
    first.reject(requeue=True)
    again = take(conn)
    assert again.payload == "first"
    assert again.delivery_info["redelivered"] is True
    again.ack()
    assert take(conn).payload == "second"


def test_a_rejected_message_is_set_aside_with_one_line(conn: Connection, folder: Path) -> None:
    publish(conn, "unwanted")
    message = take(conn)
    with capture_logs() as logs:
        message.reject(requeue=False)
    (line,) = [line for line in logs if line["event"] == SET_ASIDE]
    (dead,) = set_aside(folder)
    assert line["path"] == str(dead)
    assert line["problem"] == "rejected by its consumer"
    assert held(folder) == []


def test_closing_the_channel_gives_back_what_it_held(folder: Path) -> None:
    with connect(folder) as first:
        Queue(QUEUE, routing_key=QUEUE)(first.default_channel).declare()
        publish(first, "kept")
        assert take(first).payload == "kept"  # never acknowledged
    assert held(folder) == []
    assert len(waiting(folder)) == 1
    assert os.listdir(folder / layout.CONSUMERS) == []
    with connect(folder) as second:
        message = take(second)
        assert (message.payload, message.delivery_info["redelivered"]) == ("kept", True)


def test_no_ack_consumers_leave_nothing_held(conn: Connection, folder: Path) -> None:
    publish(conn, "once")
    assert conn.default_channel.basic_get(QUEUE, no_ack=True).payload == "once"
    assert held(folder) == []
    assert waiting(folder) == []


# ─── a consumer that dies ─────────────────────────────────────────────────────


def test_a_sigkilled_consumer_s_messages_go_back_even_with_a_forked_child_alive(
    conn: Connection, folder: Path, tmp_path: Path
) -> None:
    """The child inherited the lock file's descriptor, as a Celery pool process does; the
    lock still ends with its owner, so the owner's messages come back."""
    publish(conn, "one", "two", "three")
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.broker_agents", "hold", str(folder), QUEUE, "2", str(ready)],
        cwd=REPO,
    )
    child = 0
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            assert holder.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(ready.read_text())
        assert len(held(folder)) == 2
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with Consumer(conn, [Queue(QUEUE, routing_key=QUEUE)], accept=["json"]) as consumer:
            got: list[tuple[str, bool]] = []
            consumer.register_callback(
                lambda body, message: (
                    got.append((body, bool(message.delivery_info.get("redelivered")))),
                    message.ack(),
                )
            )
            # this consumer looks for dead ones when it starts and every RECOVER_EVERY_S
            deadline = time.monotonic() + RECOVER_EVERY_S + 30
            while len(got) < 3:
                assert time.monotonic() < deadline, got
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    finally:
        holder.kill()
        holder.wait()
        if child:
            os.kill(child, signal.SIGKILL)
    assert sorted(got) == [("one", True), ("three", False), ("two", True)]
    assert held(folder) == []
    # only this process's consumer is left: the dead one's lock file and folder are gone
    left = {name.removesuffix(layout.LOCK_SUFFIX) for name in os.listdir(folder / layout.CONSUMERS)}
    assert left <= own_consumer_ids()


def test_a_dead_consumer_is_found_while_the_queue_is_never_empty(
    conn: Connection, folder: Path
) -> None:
    """The look for dead consumers runs every RECOVER_EVERY_S on every drain, not only when the
    queue is empty: a busy consumer gives a dead one's messages back within the bound."""
    publish(conn, "held by the dead")
    dead = Holder(folder)
    queue_folder = layout.queue_folder_name(QUEUE)
    (name,) = waiting(folder)
    os.rename(layout.queue_path(folder, QUEUE) / name, dead.held_folder(queue_folder) / name)
    got: list[str] = []
    with Consumer(
        conn,
        [Queue(QUEUE, routing_key=QUEUE)],
        callbacks=[lambda body, message: (got.append(body), message.ack())],
        accept=["json"],
    ):
        # consuming made this consumer, which looked for dead ones: the other was alive then
        started = time.monotonic()
        dead.close()  # it dies now
        # one message waits before every drain: the queue is never found empty
        while time.monotonic() < started + RECOVER_EVERY_S + 0.5 and "held by the dead" not in got:
            publish(conn, "busy")
            conn.drain_events(timeout=5)
        for _ in range(2):  # the dead one's message, first in the queue, then the busy one left
            publish(conn, "busy")
            conn.drain_events(timeout=5)
    assert "held by the dead" in got
    assert held(folder) == []


def test_a_dead_consumer_s_lock_needs_no_write_access(tmp_path: Path) -> None:
    """Recovery opens another consumer's lock file read-only: ``flock`` needs no more. The
    lock file here is read-only to everyone; as root (which permissions do not stop), the
    recovery runs in a child process as another user."""
    base = Path(tempfile.mkdtemp(prefix="relayr-lock-"))
    try:
        base.chmod(0o777)
        folder = base / "broker"
        with connect(folder) as conn:
            Queue(QUEUE, routing_key=QUEUE)(conn.default_channel).declare()
            publish(conn, "held by the dead")
        dead = Holder(folder)
        queue_folder = layout.queue_folder_name(QUEUE)
        (name,) = waiting(folder)
        os.rename(layout.queue_path(folder, QUEUE) / name, dead.held_folder(queue_folder) / name)
        dead.close()
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o777 if path.is_dir() else 0o666)
        (folder / layout.CONSUMERS / f"{dead.id}{layout.LOCK_SUFFIX}").chmod(0o444)
        assert recovered_as_another_user(folder) == 1
        assert len(waiting(folder)) == 1
        assert held(folder) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


NOBODY: Final = 65534


def recovered_as_another_user(folder: Path) -> int:
    """:func:`recover_dead_consumers` as a user the files' permissions apply to: this one, or
    user 65534 in a forked child when this one is root."""
    if os.geteuid() != 0:
        return recover_dead_consumers(folder)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover  # the child reports through the pipe
        code = 1
        try:
            os.close(reader)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(writer, str(recover_dead_consumers(folder)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader) as answer:
        moved = answer.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return int(moved)


# ─── what cannot be read, or moved ────────────────────────────────────────────


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


# ─── Redis ────────────────────────────────────────────────────────────────────


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
