"""relayr's metrics: names, what each recording function counts, and values across processes.

In this process the metrics stay in memory (nothing here enables the file mode, which would
change prometheus_client for every later test); file mode is tested in subprocesses: forked
children, a real prefork Celery worker, and a real relayr worker under a small load.
"""

import asyncio
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from relayr import metrics
from relayr.cli.processes import RelayrProcess, relayr_command
from tests.services import forget_redis_queue, free_port

REPO = Path(__file__).resolve().parent.parent

EXPECTED = {
    # family name (samples add _total to counters): (type, label names)
    "relayr_runs_executed": ("counter", ("rule", "outcome")),
    "relayr_emissions": ("counter", ("kind", "outcome")),
    "relayr_refusals": ("counter", ("reason",)),
    "relayr_attempt_duration_seconds": ("histogram", ("rule",)),
    "relayr_dispatch_lag_seconds": ("histogram", ()),
    "relayr_runs_redelivered": ("counter", ()),
    "relayr_runs_enqueued": ("counter", ()),
    "relayr_turns_started": ("counter", ()),
    "relayr_turns_drained": ("counter", ()),
}

type Sample = tuple[str, frozenset[tuple[str, str]]]
type Samples = dict[Sample, float]

SCRAPE_TIMEOUT_S = 60.0
"""How long a scrape may take to show every task of a small load: far above what it needs."""


def value(name: str, **labels: str) -> float:
    """The current value of one sample of this process's metrics (0 when absent)."""
    found = metrics.registry().get_sample_value(name, labels)
    return float(found or 0.0)


def scrape_text(text: str) -> Samples:
    """Prometheus text as {(sample name, labels): value}."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def sample(
    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return scrape_text(response.read().decode())


# ─── names and recording, in this process ───────────────────────────────────


def test_every_metric_is_declared_with_conventional_names_and_labels() -> None:
    metrics.record_run("ops:a", "succeeded", 0.1)
    families = {family.name: family for family in metrics.registry().collect()}
    declared = {name: family.type for name, family in families.items()}
    assert declared == {name: kind for name, (kind, _) in EXPECTED.items()}
    for name, family in families.items():
        assert name.startswith("relayr_")
        assert family.documentation
        if family.type == "histogram":
            assert name.endswith("_seconds")
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name.endswith("_created"):  # in memory only: when each series began
            continue
        _, labels = EXPECTED[family.name]
        for found in family.samples:
            assert set(found.labels) - {"le"} == set(labels), found
            assert found.name.removeprefix(family.name) in {"_total", "_bucket", "_sum", "_count"}


def test_record_run_counts_the_outcome_and_times_the_attempt() -> None:
    before = value("relayr_runs_executed_total", rule="ops:r1", outcome="succeeded")
    observed = value("relayr_attempt_duration_seconds_count", rule="ops:r1")
    total = value("relayr_attempt_duration_seconds_sum", rule="ops:r1")
    metrics.record_run("ops:r1", "succeeded", 0.25)
    metrics.record_run("ops:r1", "succeeded", 0.5)
    assert value("relayr_runs_executed_total", rule="ops:r1", outcome="succeeded") == before + 2
    assert value("relayr_attempt_duration_seconds_count", rule="ops:r1") == observed + 2
    assert value("relayr_attempt_duration_seconds_sum", rule="ops:r1") == pytest.approx(
        total + 0.75
    )


def test_a_run_that_did_not_run_is_counted_without_a_duration() -> None:
    observed = value("relayr_attempt_duration_seconds_count", rule="ops:r2")
    metrics.record_run("ops:r2", "not_due")
    metrics.record_run(None, "missing")
    assert value("relayr_runs_executed_total", rule="ops:r2", outcome="not_due") >= 1
    assert value("relayr_runs_executed_total", rule="unknown", outcome="missing") >= 1
    assert value("relayr_attempt_duration_seconds_count", rule="ops:r2") == observed


def test_a_negative_duration_or_lag_counts_as_zero() -> None:
    zero_bucket = value("relayr_dispatch_lag_seconds_bucket", le="0.05")
    total = value("relayr_dispatch_lag_seconds_sum")
    metrics.record_dispatch_lag(-3.0)
    assert value("relayr_dispatch_lag_seconds_bucket", le="0.05") == zero_bucket + 1
    assert value("relayr_dispatch_lag_seconds_sum") == total
    metrics.record_run("ops:r3", "succeeded", -1.0)
    assert value("relayr_attempt_duration_seconds_sum", rule="ops:r3") == 0.0


def test_dispatch_lag_lands_in_its_bucket() -> None:
    within_2s = value("relayr_dispatch_lag_seconds_bucket", le="2.0")
    within_1s = value("relayr_dispatch_lag_seconds_bucket", le="1.0")
    metrics.record_dispatch_lag(1.5)
    assert value("relayr_dispatch_lag_seconds_bucket", le="2.0") == within_2s + 1
    assert value("relayr_dispatch_lag_seconds_bucket", le="1.0") == within_1s


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [("notice", "posted"), ("notice", "already_posted"), ("message", "asked")],
)
def test_record_emission_counts_by_kind_and_outcome(kind: str, outcome: str) -> None:
    before = value("relayr_emissions_total", kind=kind, outcome=outcome)
    metrics.record_emission(kind, outcome)
    assert value("relayr_emissions_total", kind=kind, outcome=outcome) == before + 1


def test_refusals_redeliveries_enqueues_and_turns_are_counted() -> None:
    counters: dict[str, Callable[[], None]] = {
        "relayr_refusals_total": lambda: metrics.record_refusal("not_allowed"),
        "relayr_runs_redelivered_total": metrics.record_redelivery,
        "relayr_runs_enqueued_total": lambda: metrics.record_enqueued(3),
        "relayr_turns_started_total": metrics.record_turn_started,
        "relayr_turns_drained_total": lambda: metrics.record_turns_drained(2),
    }
    steps = {
        "relayr_refusals_total": 1,
        "relayr_runs_redelivered_total": 1,
        "relayr_runs_enqueued_total": 3,
        "relayr_turns_started_total": 1,
        "relayr_turns_drained_total": 2,
    }
    for name, record in counters.items():
        labels = {"reason": "not_allowed"} if name == "relayr_refusals_total" else {}
        before = value(name, **labels)
        record()
        assert value(name, **labels) == before + steps[name], name


def test_no_turns_drained_adds_nothing() -> None:
    before = value("relayr_turns_drained_total")
    metrics.record_turns_drained(0)
    assert value("relayr_turns_drained_total") == before


def test_each_serving_process_has_a_directory_of_its_own(tmp_path: Path) -> None:
    worker = metrics.metrics_directory(tmp_path, "worker", pid=41)
    assert worker == tmp_path.absolute() / "metrics" / "worker-41"
    assert metrics.metrics_directory(tmp_path, "dispatcher").name == f"dispatcher-{os.getpid()}"


def test_a_server_in_memory_mode_serves_this_process(tmp_path: Path) -> None:
    server = metrics.start_metrics_server(0, None, addr="127.0.0.1")
    try:
        metrics.record_refusal("served_here")
        assert sample(scrape(server.port), "relayr_refusals_total", reason="served_here") >= 1
    finally:
        server.close()


# ─── file mode, across processes ────────────────────────────────────────────

FORKED = textwrap.dedent(
    """
    import json, multiprocessing, sys
    from pathlib import Path
    from relayr import metrics

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


