"""Publish to notice, one event at a time: how long a run waits to be decided, run and written.

``python -m bench.latency`` measures what a new user sees: ``relayr run`` (the dispatcher and a
worker subprocess, default settings) on a storage of the case's own, and ``deploy:finished``
events published from another process, one every ``--interval-s`` (1 s), ``--n`` of them (100):
by one ``relayr publish --stream`` fed a line at a time (``--publishing stream``, the default,
as an application publishes), or by a ``relayr publish`` process per event (``process``). Each
event's latency is its notice's commit time (artifactr's ``message_posted`` envelope) minus its
publish time (reflexr's envelope), both read from the stores (:mod:`bench.stamps`); one warm-up
event first, not counted.

Per storage (``--storage sqlite postgres``: the embedded default, and Redis with PostgreSQL
when both answer), one JSON line::

    {"bench": "latency", "storage": "sqlite", "n": 100, "latency_ms": {"p50": ..., "p90": ...,
     "p99": ..., "max": ...}, "stages_ms": {"decide": ..., "queue": ..., "act": ...},
     "notices": 100, "complete": true, ...}

where ``stages_ms`` splits the latency at the run's making and its claim (the same four
figures each).

then one verdict line per target (:mod:`bench.verdicts`): p50 ≤ 100 ms and p99 ≤ 400 ms on the
embedded default, p50 ≤ 50 ms and p99 ≤ 250 ms on Redis + PostgreSQL. A run of fewer than
:data:`JUDGED_N` events prints them marked not judged. Only the command line and the stores are
used, so it measures whichever dispatcher ``relayr run`` starts.
"""

import argparse
import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Final

from bench.common import (
    STORAGES,
    StorageKind,
    available_storages,
    emit,
    machine,
    note,
    quiet_logging,
)
from bench.deployed import PUBLISHINGS, Deployment, deployment
from bench.stamps import (
    Stores,
    deploy,
    latencies_ms,
    latency_summary,
    stage_summaries,
    thread_of,
)
from bench.verdicts import Target

LIMITS_MS: Final[Mapping[StorageKind, tuple[float, float]]] = {
    "sqlite": (100.0, 400.0),
    "postgres": (50.0, 250.0),
}
"""Each storage's p50 and p99 targets, publish to notice committed, in milliseconds."""

JUDGED_N: Final = 100
"""The fewest events whose p99 means something: a run of fewer is not judged."""

WORKSPACE: Final = "ops"

WARM_UP_S: Final = 180.0
"""How long the warm-up event's notice may take: the processes' start, the first migration."""


async def measure(
    deployed: Deployment, n: int, interval_s: float, concurrency: int
) -> dict[str, Any]:
    """Start ``relayr run`` in ``deployed``, warm it up, publish ``n`` events, read the figures."""
    async with Stores.opened(deployed.settings) as stores:
        threads = await stores.create_threads(WORKSPACE, n + 1)
        deployed.start("run", "--concurrency", str(concurrency), name="run")
        watch = await stores.watch([WORKSPACE])
        async with deployed.publisher(WORKSPACE, "latency") as publisher:
            await asyncio.to_thread(publisher.publish, deploy("warm-up", threads[0]))
            if not await watch.until(["warm-up"], WARM_UP_S):
                raise SystemExit(f"the warm-up event's notice did not come: see {deployed.home}")
            services = [f"svc-{index:05d}" for index in range(n)]
            rows = [
                deploy(service, thread_of(threads, index + 1))
                for index, service in enumerate(services)
            ]
            load_before = machine()["load_avg"]
            await publisher.paced(rows, interval_s)
        complete = await watch.until(services, timeout_s=120.0 + n * 0.5)
        published = await stores.published(WORKSPACE)
        stages = await stores.stages(WORKSPACE)
    milliseconds = latencies_ms(published, watch.seen, services)
    return {
        "bench": "latency",
        **deployed.described,
        "n": n,
        "interval_s": interval_s,
        "worker_processes": concurrency,
        "notices": len(milliseconds),
        "complete": complete,
        "duplicates": watch.duplicates,
        "latency_ms": latency_summary(milliseconds),
        "stages_ms": stage_summaries(stages, watch.seen, services),
        "load_avg": {"before": load_before, "after": machine()["load_avg"]},
    }


def verdicts(figures: Mapping[str, Any], size: str) -> list[dict[str, Any]]:
    kind: StorageKind = figures["storage"]
    p50, p99 = LIMITS_MS[kind]
    measured = figures["latency_ms"]
    return [
        Target(f"{kind}: publish to notice p50, ms", p50, measured["p50"]).line(size),
        Target(f"{kind}: publish to notice p99, ms", p99, measured["p99"]).line(size),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, default=JUDGED_N, help="events measured")
    parser.add_argument("--interval-s", type=float, default=1.0, help="between two publishes")
    parser.add_argument("--concurrency", type=int, default=2, help="the worker's processes")
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument(
        "--publishing",
        choices=PUBLISHINGS,
        default="stream",
        help="one relayr publish --stream, or a relayr publish per event",
    )
    parser.add_argument("--keep", action="store_true", help="keep each case's home")
    args = parser.parse_args(argv)
    if args.n < 1 or args.interval_s <= 0 or args.concurrency < 1:
        parser.error("--n and --concurrency must be at least 1, --interval-s above 0")
    quiet_logging()
    emit({"bench": "machine", **machine()})
    size = "full" if args.n >= JUDGED_N else "small"
    lines: list[dict[str, Any]] = []
    for kind in available_storages("latency", args.storage):
        note(f"latency on {kind}: {args.n} events, one every {args.interval_s} s")
        with deployment(
            kind, f"latency-{kind}", keep=args.keep, publishing=args.publishing
        ) as deployed:
            figures = asyncio.run(measure(deployed, args.n, args.interval_s, args.concurrency))
        emit(figures)
        lines += verdicts(figures, size)
    for line in lines:
        emit(line)


if __name__ == "__main__":
    main()
