"""How the embedded broker's consumer waits between looks at its queues (ADR-0095).

:class:`NotifiedWait` (Linux): woken by inotify the moment a file is renamed (a publish, a
requeue, a dead consumer's message given back) or written into a consumed queue's folder.
:class:`PolledWait` (no inotify): woken only by :meth:`Wait.wake`. Both are woken by
:meth:`Wait.wake` from any thread (a settled message may lift the prefetch limit). Neither is
trusted alone: the transport still looks once per polling interval, so a notification that
never comes costs at most that.
"""

import os
import select
import threading
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

logger = structlog.get_logger("relayr.broker")

READ_CHUNK: Final = 65536
"""Bytes read from the wake pipe at once: any number of wakes is one."""


class Wait(Protocol):
    """What the transport waits on between looks at its queues."""

    def watch(self, folders: Iterable[Path]) -> bool:
        """Watch exactly these queue folders from now on; whether the set changed (then the
        caller looks at once: a folder newly watched may already hold messages)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block until woken or notified, at most ``timeout_s``; whether something happened.
        What woke it is consumed: the next call waits again."""
        ...

    def wake(self) -> None:
        """End the current or next :meth:`wait` early; safe from any thread."""
        ...

    def close(self) -> None: ...


class PolledWait:
    """Waits on a :class:`threading.Event` alone: woken only by :meth:`wake`."""

    def __init__(self) -> None:
        self._woken = threading.Event()
        self._folders: frozenset[Path] = frozenset()

    def watch(self, folders: Iterable[Path]) -> bool:
        wanted = frozenset(folders)
        changed = wanted != self._folders
        self._folders = wanted
        return changed

    def wait(self, timeout_s: float) -> bool:
        woken = self._woken.wait(max(0.0, timeout_s))
        self._woken.clear()
        return woken

    def wake(self) -> None:
        self._woken.set()

    def close(self) -> None:
        pass


class NotifiedWait:
    """Waits on an inotify instance watching the consumed queue folders, and on a pipe that
    :meth:`wake` writes to.

    Raises:
        OSError: From the constructor, when inotify cannot be had (no such system call, the
            user's instances used up); :func:`open_wait` falls back to polling then.
    """

    def __init__(self) -> None:
        from inotify_simple import INotify, flags

        self._mask: int = flags.MOVED_TO | flags.CLOSE_WRITE | flags.ONLYDIR
        self._ignored: int = flags.IGNORED
        self._inotify: Any = INotify(nonblocking=True)
        try:
            self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._inotify.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._inotify.fileno(), select.POLLIN)
        self._poller.register(self._wake_read, select.POLLIN)
        self._closing = threading.Lock()
        self._closed = False
        self._wanted: frozenset[Path] = frozenset()
        self._watches: dict[Path, int] = {}
        self._unwatched: set[Path] = set()

    def watch(self, folders: Iterable[Path]) -> bool:
        wanted = frozenset(folders)
        changed = wanted != self._wanted
        self._wanted = wanted
        for folder in [folder for folder in self._watches if folder not in wanted]:
            with suppress(OSError):  # gone with its folder already
                self._inotify.rm_watch(self._watches.pop(folder))
        for folder in wanted - self._watches.keys():
            try:
                self._watches[folder] = self._inotify.add_watch(folder, self._mask)
            except OSError as error:
                if folder not in self._unwatched:  # one line per folder, not one per look
                    self._unwatched.add(folder)
                    logger.warning(
                        "a queue folder is polled, not watched",
                        folder=str(folder),
                        error=str(error),
                    )
            else:
                # watched again (after its folder went away, say): it may hold messages already
                changed = True
                self._unwatched.discard(folder)
        return changed

    def wait(self, timeout_s: float) -> bool:
        ready = self._poller.poll(max(0.0, timeout_s) * 1000.0)
        if not ready:
            return False
        with suppress(BlockingIOError):
            while os.read(self._wake_read, READ_CHUNK):
                pass
        for event in self._inotify.read(timeout=0):
            if event.mask & self._ignored:  # the folder went away: watched again when it is back
                for folder, descriptor in list(self._watches.items()):
                    if descriptor == event.wd:
                        del self._watches[folder]
        return True

    def wake(self) -> None:
        with self._closing:  # never a write to a descriptor closed, and maybe reused, meanwhile
            if self._closed:
                return
            with suppress(OSError):  # BlockingIOError: a full pipe is a wake already pending
                os.write(self._wake_write, b"\0")

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self._inotify.close()
        for descriptor in (self._wake_read, self._wake_write):
            with suppress(OSError):
                os.close(descriptor)


def open_wait() -> Wait:
    """A :class:`NotifiedWait` where inotify works, else a :class:`PolledWait` (with one log
    line saying why, so an operator knows new messages wait up to one polling interval)."""
    try:
        return NotifiedWait()
    except (ImportError, OSError, AttributeError) as error:
        # ImportError: not Linux (the dependency is Linux's only); AttributeError: a C library
        # without inotify; OSError: inotify_init1 refused (ENOSYS, EMFILE: instances used up)
        logger.warning("the embedded broker polls: inotify is unavailable", error=str(error))
        return PolledWait()
