"""Fairness between workspaces: a quiet workspace's latency while another one floods.

``python -m bench.fairness`` runs ``relayr run`` (the dispatcher and a worker subprocess, default
settings) on a storage of the case's own and, one after the other on the same processes, in
workspaces of one tenant made for each phase:

1. ``quiet alone``: ``--quiet`` events (60), one a second, into a workspace alone, by one
   ``relayr publish --stream`` fed a line at a time (``--publishing stream``, the default, as an
   application publishes) or a ``relayr publish`` per event (``process``): the quiet
   workspace's latency without a flood;
2. for each flood size F of ``--floods`` (2000 5000):

   - ``flood alone``: F events published at once into a workspace (``relayr publish
     --data-file``, one process): the flood's throughput alone;
   - ``flood and quiet``: the same flood into another workspace, then, as soon as it is
     published, ``--quiet`` events one a second into a quiet workspace: the quiet workspace's
     latency during the flood, and the flood's throughput beside it.

Latency is a notice's commit time minus its event's publish time, throughput a flood's events
over the time from its first event's publish to its last notice's commit, all read from the
stores (:mod:`bench.stamps`), with where the quiet events' time went (``quiet_stages_ms``: to
their runs made, to claimed, to the notice). One JSON line per phase, then one verdict line per
target (:mod:`bench.verdicts`): during each flood the quiet workspace's p99 at most
:data:`P99_OVER_ALONE` times its p99 alone; the quiet p99s of the two largest floods within
:data:`FLOODS_APART` of each other; each flood's throughput beside the quiet workspace at least
:data:`THROUGHPUT_KEPT` of its throughput alone. A run smaller than :data:`JUDGED_FLOODS` and
:data:`JUDGED_QUIET` prints them marked not judged. Only the command line and the stores are
used, so it measures whichever dispatcher ``relayr run`` starts.
"""

import argparse
import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from bench.common import STORAGES, available_storages, emit, machine, note, quiet_logging
from bench.deployed import PUBLISHINGS, Deployment, deployment
from bench.stamps import (
    Stages,
    Stores,
    deploy,
    latencies_ms,
    latency_summary,
    stage_summaries,
    thread_of,
)
from bench.verdicts import Target, divided
from relayr.cli.helpers import reserve_for

P99_OVER_ALONE: Final = 2.0
"""The quiet workspace's p99 during a flood, over its p99 alone, at most."""

FLOODS_APART: Final = 1.2
"""The larger of the two largest floods' quiet p99s over the smaller, at most: the delay a
flood causes must not grow with its size."""

THROUGHPUT_KEPT: Final = 0.9
"""A flood's throughput beside the quiet workspace over its throughput alone, at least."""

JUDGED_FLOODS: Final = (2000, 5000)
JUDGED_QUIET: Final = 60

WARM_UP_S: Final = 180.0
"""How long the warm-up event's notice may take: the processes' start, the first migration."""


def wait_s(events: int) -> float:
    """How long a phase may take to see its notices: generous, on a busy host."""
    return 300.0 + events * 2.0


async def warm_up(deployed: Deployment, stores: Stores) -> None:
    """One event through the whole path, before anything is measured."""
    (thread,) = await stores.create_threads("warm-up", 1)
    watch = await stores.watch(["warm-up"])
    async with deployed.publisher("warm-up", "fairness-warm-up") as publisher:
        await asyncio.to_thread(publisher.publish, deploy("warm-up", thread))
    if not await watch.until(["warm-up"], WARM_UP_S):
        raise SystemExit(f"the warm-up event's notice did not come: see {deployed.home}")


