"""The embedded broker's consumers on disk: each one's folder and lock, and a dead one's messages.

A consumer holds an ``flock`` on its lock file for as long as it lives; one whose lock can be
taken is dead, and :func:`recover_dead_consumers` moves its messages back to their queues in
enqueue order. Leftovers of a process that died mid-step are removed once old enough (ADR-0013).
"""

import fcntl
import os
import time
import weakref
from contextlib import suppress
from pathlib import Path
from typing import Final

import structlog
from kombu.exceptions import ChannelError

from relayr.broker import layout

logger = structlog.get_logger("relayr.broker")

STALE_INCOMING_S: Final = 600.0
"""A file in ``incoming/`` this old belongs to a publisher that died between writing and
renaming (which takes microseconds): it is removed."""

STALE_STAGING_S: Final = 60.0
"""A consumer's lock file still under its staging name this long after it was made belongs to
a consumer that died while starting: it is removed."""

OPEN_FLAGS: Final = os.O_CLOEXEC | os.O_NOFOLLOW

FILE_MODE: Final = 0o666
"""Message and lock files are as open as the process's umask allows, as kombu's were: the
processes that share a broker folder (workers, a dispatcher) may run as users of one group.
Another consumer opens a lock file read-only to test its ``flock`` (which needs no write
access), so a umask of 022 still lets it find a dead consumer."""


class Holder:
    """One consumer's folder, with the ``flock`` that says its owner is alive.

    The lock file is created and locked under a staging name, then renamed, so a lock file
    anyone can see is already locked; the folder is made after it and removed before it, so a
    folder without a lock file is never a living consumer's.
    """

    def __init__(self, root: Path) -> None:
        consumers = root / layout.CONSUMERS
        for _ in range(3):
            consumer_id = f"{os.getpid():x}-{os.urandom(6).hex()}"
            staging = consumers / f"{layout.STAGING_PREFIX}{consumer_id}{layout.LOCK_SUFFIX}"
            fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(staging, consumers / f"{consumer_id}{layout.LOCK_SUFFIX}")
            except OSError:  # a sweep took the staged file: try another id
                os.close(fd)
                continue
            break
        else:
            raise ChannelError(f"cannot register a consumer in {consumers}")
        self.id = consumer_id
        self.folder = consumers / consumer_id
        self.folder.mkdir()
        self.fd: int | None = fd
        self.pid = os.getpid()
        self._made: set[str] = set()
        _holders.add(self)

    @property
    def mine(self) -> bool:
        """Whether this process owns the folder (a forked child holds a copy that it does not)."""
        return self.fd is not None and self.pid == os.getpid()

    def held_folder(self, queue_folder: str) -> Path:
        """Where this consumer keeps the messages it took from the queue stored in
        ``queue_folder``."""
        folder = self.folder / queue_folder
        if queue_folder not in self._made:
            folder.mkdir(parents=True, exist_ok=True)
            self._made.add(queue_folder)
        return folder

    def forget(self, queue_folder: str) -> None:
        self._made.discard(queue_folder)

    def release(self, root: Path) -> None:
        """Move back what is left, remove the folder, then the lock file, then unlock."""
        if not self.mine:
            return
        restore_folder(root, self.folder)
        with suppress(OSError):
            self.folder.rmdir()
        with suppress(FileNotFoundError):
            os.unlink(self.folder.with_name(self.id + layout.LOCK_SUFFIX))
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            with suppress(OSError):
                os.close(self.fd)
            self.fd = None


_holders: "weakref.WeakSet[Holder]" = weakref.WeakSet()


def _forget_inherited_locks() -> None:
    """In a forked child: close the copies of the parent's lock descriptors, so the locks end
    when the parent dies (an ``flock`` lasts while any copy of its descriptor is open) and the
    child never acts as their owner."""
    for holder in list(_holders):
        if holder.pid != os.getpid():
            holder.close()


os.register_at_fork(after_in_child=_forget_inherited_locks)


