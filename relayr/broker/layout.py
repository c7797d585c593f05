"""Where the embedded broker keeps what, and how a message file is named (no kombu, no I/O).

Everything lives in one folder (``RELAYR_HOME/broker``), so every rename is atomic (ADR-0013):

- ``queues/<queue>/``: waiting messages, named by priority and enqueue time, so a sorted
  listing is FIFO within a priority, and the highest priority comes first;
- ``incoming/``: where a publisher writes a message before renaming it into its queue;
- ``consumers/<id>.lock`` and ``consumers/<id>/<queue>/``: a live consumer's ``flock`` and the
  messages it took and has not acknowledged;
- ``dead/<queue>/``: messages set aside for a person, never delivered again;
- ``exchanges/``: kombu's bindings, read by every process.

A message that comes back to its queue keeps its time (it is taken next) and gets
:data:`REDELIVERED_SUFFIX`, so its next delivery says ``redelivered``.
"""

import hashlib
import os
import time
from itertools import count
from pathlib import Path
from typing import Final
from urllib.parse import quote

QUEUES: Final = "queues"
INCOMING: Final = "incoming"
CONSUMERS: Final = "consumers"
DEAD: Final = "dead"
EXCHANGES: Final = "exchanges"
FOLDERS: Final = (QUEUES, INCOMING, CONSUMERS, DEAD, EXCHANGES)

MESSAGE_SUFFIX: Final = ".msg"
REDELIVERED_SUFFIX: Final = ".redelivered.msg"
LOCK_SUFFIX: Final = ".lock"
LOWER_PRIORITY_PREFIX: Final = "p"
"""Starts the name of a message of a priority below the highest: it sorts after every name
that starts with a digit (the enqueue time of the highest's)."""
STAGING_PREFIX: Final = "."
"""A consumer's lock file is created under a name starting with this, locked, then renamed to
its public name: a lock file anyone can see is already locked by its living owner."""

MAX_QUEUE_FOLDER_NAME: Final = 200
"""Longer queue names are cut and suffixed with a digest, under the usual 255-byte file name
limit."""

_sequence = count()


def queue_folder_name(queue: str) -> str:
    """The folder name of ``queue``: the name itself when it is plain, else percent-encoded.

    Distinct queues always get distinct names (a digest keeps long ones apart), and no name can
    leave its parent folder (``/``, ``.``, ``..`` are encoded).
    """
    name = quote(queue, safe="@_-.")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if not name:
        name = "%00"
    if len(name) > MAX_QUEUE_FOLDER_NAME:
        digest = hashlib.sha256(queue.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        # "%%" never appears in a percent-encoded name, so a cut name meets no plain one
        name = f"{name[: MAX_QUEUE_FOLDER_NAME - 18]}%%{digest}"
    return name


def message_name(now_ns: int | None = None, *, priority: int = 0) -> str:
    """A new message file's name: enqueue time first, so a sorted listing is FIFO; a message of
    a lower ``priority`` (1 to 9, as Redis's: 0 is the highest) is named after every message of
    a higher one, :data:`LOWER_PRIORITY_PREFIX` and its digit first."""
    enqueued_ns = time.time_ns() if now_ns is None else now_ns
    name = f"{enqueued_ns:020d}-{os.getpid():x}-{next(_sequence):x}-{os.urandom(3).hex()}.msg"
    if priority <= 0:
        return name
    return f"{LOWER_PRIORITY_PREFIX}{min(priority, 9)}-{name}"


def is_message(name: str) -> bool:
    """Whether a file in a queue folder is a message: any file but a hidden one."""
    return not name.startswith(".")


def is_redelivered(name: str) -> bool:
    return name.endswith(REDELIVERED_SUFFIX)


def redelivered_name(name: str) -> str:
    """The name a message file gets when it goes back to its queue: same time, same place."""
    if is_redelivered(name):
        return name
    if name.endswith(MESSAGE_SUFFIX):
        name = name[: -len(MESSAGE_SUFFIX)]
    return name + REDELIVERED_SUFFIX


def queues_folder(root: Path) -> Path:
    return root / QUEUES


def queue_path(root: Path, queue: str) -> Path:
    return root / QUEUES / queue_folder_name(queue)


def dead_path(root: Path, queue: str) -> Path:
    return root / DEAD / queue_folder_name(queue)


def count_messages(folder: Path) -> int:
    """How many message files ``folder`` holds (0 if it does not exist)."""
    try:
        return sum(1 for name in os.listdir(folder) if is_message(name))
    except FileNotFoundError:
        return 0
