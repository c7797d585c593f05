"""Fault tests: every run's effects happen once while workers, the broker or the database fail.

Each scenario runs a load of the example's runs (deploy notices and incident triage turns) with
real ``celery worker`` processes on a Redis of the test's own (AOF on, its own port), breaks
something while runs are known to be inside their actions (held there until the test releases
them, :mod:`tests.faults.holds`), and then checks one set of invariants
(:func:`tests.faults.checker.check_invariants`): every run ended, one notice per notice run,
one message per send run and each taken by a turn, no message id twice, and a ledger cause for
every write. The load is published in parts around the fault, so neither a fast nor a slow
machine changes what the fault hits. Each prints its figures as one JSON line (``pytest -s``
shows them).

Load: 120 notices + 12 turns by default, so each scenario takes about a minute on a 2-core
machine; ``FAULTS_FULL_LOAD=1`` runs 300 deploy notices + 30 incident triage turns under each
fault (several minutes per scenario). ``FAULTS_SEED`` changes the random moments and points of
the pool kills.
"""

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.faults.app import FAULT_APP, POISON_RULE, Poisoned, poison_kills
from tests.faults.breaks import (
    cut_postgres,
    kill_pool_processes,
    kill_worker,
    no_fault,
    restart_redis,
    sweep_with_a_short_visibility_timeout,
    terminate_worker,
)
from tests.faults.checker import Report
from tests.faults.constants import FAULT_SETTINGS, FULL_LOAD_VARIABLE
from tests.faults.load import Fault, load_plan, run_load
from tests.faults.private_redis import PrivateRedis
from tests.workers import relayr_environment

pytestmark = [pytest.mark.worker, pytest.mark.slow]

PLAN = load_plan()
FULL = os.environ.get(FULL_LOAD_VARIABLE) == "1"

TEST_TIMEOUT_S = 1200 if FULL else 420
"""Far above what a scenario needs on a busy machine; a hang fails the test, and the workers
and the Redis it started are still stopped."""

LOAD_TIMEOUT_S = 900.0 if FULL else 300.0
"""How long the runs of a scenario may take to end."""

SEED = int(os.environ.get("FAULTS_SEED", "20261130"))


def environment(home: Path, server: PrivateRedis, **settings: object) -> dict[str, str]:
    """The fault application on the test's Redis, with the fault settings and ``settings``."""
    return relayr_environment(
        home, broker_url=server.url, app=FAULT_APP, **{**FAULT_SETTINGS, **settings}
    )


def scenario(
    name: str,
    environment: dict[str, str],
    home: Path,
    fault: Fault,
    **options: Any,
) -> Report:
    report = asyncio.run(
        run_load(name, environment, home, fault, plan=PLAN, timeout_s=LOAD_TIMEOUT_S, **options)
    )
    print(report.line())
    return report


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_pool_processes_killed_at_random_moments(
    tmp_path: Path, redis_server: PrivateRedis
) -> None:
    """1. SIGKILL a pool process 10 times mid-load, each while the run it executes is inside
    its action (before or after its write); Celery replaces each one, and each killed run
    succeeds in a later attempt, its write made once."""
    report = scenario(
        "pool-kills",
        environment(tmp_path, redis_server),
        tmp_path,
        kill_pool_processes(10, seed=SEED),
    )
    assert report.problems == []
    assert report.figures["kills"] == 10
    assert report.figures["kills_while_runs_ran"] == 10
    assert report.figures["tasks_lost_with_their_process"] == 10


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_worker_main_process_killed(tmp_path: Path, redis_server: PrivateRedis) -> None:
    """2. SIGKILL the worker's main process while both its pool processes are inside a run's
    action and more runs are queued; a new worker finishes the load."""
    report = scenario(
        "worker-kill",
        environment(tmp_path, redis_server),
        tmp_path,
        kill_worker(),
    )
    assert report.problems == []
    assert report.figures["runs_running_at_kill"] == 2


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_redis_restarted(tmp_path: Path, redis_server: PrivateRedis) -> None:
    """3. SIGKILL Redis while two runs are inside their actions and more are queued in it;
    restart it on its AOF once the dispatcher failed to reach it and the held attempts are
    over."""
    report = scenario(
        "redis-restart",
        environment(tmp_path, redis_server),
        tmp_path,
        restart_redis(redis_server),
    )
    assert report.problems == []
    assert redis_server.restarts == 1
    assert report.figures["runs_running_at_kill"] == 2
    assert report.figures["messages_queued_at_kill"] >= 1
    assert report.figures["enqueue_failures"] >= 1


