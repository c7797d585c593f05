"""Operators and ops on real processes: (a) a dead run retried posts one notice, (b) a send
killed between commit and ask gets one message and one turn, (c) ``allowlist explain`` names
the entry that granted, (d) revoking turns stops the next send while a broken file changes
nothing, (e) ``allowlist check`` names every problem with its key.

Every step is the command a person would type: ``relayr dispatch`` and a ``celery worker`` run
as subprocesses, and the test drives them with ``relayr publish``, ``relayr thread``,
``relayr runs`` and ``relayr allowlist``, reading their ``--json`` output. The operators'
actions (``runs retry``) and ``allowlist check`` run as processes of their own, as typed; the
rest runs in the test's own process (:func:`tests.workers.relayr_here`), which spares a Python
start each. Storage is SQLite
and PostgreSQL; the broker is the embedded one, or Redis where the scenario kills a worker.
"""

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relayr.cli import cli
from relayr.cli.processes import RelayrProcess
from tests.ops.ops_app import CRASH_CONTENT, FIXED
from tests.services import forgetting_redis_queue
from tests.workers import (
    log_records,
    relayr_environment,
    relayr_here,
    relayr_json,
    relayr_output,
    running_dispatcher,
    running_worker,
    until,
)

pytestmark = [pytest.mark.worker, pytest.mark.slow]

WHERE = "acme/ops"
WAIT_S = 90.0
"""How long a run may take to reach the state a step waits for; far above what it needs."""

GRANTED = '[rules."ops:crash-send"]\nturns = true\n[rules."ops:incident-triage"]\nturns = true\n'
REVOKED = '[rules."ops:crash-send"]\nturns = true\n[rules."ops:incident-triage"]\n'
BROKEN = '[rules."ops:incident-triage"]\nturns = "yes"\nwake = true\n[namespaces.reflexr]\n'


def runs(environment: dict[str, str], *filters: str) -> list[dict[str, Any]]:
    """``relayr runs list`` of the workspace, in this process: tests poll it."""
    found: list[dict[str, Any]] = relayr_here(
        environment, "runs", "list", "--workspace", WHERE, *filters
    )
    return found


def ended(
    environment: dict[str, str],
    rule: str,
    status: str,
    *processes: RelayrProcess,
    count: int = 1,
) -> list[Any]:
    """The runs of ``rule`` in ``status`` once there are ``count``; a timeout shows the logs of
    ``processes``."""

    def probe() -> list[Any] | None:
        found = runs(environment, "--rule", rule, "--status", status)
        return found if len(found) >= count else None

    return until(f"{count} {status} run(s) of {rule}", probe, *processes, timeout_s=WAIT_S)


