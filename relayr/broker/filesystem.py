"""relayr's embedded broker: a kombu transport on files that survives load and SIGKILL (ADR-0013).

Guarantees, on one local filesystem (the folders are :mod:`relayr.broker.layout`'s):

- a consumer never reads a half-written message (publishers write, then rename);
- a message is kept until acknowledged: a consumer takes it by renaming it into its own folder,
  and any consumer moves a dead consumer's messages back (at start, then every
  :data:`RECOVER_EVERY_S`); nothing is deleted but by an ack;
- a file that is not a usable message is set aside (:mod:`relayr.broker.dead_letters`), never
  raised into Celery; an ``OSError`` is a connection error, on which Celery reconnects;
- messages are taken FIFO by enqueue time; an empty queue is polled every
  :data:`POLLING_INTERVAL_S`.

This module waits, wakes and recovers; :mod:`relayr.broker.filesystem_channel` moves the files.
"""

import threading
from queue import Empty
from time import monotonic
from typing import Any, Final

from kombu.transport import filesystem, virtual

from relayr.broker.filesystem_channel import Channel

POLLING_INTERVAL_S: Final = 0.05
"""How long a consumer waits before it looks at an empty queue again: the longest a new
message waits for an idle worker. kombu's default, 1 s, would cap a worker at about one message
a second per process once its queue runs dry between messages."""

RECOVER_EVERY_S: Final = 1.0
"""How often a consumer looks for dead consumers' messages: the bound on how long a SIGKILLed
consumer's messages stay out of their queue while another consumer runs. A look is one listing
of ``consumers/`` and one non-blocking ``flock`` per consumer."""

# kombu's annotations are partial: its classes and functions are used untyped, as Any
KombuTransport: Any = filesystem.Transport
BrokerState: Any = virtual.BrokerState


class Transport(KombuTransport):  # type: ignore[misc]  # kombu, used untyped
    """relayr's embedded transport: ``transport_options={"folder": ...}`` (see :class:`Channel`).

    An ``OSError`` is one of its connection errors, as it is of kombu's Redis transport: the
    files are this broker's connection, so Celery reconnects on one (and it is never taken for
    a message's fault, :class:`~relayr.broker.dead_letters.SetAsideOnError`).
    """

    Channel = Channel
    connection_errors = (*KombuTransport.connection_errors, OSError)
    global_state = BrokerState()
    polling_interval = POLLING_INTERVAL_S
    driver_type = "filesystem"
    driver_name = "relayr-filesystem"

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self._woken = threading.Event()
        self._next_recovery = monotonic() + RECOVER_EVERY_S

    def wake(self) -> None:
        self._woken.set()

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        """Deliver one message; between empty looks, wait one poll or until a message is
        settled (which may lift the prefetch limit), and look for dead consumers now and then.

        Raises:
            TimeoutError: When ``timeout`` passed without a message (``socket.timeout``).
            OSError: When a taken message cannot be read (it is back in its queue first).
        """
        started = monotonic()
        while True:
            self._woken.clear()
            now = monotonic()
            if now >= self._next_recovery:  # on every call: a busy queue is never empty
                self._next_recovery = now + RECOVER_EVERY_S
                self._recover()
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                pass
            now = monotonic()
            wait_s = self.polling_interval
            if timeout is not None:
                left_s = timeout - (now - started)
                if left_s <= 0:
                    raise TimeoutError()
                wait_s = min(wait_s, left_s)
            self._woken.wait(wait_s)

    def _recover(self) -> None:
        for channel in list(self.channels):
            if isinstance(channel, Channel) and channel._holder is not None:
                channel.recover()
                return