@pytest.mark.postgres
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_postgres_connections_cut(
    tmp_path: Path, redis_server: PrivateRedis, postgres_url: str
) -> None:
    """4. ``pg_terminate_backend`` every connection to the database, 3 times mid-load, each
    while a run is inside its action."""
    report = scenario(
        "postgres-cuts",
        environment(tmp_path, redis_server, database_url=postgres_url),
        tmp_path,
        cut_postgres(postgres_url, cuts=3),
    )
    assert report.problems == []
    assert report.figures["cuts_while_runs_ran"] == 3
    assert len(report.figures["connections_cut"]) == 3
    assert min(report.figures["connections_cut"]) >= 1


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_visibility_timeout_shorter_than_a_slow_run(
    tmp_path: Path, redis_server: PrivateRedis
) -> None:
    """5. The broker hands a run that is still running to a worker again.

    relayr's settings keep a worker's own time limits below its visibility timeout, so this
    needs what they cannot see: a second worker on the same Redis with a shorter visibility
    timeout (a rolling deploy of new settings, another app on the broker). kombu's unacked
    messages are global to the Redis database, and that worker's transport puts back every
    one older than its timeout at the head of the queue, the message of the run held inside
    its action included (held until the test saw that delivery refused, however long the
    second worker took to start: a hold that gave up first fails the scenario).
    """
    report = scenario(
        "visibility",
        environment(tmp_path, redis_server),
        tmp_path,
        sweep_with_a_short_visibility_timeout(visibility_timeout_s=4.0),
    )
    assert report.problems == []
    assert report.figures["turns"]["unended"] == 0
    assert report.figures["redeliveries"] >= 1
    assert report.figures["slow_run_refused_again"] is True
    assert report.figures["redelivered_while_running"] >= 1


def poison(thread_id: str) -> Sequence[tuple[str, Any]]:
    return [("poison-1", Poisoned(label="out of memory"))]


MAX_REDELIVERIES = 2


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_poison_run_is_failed_after_a_bounded_number_of_deliveries(
    tmp_path: Path, redis_server: PrivateRedis
) -> None:
    """6. A run whose action kills its own pool process: failed ``worker_lost``, the rest run.

    The poison rule allows 10 attempts, more than ``max_redeliveries`` (2) allows deliveries,
    so the run must be stopped by relayr's bound (``max_redeliveries + 1`` pool processes
    killed, ADR-0022), not by the rule's retry policy.
    """
    report = scenario(
        "poison",
        environment(tmp_path, redis_server, max_redeliveries=MAX_REDELIVERIES),
        tmp_path,
        no_fault,
        extra=poison,
        dead_allowed={POISON_RULE.name: frozenset({"worker_lost"})},
    )
    assert report.problems == []
    assert report.figures["dead_reasons"] == {f"{POISON_RULE.name}:worker_lost": 1}
    assert poison_kills(tmp_path) == MAX_REDELIVERIES + 1
    assert report.figures["tasks_lost_with_their_process"] == MAX_REDELIVERIES + 1


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_warm_shutdown_mid_load(tmp_path: Path, redis_server: PrivateRedis) -> None:
    """7. SIGTERM while both pool processes are inside a run's action: the running attempts
    finish, then a new worker finishes the load."""
    report = scenario(
        "sigterm",
        environment(tmp_path, redis_server),
        tmp_path,
        terminate_worker(),
    )
    assert report.problems == []
    assert report.figures["runs_running_at_sigterm"] == 2
    assert report.figures["turns"]["unended"] == 0
    assert report.figures["exit_code"] == 0
    assert report.figures["outcomes"].get("abandoned", 0) == 0
    assert report.figures["outcomes"].get("interrupted", 0) == 0
