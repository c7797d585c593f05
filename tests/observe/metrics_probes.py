"""What the metrics tests share: Prometheus text read as samples, and a real prefork Celery
worker whose tasks record relayr metrics and which beats (tests/observe/test_health.py reads its
heartbeat too).

The worker is :data:`PROBE_WORKER`, run as ``python -c`` from the repository on a queue of its
own, serving its metrics in file mode from a directory of the test's.
"""

import sys
import textwrap
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from relayr.cli.processes import RelayrProcess
from tests.services import forget_redis_queue
from tests.workers import REPO

type Sample = tuple[str, frozenset[tuple[str, str]]]
type Samples = dict[Sample, float]


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


PROBE_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from celery import Celery
    from relayr.observe import health
    from relayr.observe import metrics

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
