"""The embedded broker after a consumer's death: what it held goes back to its queue.

On real files and real processes (ADR-0013): a SIGKILLed consumer's messages come back even
while a forked child still holds its lock file's descriptor; a dead consumer is found while the
queue is never empty; and recovery needs no write access to the dead one's lock file (checked
as another user when the tests run as root).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import pytest
from kombu import Connection, Consumer, Queue

from relayr.broker import layout
from relayr.broker.consumers import Holder, own_consumer_ids, recover_dead_consumers
from relayr.broker.filesystem import RECOVER_EVERY_S
from tests.broker.broker_files import QUEUE, connect, held, publish, waiting
from tests.workers import REPO

pytestmark = pytest.mark.process


def test_a_sigkilled_consumer_s_messages_go_back_even_with_a_forked_child_alive(
    conn: Connection, folder: Path, tmp_path: Path
) -> None:
    """The child inherited the lock file's descriptor, as a Celery pool process does; the
    lock still ends with its owner, so the owner's messages come back."""
    publish(conn, "one", "two", "three")
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.broker.broker_agents",
            "hold",
            str(folder),
            QUEUE,
            "2",
            str(ready),
        ],
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