# ─── a real prefork Celery worker ───────────────────────────────────────────

PROBE_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from celery import Celery
    from relayr import health, metrics

    broker, queue, directory, heartbeat, concurrency = sys.argv[1:6]
    server = metrics.start_metrics_server(0, Path(directory), addr="127.0.0.1")
    print(f"metrics port {server.port}", flush=True)
    app = Celery("probe", broker=broker)
    app.conf.update(
        task_default_queue=queue,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        accept_content=["json"],
        worker_hijack_root_logger=False,
    )
    app.steps["worker"].add(health.heartbeat_step(Path(heartbeat), interval_s=0.5))

    @app.task(name="probe.record")
    def record(rule, outcome, duration_s, sleep_s=0.0, gate=None):
        time.sleep(sleep_s)
        if gate is not None:  # busy until the test creates the file `gate`
            Path(gate + ".started").touch()
            deadline = time.monotonic() + 60
            while not Path(gate).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        metrics.record_run(rule, outcome, duration_s)
        metrics.record_emission("notice", "posted")
        return os.getpid()

    app.worker_main([
        "worker", f"--queues={queue}", f"--concurrency={concurrency}", "--pool=prefork",
        "--without-gossip", "--without-mingle", "--loglevel=INFO", f"--hostname={queue}@%h",
    ])
    """
)


@dataclass
class ProbeWorker:
    """A real prefork Celery worker whose tasks record relayr metrics and which beats."""

    process: RelayrProcess
    queue: str
    broker_url: str
    directory: Path
    heartbeat: Path

    def log(self) -> str:
        return self.process.log()

    @property
    def port(self) -> int:
        for line in self.log().splitlines():
            if line.startswith("metrics port "):
                return int(line.removeprefix("metrics port "))
        raise AssertionError(f"the worker printed no metrics port:\n{self.log()}")

    def send(self, app: Celery, *args: object) -> None:
        app.send_task("probe.record", args=list(args), queue=self.queue)


@contextmanager
def probe_worker(
    broker_url: str, tmp_path: Path, *, heartbeat: Path | None = None, concurrency: int = 2
) -> Iterator[ProbeWorker]:
    """Start :data:`PROBE_WORKER` on a queue of its own; wait until it is ready; stop it."""
    queue = f"relayr.test.probe.{uuid.uuid4().hex[:12]}"
    directory = tmp_path / "metrics"
    beat = heartbeat or tmp_path / "health" / "worker.heartbeat"
    command = [
        sys.executable,
        "-c",
        PROBE_WORKER,
        broker_url,
        queue,
        str(directory),
        str(beat),
        str(concurrency),
    ]
    process = RelayrProcess.start(
        command, name=f"probe worker {queue}", cwd=REPO, log_path=tmp_path / f"probe-{queue}.log"
    )
    try:
        process.ready()
        yield ProbeWorker(process, queue, broker_url, directory, beat)
    finally:
        process.stop(30.0)
        if broker_url.startswith("redis://"):
            forget_redis_queue(queue, broker_url)


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
            return sample(samples, "relayr_emissions_total", kind="notice", outcome="posted") >= 8

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
