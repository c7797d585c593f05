"""``relayr health``: heartbeats, broker and database checks, as a probe runs them.

The command runs as a real process, as Kubernetes and compose run it, against a Redis server of
the test's own (:mod:`tests.faults.private_redis`: started, stopped and started again on one
port), PostgreSQL, a server that accepts connections and never answers, and a real prefork
worker kept busy.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery

from relayr.observe.health import (
    DEFAULT_MAX_AGE_S,
    Check,
    HealthReport,
    check_heartbeat,
    heartbeat_path,
    redact,
    touch_heartbeat,
)
from tests.faults.private_redis import PrivateRedis
from tests.observe.metrics_probes import probe_worker
from tests.services import free_port

REPO = Path(__file__).resolve().parents[2]

BUSY_WAIT_S = 60.0
"""How long a probe worker's task may take to start, on a busy host."""

BUSY_MAX_AGE_S = 3
"""The heartbeat's allowed age while the worker is busy: several of its beats (0.5 s apart)."""

POLL_S = 0.1

STARTUP_ALLOWANCE_S = 6.0
"""What starting Python and importing relayr may add to ``--timeout`` on a busy host."""


def health_environment(home: Path, **settings: str) -> dict[str, str]:
    """This environment without ``RELAYR_*``, plus a home and an existing SQLite file."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RELAYR_")}
    database = home / "relayr.db"
    database.touch()
    environment["RELAYR_HOME"] = str(home)
    environment["RELAYR_DATABASE_URL"] = f"sqlite+aiosqlite:///{database}"
    for name, value in settings.items():
        environment[f"RELAYR_{name.upper()}"] = value
    return environment


@dataclass
class Ran:
    code: int
    output: str
    elapsed_s: float


def health(environment: dict[str, str], *args: str, module: str = "relayr.cli") -> Ran:
    """Run the health command in a process of its own, as a probe does."""
    command = [sys.executable, "-m", module]
    if module == "relayr.cli":
        command.append("health")
    started = time.monotonic()
    done = subprocess.run(
        [*command, *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Ran(done.returncode, done.stdout + done.stderr, time.monotonic() - started)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: a hung broker or database."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


# ─── the pieces ─────────────────────────────────────────────────────────────


def test_a_heartbeat_is_fresh_stale_or_missing(tmp_path: Path) -> None:
    path = heartbeat_path(tmp_path, "worker")
    assert path == tmp_path.absolute() / "health" / "worker.heartbeat"
    missing = check_heartbeat(path, max_age_s=60)
    assert not missing.ok
    assert "no heartbeat at" in missing.detail
    touch_heartbeat(path)
    mtime = path.stat().st_mtime
    assert check_heartbeat(path, max_age_s=60, now=mtime + 59).ok
    stale = check_heartbeat(path, max_age_s=60, now=mtime + 75)
    assert not stale.ok
    assert "is 75.0 s old (limit 60 s)" in stale.detail


def test_touching_a_heartbeat_moves_its_mtime(tmp_path: Path) -> None:
    path = tmp_path / "health" / "dispatcher.heartbeat"
    touch_heartbeat(path)
    os.utime(path, (1_000_000, 1_000_000))
    touch_heartbeat(path)
    assert time.time() - path.stat().st_mtime < 5


def test_passwords_never_reach_a_message() -> None:
    assert redact("redis://:s3cret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert (
        redact("postgresql+asyncpg://relayr:s3cret@db/relayr")
        == "postgresql+asyncpg://relayr:***@db/relayr"
    )
    assert redact("redis://cache:6379/0") == "redis://cache:6379/0"


def test_a_report_names_every_failure() -> None:
    report = HealthReport(
        "worker",
        (
            Check("heartbeat", True, "1.0 s old", 0.0),
            Check("broker", False, "cannot reach redis://x", 0.1),
            Check("database", False, "no answer", 0.2),
        ),
    )
    assert not report.ok
    assert report.reason == "broker: cannot reach redis://x; database: no answer"
    assert report.summary().startswith("worker unhealthy: heartbeat: 1.0 s old; broker:")
    assert report.as_dict()["checks"][1] == {
        "name": "broker",
        "ok": False,
        "detail": "cannot reach redis://x",
        "duration_s": 0.1,
    }
    assert HealthReport(None, ()).ok


# ─── the command, as a probe runs it ────────────────────────────────────────


@pytest.mark.redis
@pytest.mark.process
def test_health_fails_while_redis_is_down_and_passes_when_it_is_back(
    tmp_path: Path, redis_server: PrivateRedis
) -> None:
    environment = health_environment(tmp_path, broker_url=redis_server.url)
    up = health(environment, "--timeout", "2")
    assert up.code == 0, up.output
    assert "broker: redis://127.0.0.1" in up.output
    assert "answered PING" in up.output

    redis_server.stop()
    down = health(environment, "--timeout", "2")
    assert down.code == 1, down.output
    assert f"cannot reach redis://127.0.0.1:{redis_server.port}/0" in down.output
    assert down.elapsed_s < 2 + STARTUP_ALLOWANCE_S

    redis_server.restart()
    back = health(environment, "--timeout", "2")
    assert back.code == 0, back.output


@pytest.mark.process
def test_health_gives_up_on_a_broker_that_never_answers_within_its_timeout(
    tmp_path: Path, silent_server: int
) -> None:
    environment = health_environment(
        tmp_path, broker_url=f"redis://:pw@127.0.0.1:{silent_server}/0"
    )
    hung = health(environment, "--timeout", "1.5", "--json")
    assert hung.code == 1, hung.output
    report = json.loads(hung.output)
    assert report["ok"] is False
    broker = next(check for check in report["checks"] if check["name"] == "broker")
    assert (
        broker["detail"] == f"no answer from redis://:***@127.0.0.1:{silent_server}/0 within 1.5 s"
    )
    assert "pw" not in hung.output
    assert hung.elapsed_s < 1.5 + STARTUP_ALLOWANCE_S


@pytest.mark.postgres
@pytest.mark.process
def test_health_checks_postgresql(tmp_path: Path, postgres_url: str, redis_url: str) -> None:
    reachable = health_environment(tmp_path, broker_url=redis_url, database_url=postgres_url)
    assert health(reachable, "--timeout", "3").code == 0
    closed = health_environment(
        tmp_path,
        broker_url=redis_url,
        database_url=f"postgresql+asyncpg://relayr:pw@127.0.0.1:{free_port()}/relayr",
    )
    refused = health(closed, "--timeout", "3")
    assert refused.code == 1
    assert "database: cannot reach postgresql+asyncpg://relayr:***@127.0.0.1" in refused.output


@pytest.mark.process
def test_a_sqlite_file_that_is_not_there_is_not_created(tmp_path: Path, redis_url: str) -> None:
    environment = health_environment(
        tmp_path, broker_url=redis_url, database_url=f"sqlite+aiosqlite:///{tmp_path}/other.db"
    )
    ran = health(environment)
    assert ran.code == 1
    assert f"SQLite file {tmp_path}/other.db does not exist" in ran.output
    assert not (tmp_path / "other.db").exists()


@pytest.mark.process
def test_the_embedded_broker_is_healthy_when_its_folder_is_there(tmp_path: Path) -> None:
    environment = health_environment(tmp_path)
    assert "does not exist" in health(environment).output
    (tmp_path / "broker" / "queues").mkdir(parents=True)
    assert health(environment).code == 0


@pytest.mark.process
def test_a_worker_is_alive_only_with_a_fresh_heartbeat(tmp_path: Path, redis_url: str) -> None:
    environment = health_environment(tmp_path, broker_url=redis_url)
    missing = health(environment, "--worker")
    assert missing.code == 1
    assert "heartbeat: no heartbeat at" in missing.output
    path = heartbeat_path(tmp_path, "worker")
    touch_heartbeat(path)
    assert health(environment, "--worker").code == 0
    old = time.time() - DEFAULT_MAX_AGE_S - 30
    os.utime(path, (old, old))
    stale = health(environment, "--worker")
    assert stale.code == 1
    assert "the process is hung or gone" in stale.output
    assert health(environment, "--worker", "--max-age", "600").code == 0


@pytest.mark.process
def test_liveness_checks_the_heartbeat_alone(tmp_path: Path) -> None:
    environment = health_environment(tmp_path, broker_url="redis://127.0.0.1:1/0")
    touch_heartbeat(heartbeat_path(tmp_path, "dispatcher"))
    alive = health(environment, "--dispatcher", "--liveness")
    assert alive.code == 0, alive.output
    assert "broker" not in alive.output
    assert health(environment, "--dispatcher").code == 1
    assert health(environment, "--liveness").code == 2  # which heartbeat? a usage error


@pytest.mark.process
def test_invalid_settings_are_named(tmp_path: Path) -> None:
    environment = health_environment(tmp_path, broker_url="amqp://nowhere")
    ran = health(environment)
    assert ran.code == 2
    assert "RELAYR_BROKER_URL='amqp://nowhere' is invalid" in ran.output


# ─── a real worker, busy ────────────────────────────────────────────────────


@pytest.mark.redis
@pytest.mark.worker
@pytest.mark.slow
def test_a_busy_worker_is_healthy_and_a_stopped_one_is_not(tmp_path: Path, redis_url: str) -> None:
    environment = health_environment(tmp_path, broker_url=redis_url)
    beat = heartbeat_path(tmp_path, "worker")
    producer = Celery("producer", broker=redis_url)
    gate = tmp_path / "release-slow"
    with probe_worker(redis_url, tmp_path, heartbeat=beat, concurrency=1) as worker:
        # holds the only pool process until the test creates the gate
        worker.send(producer, "ops:slow", "succeeded", 8.0, 0.0, str(gate))
        deadline = time.monotonic() + BUSY_WAIT_S
        while not gate.with_suffix(".started").exists():
            assert time.monotonic() < deadline, worker.log()
            time.sleep(POLL_S)
        busy_since, checks = time.monotonic(), 0
        # busy for longer than --max-age: a heartbeat that stopped while busy would be stale
        while checks < 3 or time.monotonic() - busy_since <= BUSY_MAX_AGE_S + 1:
            busy = health(
                environment, "--worker", "--max-age", str(BUSY_MAX_AGE_S), "--timeout", "2"
            )
            assert busy.code == 0, busy.output + worker.log()
            checks += 1
        gate.touch()
        producer.close()
    stopped = health(environment, "--worker")
    assert stopped.code == 1
    assert "no heartbeat at" in stopped.output


# ─── `relayr health` itself ─────────────────────────────────────────────────


@pytest.mark.redis
@pytest.mark.process
def test_relayr_health_is_the_same_command(tmp_path: Path, redis_url: str) -> None:
    environment = health_environment(tmp_path, broker_url=redis_url)
    ran = health(environment, "--timeout", "3", module="relayr.cli")
    assert ran.code == 0, ran.output
    assert "dependencies healthy" in ran.output
