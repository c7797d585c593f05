"""The embedded broker's channel: how a message's file is published, taken and settled.

Each step is a rename inside the broker's folder (:mod:`relayr.broker.layout`): a publish from
``incoming/`` into its queue, a take into the consumer's own folder
(:mod:`relayr.broker.consumers`), a set aside into the queue's dead letters
(:mod:`relayr.broker.dead_letters`); an ack is the one delete. What that guarantees, and the
transport that waits and wakes for this channel, are :mod:`relayr.broker.filesystem`'s; see
ADR-0013.
"""

import errno
import heapq
import os
import stat
from collections import deque
from contextlib import suppress
from itertools import count
from pathlib import Path
from queue import Empty
from typing import Any, Final

import structlog
from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils import json as kombu_json

from relayr.broker import layout
from relayr.broker.consumers import (
    FILE_MODE,
    OPEN_FLAGS,
    Holder,
    fsync_folder,
    move_back,
    recover_dead_consumers,
    write_all,
)
from relayr.broker.dead_letters import SetAsideOnError, decode, log_set_aside
from relayr.broker.reserve import behind_at_most

logger = structlog.get_logger("relayr.broker")

CANDIDATES_PER_LISTING: Final = 512
"""How many of the oldest names one listing of a queue folder yields before the next listing:
a listing costs O(backlog), so this many messages share it. Messages that come back to the
queue meanwhile (older names) wait for the next listing. Messages of a lower priority (a
dispatcher's backlog, a few per workspace) are each taken from a listing of their own."""

FILE_FAULTS: Final = frozenset({errno.EACCES, errno.EPERM, errno.ELOOP})
"""Why a taken file may fail to open that is the file's own doing (its permissions, a symbolic
link): it is set aside. Any other ``OSError`` is the process's or the disk's, and the message
goes back to its queue."""

# kombu's annotations are partial: its classes and functions are used untyped, as Any
KombuQoS: Any = virtual.QoS
KombuChannel: Any = filesystem.Channel
dumps: Any = kombu_json.dumps


class QoS(KombuQoS):  # type: ignore[misc]  # kombu, used untyped
    """kombu's QoS, settling the message's file: ack deletes it, reject sets it aside,
    requeue and restore (kombu's) move it back to its queue."""

    def ack(self, delivery_tag: str) -> None:
        self.channel.settle(delivery_tag)
        super().ack(delivery_tag)
        self.channel.wake()

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not requeue:
            self.channel.settle(delivery_tag, set_aside="rejected by its consumer")
        super().reject(delivery_tag, requeue=requeue)
        self.channel.wake()


