"""What a dispatcher costs when nothing happens, and how fast it decides when much does at once.

``python -m bench.idle`` makes ``--workspaces`` W workspaces (10,000) of one tenant on a storage
of the case's own, each with a thread in artifactr and one event in reflexr that no rule
answers (so a dispatcher knows and follows every one of them, and none has a run), then starts
``relayr dispatch`` (default settings, following artifactr's logs as it does by default; no
worker) and:

1. waits until it has worked off its first sweep (every workspace followed and evaluated, in
   batches): its heartbeat, refreshed after each pass (``relayr health --dispatcher``), has
   beaten twice and it logged ``dispatcher caught up`` (at most ``--settle-s``; ``caught_up_s``
   and ``caught_up_passes`` say how long that took and in how many passes);
2. **idle**: reads its CPU time from ``/proc`` over ``--window-s`` (30 s) with nothing new
   anywhere, as a share of one core (and, on PostgreSQL, its database backends' too);
3. **decide**: publishes one ``deploy:finished`` event into each of ``--new`` M of the
   workspaces (1,000), from this process through the store, and measures how long after the
   last of them every run was decided and enqueued: until the broker's queue holds M messages
   (a run message carries runs of one workspace, and no worker takes them), read every
   :data:`DEPTH_EVERY_S`. The runs are counted in the store afterwards. (A dispatcher that
   held runs back until workers finish others would never reach M: its line then says so,
   ``decided_s`` null and ``messages_enqueued`` below ``new``.)

One JSON line per storage, then one verdict line per target (:mod:`bench.verdicts`): at most
:data:`IDLE_CPU_PERCENT` % of a core idle with 10,000 workspaces; the 1,000 runs decided within
:data:`DECIDE_S`. A run with fewer workspaces or events prints them marked not judged. Only the
command line and the stores are used, so it measures whichever dispatcher ``relayr dispatch``
runs: with ``RELAYR_APP=bench.idle_app:create_app``, the example application plus an event no
rule answers (:mod:`bench.idle_app`).
"""

import argparse
import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from reflexr import Event

from bench.common import (
    STORAGES,
    available_storages,
    children,
    cpu_s,
    emit,
    machine,
    note,
    postgres_backends,
    quiet_logging,
)
from bench.deployed import Deployment, deployment
from bench.idle_app import APP, Seen
from bench.stamps import READER, Stores, deploy
from bench.verdicts import Target
from relayr import broker
from relayr.cli.processes import RelayrProcess
from relayr.observe.health import heartbeat_path
from relayr.settings import Settings

IDLE_CPU_PERCENT: Final = 2.0
"""A dispatcher watching 10,000 workspaces with nothing new: at most this % of one core."""

DECIDE_S: Final = 3.0
"""One new event in each of 1,000 workspaces: every run enqueued within this many seconds."""

JUDGED_WORKSPACES: Final = 10_000
JUDGED_NEW: Final = 1000

DEPTH_EVERY_S: Final = 0.02
"""How often the queue's depth is read while the runs are being decided: one listing of a
folder, or one ``LLEN``; the granularity of the decide time."""

BEATS_SETTLED: Final = 2
"""Heartbeats after the start before the window opens: the first pass's, then one more."""

CAUGHT_UP: Final = re.compile(r"^.*dispatcher caught up.*$", re.MULTILINE)
"""The dispatcher's log line when it has worked off its first sweep (as text or as JSON)."""


def workspace_name(index: int) -> str:
    return f"idle-{index:05d}"


async def make_workspaces(stores: Stores, count: int) -> list[str]:
    """``count`` workspaces, each with a thread and a :class:`Seen` event; their threads."""
    threads = []
    for index in range(count):
        name = workspace_name(index)
        (thread,) = await stores.create_threads(name, 1)
        rules = await stores.rules.open("bench", name, actor=READER)
        await rules.publish(Seen(), id=f"seen-{index}")
        threads.append(thread)
        if (index + 1) % 1000 == 0:
            note(f"{index + 1} of {count} workspaces made")
    return threads


