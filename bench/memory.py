"""Memory: a worker pool process's peak RSS after 200 runs, and after 5,000.

``python -m bench.memory --storage sqlite`` starts one ``celery worker`` with one pool process,
publishes 200 ``deploy:finished`` events and waits for their notices, reads the pool process's
``VmHWM`` (peak RSS) and ``VmRSS`` from ``/proc/<pid>/status``, then publishes the remaining
4,800 and reads them again: the same process, so what it keeps per run shows as growth.
``bytes_per_run`` is the peak's growth over the second round's runs.
"""

import argparse
from collections.abc import Sequence
from typing import Any

from bench.cases import Case, run_case
from bench.common import STORAGES, emit, quiet_logging, storage_available


def measure(
    storage: str,
    first: int,
    total_runs: int,
    *,
    rate: float | None = None,
) -> dict[str, Any]:
    case = Case(
        storage=storage,  # type: ignore[arg-type]
        n=total_runs,
        workers=1,
        batches=(first, total_runs - first),
        rate=rate,
    )
    early, late = run_case(case)
    ((pid, at_first),) = early["rss_kib"].items()
    at_total = late["rss_kib"][pid]
    growth_kib = at_total["VmHWM"] - at_first["VmHWM"]
    return {
        "bench": "memory",
        "storage": storage,
        "rate": rate,
        "pool_pid": int(pid),
        f"after_{first}": at_first,
        f"after_{total_runs}": at_total,
        "hwm_growth_kib": growth_kib,
        "rss_growth_kib": at_total["VmRSS"] - at_first["VmRSS"],
        "bytes_per_run": round(growth_kib * 1024 / (total_runs - first), 1),
        "ms_per_run": {f"first_{first}": early["ms_per_run"], "rest": late["ms_per_run"]},
        "notices": early["notices"] + late["notices"],
        "runs_succeeded": late["runs_succeeded_total"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--first", type=int, default=200, help="runs before the first reading")
    parser.add_argument("--total", type=int, default=5000, help="runs before the second")
    parser.add_argument("--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite"])
    parser.add_argument("--rate", type=float, default=None, help="events/s (default: a burst)")
    args = parser.parse_args(argv)
    quiet_logging()
    for storage in args.storage:
        if not storage_available(storage):
            emit({"bench": "memory", "storage": storage, "skipped": "a service is down"})
            continue
        emit(measure(storage, args.first, args.total, rate=args.rate))


if __name__ == "__main__":
    main()
