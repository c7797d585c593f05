"""``relayr run``'s restart policy, as tables: the wait between restarts, and how an exit reads.

The wait doubles with each exit in a row up to its bound, and a worker that stayed up long
enough counts as a first exit again; an exit names its code or its signal. Pure: no process runs.
"""

import signal
from datetime import UTC, datetime

import pytest

from relayr.observe.health import WorkerExit
from relayr.runtime.supervisor import RestartPolicy


@pytest.mark.parametrize(
    ("exits_in_a_row", "delay_s"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (7, 30.0), (10_000, 30.0)],
)
def test_the_wait_doubles_up_to_its_bound(exits_in_a_row: int, delay_s: float) -> None:
    assert RestartPolicy(first_s=1.0, max_s=30.0).delay_s(exits_in_a_row) == delay_s


@pytest.mark.parametrize(
    ("before", "uptime_s", "after"),
    [(0, 0.5, 1), (3, 0.5, 4), (3, 59.9, 4), (3, 60.0, 1), (7, 3600.0, 1)],
)
def test_a_worker_that_stayed_up_counts_as_a_first_exit_again(
    before: int, uptime_s: float, after: int
) -> None:
    assert RestartPolicy(stable_after_s=60.0).exits_in_a_row(before, uptime_s) == after


def test_an_exit_names_its_code_or_its_signal() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    killed = WorkerExit.of(-signal.SIGKILL, at=at, uptime_s=3.25)
    assert (killed.code, killed.signal) == (None, "SIGKILL")
    assert killed.describe() == "killed by SIGKILL after 3.25 s up"
    assert WorkerExit.of(1, at=at, uptime_s=0.0).describe() == "exited with code 1 after 0 s up"