def own_consumer_ids() -> set[str]:
    """The consumers this process runs: never checked (or restored) as dead ones."""
    return {holder.id for holder in list(_holders) if holder.mine}


def move_back(root: Path, source: Path, queue_folder: str) -> bool:
    """Move a taken message back into its queue, as redelivered; False if it is gone."""
    target_folder = root / layout.QUEUES / queue_folder
    target = target_folder / layout.redelivered_name(source.name)
    try:
        os.rename(source, target)
    except FileNotFoundError:
        if not source.exists():
            return False  # another consumer moved it first
        target_folder.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(source, target)
        except FileNotFoundError:
            return False
    return True


def restore_folder(root: Path, folder: Path) -> int:
    """Move every message in a consumer's ``folder`` back to its queue; how many moved."""
    moved = 0
    try:
        queue_folders = os.listdir(folder)
    except FileNotFoundError:
        return 0
    for queue_folder in queue_folders:
        held = folder / queue_folder
        try:
            names = os.listdir(held)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in sorted(names):
            moved += move_back(root, held / name, queue_folder)
        with suppress(OSError):
            held.rmdir()
    return moved


def recover_dead_consumers(root: Path) -> int:
    """Give the messages of every dead consumer back to their queues; how many moved.

    A consumer is dead when its lock file's ``flock`` can be taken. Several consumers may look
    at once: each message is moved by one rename, so by exactly one of them.
    """
    consumers = root / layout.CONSUMERS
    try:
        names = os.listdir(consumers)
    except FileNotFoundError:
        return 0
    own = own_consumer_ids()
    moved = 0
    locked = {
        name.removesuffix(layout.LOCK_SUFFIX)
        for name in names
        if name.endswith(layout.LOCK_SUFFIX) and not name.startswith(layout.STAGING_PREFIX)
    }
    for name in names:
        if name.startswith(layout.STAGING_PREFIX):
            _remove_stale(consumers / name, STALE_STAGING_S)
        elif name.endswith(layout.LOCK_SUFFIX):
            consumer_id = name.removesuffix(layout.LOCK_SUFFIX)
            if consumer_id not in own:
                moved += _recover_consumer(root, consumer_id)
        elif (
            name not in own
            and name not in locked
            and not (consumers / (name + layout.LOCK_SUFFIX)).exists()
        ):
            # a folder is made after its lock file and removed before it: without one, its
            # owner and whoever began to restore it are both gone
            moved += _restore_and_remove(root, consumers / name, name)
    incoming = root / layout.INCOMING
    with suppress(FileNotFoundError):
        for name in os.listdir(incoming):
            _remove_stale(incoming / name, STALE_INCOMING_S, lock=False)
    return moved


def _recover_consumer(root: Path, consumer_id: str) -> int:
    lock = root / layout.CONSUMERS / (consumer_id + layout.LOCK_SUFFIX)
    try:
        fd = os.open(lock, os.O_RDONLY | OPEN_FLAGS)  # flock needs no write access
    except FileNotFoundError:
        return 0
    except OSError as error:  # not ours to open: its owner's to restore when it starts again
        logger.debug("a consumer's lock cannot be opened", path=str(lock), error=str(error))
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # alive
        moved = _restore_and_remove(root, root / layout.CONSUMERS / consumer_id, consumer_id)
        if not (root / layout.CONSUMERS / consumer_id).exists():
            with suppress(FileNotFoundError):
                os.unlink(lock)
        return moved
    finally:
        os.close(fd)


def _restore_and_remove(root: Path, folder: Path, consumer_id: str) -> int:
    moved = restore_folder(root, folder)
    try:
        folder.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning(
            "a dead consumer's folder could not be removed", path=str(folder), error=str(error)
        )
    if moved:
        logger.warning(
            "messages of a dead consumer went back to their queues",
            consumer=consumer_id,
            messages=moved,
            folder=str(folder),
        )
    return moved


def _remove_stale(path: Path, age_s: float, *, lock: bool = True) -> None:
    try:
        if os.path.getmtime(path) > time.time() - age_s:
            return
        if not lock:
            os.unlink(path)
            return
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
