"""The embedded broker as its tests use it: a folder connected to, published to, taken from, read.

:func:`connect` opens a kombu connection on relayr's filesystem transport in a folder of the
test's own; :func:`publish` and :func:`take` go through kombu's API, while :func:`waiting`,
:func:`held` and :func:`set_aside` read the folder's files (:mod:`relayr.broker.layout`) to see
where each message is. The ``folder`` and ``conn`` fixtures (tests/conftest.py) build on them.
"""

import os
from pathlib import Path
from typing import Any

from kombu import Connection, Producer

from relayr.broker import FILESYSTEM_TRANSPORT, layout

QUEUE = "relayr.test.broker"


def connect(folder: Path) -> Connection:
    return Connection(
        "filesystem://localhost/",
        transport=FILESYSTEM_TRANSPORT,
        transport_options={"folder": str(folder)},
    )


def publish(conn: Connection, *bodies: object, queue: str = QUEUE) -> None:
    producer = Producer(conn.default_channel, serializer="json")
    for each in bodies:
        producer.publish(each, exchange="", routing_key=queue)


def take(conn: Connection, queue: str = QUEUE) -> Any:
    return conn.default_channel.basic_get(queue)


def waiting(folder: Path, queue: str = QUEUE) -> list[str]:
    return sorted(os.listdir(layout.queue_path(folder, queue)))


def held(folder: Path) -> list[Path]:
    """The messages consumers hold (their lock files aside)."""
    return [
        path
        for path in (folder / layout.CONSUMERS).rglob("*")
        if path.is_file() and path.parent != folder / layout.CONSUMERS
    ]


def set_aside(folder: Path) -> list[Path]:
    return sorted(path for path in (folder / layout.DEAD).rglob("*") if path.is_file())