def settle(deployed: Deployment, dispatcher: RelayrProcess, timeout_s: float) -> dict[str, Any]:
    """Wait for :data:`BEATS_SETTLED` heartbeats of the dispatcher, then until it says it
    caught up (``dispatcher caught up``: the first sweep's workspaces followed and evaluated,
    in batches); when the first beat came, how long catching up took, and whether both came
    within ``timeout_s``."""
    path = heartbeat_path(deployed.settings.home, "dispatcher")
    started = time.monotonic()
    beats: list[float] = []
    last: float | None = None
    caught_up: tuple[int, float] | None = None
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(FileNotFoundError):
            mtime = path.stat().st_mtime
            if mtime != last:
                last = mtime
                beats.append(time.monotonic() - started)
        if caught_up is None:
            caught_up = caught_up_in(dispatcher.log())
        if len(beats) >= BEATS_SETTLED and caught_up is not None:
            break
        time.sleep(0.05)
    return {
        "first_pass_s": round(beats[0], 2) if beats else None,
        "caught_up_s": None if caught_up is None else caught_up[1],
        "caught_up_passes": None if caught_up is None else caught_up[0],
        "settled": len(beats) >= BEATS_SETTLED and caught_up is not None,
    }


def caught_up_in(log: str) -> tuple[int, float] | None:
    """The passes and seconds of the dispatcher's first ``dispatcher caught up`` line, as text
    (``passes=3 took_s=1.2``) or as JSON (``"passes": 3, "took_s": 1.2``); None before it."""
    line = CAUGHT_UP.search(log)
    if line is None:
        return None
    passes = re.search(r"passes\W{1,3}(\d+)", line[0])
    took_s = re.search(r"took_s\W{1,3}([\d.]+)", line[0])
    if passes is None or took_s is None:
        return None
    return int(passes[1]), float(took_s[1])


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of its children (should the dispatcher ever start any)."""
    return cpu_s(pid) + sum(cpu_s(child) for child in children(pid))


def cpu_window(deployed: Deployment, pid: int, window_s: float) -> dict[str, Any]:
    """The dispatcher's CPU, and its database backends', over ``window_s``, in % of a core."""
    database = deployed.storage.database
    backends = asyncio.run(postgres_backends(database)) if database else []
    before = tree_cpu_s(pid), sum(cpu_s(backend) for backend in backends)
    started = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - started
    after = tree_cpu_s(pid), sum(cpu_s(backend) for backend in backends)
    return {
        "window_s": round(elapsed, 1),
        "dispatcher_cpu_percent": round((after[0] - before[0]) / elapsed * 100, 2),
        "database_cpu_percent": (
            round((after[1] - before[1]) / elapsed * 100, 2) if database else None
        ),
    }


class DepthWatch(threading.Thread):
    """Reads the queue's depth until it holds ``wanted`` messages; when it first did."""

    def __init__(self, settings: Settings, wanted: int, timeout_s: float) -> None:
        super().__init__(name="bench-depth", daemon=True)
        self.settings, self.wanted, self.timeout_s = settings, wanted, timeout_s
        self.reached: datetime | None = None
        self.depth = 0

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            self.depth = broker.queue_depth(self.settings)
            if self.depth >= self.wanted:
                self.reached = datetime.now(UTC)
                return
            time.sleep(DEPTH_EVERY_S)


async def decide(
    deployed: Deployment, stores: Stores, threads: Sequence[str], new: int, timeout_s: float
) -> dict[str, Any]:
    """Publish one deploy into each of ``new`` workspaces; how long until all were enqueued."""
    watch = DepthWatch(deployed.settings, new, timeout_s)
    watch.start()
    stamps = []
    for index in range(new):
        rules = await stores.rules.open("bench", workspace_name(index), actor=READER)
        published = await rules.publish(
            deploy_event(f"new-{index:05d}", threads[index]), id=f"new-{index}"
        )
        stamps.append(published.envelope.ts)
    await asyncio.to_thread(watch.join)
    runs = 0
    for index in range(new):
        rules = await stores.rules.open("bench", workspace_name(index), actor=READER)
        runs += len(await rules.runs())
    first, last = min(stamps), max(stamps)
    return {
        "new": new,
        "publish_s": round((last - first).total_seconds(), 2),
        "decided_s": (
            None if watch.reached is None else round((watch.reached - last).total_seconds(), 2)
        ),
        "decided_from_first_publish_s": (
            None if watch.reached is None else round((watch.reached - first).total_seconds(), 2)
        ),
        "messages_enqueued": watch.depth,
        "runs_decided": runs,
    }


