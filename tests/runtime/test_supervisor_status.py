"""The supervisor's status file, and what ``relayr health`` makes of it.

A status reads back as written (no partial file left); a file that is not a status is unhealthy
and named; health is unhealthy while the worker is down, and ignores a status too old to be
``relayr run``'s. On files in the test's folder: no process runs.
"""

import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from relayr.observe.health import (
    SupervisorStatus,
    WorkerExit,
    check_supervisor,
    read_status,
    status_path,
    write_status,
)


def status(**fields: Any) -> SupervisorStatus:
    values: dict[str, Any] = {
        "supervisor_pid": 10,
        "state": "running",
        "worker_pid": 11,
        "since": "2026-01-01T00:00:00+00:00",
    }
    return SupervisorStatus(**{**values, **fields})


def test_a_status_reads_back_as_written(tmp_path: Path) -> None:
    path = status_path(tmp_path)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    written = status(
        state="restarting",
        restarts=3,
        next_start_at="2026-01-01T00:00:30+00:00",
        last_exit=WorkerExit.of(-signal.SIGKILL, at=at, uptime_s=1.0),
    )
    write_status(path, written)
    found = read_status(path)
    assert found is not None
    assert found[0] == written
    assert found[1] < 60
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "is not a supervisor status"),
        ("[]", "not a JSON object"),
        ('{"schema": 99}', "schema 99 is not 1"),
        (
            '{"schema": 1, "supervisor_pid": 1, "state": "dozing", "worker_pid": 2, "since": ""}',
            "state 'dozing' is unknown",
        ),
        ('{"schema": 1, "state": "running"}', "missing"),
    ],
)
def test_a_status_file_that_is_not_one_is_unhealthy_and_named(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = status_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    found = check_supervisor(tmp_path, max_age_s=60)
    assert found is not None
    check, data = found
    assert not check.ok
    assert problem in check.detail
    assert str(path) in check.detail
    assert data is None


def test_health_is_unhealthy_while_the_worker_is_down_and_ignores_a_stale_status(
    tmp_path: Path,
) -> None:
    assert check_supervisor(tmp_path, max_age_s=60) is None  # no relayr run: nothing to say
    path = status_path(tmp_path)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    exited = WorkerExit.of(-signal.SIGKILL, at=at, uptime_s=5.0)
    write_status(path, status(state="restarting", last_exit=exited, next_start_at="soon"))
    found = check_supervisor(tmp_path, max_age_s=60)
    assert found is not None
    check, data = found
    assert not check.ok
    assert check.detail.startswith("the worker is down: worker pid 11 killed by SIGKILL")
    assert data is not None
    assert data["state"] == "restarting"

    write_status(path, status(restarts=1, last_exit=exited))
    found = check_supervisor(tmp_path, max_age_s=60)
    assert found is not None
    assert found[0].ok
    assert "restarts: 1" in found[0].detail

    write_status(path, status(state="restarting", last_exit=exited))
    old = time.time() - 120
    os.utime(path, (old, old))
    found = check_supervisor(tmp_path, max_age_s=60)
    assert found is not None
    assert found[0].ok
    assert "relayr run is gone or hung" in found[0].detail
