"""``relayr run`` end to end: its worker killed comes back, a worker unable to start stops it,
and its dispatcher and worker processes freeze what they started with.

The tests start ``relayr run`` as a person would, SIGKILL its worker subprocess (found by the
pid the supervisor's status file names), and drive it with ``relayr health``, ``relayr publish``
and ``relayr thread show``, on the embedded broker and SQLite of the test's own home. "While the
worker is down" is made certain, not raced: the restart delay is far longer than the probe
takes, and the status file is read before and after the probe to show no restart happened in
between.
"""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relayr.cli import cli
from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.observe.health import SupervisorStatus, read_status, status_path
from tests.runtime.supervised import WAIT_S, wait_for
from tests.workers import REPO, relayr_environment

DOWN_S = 20.0
"""The restart delay while the test probes the worker that is down: a probe takes well under a
second, so the worker is certainly still down when it answers (and the test checks it was)."""

INVALID_ALLOWLIST = '[rules."ops:deploy-notice"]\nturns = "yes"\n'


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text((REPO / "rules" / "allowlist.toml").read_text())
    return relayr_environment(tmp_path, allowlist=allowlist)


def start_run(environment: dict[str, str], *options: str) -> RelayrProcess:
    return RelayrProcess.start(
        relayr_command("run", "--concurrency", "1", *options),
        environment=environment,
        cwd=REPO,
        log_path=Path(environment["RELAYR_HOME"]) / "run.log",
    )


@pytest.fixture
def relayr_run(environment: dict[str, str]) -> Iterator[Callable[..., RelayrProcess]]:
    """Starts ``relayr run``; whatever the test did, it is stopped with Ctrl-C, else killed."""
    processes: list[RelayrProcess] = []

    def start(*options: str) -> RelayrProcess:
        processes.append(start_run(environment, *options))
        return processes[-1]

    try:
        yield start
    finally:
        for process in processes:
            if process.alive():
                process.signal(signal.SIGINT)
                with suppress(subprocess.TimeoutExpired):
                    process.wait(60)
            process.kill()
        found = read_status(status_path(Path(environment["RELAYR_HOME"])))
        if found is not None:  # a worker a killed relayr run left behind
            with_pid = found[0].worker_pid
            if with_pid and Path(f"/proc/{with_pid}").exists():
                os.killpg(with_pid, signal.SIGKILL)
        log = Path(environment["RELAYR_HOME"]) / "run.log"
        if log.exists():
            print(log.read_text(errors="replace")[-6000:])


def invoke(environment: dict[str, str], *args: str) -> Any:
    return CliRunner().invoke(cli, list(args), env=environment, catch_exceptions=False)


def supervisor_status(environment: dict[str, str]) -> SupervisorStatus | None:
    found = read_status(status_path(Path(environment["RELAYR_HOME"])))
    return None if found is None else found[0]


def healthy_worker(environment: dict[str, str]) -> dict[str, Any] | None:
    """``relayr health --worker --json`` when it says healthy, else None."""
    result = invoke(environment, "health", "--worker", "--json")
    report: dict[str, Any] = json.loads(result.stdout)
    return report if result.exit_code == 0 else None