def deploy_event(service: str, thread_id: str) -> Event:
    from reflexr.core import load_event

    return load_event({"type": "deploy:finished", **deploy(service, thread_id)})


async def prepare(deployed: Deployment, workspaces: int) -> list[str]:
    async with Stores.opened(deployed.settings) as stores:
        return await make_workspaces(stores, workspaces)


async def deciding(
    deployed: Deployment, threads: Sequence[str], new: int, timeout_s: float
) -> dict[str, Any]:
    async with Stores.opened(deployed.settings) as stores:
        return await decide(deployed, stores, threads, new, timeout_s)


def measure(deployed: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    note(f"{deployed.storage.kind}: making {args.workspaces} workspaces")
    started = time.monotonic()
    threads = asyncio.run(prepare(deployed, args.workspaces))
    made_s = time.monotonic() - started
    dispatcher = deployed.start("dispatch", name="dispatch")
    note(f"{deployed.storage.kind}: waiting for the dispatcher's first pass")
    settled = settle(deployed, dispatcher, args.settle_s)
    note(f"{deployed.storage.kind}: idle for {args.window_s} s")
    load_before = machine()["load_avg"]
    idle = cpu_window(deployed, dispatcher.pid, args.window_s)
    note(f"{deployed.storage.kind}: one new event in each of {args.new} workspaces")
    cpu_before = tree_cpu_s(dispatcher.pid)
    decided = asyncio.run(deciding(deployed, threads, args.new, args.decide_timeout_s))
    decided["dispatcher_cpu_s"] = round(tree_cpu_s(dispatcher.pid) - cpu_before, 2)
    return {
        "bench": "idle",
        **deployed.described,
        "workspaces": args.workspaces,
        "workspaces_made_s": round(made_s, 1),
        **settled,
        **idle,
        **decided,
        "load_avg": {"before": load_before, "after": machine()["load_avg"]},
    }


def verdicts(figures: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    kind = figures["storage"]
    idle_size = "full" if args.workspaces >= JUDGED_WORKSPACES else "small"
    new_size = "full" if args.new >= JUDGED_NEW else "small"
    return [
        Target(
            f"{kind}: dispatcher's CPU, {args.workspaces} workspaces with nothing new, % of a core",
            IDLE_CPU_PERCENT,
            figures["dispatcher_cpu_percent"],
        ).line(idle_size),
        Target(
            f"{kind}: one new event in each of {args.new} workspaces, all enqueued, s",
            DECIDE_S,
            figures["decided_s"],
        ).line(new_size),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.idle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workspaces", type=int, default=JUDGED_WORKSPACES)
    parser.add_argument("--new", type=int, default=JUDGED_NEW, help="workspaces given an event")
    parser.add_argument("--window-s", type=float, default=30.0, help="the idle window")
    parser.add_argument("--settle-s", type=float, default=900.0, help="for the first pass")
    parser.add_argument(
        "--decide-timeout-s", type=float, default=600.0, help="for every run to be enqueued"
    )
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument("--keep", action="store_true", help="keep each case's home")
    args = parser.parse_args(argv)
    if args.workspaces < 1 or not 1 <= args.new <= args.workspaces:
        parser.error("--workspaces must be at least 1, and --new between 1 and --workspaces")
    if min(args.window_s, args.settle_s, args.decide_timeout_s) <= 0:
        parser.error("--window-s, --settle-s and --decide-timeout-s must be above 0")
    quiet_logging()
    emit({"bench": "machine", **machine()})
    lines: list[dict[str, Any]] = []
    for kind in available_storages("idle", args.storage):
        with deployment(kind, f"idle-{kind}", keep=args.keep, app=APP) as deployed:
            figures = measure(deployed, args)
        emit(figures)
        lines += verdicts(figures, args)
    for line in lines:
        emit(line)


if __name__ == "__main__":
    main()
