"""The dispatcher's enqueue publishes off its loop: a broker that hangs holds one thread only.

The dispatcher's loop also renews the followers' leases, beats its heartbeat and, under
``relayr run``, supervises the worker. Celery's publish blocks its thread while the broker does
not answer, so :func:`relayr.cli.serve.batch_enqueuer` runs it in a thread of its own. The
broker here is a real TCP listener that accepts a connection and never answers, until the test
lets it go (or, should the loop stay held, until :data:`HELD_S` has passed, so that a failing
test ends): while it holds the publish, the loop must go on.
"""

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from relayr.cli.serve import batch_enqueuer
from relayr.core.run_messages import RunMessage
from relayr.settings import Settings

HELD_S = 30.0
"""How long the silent broker holds a connection at most: far longer than a thread and the loop
need to see it accepted, so the test does not depend on the machine's speed."""


class SilentBroker:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers them."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.accepted = threading.Event()
        self.released = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        """Close the connections held and stop listening: the broker is gone."""
        self.released.set()
        with suppress(OSError):  # wakes the accepting thread: a closed fd alone would not
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for connection in list(self._held):
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self) -> None:
        while not self.released.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self._held.append(connection)
            self.accepted.set()
            threading.Thread(target=self._hold, args=(connection,), daemon=True).start()

    def _hold(self, connection: socket.socket) -> None:
        if not self.released.wait(HELD_S):
            self.release()
        with suppress(OSError):  # accepted while release() closed the others
            connection.shutdown(socket.SHUT_RDWR)
        connection.close()


@contextmanager
def silent_broker() -> Iterator[SilentBroker]:
    broker = SilentBroker()
    try:
        yield broker
    finally:
        broker.release()


async def test_a_broker_that_does_not_answer_does_not_hold_the_loop(tmp_path: Path) -> None:
    with silent_broker() as broker:
        settings = Settings(home=tmp_path, broker_url=f"redis://127.0.0.1:{broker.port}/0")
        enqueue = batch_enqueuer(settings)
        sending = asyncio.create_task(
            enqueue(RunMessage(tenant_id="acme", workspace_id="ops", run_ids=("fir_1",)))
        )
        # this coroutine goes on once the broker holds the publish, if the loop is free
        assert await asyncio.to_thread(broker.accepted.wait, HELD_S)
        assert not broker.released.is_set(), "the loop was held until the broker let go"
        assert not sending.done()
        broker.release()
        with pytest.raises(Exception, match="Connection"):  # Celery's retries meet a closed port
            await sending