class Phase:
    """One phase's workspaces: a flood (or none) and a quiet series (or none)."""

    def __init__(self, name: str, flood: int, quiet: int, tag: str) -> None:
        self.name, self.flood, self.quiet = name, flood, quiet
        self.flood_workspace = f"flood-{tag}"
        self.quiet_workspace = f"quiet-{tag}"
        self.flood_services = [f"{tag}-f{index:05d}" for index in range(flood)]
        self.quiet_services = [f"{tag}-q{index:05d}" for index in range(quiet)]

    async def run(self, deployed: Deployment, stores: Stores, interval_s: float) -> dict[str, Any]:
        flood_threads = await stores.create_threads(self.flood_workspace, self.flood)
        quiet_threads = await stores.create_threads(self.quiet_workspace, self.quiet)
        watched = [name for name, count in self.workspaces() if count]
        watch = await stores.watch(watched)
        load_before = machine()["load_avg"]
        async with contextlib.AsyncExitStack() as publishing:
            publisher = None
            if self.quiet:  # started before the flood: its start is not beside the flood
                publisher = await publishing.enter_async_context(
                    deployed.publisher(self.quiet_workspace, self.quiet_workspace)
                )
            publish_s = None
            if self.flood:
                rows = [
                    deploy(service, thread_of(flood_threads, index))
                    for index, service in enumerate(self.flood_services)
                ]
                publish_s = await asyncio.to_thread(
                    deployed.publish_file,
                    self.flood_workspace,
                    rows,
                    id_prefix=self.flood_workspace,
                )
            if publisher is not None:
                quiet_rows = [
                    deploy(service, thread_of(quiet_threads, index))
                    for index, service in enumerate(self.quiet_services)
                ]
                await publisher.paced(quiet_rows, interval_s)
        services = [*self.flood_services, *self.quiet_services]
        complete = await watch.until(services, wait_s(len(services)))
        published = {
            **await stores.published(self.flood_workspace),
            **await stores.published(self.quiet_workspace),
        }
        figures: dict[str, Any] = {
            "bench": "fairness",
            **deployed.described,
            "phase": self.name,
            "flood": self.flood,
            "quiet": self.quiet,
            "interval_s": interval_s,
            "complete": complete,
            "duplicates": watch.duplicates,
        }
        if self.flood:
            figures.update(self._flood_figures(published, watch.seen, publish_s))
        if self.quiet:
            stages = await stores.stages(self.quiet_workspace)
            figures.update(self._quiet_figures(published, watch.seen, stages))
        figures["load_avg"] = {"before": load_before, "after": machine()["load_avg"]}
        return figures

    def workspaces(self) -> list[tuple[str, int]]:
        return [(self.flood_workspace, self.flood), (self.quiet_workspace, self.quiet)]

    def _flood_figures(
        self,
        published: Mapping[str, datetime],
        noticed: Mapping[str, datetime],
        publish_s: float | None,
    ) -> dict[str, Any]:
        starts = [published[s] for s in self.flood_services if s in published]
        ends = [noticed[s] for s in self.flood_services if s in noticed]
        span_s = (max(ends) - min(starts)).total_seconds() if starts and ends else None
        return {
            "flood_notices": len(ends),
            "flood_publish_s": None if publish_s is None else round(publish_s, 2),
            "flood_s": None if span_s is None else round(span_s, 2),
            "flood_runs_per_s": None if not span_s else round(len(ends) / span_s, 1),
        }

    def _quiet_figures(
        self,
        published: Mapping[str, datetime],
        noticed: Mapping[str, datetime],
        stages: Mapping[str, Stages],
    ) -> dict[str, Any]:
        milliseconds = latencies_ms(published, noticed, self.quiet_services)
        figures: dict[str, Any] = {
            "quiet_notices": len(milliseconds),
            "quiet_latency_ms": latency_summary(milliseconds),
            "quiet_stages_ms": stage_summaries(stages, noticed, self.quiet_services),
        }
        if self.flood:
            ends = [noticed[s] for s in self.flood_services if s in noticed]
            drained = max(ends) if ends else None
            figures["quiet_published_during_flood"] = sum(
                1
                for service in self.quiet_services
                if service in published and drained is not None and published[service] <= drained
            )
        return figures


async def measure(
    deployed: Deployment,
    floods: Sequence[int],
    quiet: int,
    interval_s: float,
    processes: tuple[int, int | None],
) -> list[dict[str, Any]]:
    """Every phase on one ``relayr run`` of ``processes`` (its ``--concurrency`` and
    ``--reserve``), one after the other; their figures."""
    results = []
    concurrency, given = processes
    reserve = reserve_for(deployed.settings, given)
    async with Stores.opened(deployed.settings) as stores:
        deployed.start(
            "run", "--concurrency", str(concurrency), "--reserve", str(reserve), name="run"
        )
        await warm_up(deployed, stores)
        phases = [Phase("quiet alone", 0, quiet, "alone")]
        for flood in floods:
            phases.append(Phase("flood alone", flood, 0, f"{flood}-alone"))
            phases.append(Phase("flood and quiet", flood, quiet, f"{flood}-beside"))
        for phase in phases:
            note(f"{deployed.storage.kind}: {phase.name}, flood {phase.flood}, quiet {phase.quiet}")
            figures = await phase.run(deployed, stores, interval_s)
            figures["worker_processes"] = concurrency
            figures["reserve_processes"] = reserve
            emit(figures)
            results.append(figures)
    return results


