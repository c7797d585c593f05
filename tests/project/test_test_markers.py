"""The markers that keep ``make test-fast`` free of processes and servers hold: a test that
starts a process without saying so fails, and one that takes a server is marked for it; the
modules whose markers say they cost most are collected first."""

import subprocess
import sys

import pytest

import tests.conftest as suite


def test_a_test_not_marked_to_start_processes_fails_when_it_starts_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(suite, "_may_start_processes", False)
    with pytest.raises(AssertionError, match="not marked `process` or `worker`"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.process
def test_a_test_marked_process_starts_one() -> None:
    assert subprocess.run([sys.executable, "-c", "pass"], check=True).returncode == 0


class Collected:
    """What the collection hook reads of a test: its id, its fixtures and markers, and the
    markers it adds."""

    def __init__(self, *fixtures: str, nodeid: str = "tests/a.py::t", marked: str = "") -> None:
        self.nodeid = nodeid
        self.fixturenames = fixtures
        self.markers: list[str] = [marked] if marked else []

    def add_marker(self, marker: str) -> None:
        self.markers.append(marker)

    def iter_markers(self, name: str) -> list[str]:
        return [marker for marker in self.markers if marker == name]


def test_a_test_that_takes_a_server_is_marked_for_it() -> None:
    items = [
        Collected("tmp_path", "redis_url"),
        Collected("migrated_postgres_url", "redis_server"),
        Collected("postgres_url"),
        Collected("tmp_path"),
    ]
    suite.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.markers for item in items] == [["redis"], ["postgres", "redis"], ["postgres"], []]


def test_the_modules_that_start_workers_are_collected_first_each_as_written() -> None:
    items = [
        Collected(nodeid="tests/fast.py::one"),
        Collected(nodeid="tests/fast.py::two"),
        Collected(nodeid="tests/fast.py::three"),
        Collected(nodeid="tests/commands.py::one", marked="process"),
        Collected(nodeid="tests/workers.py::one"),
        Collected(nodeid="tests/workers.py::two", marked="worker"),
    ]
    suite.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.nodeid for item in items] == [
        "tests/workers.py::one",
        "tests/workers.py::two",
        "tests/commands.py::one",
        "tests/fast.py::one",
        "tests/fast.py::two",
        "tests/fast.py::three",
    ]
