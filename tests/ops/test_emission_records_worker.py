"""Every send leaves its emission record, whatever becomes of its run: on real processes.

The rule ``ops:send-then-die`` (:mod:`tests.ops.ops_app`) sends its message with the real
``Runner.send`` and then kills its own pool process, so no attempt of its run ever completes.
Then ops end the run: cancelled while its dead attempt still holds it, or, once the redelivery
bound failed it ``worker_lost``, skipped. ``relayr runs show`` must list exactly one validated
record for each attempt that sent (the first ``posted``); before records rode their sends, it
listed none, as they waited for a completion that never came (ADR-0103).

``relayr dispatch`` and a ``celery worker`` run as subprocesses on the embedded broker, the test
drives them with the commands a person types: ops' ``runs cancel`` and ``runs skip`` as
processes of their own, the others in its own process (:func:`tests.workers.relayr_here`);
storage is SQLite and PostgreSQL.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ops.ops_app import DIE_CONTENT
from tests.ops.test_ops_worker import WAIT_S, WHERE, by, ended, runs
from tests.workers import (
    relayr_environment,
    relayr_here,
    relayr_json,
    running_dispatcher,
    running_worker,
    until,
)

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(900)]
"""Far above what a scenario needs: each step is a command a person types, a few seconds each
on a busy machine; a hang still fails the test."""

RULE = "ops:send-then-die"
AUTHOR = f"external_agent:reflexr:{RULE}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest) -> dict[str, object]:
    if request.param == "postgres":
        return {"database_url": request.getfixturevalue("postgres_url")}
    return {}


def environment(tmp_path: Path, database: dict[str, object], **settings: object) -> dict[str, str]:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(f'[rules."{RULE}"]\nturns = true\n')
    return relayr_environment(
        tmp_path,
        app="tests.ops.ops_app:create_ops_app",
        allowlist=allowlist,
        **database,
        **settings,
    )


def sent_messages(env: dict[str, str], thread: str) -> list[dict[str, Any]]:
    """The rule's messages in ``thread`` (``relayr thread show``, in this process: a test polls
    it)."""
    return by(AUTHOR, relayr_here(env, "thread", "show", WHERE, thread))


def check_records(env: dict[str, str], run_id: str, thread: str) -> list[dict[str, Any]]:
    """The run's records as ``runs show`` reads them (each validated as it is read)."""
    [message] = sent_messages(env, thread)
    assert (message["kind"], message["content"]) == ("message", DIE_CONTENT)
    records: list[dict[str, Any]] = relayr_here(env, "runs", "show", run_id)["emissions"]
    assert records, "the send left no emission record"
    assert all(r["message_id"] == message["id"] for r in records)
    attempts = [r["attempt"] for r in records]
    assert len(attempts) == len(set(attempts)), f"an attempt recorded twice: {records}"
    first = records[0]
    assert (first["attempt"], first["kind"], first["policy"], first["outcome"]) == (
        1,
        "message",
        "turn",
        "posted",
    )
    assert all(r["outcome"] == "asked" for r in records[1:]), records
    return records


def test_a_send_whose_worker_died_and_whose_run_ops_cancelled_keeps_its_record(
    tmp_path: Path, database: dict[str, object]
) -> None:
    env = environment(tmp_path, database)
    thread = relayr_here(env, "thread", "create", WHERE, "--title", "disk")["id"]
    with running_worker(env, tmp_path) as worker, running_dispatcher(env, tmp_path):
        relayr_here(
            env, "publish", WHERE, "opsw:disk_full", "--data", json.dumps({"thread_id": thread})
        )
        until("the send's message", lambda: sent_messages(env, thread) or None, timeout_s=WAIT_S)
        [running] = until(
            "the run, running", lambda: runs(env, "--rule", RULE) or None, timeout_s=WAIT_S
        )
        # redeliveries may have begun other attempts meanwhile, dying as the first did
        assert running["status"] in ("running", "retrying", "pending", "dead"), running
        relayr_json(env, "runs", "cancel", running["id"])
        [cancelled] = ended(env, RULE, "cancelled")
        assert worker.alive()  # the pool process died, not the worker

    records = check_records(env, running["id"], thread)
    assert len(records) <= cancelled["attempts"]


def test_a_send_whose_run_failed_worker_lost_and_ops_skipped_keeps_its_records(
    tmp_path: Path, database: dict[str, object]
) -> None:
    env = environment(tmp_path, database, lease_ttl_s=2.0, max_redeliveries=1)
    thread = relayr_here(env, "thread", "create", WHERE, "--title", "disk")["id"]
    with running_worker(env, tmp_path), running_dispatcher(env, tmp_path):
        relayr_here(
            env, "publish", WHERE, "opsw:disk_full", "--data", json.dumps({"thread_id": thread})
        )
        [dead] = ended(env, RULE, "dead")
        assert dead["reason"] in ("worker_lost", "abandoned"), dead
        relayr_json(env, "runs", "skip", dead["id"], "--reason", "disk replaced")
        ended(env, RULE, "skipped")

    check_records(env, dead["id"], thread)
