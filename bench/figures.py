"""The figures of an end-to-end case: what a round cost, what the workers' tasks did, where
the pool processes' time went (:mod:`bench.cases` measures, this module computes)."""

import asyncio
import json
import pstats
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Protocol

from bench.common import (
    EngineCounter,
    children,
    cpu_s,
    difference,
    memory_kib,
    note,
    percentile,
    postgres_backends,
    read_counts,
    run_delay_s,
    total,
)
from bench.workers import RelayrProcess
from tasks.runs import RUN_OUTCOME_LINES

IDLE_QUIET_S: Final = 1.0
"""How long the workers' transaction counts must stay unchanged for them to count as idle."""

_MESSAGE_OUTCOMES: Final = {message: outcome for outcome, (_, message) in RUN_OUTCOME_LINES.items()}


class Counting(Protocol):
    """What a probe reads of the case's dispatcher."""

    passes: int
    copies: int


class Probe:
    """Reads what a round costs: transactions, passes, CPU, wall time."""

    def __init__(
        self,
        home: Path,
        workers: Sequence[RelayrProcess],
        counters: dict[str, EngineCounter],
        dispatcher: Counting,
        database: str | None,
    ) -> None:
        self.home = home
        self.mains = [worker.process.pid for worker in workers]
        self.pool = [pid for main in self.mains for pid in children(main)]
        self.counters = counters
        self.dispatcher = dispatcher
        self.database = database

    async def backends(self) -> list[int]:
        return [] if self.database is None else await postgres_backends(self.database)

    async def read(self) -> dict[str, Any]:
        import os

        backends = await self.backends()
        return {
            "at": time.monotonic(),
            "workers": total(read_counts(self.home, self.pool)),
            "engines": {label: counter.snapshot() for label, counter in self.counters.items()},
            "passes": self.dispatcher.passes,
            "copies": self.dispatcher.copies,
            "cpu": {
                "worker_main": sum(cpu_s(pid) for pid in self.mains),
                "pool": sum(cpu_s(pid) for pid in self.pool),
                "bench": cpu_s(os.getpid()),
            },
            "backends": {pid: cpu_s(pid) for pid in backends},
            "run_queue": {
                "worker_main": sum(run_delay_s(pid) for pid in self.mains),
                "pool": sum(run_delay_s(pid) for pid in self.pool),
                "bench": run_delay_s(os.getpid()),
            },
        }

    async def idle(self, timeout_s: float = 60.0) -> None:
        """Wait until every pool process wrote its counts and they stopped changing."""
        deadline = time.monotonic() + timeout_s
        last: dict[int, dict[str, int]] | None = None
        since = time.monotonic()
        while time.monotonic() < deadline:
            counts = read_counts(self.home, self.pool)
            if len(counts) < len(self.pool) or counts != last:
                last, since = counts, time.monotonic()
            elif time.monotonic() - since >= IDLE_QUIET_S:
                return
            await asyncio.sleep(0.2)
        note(f"workers did not settle within {timeout_s} s; counts may include stragglers")


def _per(value: float, count: int, digits: int = 2) -> float | None:
    return None if count <= 0 else round(value / count, digits)


