"""The markers that keep ``make test-fast`` free of processes and servers hold: a test that
starts a process without saying so fails, and one that takes a server is marked for it."""

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
    """What the collection hook reads of a test: its fixtures, and the markers it adds."""

    def __init__(self, *fixtures: str) -> None:
        self.fixturenames = fixtures
        self.markers: list[str] = []

    def add_marker(self, marker: str) -> None:
        self.markers.append(marker)


def test_a_test_that_takes_a_server_is_marked_for_it() -> None:
    items = [
        Collected("tmp_path", "redis_url"),
        Collected("migrated_postgres_url", "redis_server"),
        Collected("postgres_url"),
        Collected("tmp_path"),
    ]
    suite.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.markers for item in items] == [["redis"], ["postgres", "redis"], ["postgres"], []]
