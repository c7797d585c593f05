"""The embedded broker's tests: a folder and a connection of each test's own."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection, Queue

from tests.broker.broker_files import QUEUE, connect


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The embedded broker's folder of this test's own, not made yet."""
    return tmp_path / "broker"


@pytest.fixture
def conn(folder: Path) -> Iterator[Connection]:
    """A connection on the embedded broker in ``folder``, its test queue declared."""
    with connect(folder) as connection:
        Queue(QUEUE, routing_key=QUEUE)(connection.default_channel).declare()
        yield connection