def round_figures(
    n: int,
    published: dict[str, datetime],
    seen: dict[str, datetime],
    before: dict[str, Any],
    after: dict[str, Any],
    probe: Probe,
    publish_s: float,
) -> dict[str, Any]:
    """The figures of one round, from its publish stamps, its notices and two probe reads.

    Per-run figures of the workers are over the runs whose notices are in (all of them, unless
    the round timed out); the publish's and the dispatcher's over every event published.
    """
    latencies = [
        (seen[service] - stamp).total_seconds() * 1000
        for service, stamp in published.items()
        if service in seen
    ]
    notices = [seen[service] for service in published if service in seen]
    elapsed_s = (max(notices) - min(published.values())).total_seconds() if notices else None
    workers = difference(after["workers"], before["workers"])
    engines = {
        label: difference(after["engines"][label], before["engines"][label])
        for label in after["engines"]
    }
    passes = after["passes"] - before["passes"]
    backends_cpu = sum(
        cpu - before["backends"].get(pid, 0.0) for pid, cpu in after["backends"].items()
    )
    cpu = {name: after["cpu"][name] - before["cpu"][name] for name in after["cpu"]}
    if probe.database is not None:
        cpu["postgres"] = backends_cpu
    waited = {
        name: after["run_queue"][name] - before["run_queue"][name] for name in after["run_queue"]
    }
    complete = len(notices)
    return {
        "notices": complete,
        "copies": after["copies"] - before["copies"],
        "complete": complete == n,
        "elapsed_s": None if elapsed_s is None else round(elapsed_s, 3),
        "runs_per_s": round(complete / elapsed_s, 2) if elapsed_s else None,
        "ms_per_run": round(elapsed_s * 1000 / complete, 2) if elapsed_s and complete else None,
        "publish_ms_per_event": round(publish_s * 1000 / n, 2),
        "latency_ms": {
            name: None if value is None else round(value, 1)
            for name, value in (
                ("p50", percentile(latencies, 50)),
                ("p95", percentile(latencies, 95)),
                ("p99", percentile(latencies, 99)),
                ("max", percentile(latencies, 100)),
            )
        },
        "transactions": {
            "worker_per_run": _per(workers["begin"], complete),
            "publish_per_run": _per(engines["publish"]["begin"], n),
            "notice_run_with_publish": _per(
                workers["begin"] * n / max(complete, 1) + engines["publish"]["begin"], n
            ),
            "dispatch_per_run": _per(engines["dispatch"]["begin"], n),
            "dispatch_per_pass": _per(engines["dispatch"]["begin"], passes),
            "dispatch_passes": passes,
            "bench_poll_per_run": _per(engines["watch"]["begin"], n),
            "worker": workers,
            "publish": engines["publish"],
            "dispatch": engines["dispatch"],
        },
        "cpu_ms_per_run": {name: _per(seconds * 1000, complete) for name, seconds in cpu.items()},
        "run_queue_ms_per_run": {
            name: _per(seconds * 1000, complete) for name, seconds in waited.items()
        },
        "wall_s": round(after["at"] - before["at"], 2),
        "rss_kib": {str(pid): memory_kib(pid) for pid in probe.pool},
    }


def count_outcomes(workers: Sequence[RelayrProcess]) -> dict[str, int]:
    """What the run tasks did, from the workers' JSON logs."""
    outcomes: Counter[str] = Counter()
    for worker in workers:
        for line in worker.log().splitlines():
            if not line.startswith("{"):
                continue
            try:
                message = json.loads(line).get("event")
            except ValueError:
                continue
            if message in _MESSAGE_OUTCOMES:
                outcomes[_MESSAGE_OUTCOMES[message]] += 1
    return dict(sorted(outcomes.items()))


def profile_summary(home: Path, runs: int, top: int = 25) -> dict[str, Any]:
    """The pool processes' profiles merged: the functions that took the most time per run."""
    paths = sorted(home.glob("profile-*.prof"))
    if not paths:
        return {}
    stats = pstats.Stats(*(str(path) for path in paths))
    text = home / "profile.txt"
    with text.open("w") as out:
        for order in ("tottime", "cumulative"):
            stats.stream = out  # type: ignore[attr-defined]
            stats.sort_stats(order).print_stats(60)
    rows = stats.stats  # type: ignore[attr-defined]

    def name(key: tuple[str, int, str]) -> str:
        filename, line, function = key
        short = filename.split("site-packages/")[-1].replace(str(home.parents[2]) + "/", "")
        return f"{short}:{line}({function})"

    def listing(index: int) -> list[dict[str, Any]]:
        ordered = sorted(rows.items(), key=lambda item: item[1][index], reverse=True)[:top]
        return [
            {
                "function": name(key),
                "calls_per_run": round(value[1] / runs, 2),
                "tottime_ms_per_run": round(value[2] * 1000 / runs, 3),
                "cumtime_ms_per_run": round(value[3] * 1000 / runs, 3),
            }
            for key, value in ordered
        ]

    return {"text": str(text), "by_tottime": listing(2), "by_cumtime": listing(3)}
