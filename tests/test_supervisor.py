"""``relayr run`` supervises its worker: killed, it comes back; unable to start, run stops.

The back-off is a table; the supervisor's loop runs real short-lived processes; the end-to-end
tests start ``relayr run`` as a person would, SIGKILL its worker subprocess (found by the pid
the supervisor's status file names), and drive it with ``relayr health``, ``relayr publish`` and
``relayr thread show``. "While the worker is down" is made certain, not raced: the restart
delay is far longer than the probe takes, and the status file is read before and after the
probe to show no restart happened in between.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from relayr.cli import cli
from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.health import check_supervisor
from relayr.supervisor import (
    RestartPolicy,
    SupervisorStatus,
    WorkerExit,
    WorkerSupervisor,
    read_status,
    status_path,
    write_status,
)
from tests.workers import REPO, relayr_environment

WAIT_S = 90.0
"""How long a step may take to reach the state it waits for: far above what it needs."""

DOWN_S = 20.0
"""The restart delay while the test probes the worker that is down: a probe takes well under a
second, so the worker is certainly still down when it answers (and the test checks it was)."""

INVALID_ALLOWLIST = '[rules."ops:deploy-notice"]\nturns = "yes"\n'


# ─── the back-off ─────────────────────────────────────────────────────────────


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


# ─── the status file and what health makes of it ─────────────────────────────


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


# ─── the supervisor's loop, on real short-lived processes ────────────────────


EXITING = "import sys; sys.exit(1)"
STAYING = "import time; time.sleep(600)"
CANNOT_START = None
"""In :func:`starting`: a command that does not exist, so starting it raises ``OSError``."""


def starting(
    *codes: str | None,
) -> tuple[Callable[[], RelayrProcess], list[RelayrProcess]]:
    """Starts a real process per call, running each of ``codes`` (a line of Python) in turn,
    then the last one again, in a session of its own as ``relayr run`` starts its worker."""
    started: list[RelayrProcess] = []
    calls = 0

    def start() -> RelayrProcess:
        nonlocal calls
        code = codes[min(calls, len(codes) - 1)]
        calls += 1
        command = ["/nonexistent/relayr-worker"] if code is None else [sys.executable, "-c", code]
        started.append(RelayrProcess.start(command, name="worker"))
        return started[-1]

    return start, started


def leaving_a_child(pid_file: Path) -> str:
    """A worker whose main process exits and leaves a process of its session behind, whose pid
    it writes to ``pid_file`` first (as a pool process outlives a killed Celery worker)."""
    return (
        "import pathlib, subprocess, sys; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid)); "
        "sys.exit(1)"
    )


def gone(pid: int) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie no one reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@contextmanager
def killed_in_the_end(pid_file: Path) -> Iterator[None]:
    """Whatever the test found, the left-behind process does not outlive it."""
    try:
        yield
    finally:
        if pid_file.exists():
            with suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def until(probe: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_worker_that_keeps_exiting_is_started_again_with_a_growing_wait(
    tmp_path: Path,
) -> None:
    start, started = starting(EXITING, EXITING, STAYING)
    path = status_path(tmp_path)
    policy = RestartPolicy(first_s=0.2, max_s=0.4)
    supervisor = WorkerSupervisor(start, path, policy=policy, stop_timeout_s=10)
    supervisor.start()
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.supervise(stop))

    def running_again() -> bool:
        found = read_status(path)
        return len(started) == 3 and found is not None and found[0].state == "running"

    with capture_logs() as logs:
        try:
            await until(running_again, "the third start, which stays up")
            found = read_status(path)
            assert found is not None
            assert (found[0].restarts, found[0].worker_pid) == (2, started[2].pid)
            assert found[0].last_exit is not None
            assert found[0].last_exit.code == 1
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()
    assert [process.poll() for process in started[:2]] == [1, 1]
    assert started[2].poll() == -signal.SIGTERM  # stopped by the supervisor
    exits = [e for e in logs if e["event"] == "worker exited; starting it again"]
    assert [(e["pid"], e["exit_code"], e["restart_in_s"]) for e in exits] == [
        (started[0].pid, 1, 0.2),
        (started[1].pid, 1, 0.4),
    ]
    starts = [(e["pid"], e["restarts"]) for e in logs if e["event"] == "worker started"]
    assert starts == [(started[1].pid, 1), (started[2].pid, 2)]  # the first, before capture
    assert not path.exists()


async def test_a_worker_that_cannot_start_is_not_started_again(tmp_path: Path) -> None:
    start, started = starting("import sys; sys.exit(2)")
    path = status_path(tmp_path)
    supervisor = WorkerSupervisor(start, path, policy=RestartPolicy(first_s=0.1), stop_timeout_s=1)
    supervisor.start()
    supervised = await asyncio.wait_for(supervisor.supervise(asyncio.Event()), WAIT_S)
    supervisor.stop()
    assert supervised == "cannot_start"
    assert len(started) == 1
    assert supervisor.last_exit is not None
    assert supervisor.last_exit.code == 2
    assert not path.exists()


async def test_a_worker_that_cannot_be_started_is_tried_again_after_the_back_off(
    tmp_path: Path,
) -> None:
    """Starting it raised (as a fork fails with no memory): one more exit in a row, logged,
    and relayr run goes on."""
    start, started = starting(EXITING, CANNOT_START, STAYING)
    path = status_path(tmp_path)
    policy = RestartPolicy(first_s=0.2, max_s=0.4)
    supervisor = WorkerSupervisor(start, path, policy=policy, stop_timeout_s=10)
    supervisor.start()
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.supervise(stop))

    def running_again() -> bool:
        found = read_status(path)
        return len(started) == 2 and found is not None and found[0].state == "running"

    with capture_logs() as logs:
        try:
            await until(running_again, "the start after the one that failed")
            found = read_status(path)
            assert found is not None
            assert (found[0].restarts, found[0].worker_pid) == (1, started[1].pid)
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()
    [failed] = [e for e in logs if e["event"] == "worker could not be started; trying again"]
    assert (failed["restart_in_s"], failed["exits_in_a_row"]) == (0.4, 2)
    assert failed["error"].startswith("FileNotFoundError")
    assert started[1].poll() == -signal.SIGTERM


async def test_a_status_file_that_cannot_be_written_does_not_stop_the_supervisor(
    tmp_path: Path,
) -> None:
    """The status is for health only: a worker that exits is still started again."""
    (tmp_path / "health").write_text("a file where the status folder goes")
    path = status_path(tmp_path)
    start, started = starting(EXITING, STAYING)
    policy = RestartPolicy(first_s=0.1, max_s=0.1)
    supervisor = WorkerSupervisor(start, path, policy=policy, stop_timeout_s=10)
    stop = asyncio.Event()
    with capture_logs() as logs:
        supervisor.start()
        task = asyncio.create_task(supervisor.supervise(stop))
        try:
            await until(lambda: len(started) == 2, "the worker to be started again")
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()
    assert [p.poll() for p in started] == [1, -signal.SIGTERM]
    warned = [e for e in logs if e["event"] == "status file not written; supervising goes on"]
    assert len(warned) == 1  # once, not at every poll
    assert "NotADirectoryError" in warned[0]["error"] or "FileExistsError" in warned[0]["error"]


async def test_a_worker_that_exited_leaves_no_process_of_its_session_behind(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child.pid"
    start, _ = starting(leaving_a_child(pid_file))
    path = status_path(tmp_path)
    supervisor = WorkerSupervisor(start, path, policy=RestartPolicy(first_s=600), stop_timeout_s=1)
    stop = asyncio.Event()
    with killed_in_the_end(pid_file):
        supervisor.start()
        task = asyncio.create_task(supervisor.supervise(stop))
        try:
            await until(
                lambda: (found := read_status(path)) is not None and found[0].state == "restarting",
                "the supervisor to see its worker exit",
            )
            child = int(pid_file.read_text())
            await until(lambda: gone(child), "the worker's leftover to be killed", timeout_s=30)
        finally:
            stop.set()
            assert await task == "stopped"
            supervisor.stop()


def test_stopping_kills_what_a_worker_that_exited_left_behind(tmp_path: Path) -> None:
    """Stopped before it saw the exit, the supervisor still cleans the worker's session."""
    pid_file = tmp_path / "child.pid"
    start, started = starting(leaving_a_child(pid_file))
    supervisor = WorkerSupervisor(start, status_path(tmp_path), stop_timeout_s=1)
    with killed_in_the_end(pid_file):
        supervisor.start()
        assert started[0].wait(WAIT_S) == 1
        child = int(pid_file.read_text())
        assert not gone(child)

        assert supervisor.stop() is None

        wait_for(lambda: gone(child), "the worker's leftover to be killed", timeout_s=30)


# ─── relayr run, end to end ──────────────────────────────────────────────────


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


def wait_for[T](probe: Callable[[], T | None], what: str, timeout_s: float = WAIT_S) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


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
