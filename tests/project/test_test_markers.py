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
    """What the collection hook reads of a test: its module, fixtures and markers."""

    def __init__(self, path: str, *fixtures: str, slow: bool = False) -> None:
        self.path = path
        self.fixturenames = fixtures
        self.markers: list[str] = ["slow"] if slow else []

    def add_marker(self, marker: str) -> None:
        self.markers.append(marker)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.markers else None


def test_a_test_that_takes_a_server_is_marked_for_it() -> None:
    items = [
        Collected("a.py", "tmp_path", "redis_url"),
        Collected("a.py", "migrated_postgres_url", "redis_server"),
        Collected("a.py", "postgres_url"),
        Collected("a.py", "tmp_path"),
    ]
    suite.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.markers for item in items] == [["redis"], ["postgres", "redis"], ["postgres"], []]


def test_modules_with_more_slow_tests_come_first_each_in_its_own_order() -> None:
    quick = [Collected("quick.py", "one"), Collected("quick.py", "two")]
    one_slow = [Collected("one.py", "one", slow=True), Collected("one.py", "two")]
    two_slow = [Collected("two.py", "one", slow=True), Collected("two.py", "two", slow=True)]
    items = [*quick, *one_slow, *two_slow]
    suite.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert items == [*two_slow, *one_slow, *quick]