def is_worker(pid: int) -> bool:
    """Whether ``pid`` is a ``relayr worker`` process (its command line, from /proc)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"relayr.cli" in command and b"worker" in command


def transcript(environment: dict[str, str], thread_id: str) -> list[dict[str, Any]]:
    shown = invoke(environment, "thread", "show", "acme/ops", thread_id, "--json")
    assert shown.exit_code == 0, shown.output
    messages: list[dict[str, Any]] = json.loads(shown.stdout)
    return messages


def log_lines(environment: dict[str, str]) -> list[dict[str, Any]]:
    text = (Path(environment["RELAYR_HOME"]) / "run.log").read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.worker
@pytest.mark.slow
def test_a_killed_worker_comes_back_and_health_said_it_was_down(
    environment: dict[str, str], relayr_run: Callable[..., RelayrProcess]
) -> None:
    run = relayr_run("--restart-delay", str(DOWN_S))
    first = wait_for(lambda: healthy_worker(environment), "the first worker to be healthy")
    assert first["supervisor"]["state"] == "running"
    assert first["supervisor"]["restarts"] == 0
    killed = first["supervisor"]["worker_pid"]
    assert is_worker(killed)

    os.kill(killed, signal.SIGKILL)
    down = wait_for(
        lambda: (s := supervisor_status(environment)) and s.state == "restarting" and s,
        "the supervisor to see its worker gone",
    )
    probed = invoke(environment, "health", "--worker", "--json")
    after = supervisor_status(environment)
    assert after == down, "the worker came back while the probe ran: it must run while down"
    assert probed.exit_code == 1, probed.output
    report = json.loads(probed.stdout)
    assert report["ok"] is False
    assert report["supervisor"]["state"] == "restarting"
    assert report["supervisor"]["worker_pid"] == killed
    assert report["supervisor"]["last_exit"]["signal"] == "SIGKILL"
    [supervisor_check] = [c for c in report["checks"] if c["name"] == "supervisor"]
    assert supervisor_check["ok"] is False
    assert f"the worker is down: worker pid {killed} killed by SIGKILL" in report["reason"]
    liveness = invoke(environment, "health", "--worker", "--liveness")
    assert liveness.exit_code == 1  # the old heartbeat is still fresh: the status decides
    assert supervisor_status(environment) == down

    back = wait_for(
        lambda: (h := healthy_worker(environment)) and h["supervisor"]["restarts"] == 1 and h,
        "the worker to be started again and healthy",
        timeout_s=DOWN_S + WAIT_S,
    )
    restarted = back["supervisor"]["worker_pid"]
    assert restarted != killed
    assert is_worker(restarted)
    assert back["supervisor"]["last_exit"]["signal"] == "SIGKILL"

    created = invoke(environment, "thread", "create", "acme/ops", "--title", "after the kill")
    thread_id = created.stdout.strip()
    data = json.dumps({"service": "api", "status": "succeeded", "thread_id": thread_id})
    published = invoke(environment, "publish", "acme/ops", "deploy:finished", "--data", data)
    assert published.exit_code == 0, published.output
    [notice] = wait_for(lambda: transcript(environment, thread_id), "the run's notice")
    assert (notice["kind"], notice["author"], notice["content"]) == (
        "notice",
        "external_agent:reflexr:ops:deploy-notice",
        "deploy of api finished: succeeded",
    )

    run.signal(signal.SIGINT)
    assert run.wait(60) == 0
    assert not is_worker(restarted)
    assert supervisor_status(environment) is None
    lines = log_lines(environment)
    exits = [line for line in lines if line["event"] == "worker exited; starting it again"]
    assert [(e["pid"], e["signal"], e["restart_in_s"]) for e in exits] == [
        (killed, "SIGKILL", DOWN_S)
    ]
    starts = [(e["pid"], e["restarts"]) for e in lines if e["event"] == "worker started"]
    assert starts == [(killed, 0), (restarted, 1)]


FROZEN_AT_LEAST = 50_000
"""Objects a process that froze after it started holds out of the collector's sight, at least:
its modules, application and engines come to some 200,000; a bare interpreter to a few
thousand."""


@pytest.mark.worker
def test_the_dispatcher_and_the_workers_processes_freeze_what_they_started_with(
    environment: dict[str, str], relayr_run: Callable[..., RelayrProcess]
) -> None:
    run = relayr_run()

    def frozen() -> dict[str, dict[str, Any]] | None:
        found = {
            line["role"]: line
            for line in log_lines(environment)
            if line["event"] == "start-up objects frozen"
        }
        return found if {"dispatcher", "worker main", "worker"} <= found.keys() else None

    found = wait_for(frozen, "the dispatcher and the worker's processes to freeze their start-up")
    assert found["dispatcher"]["pid"] == run.pid
    assert len({found[role]["pid"] for role in found}) == 3  # the worker's, and its pool's
    for role in found:
        assert found[role]["objects"] >= FROZEN_AT_LEAST, found[role]
    run.signal(signal.SIGINT)
    assert run.wait(60) == 0


@pytest.mark.worker
def test_relayr_run_refuses_a_worker_that_cannot_start_in_one_line(
    environment: dict[str, str],
) -> None:
    Path(environment["RELAYR_ALLOWLIST"]).write_text(INVALID_ALLOWLIST)
    done = subprocess.run(
        [sys.executable, "-m", "relayr.cli", "run"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("Error: allowlist ")
    assert 'rules."ops:deploy-notice".turns' in line
    assert supervisor_status(environment) is None


@pytest.mark.worker
@pytest.mark.slow
def test_a_worker_whose_allowlist_broke_while_it_ran_stops_relayr_run(
    environment: dict[str, str], relayr_run: Callable[..., RelayrProcess]
) -> None:
    run = relayr_run("--restart-delay", "0.1")
    first = wait_for(lambda: healthy_worker(environment), "the worker to be healthy")
    Path(environment["RELAYR_ALLOWLIST"]).write_text(INVALID_ALLOWLIST)
    os.kill(first["supervisor"]["worker_pid"], signal.SIGKILL)
    assert run.wait(WAIT_S) == 2
    output = (Path(environment["RELAYR_HOME"]) / "run.log").read_text().strip().splitlines()
    assert output[-1].startswith("Error: the worker cannot start, so relayr run stops: allowlist")
    lines = log_lines(environment)
    assert [line["exit_code"] for line in lines if line["event"].startswith("worker cannot")] == [2]
    assert supervisor_status(environment) is None


def test_a_restart_delay_above_its_bound_is_refused(environment: dict[str, str]) -> None:
    result = invoke(environment, "run", "--restart-delay", "5", "--restart-delay-max", "1")
    assert result.exit_code == 2
    assert result.stderr.strip() == "Error: --restart-delay-max 1 is below --restart-delay 5"
    assert supervisor_status(environment) is None
