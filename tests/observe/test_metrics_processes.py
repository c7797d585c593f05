"""relayr's metrics in file mode, across processes: the values of every process add up.

In subprocesses only, since file mode changes prometheus_client for the whole process: forked
children of one parent, a real prefork Celery worker
(:func:`tests.observe.metrics_probes.probe_worker`)
on Redis, and a real relayr worker on Redis under a small load of the demo scenario.
"""

import asyncio
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from relayr.cli.processes import RelayrProcess, relayr_command
from tests.observe.metrics_probes import Samples, probe_worker, sample, scrape, scrape_text
from tests.services import forget_redis_queue, free_port
from tests.workers import REPO

SCRAPE_TIMEOUT_S = 60.0
"""How long a scrape may take to show every task of a small load: far above what it needs."""


# ─── file mode, across processes ────────────────────────────────────────────

FORKED = textwrap.dedent(
    """
    import json, multiprocessing, sys
    from pathlib import Path
    from relayr.observe import metrics

    directory = Path(sys.argv[1])
    metrics.record_run("ops:before", "succeeded", 1.0)  # in memory: not this process's files
    stale = directory / "counter_1.db"
    directory.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"left by an earlier process")
    metrics.enable_multiprocess(directory)
    assert not stale.exists()
    metrics.record_run("ops:a", "succeeded", 0.5)

    def child(n):
        for _ in range(n):
            metrics.record_run("ops:a", "succeeded", 0.1)
        metrics.record_emission("message", "asked")

    context = multiprocessing.get_context("fork")
    children = [context.Process(target=child, args=(n,)) for n in (1, 2, 3)]
    for process in children:
        process.start()
    for process in children:
        process.join()
        assert process.exitcode == 0
    try:
        metrics.enable_multiprocess(directory.parent / "elsewhere")
    except RuntimeError as error:
        print("refused:", error, file=sys.stderr)
    else:
        raise AssertionError("a second directory was accepted")
    print(metrics.exposition().decode())
    """
)


@pytest.mark.process
def test_values_of_forked_children_add_up_in_the_parent(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    done = subprocess.run(
        [sys.executable, "-c", FORKED, str(directory)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "refused: metrics are already kept in" in done.stderr
    samples = scrape_text(done.stdout)
    assert sample(samples, "relayr_runs_executed_total", rule="ops:a", outcome="succeeded") == 7
    assert sample(samples, "relayr_attempt_duration_seconds_count", rule="ops:a") == 7
    assert sample(samples, "relayr_attempt_duration_seconds_sum", rule="ops:a") == pytest.approx(
        1.1
    )
    assert sample(samples, "relayr_emissions_total", kind="message", outcome="asked") == 3
    assert (
        sample(samples, "relayr_runs_executed_total", rule="ops:before", outcome="succeeded") == 0
    )
    # unlabelled counters are there at 0 before anything happens, so increase() works
    assert ("relayr_turns_started_total", frozenset()) in samples
    assert len(list(directory.glob("counter_*.db"))) == 4


def wait_for(port: int, done: Callable[[Samples], bool]) -> Samples:
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        samples = scrape(port)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


@pytest.mark.redis
@pytest.mark.worker
@pytest.mark.slow
def test_a_prefork_worker_serves_the_sum_of_its_pool_processes(
    tmp_path: Path, redis_url: str
) -> None:
    producer = Celery("producer", broker=redis_url)
    with probe_worker(redis_url, tmp_path) as worker:
        for _ in range(5):
            worker.send(producer, "ops:a", "succeeded", 0.1, 0.1)
        for _ in range(3):
            worker.send(producer, "ops:b", "dead", 2.0, 0.1)

        def finished(samples: Samples) -> bool:
            # a scrape reads each process's counters and histograms from files of their own,
            # one after the other: a task's emission can show while its histogram does not yet
            return (
                sample(samples, "relayr_emissions_total", kind="notice", outcome="posted") >= 8
                and sample(samples, "relayr_attempt_duration_seconds_count", rule="ops:a") >= 5
                and sample(samples, "relayr_attempt_duration_seconds_count", rule="ops:b") >= 3
            )

        samples = wait_for(worker.port, finished)
        assert sample(samples, "relayr_runs_executed_total", rule="ops:a", outcome="succeeded") == 5
        assert sample(samples, "relayr_runs_executed_total", rule="ops:b", outcome="dead") == 3
        assert sample(samples, "relayr_emissions_total", kind="notice", outcome="posted") == 8
        assert sample(samples, "relayr_attempt_duration_seconds_count", rule="ops:b") == 3
        assert (
            sample(samples, "relayr_attempt_duration_seconds_bucket", rule="ops:b", le="2.5") == 3
        )
        assert (
            sample(samples, "relayr_attempt_duration_seconds_bucket", rule="ops:b", le="1.0") == 0
        )
        # the tasks ran in pool processes, whose files the main process merged
        pids = {int(path.stem.split("_")[-1]) for path in worker.directory.glob("counter_*.db")}
        assert pids - {worker.process.pid}, pids
        producer.close()


# ─── a real relayr worker under a small load ────────────────────────────────


@pytest.mark.redis
@pytest.mark.worker
@pytest.mark.slow
def test_a_relayr_worker_counts_a_small_load(tmp_path: Path, redis_url: str) -> None:
    from relayr.cli.demo import run_scenario
    from relayr.demo import Plan
    from relayr.settings import Settings
    from tests.workers import relayr_environment

    environment = relayr_environment(tmp_path, broker_url=redis_url)
    settings = Settings.from_env(environment)
    plan = Plan(deploys=6, incidents=2)
    port = free_port()
    worker = RelayrProcess.start(
        relayr_command("worker", "--concurrency", "2", "--metrics-port", str(port)),
        environment=environment,
        cwd=REPO,
        log_path=tmp_path / "worker.log",
    )
    try:
        worker.ready()
        result = asyncio.run(run_scenario(settings, plan, timeout_s=180))
        summary = result.summary
        assert summary["problems"] == []
        # the plan's runs, and the example's inbound rules' runs on what they wrote
        posted = summary["notices"] + summary["messages"]

        def finished(samples: Samples) -> bool:
            return (
                sample(samples, "relayr_emissions_total", kind="notice", outcome="posted")
                + sample(samples, "relayr_emissions_total", kind="message", outcome="posted")
                >= posted
            )

        samples = wait_for(port, finished)
        succeeded = sum(
            value
            for (name, labels), value in samples.items()
            if name == "relayr_runs_executed_total" and ("outcome", "succeeded") in labels
        )
        assert succeeded == summary["runs_succeeded"] > plan.runs
        notices = sample(samples, "relayr_emissions_total", kind="notice", outcome="posted")
        assert notices == summary["notices"]
        assert sample(samples, "relayr_emissions_total", kind="message", outcome="posted") == 2
        assert sample(samples, "relayr_turns_started_total") == summary["turns"] == 2
        assert sample(samples, "relayr_refusals_total", reason="not_allowed") == 0
        assert sample(samples, "relayr_dispatch_lag_seconds_count") == summary["runs_succeeded"]
        assert (
            sample(samples, "relayr_attempt_duration_seconds_count", rule="ops:deploy-notice") == 6
        )
    finally:
        worker.stop()
        forget_redis_queue(settings.queue, redis_url)
