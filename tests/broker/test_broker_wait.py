"""The embedded broker's consumer waits on a notification, not on its poll (ADR-0095).

On real files and the kernel's real inotify: a consumer whose polling interval is far longer
than any wait here takes a message the moment it is published, and a message no notification
announces is still taken at the next poll. A real worker's case is in
tests/broker/test_broker_worker.py.
"""

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from kombu import Connection, Consumer, Queue

from relayr.broker import FILESYSTEM_TRANSPORT, layout
from relayr.broker.filesystem_wait import NotifiedWait, PolledWait, open_wait
from tests.broker.broker_files import QUEUE, publish, waiting

LONG_POLL_S: Final = 30.0
"""A polling interval no wait in these tests comes near: what is taken sooner was notified."""

NOTIFIED_WITHIN_S: Final = 10.0
"""How long a notified consumer may take, on a busy host: a third of :data:`LONG_POLL_S`."""


def connect(folder: Path, polling_interval: float) -> Connection:
    return Connection(
        "filesystem://localhost/",
        transport=FILESYSTEM_TRANSPORT,
        transport_options={"folder": str(folder), "polling_interval": polling_interval},
    )


@pytest.fixture
def consumed(folder: Path) -> Iterator[tuple[Connection, list[Any]]]:
    """A consumer of the test queue with a polling interval of :data:`LONG_POLL_S`, after one
    empty look (so its next poll is that far away), and the bodies it took."""
    with connect(folder, LONG_POLL_S) as connection:
        queue = Queue(QUEUE, routing_key=QUEUE)
        taken: list[Any] = []
        with Consumer(connection, [queue], accept=["json"]) as consumer:
            consumer.register_callback(lambda body, message: (taken.append(body), message.ack()))
            with pytest.raises(TimeoutError):
                connection.drain_events(timeout=0.2)
            yield connection, taken


def test_a_published_message_is_taken_long_before_the_poll(
    consumed: tuple[Connection, list[Any]], folder: Path
) -> None:
    connection, taken = consumed
    with connect(folder, LONG_POLL_S) as publisher:
        publish(publisher, "now")
    started = time.monotonic()
    connection.drain_events(timeout=NOTIFIED_WITHIN_S)
    assert taken == ["now"]
    assert time.monotonic() - started < NOTIFIED_WITHIN_S


def test_a_message_no_notification_announces_is_taken_at_the_next_poll(folder: Path) -> None:
    """A hard link into the queue's folder is neither a rename nor a written file: only the
    poll finds it, one short interval later."""
    with connect(folder, 0.2) as connection:
        queue = Queue(QUEUE, routing_key=QUEUE)
        taken: list[Any] = []
        with Consumer(connection, [queue], accept=["json"]) as consumer:
            consumer.register_callback(lambda body, message: (taken.append(body), message.ack()))
            with pytest.raises(TimeoutError):
                connection.drain_events(timeout=0.2)
            publish(connection, "linked", queue="relayr.test.elsewhere")
            (name,) = waiting(folder, "relayr.test.elsewhere")
            source = layout.queue_path(folder, "relayr.test.elsewhere") / name
            os.link(source, layout.queue_path(folder, QUEUE) / name)
            source.unlink()
            connection.drain_events(timeout=60)
    assert taken == ["linked"]


def test_a_notified_wait_wakes_for_a_file_renamed_into_a_watched_folder(tmp_path: Path) -> None:
    watched, staging = tmp_path / "queue", tmp_path / "incoming"
    watched.mkdir()
    staging.mkdir()
    wait = NotifiedWait()
    try:
        assert wait.watch([watched]) is True
        assert wait.watch([watched]) is False
        assert wait.wait(0.05) is False
        (staging / "m").write_bytes(b"{}")
        assert wait.wait(0.05) is False  # written elsewhere: nothing landed yet
        (staging / "m").rename(watched / "m")
        assert wait.wait(NOTIFIED_WITHIN_S) is True
        assert wait.wait(0.05) is False  # consumed: the next wait waits again
    finally:
        wait.close()


def test_a_watched_folder_made_again_is_watched_again(tmp_path: Path) -> None:
    watched = tmp_path / "queue"
    watched.mkdir()
    wait = NotifiedWait()
    try:
        wait.watch([watched])
        watched.rmdir()
        assert wait.wait(NOTIFIED_WITHIN_S) is True  # the watch went with its folder
        assert wait.watch([watched]) is False  # not there: polled, nothing to say yet
        watched.mkdir()
        assert wait.watch([watched]) is True  # watched again, and may hold messages already
        (tmp_path / "m").write_bytes(b"{}")
        (tmp_path / "m").rename(watched / "m")
        assert wait.wait(NOTIFIED_WITHIN_S) is True
    finally:
        wait.close()


@pytest.mark.parametrize("kind", [NotifiedWait, PolledWait])
def test_a_wake_from_another_thread_ends_the_wait(kind: type[NotifiedWait | PolledWait]) -> None:
    wait = kind()
    try:
        waker = threading.Timer(0.1, wait.wake)
        waker.start()
        started = time.monotonic()
        assert wait.wait(LONG_POLL_S) is True
        assert time.monotonic() - started < NOTIFIED_WITHIN_S
        waker.join()
        wait.wake()
        wait.wake()  # wakes do not pile up: one wait consumes them all
        assert wait.wait(0.05) is True
        assert wait.wait(0.05) is False
    finally:
        wait.close()


def test_linux_gets_the_notified_wait() -> None:
    wait = open_wait()
    try:
        assert isinstance(wait, NotifiedWait)
    finally:
        wait.close()
