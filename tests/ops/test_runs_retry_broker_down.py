"""``relayr runs retry`` with the broker down: one line, exit 1, the run left for the dispatcher.

A dead run is made as ops would meet it (the ops test application's ``ops:backup-check``, on
SQLite, executed by a real worker and dispatcher on a Redis of the test's own). Then that Redis
is killed and ops retry the run: the command tries the broker a few times, says in one line on
stderr which broker is down and that the dispatcher will enqueue the run, exits 1, and leaves
the run retried in reflexr (``pending``, due) with nothing else changed: no other run, no
message, no message in the broker. With Redis back, a dispatcher and a worker run it.
"""

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kombu.exceptions import EncodeError
from kombu.exceptions import OperationalError as KombuOperationalError

from relayr.cli.runs import BROKER_TRIES
from relayr.runtime.transient import is_transient
from tests.faults.private_redis import PrivateRedis
from tests.ops.ops_app import FIXED
from tests.ops.test_ops_worker import GRANTED, WHERE, ended, runs
from tests.workers import (
    relayr_environment,
    relayr_here,
    relayr_output,
    running_dispatcher,
    running_worker,
)

RULE = "ops:backup-check"

COMMAND_LIMIT_S = 60.0
"""A bound on the whole command (Python's start, opening SQLite, the broker's tries): far above
the few seconds the tries take, far below a retry loop that never gives up."""


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (KombuOperationalError("Error 111 connecting to 127.0.0.1:1. Connection refused."), True),
        (ConnectionRefusedError(111, "Connection refused"), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError("timed out"), True),
        (EncodeError("cannot encode"), False),
        (PermissionError(13, "Permission denied"), False),
        (ValueError("bad"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_only_a_connection_fault_is_tried_again(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def every_run(environment: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in runs(environment, "--limit", "1000")}


@pytest.mark.worker
@pytest.mark.slow
def test_a_retry_with_the_broker_down_leaves_the_run_pending_for_the_dispatcher(
    tmp_path: Path, redis_server: PrivateRedis
) -> None:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(GRANTED)
    environment = relayr_environment(
        tmp_path,
        app="tests.ops.ops_app:create_ops_app",
        allowlist=allowlist,
        broker_url=redis_server.url,
        lease_ttl_s=2.0,
    )
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", "backups")["id"]
    data = json.dumps({"thread_id": thread})
    with running_worker(environment, tmp_path), running_dispatcher(environment, tmp_path):
        relayr_here(environment, "publish", WHERE, "opsw:backup", "--data", data)
        [dead] = ended(environment, RULE, "dead")
        # a second run that succeeds: it must be left as it is
        (tmp_path / FIXED).touch()
        relayr_here(environment, "publish", WHERE, "opsw:backup", "--data", data)
        ended(environment, RULE, "succeeded")
        (tmp_path / FIXED).unlink()

    before = every_run(environment)
    transcript_before = relayr_here(environment, "thread", "show", WHERE, thread)
    report_before = relayr_here(environment, "runs", "show", dead["id"])
    assert before[dead["id"]]["status"] == "dead"

    redis_server.kill()
    started = time.monotonic()
    done = relayr_output(
        environment, "runs", "retry", dead["id"], check=False, timeout_s=COMMAND_LIMIT_S * 2
    )
    elapsed_s = time.monotonic() - started
    print(json.dumps({"retry_with_broker_down_s": round(elapsed_s, 2)}))

    assert done.returncode == 1, done.stderr + done.stdout
    assert done.stderr.splitlines() == [
        f"Error: broker {redis_server.url} is unavailable: retried in reflexr but not enqueued: "
        f"{dead['id']} ({WHERE}); the dispatcher will enqueue it once it reaches the broker"
    ]
    [result, summary] = done.stdout.splitlines()
    assert result.startswith(f"ok      {dead['id']} ({WHERE}): retried, not enqueued (broker ")
    assert f"is unreachable after {BROKER_TRIES} tries: OperationalError: " in result
    assert result.endswith("; the dispatcher will enqueue it")
    assert summary == "1 done, 0 refused"
    assert elapsed_s < COMMAND_LIMIT_S

    after = every_run(environment)
    retried = after.pop(dead["id"])
    assert (retried["status"], retried["attempts"]) == ("pending", 0), retried
    assert datetime.fromisoformat(retried["next_attempt_at"]) <= datetime.fromisoformat(
        retried["updated_at"]
    ), "the retried run is due at once"
    assert after == {key: row for key, row in before.items() if key != dead["id"]}
    assert relayr_here(environment, "thread", "show", WHERE, thread) == transcript_before
    report_after = relayr_here(environment, "runs", "show", dead["id"])
    assert report_after["attempts"] == report_before["attempts"]
    assert report_after["emissions"] == report_before["emissions"]

    redis_server.start()
    queued = redis_server.client().llen(environment["RELAYR_QUEUE"])
    assert queued == 0, "nothing was enqueued while the broker was down"

    (tmp_path / FIXED).touch()
    with running_worker(environment, tmp_path), running_dispatcher(environment, tmp_path):
        ended(environment, RULE, "succeeded", count=2)
    report = relayr_here(environment, "runs", "show", dead["id"])
    assert [a["outcome"] for a in report["attempts"]] == ["failed", "dead", "succeeded"]
    notices = [
        entry
        for entry in relayr_here(environment, "thread", "show", WHERE, thread)
        if entry["author"] == f"external_agent:reflexr:{RULE}"
    ]
    assert [n["content"] for n in notices] == ["checking the nightly backup"] * 2  # one per run