class Channel(SetAsideOnError, KombuChannel):  # type: ignore[misc]  # kombu, used untyped
    """A channel of :class:`~relayr.broker.filesystem.Transport` (see
    :mod:`relayr.broker.filesystem`).

    Transport options: ``folder`` (required: the broker's folder), ``fsync`` (default False:
    flush each message and its queue folder to disk before the publish returns, for a message
    that must outlive a power cut; relayr's need not, reflexr's store is the truth about a run),
    ``behind_at_most`` (default unset: while the channel holds this many messages of a lower
    priority, it takes only the highest's; :mod:`relayr.broker.reserve`).
    """

    QoS = QoS

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        options = self.connection.client.transport_options
        folder = options.get("folder")
        if not folder:
            raise ChannelError("relayr's filesystem transport needs transport_options['folder']")
        self.root = Path(folder).absolute()
        for name in layout.FOLDERS:
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self.fsync = bool(options.get("fsync", False))
        self.behind_at_most = behind_at_most(options)
        self._holder: Holder | None = None
        self._held: dict[str, tuple[str, str]] = {}
        self._candidates: dict[str, deque[str]] = {}
        self._no_ack: set[str] = set()
        self._tags = count(1)

    @property
    def control_folder(self) -> Path:
        """kombu's bindings files (read by kombu's filesystem channel)."""
        return self.root / layout.EXCHANGES

    # ─── publishing ──────────────────────────────────────────────────────────

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """Write the message under ``incoming/``, then rename it into its queue's folder."""
        name = layout.message_name(priority=self._get_message_priority(message))
        staged = self.root / layout.INCOMING / name
        target_folder = layout.queue_path(self.root, queue)
        try:
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, FILE_MODE)
            try:
                write_all(fd, dumps(message).encode("utf-8"))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.rename(staged, target_folder / name)
            except FileNotFoundError:
                target_folder.mkdir(parents=True, exist_ok=True)
                os.rename(staged, target_folder / name)
            if self.fsync:
                fsync_folder(target_folder)
        except OSError as error:
            with suppress(OSError):
                os.unlink(staged)
            raise ChannelError(f"cannot publish to queue {queue!r}: {error}") from error

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        # kombu creates a bindings file by truncating it, then writing: a reader in between
        # would read nothing. Create it whole first; kombu then only updates it under its lock.
        table = self._exchange_file(exchange)
        if not table.exists():
            staged = self.root / layout.INCOMING / f".{layout.message_name()}.exchange"
            staged.write_bytes(b"[]")
            try:
                os.link(staged, table)
            except FileExistsError:
                pass
            finally:
                staged.unlink()
        super()._queue_bind(exchange, routing_key, pattern, queue)

    # ─── consuming ───────────────────────────────────────────────────────────

    def _get(self, queue: str) -> dict[str, Any]:
        """Take the oldest message of ``queue``'s highest priority that no other consumer takes
        first. A message of a lower priority is taken only from a listing made now (messages of
        the highest are taken from the last one): one that came meanwhile goes before it; and
        none while the channel holds ``behind_at_most`` of them."""
        holder = self._holder_here()
        queue_folder = layout.queue_folder_name(queue)
        source_folder = self.root / layout.QUEUES / queue_folder
        candidates = self._candidates.setdefault(queue, deque())
        listed = False
        while True:
            if not candidates:
                if listed:
                    raise Empty()
                listed = True
                try:
                    names = os.listdir(source_folder)
                except FileNotFoundError:
                    raise Empty() from None
                candidates.extend(
                    heapq.nsmallest(
                        CANDIDATES_PER_LISTING, (n for n in names if layout.is_message(n))
                    )
                )
                continue
            if candidates[0].startswith(layout.LOWER_PRIORITY_PREFIX):
                if not listed:
                    candidates.clear()  # a message of a higher priority may have come since
                    continue
                if self._ahead_only():
                    raise Empty()  # a settled message wakes the consumer (QoS)
            name = candidates.popleft()
            held_folder = holder.held_folder(queue_folder)
            held = held_folder / name
            try:
                os.rename(source_folder / name, held)
            except FileNotFoundError:
                if not held_folder.is_dir():  # removed under us: make it again, try again
                    holder.forget(queue_folder)
                    candidates.appendleft(name)
                continue  # another consumer took it
            payload = self._read_taken(queue, held)
            if payload is None:
                continue
            if queue in self._no_ack:
                with suppress(FileNotFoundError):
                    os.unlink(held)
            else:
                tag = f"{holder.id}.{next(self._tags)}"
                payload["properties"]["delivery_tag"] = tag
                self._held[tag] = (queue, name)
            if layout.is_redelivered(name):
                payload["properties"]["delivery_info"]["redelivered"] = True
            return payload

    def _read_taken(self, queue: str, held: Path) -> dict[str, Any] | None:
        """The taken file's payload, or None when it is gone or was set aside.

        Raises:
            OSError: When it cannot be read for a reason that is not the file's (see
                :data:`FILE_FAULTS`); it is back in its queue first.
        """
        try:
            fd = os.open(held, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno not in FILE_FAULTS:
                self._give_back(queue, held)
                raise
            self._set_aside_file(queue, held, f"cannot be read: {error}")
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raw = None
            else:
                with open(fd, "rb", closefd=False) as file:
                    raw = file.read()
        except OSError:
            self._give_back(queue, held)
            raise
        finally:
            os.close(fd)
        if raw is None:
            self._set_aside_file(queue, held, "not a regular file")
            return None
        payload, problem = decode(raw, self)
        if problem is not None:
            self._set_aside_file(queue, held, problem)
            return None
        return payload

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        if no_ack:
            self._no_ack.add(queue)
        else:
            self._no_ack.discard(queue)
        self._holder_here()
        consumed = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.wake()  # the queue may hold messages already: no notification says so
        return consumed

    def basic_qos(self, *args: Any, **kwargs: Any) -> Any:
        """kombu's, and a wake: a higher prefetch limit may let the consumer take more now."""
        result = super().basic_qos(*args, **kwargs)
        self.wake()
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._no_ack.discard(queue)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)
        if message is not None and no_ack:
            self.settle(message.delivery_tag)
        return message

    def _ahead_only(self) -> bool:
        """Whether this channel holds all the messages of a lower priority it may."""
        if self.behind_at_most is None:
            return False
        lower = layout.LOWER_PRIORITY_PREFIX
        return sum(name.startswith(lower) for _, name in self._held.values()) >= self.behind_at_most

    def _holder_here(self) -> Holder:
        """This channel's consumer folder, made (after a look for dead consumers) when first
        needed."""
        if self._holder is None or not self._holder.mine:
            self._holder = Holder(self.root)
            self.recover()
        return self._holder

    # ─── settling ────────────────────────────────────────────────────────────

    def settle(self, delivery_tag: str, *, set_aside: str | None = None) -> None:
        """The message is done with: delete its file, or set it aside with the problem given."""
        entry = self._held.pop(delivery_tag, None)
        holder = self._holder
        if entry is None or holder is None or not holder.mine:
            return
        queue, name = entry
        held = holder.folder / layout.queue_folder_name(queue) / name
        if set_aside is None:
            with suppress(FileNotFoundError):
                os.unlink(held)
        else:
            self._set_aside_file(queue, held, set_aside)

    def _give_back(self, queue: str, held: Path) -> None:
        """Put a taken file that could not be read back in its queue, under its own name (it
        was never delivered); if even that fails, it stays in this consumer's folder, which
        goes back to the queue when the consumer stops or dies."""
        try:
            os.rename(held, layout.queue_path(self.root, queue) / held.name)
        except OSError as error:
            logger.warning(
                "a message that could not be read stays with its consumer",
                path=str(held),
                queue=queue,
                error=str(error),
            )
        self._candidates.pop(queue, None)  # it is older than any name listed

    def _restore(self, message: Any) -> None:
        """Move a taken message back to its queue (kombu's requeue and restore call this)."""
        entry = self._held.pop(message.delivery_tag, None)
        holder = self._holder
        if entry is None or holder is None or not holder.mine:
            return  # acknowledged, restored already, or a forked copy of another's
        queue, name = entry
        queue_folder = layout.queue_folder_name(queue)
        move_back(self.root, holder.folder / queue_folder / name, queue_folder)
        self._candidates.clear()  # the restored message is older than any listed

    def set_aside(self, message: Any, queue: str, problem: str) -> None:
        """Dead-letter a delivered message its consumer raised on (see ``SetAsideOnError``)."""
        if message.delivery_tag in self._held:
            self.settle(message.delivery_tag, set_aside=problem)
            self.qos.ack(message.delivery_tag)
        else:
            log_set_aside("", queue, problem)

    def _set_aside_file(self, queue: str, source: Path, problem: str) -> None:
        """Move a taken file into its queue's dead letters, with its one log line. If it cannot
        be moved there, it stays where it is, in this consumer's folder: it goes back to its
        queue when the consumer stops or dies, never deleted."""
        folder = layout.dead_path(self.root, queue)
        target = folder / source.name
        try:
            try:
                os.rename(source, target)
            except FileNotFoundError:
                if not source.exists():
                    return
                folder.mkdir(parents=True, exist_ok=True)
                os.rename(source, target)
        except FileNotFoundError:
            return
        except OSError as error:
            problem = (
                f"{problem}; it stays with its consumer, back in its queue when the consumer "
                f"stops: moving it to {folder} failed ({error.strerror})"
            )
            target = source
        log_set_aside(str(target), queue, problem)

    def recover(self) -> int:
        """Give dead consumers' messages back to their queues (see
        :mod:`relayr.broker.filesystem`); how many moved.

        A filesystem error here is logged, not raised: the next look tries again, and the
        consumer goes on with its own messages meanwhile.
        """
        try:
            moved = recover_dead_consumers(self.root)
        except OSError as error:
            logger.warning(
                "looking for dead consumers failed", root=str(self.root), error=str(error)
            )
            return 0
        if moved:
            for channel in list(self.connection.channels if self.connection else ()):
                if isinstance(channel, Channel):
                    channel._candidates.clear()
        return moved

    def wake(self) -> None:
        """Wake the transport's wait: a settled message may let this consumer take another."""
        transport = self.connection
        if transport is not None:
            transport.wake()

    # ─── queues ──────────────────────────────────────────────────────────────

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        layout.queue_path(self.root, queue).mkdir(parents=True, exist_ok=True)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return layout.queue_path(self.root, queue).is_dir()

    def _size(self, queue: str) -> int:
        return layout.count_messages(layout.queue_path(self.root, queue))

    def _purge(self, queue: str) -> int:
        folder = layout.queue_path(self.root, queue)
        purged = 0
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return 0
        for name in names:
            if layout.is_message(name):
                with suppress(FileNotFoundError):
                    os.unlink(folder / name)
                    purged += 1
        self._candidates.pop(queue, None)
        return purged

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        super()._delete(queue, *args, **kwargs)
        with suppress(OSError):
            layout.queue_path(self.root, queue).rmdir()

    def close(self) -> None:
        was_open = not self.closed
        super().close()  # cancels the consumers; kombu's QoS restores what is unacknowledged
        if was_open and self._holder is not None:
            self._held.clear()
            self._holder.release(self.root)
            self._holder = None
