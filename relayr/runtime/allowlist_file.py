"""The allowlist file a worker runs with: read, and reloaded when it changes.

The policy and parsing are pure (:mod:`relayr.core.allowlist`); this is their I/O. A reload of
a file gone bad keeps the last good one in force, so a typo never widens or empties what rules
may do. A worker checks the file at most every :data:`CHECK_INTERVAL_S` when a run acts; no
signal reloads it (a Celery main process takes SIGHUP as a restart).
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import FILE_KEY, parse_allowlist_bytes
from relayr.core.errors import InvalidAllowlist, Problem

CHECK_INTERVAL_S: Final = 1.0
"""How often a worker looks at the file's stamp: a saved change is in force within a second,
for the cost of one ``stat`` per second per process."""

logger = logging.getLogger("relayr.allowlist")


def load_allowlist(path: str | os.PathLike[str]) -> Allowlists:
    """Read and parse an allowlist file; an unreadable one is ``InvalidAllowlist`` too."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise InvalidAllowlist(source, [Problem(FILE_KEY, "cannot read: no such file")]) from None
    except PermissionError:
        raise InvalidAllowlist(
            source, [Problem(FILE_KEY, "cannot read: permission denied")]
        ) from None
    except IsADirectoryError:
        raise InvalidAllowlist(
            source, [Problem(FILE_KEY, "cannot read: it is a directory")]
        ) from None
    except OSError as error:
        reason = (error.strerror or type(error).__name__).lower()
        raise InvalidAllowlist(source, [Problem(FILE_KEY, f"cannot read: {reason}")]) from None
    return parse_allowlist_bytes(raw, source=source)


class AllowlistFile:
    """The allowlist file a worker runs with, reloaded when it changes.

    ``current()`` stats the file at most every ``check_interval_s`` and re-parses it when its
    (mtime_ns, size, inode) changed, so permissions are checked when a run acts, not when it was
    queued. A file that became invalid or unreadable is reported once per version through
    ``on_invalid`` and the last good allowlist stays in force. ``reload()`` checks now, and
    reports a bad file again. A file that is invalid at start raises
    ``InvalidAllowlist``: a clear start-up error, never a silent empty allowlist.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        check_interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        on_invalid: Callable[[InvalidAllowlist], None] | None = None,
        on_reload: Callable[[Allowlists], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._on_invalid = on_invalid if on_invalid is not None else _log_invalid
        self._on_reload = on_reload if on_reload is not None else _log_reload
        self._lock = threading.RLock()
        self._seen = _stamp(self.path)
        self._current = load_allowlist(self.path)
        self._last_error: InvalidAllowlist | None = None
        self._checked_at = clock()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        check_interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        on_invalid: Callable[[InvalidAllowlist], None] | None = None,
        on_reload: Callable[[Allowlists], None] | None = None,
    ) -> "AllowlistFile":
        """Load the file now; raise ``InvalidAllowlist`` if it is unreadable or invalid."""
        return cls(
            path,
            check_interval_s=check_interval_s,
            clock=clock,
            on_invalid=on_invalid,
            on_reload=on_reload,
        )

    @property
    def last_error(self) -> InvalidAllowlist | None:
        """Why the file on disk is not in force, while it is bad; ``None`` once it is good."""
        return self._last_error

    def current(self) -> Allowlists:
        """The allowlist in force, after a cheap check for a changed file when one is due."""
        with self._lock:
            now = self._clock()
            if now - self._checked_at >= self.check_interval_s:
                self._checked_at = now
                self._check(force=False)
            return self._current

    def reload(self) -> Allowlists:
        """Check the file now, even if it looks unchanged; return the allowlist in force."""
        with self._lock:
            self._checked_at = self._clock()
            self._check(force=True)
            return self._current

    def _check(self, *, force: bool) -> None:
        stamp = _stamp(self.path)
        if stamp == self._seen and not force:
            return
        self._seen = stamp
        try:
            allowlists = load_allowlist(self.path)
        except InvalidAllowlist as error:
            self._last_error = error
            self._on_invalid(error)
            return
        except Exception as error:  # a running worker keeps its last good allowlist, whatever
            unreadable = Problem(FILE_KEY, f"cannot read: {type(error).__name__}: {error}")
            self._last_error = InvalidAllowlist(str(self.path), [unreadable])
            self._on_invalid(self._last_error)
            return
        self._current = allowlists
        self._last_error = None
        self._on_reload(allowlists)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size, status.st_ino


def _log_invalid(error: InvalidAllowlist) -> None:
    problems = "; ".join(str(problem) for problem in error.problems)
    logger.error(
        "allowlist %s is invalid, the last good one stays in force: %s", error.source, problems
    )


def _log_reload(allowlists: Allowlists) -> None:
    logger.info("allowlist %s reloaded", allowlists.source)
