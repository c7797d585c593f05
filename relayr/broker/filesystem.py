"""relayr's embedded broker: a kombu transport on files that survives load and SIGKILL.

The guarantees (the folders are in :mod:`relayr.broker.layout`):

- **A consumer never reads a half-written message.** A publisher writes the message under
  ``incoming/`` and renames it into its queue's folder; a rename is atomic, so a message file
  in a queue folder is complete. (kombu's own filesystem transport creates the file in the
  queue folder and then writes it: a consumer listing the folder in between read an empty file,
  and Celery exited on the decode error.)
- **A message is kept until it is acknowledged.** A consumer takes a message by renaming it
  into a folder of its own (a rename that fails means another consumer took it first); ack
  deletes it there; reject with requeue, a warm shutdown's restore (kombu's ``QoS``) and a
  channel's close move it back to its queue. A consumer holds an ``flock`` on its lock file as
  long as it lives; any consumer that can take that lock knows the owner is dead and moves the
  owner's messages back (when it starts, then every :data:`RECOVER_EVERY_S`). So a SIGKILLed
  worker's messages wait at most :data:`RECOVER_EVERY_S`, while any consumer of the same broker
  folder runs, or else until the next one starts.
- **A file that is not a kombu message is set aside**, never raised into Celery
  (:mod:`relayr.broker.dead_letters`); so is a message its consumer raised on or rejected, and
  a file that is not a regular file (a folder, a FIFO that would block the consumer). A file
  that cannot be read for a reason of the process or the disk (no descriptor left, an I/O
  error) goes back to its queue and the ``OSError`` is raised: one of this transport's
  connection errors, on which Celery reconnects. Nothing is ever deleted but by an ack: a
  message that cannot be moved into its dead letters stays in its consumer's folder, and goes
  back to its queue when that consumer stops or dies.
- **FIFO by enqueue time**, and a listing serves many messages: a consumer lists its queue's
  folder once, keeps the :data:`~relayr.broker.filesystem_channel.CANDIDATES_PER_LISTING`
  oldest names and takes them in order, and lists again when they are used up (kombu's lists
  the folder for every message: a backlog of N costs O(N) per message).
- **A message is taken the moment it is published**: an idle consumer waits on the kernel's
  notification that a file landed in a queue it consumes (inotify,
  :mod:`relayr.broker.filesystem_wait`), not on a timer; it still looks every
  :data:`POLLING_INTERVAL_S`, so a notification that never comes costs at most that, and where
  inotify is unavailable it polls at that interval. A consumer held back by its prefetch limit
  wakes as soon as it acknowledges a message.

Bindings (which queues an exchange routes to) are kombu's filesystem transport's own files in
``exchanges/``, which every process reads, so Celery's remote control (a fanout exchange) and
task events work across processes as they did. The folder must be on a local filesystem
(``flock`` and atomic ``rename`` are what the guarantees rest on). See ADR-0013, and ADR-0095
for the wait on notifications.

This module is the transport: it waits for messages, wakes, and looks for dead consumers; its
channel, which moves the files, is :mod:`relayr.broker.filesystem_channel`.
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
"""The longest a consumer goes without looking at its queues, when nothing wakes it: what a
notification that never came (:mod:`relayr.broker.filesystem_wait`) costs a new message at
most, and, where the kernel sends none, how long a new message waits for an idle worker.
``RELAYR_BROKER_POLL_INTERVAL_S`` (kombu's ``polling_interval`` transport option) sets it.
kombu's default, 1 s, would cap a polling worker at about one message a second per process
once its queue runs dry between messages."""

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
