"""relayr's embedded broker: a kombu transport on files that survives load and SIGKILL (ADR-0013).

On one local filesystem: a consumer never reads a half-written message (write, then rename); a
message is kept until acknowledged, and any consumer moves a dead consumer's messages back
(every :data:`RECOVER_EVERY_S`); a file that is no usable message is set aside, never raised
into Celery; messages go FIFO by enqueue time; an idle consumer waits on the kernel's
notification and looks at least every polling interval (ADR-0095). This module waits, wakes and
recovers; :mod:`relayr.broker.filesystem_channel` moves the files.
"""

import threading
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any, Final

from kombu.transport import filesystem, virtual

from relayr.broker import layout
from relayr.broker.filesystem_channel import Channel
from relayr.broker.filesystem_wait import Wait, open_wait

POLLING_INTERVAL_S: Final = 0.05
"""The longest an idle consumer goes without looking at its queues when nothing wakes it
(kombu's ``polling_interval`` option, ``RELAYR_BROKER_POLL_INTERVAL_S``): what a missed
notification costs a message at most; where inotify is unavailable, a new message's wait."""

RECOVER_EVERY_S: Final = 1.0
"""How often a consumer looks for dead consumers' messages: the bound on how long a SIGKILLed
consumer's messages stay out of their queue while another consumer runs. A look is one listing
of ``consumers/`` and one non-blocking ``flock`` per consumer."""

# kombu's annotations are partial: its classes and functions are used untyped, as Any
KombuTransport: Any = filesystem.Transport
BrokerState: Any = virtual.BrokerState


class Transport(KombuTransport):  # type: ignore[misc]  # kombu, used untyped
    """relayr's embedded transport: ``transport_options={"folder": ...}`` (see :class:`Channel`),
    and kombu's ``polling_interval`` (default :data:`POLLING_INTERVAL_S`).

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
        self._wait: Wait | None = None
        self._wait_lock = threading.Lock()
        self._look_due = True
        now = monotonic()
        self._next_look = now
        self._next_recovery = now + RECOVER_EVERY_S

    def _waiting(self) -> Wait:
        """This transport's wait, opened when a consumer first waits (a publisher never does,
        so it never holds an inotify instance)."""
        with self._wait_lock:
            if self._wait is None:
                self._wait = open_wait()
            return self._wait

    def wake(self) -> None:
        """End the consumer's wait now: a settled message may let it take another."""
        with self._wait_lock:
            wait = self._wait
        if wait is not None:
            wait.wake()

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        """Deliver one message. The queues are looked at when something says a message may be
        there: a notification that one landed, a settled message (which may lift the prefetch
        limit), a queue newly consumed, dead consumers' messages given back, or the polling
        interval passed since the last look; between looks, the consumer waits.

        Raises:
            TimeoutError: When ``timeout`` passed without a message (``socket.timeout``).
            OSError: When a taken message cannot be read (it is back in its queue first).
        """
        deadline = None if timeout is None else monotonic() + timeout
        wait = self._waiting()
        while True:
            if wait.watch(self._consumed_folders()):
                self._look_due = True
            now = monotonic()
            if now >= self._next_recovery:  # on every call: a busy queue is never empty
                self._next_recovery = now + RECOVER_EVERY_S
                if self._recover():
                    self._look_due = True
            if self._look_due or now >= self._next_look:
                self._next_look = now + self.polling_interval
                try:
                    self.cycle.get(self._deliver, timeout=timeout)
                except Empty:
                    # a wake that came during the look is in the wait: it ends the next one
                    self._look_due = False
                else:
                    self._look_due = True  # more may wait: the next call looks at once
                    return
            now = monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError()
            until = min(self._next_look, self._next_recovery)
            if deadline is not None:
                until = min(until, deadline)
            if wait.wait(until - now):
                self._look_due = True

    def _consumed_folders(self) -> set[Path]:
        """The folders of the queues this transport's channels consume."""
        folders: set[Path] = set()
        for channel in list(self.channels):
            if isinstance(channel, Channel):
                folders.update(
                    layout.queue_path(channel.root, queue) for queue in channel._active_queues
                )
        return folders

    def _recover(self) -> int:
        """Give dead consumers' messages back to their queues; how many moved."""
        for channel in list(self.channels):
            if isinstance(channel, Channel) and channel._holder is not None:
                return channel.recover()
        return 0

    def close_connection(self, connection: Any) -> None:
        super().close_connection(connection)
        with self._wait_lock:
            wait, self._wait = self._wait, None
        if wait is not None:
            wait.close()