def by(author: str, transcript: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in transcript if entry["author"] == author]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def environment(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(GRANTED)
    settings: dict[str, object] = {
        "app": "tests.ops.ops_app:create_ops_app",
        "allowlist": allowlist,
        "max_redeliveries": 1,
        "lease_ttl_s": 2.0,
    }
    if request.param == "postgres":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    return relayr_environment(tmp_path, **settings)


def test_a_a_dead_run_retried_by_ops_posts_exactly_one_notice(
    environment: dict[str, str], tmp_path: Path
) -> None:
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", "backups")["id"]
    with (
        running_worker(environment, tmp_path) as worker,
        running_dispatcher(environment, tmp_path) as dispatcher,
    ):
        relayr_here(
            environment,
            "publish",
            WHERE,
            "opsw:backup",
            "--data",
            json.dumps({"thread_id": thread}),
        )
        [dead] = ended(environment, "ops:backup-check", "dead", worker, dispatcher)
        assert (dead["reason"], dead["attempts"]) == ("backup_down", 2)
        assert "backup host is down" in dead["error"]

        (tmp_path / FIXED).touch()
        [retried] = relayr_json(
            environment, "runs", "retry", "--dead", "--rule", "ops:backup-check"
        )
        assert (retried["run_id"], retried["ok"]) == (dead["id"], True)
        ended(environment, "ops:backup-check", "succeeded", worker, dispatcher)

    transcript = relayr_here(environment, "thread", "show", WHERE, thread)
    notices = by("external_agent:reflexr:ops:backup-check", transcript)
    assert [(n["kind"], n["content"]) for n in notices] == [
        ("notice", "checking the nightly backup")
    ]
    report = relayr_here(environment, "runs", "show", dead["id"])
    assert [a["outcome"] for a in report["attempts"]] == ["failed", "dead", "succeeded"]
    again = relayr_json(environment, "runs", "retry", dead["id"], check=False)
    assert again[0]["ok"] is False
    assert "succeeded" in again[0]["detail"]


@pytest.mark.redis
def test_b_a_send_killed_between_commit_and_ask_gets_one_message_and_one_turn(
    environment: dict[str, str], tmp_path: Path, redis_url: str
) -> None:
    environment = {**environment, "RELAYR_BROKER_URL": redis_url}
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", "incident")["id"]
    with (
        forgetting_redis_queue(environment["RELAYR_QUEUE"], url=redis_url),
        running_worker(environment, tmp_path) as worker,
        running_dispatcher(environment, tmp_path) as dispatcher,
    ):
        relayr_here(
            environment, "publish", WHERE, "opsw:lost", "--data", json.dumps({"thread_id": thread})
        )
        [dead] = ended(environment, "ops:crash-send", "dead", worker, dispatcher)
        assert dead["reason"] in ("worker_lost", "abandoned"), dead
        (tmp_path / FIXED).touch()
        relayr_json(environment, "runs", "retry", dead["id"])
        ended(environment, "ops:crash-send", "succeeded", worker, dispatcher)

        def turned() -> list[dict[str, Any]] | None:
            report = relayr_here(environment, "runs", "show", dead["id"])
            done = [t for t in report["turns"] if t["status"] == "completed"]
            return report["turns"] if done else None

        turns = until("the retried send's turn to complete", turned, worker, timeout_s=WAIT_S)
        assert worker.alive()

    transcript = relayr_here(environment, "thread", "show", WHERE, thread)
    sent = by("external_agent:reflexr:ops:crash-send", transcript)
    replies = [e for e in transcript if e["author"].startswith("agent:")]
    assert [(m["kind"], m["content"]) for m in sent] == [("message", CRASH_CONTENT)]
    assert len(turns) == 1
    assert turns[0]["message_id"] == sent[0]["id"]
    assert len(replies) == 1


def test_c_explain_names_the_namespace_that_granted(tmp_path: Path) -> None:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text('[namespaces.ops]\nturns = true\n[rules."ops:quiet"]\n')
    environment = relayr_environment(tmp_path, allowlist=allowlist)
    granted = relayr_here(environment, "allowlist", "explain", "ops:deploy-notice")
    assert granted["allowlist"]["turns"] is True
    assert granted["fields"]["turns"]["kind"] == "namespace"
    assert granted["fields"]["turns"]["key"] == "namespaces.ops"
    quiet = relayr_here(environment, "allowlist", "explain", "ops:quiet")
    assert quiet["allowlist"]["turns"] is False
    assert quiet["fields"]["turns"]["kind"] == "builtin"


def test_d_revoking_turns_stops_the_next_send_and_a_broken_file_changes_nothing(
    tmp_path: Path,
) -> None:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(GRANTED)
    environment = relayr_environment(tmp_path, allowlist=allowlist)
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", "incidents")["id"]

    def incident(title: str) -> None:
        data = json.dumps({"title": title, "thread_id": thread})
        relayr_here(environment, "publish", WHERE, "incident:opened", "--data", data)

    with (
        running_worker(environment, tmp_path) as worker,
        running_dispatcher(environment, tmp_path) as dispatcher,
    ):
        incident("first")
        ended(environment, "ops:incident-triage", "succeeded", worker, dispatcher)

        allowlist.write_text(BROKEN)
        time.sleep(1.5)  # the worker re-reads the file at most once a second
        incident("second, under a broken file")
        ended(environment, "ops:incident-triage", "succeeded", worker, dispatcher, count=2)
        log = json.dumps(list(log_records(worker.log()))).replace('\\"', '"')
        for key in (
            'rules."ops:incident-triage".turns',
            'rules."ops:incident-triage".wake',
            "namespaces.reflexr",
        ):
            assert key in log, f"{key} not reported in the worker's log"

        allowlist.write_text(REVOKED)
        time.sleep(1.5)
        incident("third, revoked")
        [refused] = ended(environment, "ops:incident-triage", "dead", worker, dispatcher)
        assert refused["reason"] == "not_allowed"
        assert worker.alive()

    transcript = relayr_here(environment, "thread", "show", WHERE, thread)
    sent = by("external_agent:reflexr:ops:incident-triage", transcript)
    assert [m["content"] for m in sent] == [
        "Triage incident: first",
        "Triage incident: second, under a broken file",
    ]


BAD_FILES = [
    ('[rules."ops:x"]\nturns = 1\n', 'rules."ops:x".turns'),
    ('[rules."ops:x"]\nthreads = "all"\n', 'rules."ops:x".threads'),
    ('[rules."ops:x"]\nwake = true\n', 'rules."ops:x".wake'),
    ('[rules."Ops X"]\nturns = true\n', 'rules."Ops X"'),
    ('[rules."reflexr:x"]\nturns = true\n', 'rules."reflexr:x"'),
    ("[namespaces.reflexr]\nturns = true\n", "namespaces.reflexr"),
    ('[namespaces.ops]\ndirect = ["Bad Kind"]\n', "namespaces.ops.direct"),
    ('[rules."ops:x"]\nturns = true\n[rules."ops:x"]\nturns = false\n', 'rules."ops:x"'),
    ("[extra]\n", "extra"),
    ('[default]\nturns = true\ncreate_threads = "no"\n', "default.create_threads"),
]


@pytest.mark.parametrize(("text", "key"), BAD_FILES)
def test_e_check_names_each_problem_with_its_key(tmp_path: Path, text: str, key: str) -> None:
    bad = tmp_path / "allowlist.toml"
    bad.write_text(text)
    result = CliRunner().invoke(cli, ["allowlist", "check", str(bad), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert any(key in problem["key"] for problem in report["problems"]), report


def test_e_check_exits_1_naming_every_problem_and_0_on_the_example(tmp_path: Path) -> None:
    bad = tmp_path / "allowlist.toml"
    bad.write_text(
        '[rules."ops:a"]\nturns = 1\n[rules."ops:b"]\nthreads = "all"\n[rules."ops:c"]\nwake = 1\n'
    )
    environment = relayr_environment(tmp_path)
    done = relayr_output(environment, "allowlist", "check", str(bad), check=False)
    assert done.returncode == 1
    for key in ('rules."ops:a".turns', 'rules."ops:b".threads', 'rules."ops:c".wake'):
        assert key in done.stderr
    good = relayr_output(environment, "allowlist", "check", check=False)
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("\n") == 1
    assert ": ok," in good.stdout
