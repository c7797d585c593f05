"""A worker's heartbeat comes from its consumer loop, on the embedded broker too (ADR-0031).

On ``filesystem://`` (a transport without an event loop) Celery runs the worker's timer in a
thread of its own. A heartbeat written from that thread would go on while the consumer loop is
stuck; :func:`relayr.observe.health.heartbeat_step` only asks from the timer, and the loop beats.

A real prefork worker on relayr's embedded broker beats every :data:`BEAT_S`. Its consumer loop
is stuck at a known point, not on a timer: a ``task_received`` handler (it runs in the loop, in
the main process) writes a file and waits for the test's gate. While it waits, the heartbeat
must not move; once the gate opens, it beats again.
"""

import sys
import textwrap
import time
from pathlib import Path
from typing import Final

import pytest
from celery import Celery

from relayr.broker import FILESYSTEM_TRANSPORT
from relayr.cli.processes import RelayrProcess

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(300)]

REPO: Final = Path(__file__).resolve().parents[2]
QUEUE: Final = "relayr.test.heartbeat"

BEAT_S: Final = 0.2
"""The worker's heartbeat interval here: short, so many beats fit in :data:`STUCK_S`."""

STUCK_S: Final = 4.0
"""How long the test watches the stuck worker's heartbeat: twenty beats' worth."""

WAIT_S: Final = 120.0
"""How long a test waits for what a worker does in well under a second on a quiet host."""

GATED_WORKER: Final = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from celery import Celery, signals
    from relayr.observe.health import heartbeat_step

    folder, queue, heartbeat, beat_s, stuck, gate = sys.argv[1:7]
    app = Celery("gated", broker="filesystem://localhost/")
    app.conf.update(
        broker_transport=sys.argv[7],
        broker_transport_options={"folder": folder},
        task_default_queue=queue,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        accept_content=["json"],
        worker_hijack_root_logger=False,
    )
    app.steps["worker"].add(heartbeat_step(Path(heartbeat), interval_s=float(beat_s)))

    @signals.task_received.connect
    def stick(request, **kwargs):
        # in the consumer loop of the main process: it turns no more until the gate opens
        if request.name == "gated.stick":
            Path(stuck).touch()
            deadline = time.monotonic() + 120
            while not Path(gate).exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    @app.task(name="gated.stick")
    def noop():
        return None

    app.worker_main([
        "worker", f"--queues={queue}", "--concurrency=1", "--pool=prefork",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=INFO",
    ])
    """
)


def mtime_ns(path: Path) -> int:
    return path.stat().st_mtime_ns


def beats(path: Path, after_ns: int, worker: RelayrProcess) -> int:
    """Wait for the heartbeat to move past ``after_ns``; its new mtime."""
    deadline = time.monotonic() + WAIT_S
    while True:
        if path.exists() and (now_ns := mtime_ns(path)) > after_ns:
            return now_ns
        assert worker.alive(), worker.log()
        assert time.monotonic() < deadline, f"the heartbeat did not move\n{worker.log()}"
        time.sleep(0.02)


def test_a_worker_whose_consumer_loop_is_stuck_stops_beating(tmp_path: Path) -> None:
    folder, heartbeat = tmp_path / "broker", tmp_path / "health" / "worker.heartbeat"
    stuck, gate = tmp_path / "stuck", tmp_path / "gate"
    command = [
        sys.executable,
        "-c",
        GATED_WORKER,
        str(folder),
        QUEUE,
        str(heartbeat),
        str(BEAT_S),
        str(stuck),
        str(gate),
        FILESYSTEM_TRANSPORT,
    ]
    worker = RelayrProcess.start(
        command, name="gated worker", cwd=REPO, log_path=tmp_path / "worker.log"
    )
    producer = Celery("producer", broker="filesystem://localhost/")
    producer.conf.update(
        broker_transport=FILESYSTEM_TRANSPORT,
        broker_transport_options={"folder": str(folder)},
    )
    try:
        worker.ready()
        beats(heartbeat, beats(heartbeat, 0, worker), worker)  # it beats, twice

        producer.send_task("gated.stick", queue=QUEUE)
        deadline = time.monotonic() + WAIT_S
        while not stuck.exists():
            assert worker.alive(), worker.log()
            assert time.monotonic() < deadline, worker.log()
            time.sleep(0.02)
        last_ns = mtime_ns(heartbeat)
        watched_until = time.monotonic() + STUCK_S
        while time.monotonic() < watched_until:
            assert mtime_ns(heartbeat) == last_ns, "a stuck consumer loop went on beating"
            time.sleep(BEAT_S / 4)
        assert worker.alive(), worker.log()

        gate.touch()
        beats(heartbeat, last_ns, worker)
    finally:
        gate.touch()
        producer.close()
        worker.stop(30.0)
    assert not heartbeat.exists()