def verdicts(results: Sequence[Mapping[str, Any]], size: str) -> list[dict[str, Any]]:
    """One line per target, from one storage's phases."""
    kind = results[0]["storage"]
    by_phase = {(line["phase"], line["flood"]): line for line in results}
    alone_p99 = by_phase[("quiet alone", 0)]["quiet_latency_ms"]["p99"]
    floods = sorted({line["flood"] for line in results if line["flood"]})
    targets = []
    during: dict[int, float | None] = {}
    for flood in floods:
        beside = by_phase[("flood and quiet", flood)]
        during[flood] = beside["quiet_latency_ms"]["p99"]
        targets.append(
            Target(
                f"{kind}: quiet workspace's p99 during a flood of {flood} / alone",
                P99_OVER_ALONE,
                divided(during[flood], alone_p99),
            )
        )
    if len(floods) >= 2:
        smaller, larger = (during[flood] for flood in floods[-2:])
        apart = None
        if smaller and larger:
            apart = round(max(smaller, larger) / min(smaller, larger), 2)
        targets.append(
            Target(
                f"{kind}: quiet workspace's p99, flood of {floods[-1]} against {floods[-2]}",
                FLOODS_APART,
                apart,
            )
        )
    for flood in floods:
        targets.append(
            Target(
                f"{kind}: throughput of a flood of {flood} beside the quiet workspace / alone",
                THROUGHPUT_KEPT,
                divided(
                    by_phase[("flood and quiet", flood)]["flood_runs_per_s"],
                    by_phase[("flood alone", flood)]["flood_runs_per_s"],
                ),
                higher_is_better=True,
            )
        )
    return [target.line(size) for target in targets]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--floods", type=int, nargs="+", default=list(JUDGED_FLOODS), help="flood sizes"
    )
    parser.add_argument("--quiet", type=int, default=JUDGED_QUIET, help="quiet events a phase")
    parser.add_argument("--interval-s", type=float, default=1.0, help="between quiet events")
    parser.add_argument("--concurrency", type=int, default=2, help="the worker's processes")
    parser.add_argument(
        "--reserve",
        type=int,
        default=None,
        help="the worker's processes kept for lone messages (default: relayr's, by database)",
    )
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument(
        "--publishing",
        choices=PUBLISHINGS,
        default="stream",
        help="the quiet events: one relayr publish --stream, or a relayr publish per event",
    )
    parser.add_argument("--keep", action="store_true", help="keep each case's home")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of relayr run's (a Settings field name, e.g. fair_batch=5); repeatable",
    )
    args = parser.parse_args(argv)
    settings: dict[str, str] = {}
    for given in args.settings:
        name, sep, value = given.partition("=")
        if not sep or not name:
            parser.error(f"--set {given!r}: expected NAME=VALUE")
        settings[name] = value
    if min(args.floods) < 1 or args.quiet < 1 or args.interval_s <= 0 or args.concurrency < 1:
        parser.error("--floods, --quiet and --concurrency must be at least 1, --interval-s above 0")
    if args.reserve is not None and args.reserve < 0:
        parser.error("--reserve must be at least 0")
    floods = sorted(set(args.floods))
    quiet_logging()
    emit({"bench": "machine", **machine(), "settings": settings})
    judged = set(JUDGED_FLOODS) <= set(floods) and args.quiet >= JUDGED_QUIET
    lines: list[dict[str, Any]] = []
    for kind in available_storages("fairness", args.storage):
        with deployment(
            kind,
            f"fairness-{kind}",
            keep=args.keep,
            publishing=args.publishing,
            **settings,
        ) as deployed:
            results = asyncio.run(
                measure(
                    deployed,
                    floods,
                    args.quiet,
                    args.interval_s,
                    (args.concurrency, args.reserve),
                )
            )
        lines += verdicts(results, "full" if judged else "small")
    for line in lines:
        emit(line)


if __name__ == "__main__":
    main()
