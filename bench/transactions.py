"""SQL transactions per notice run, the publish included, and per dispatcher pass.

``python -m bench.transactions --storage sqlite postgres --n 200`` runs the end-to-end case
(:mod:`bench.end_to_end`) and reports its transaction counts: SQLAlchemy's ``begin`` events,
counted on every engine of every process. The workers' pool processes count their own
(:func:`bench.common.create_app`, named by ``RELAYR_APP``) and write them to a file each; this
process counts its publisher's, its dispatcher's and its poller's engines apart. Counts are
taken once the workers are idle, before the first publish and after the last run, so a
process's start (migrations, recovery) is left out.

- ``per_notice_run``: the workers' transactions per run, plus one ``publish`` per event;
- ``per_dispatch_pass``: the dispatcher's transactions per pass (its reads, one evaluation
  transaction per workspace with new envelopes (ADR-0028), the follower's batches, the due
  runs' read when it is due); ``dispatch_per_run`` the same spread over the runs;
- ``all_counted``: ``per_notice_run`` plus ``dispatch_per_run``, the figure the target judges
  (:data:`bench.targets.TRANSACTIONS_PER_NOTICE_RUN`: at most 4), and ``met``;
- the workers' ``rollback`` count: transactions that ended without a commit (reads).

``--limit`` measures the same case with a limit that binds every rule and never refuses
(:data:`LIMITS`): the figures less those of ``--limit none`` are what a limit costs a run.
"""

import argparse
from collections.abc import Sequence
from typing import Any, Final

from bench.cases import Case, run_case
from bench.common import STORAGES, emit, quiet_logging, storage_available
from bench.targets import TRANSACTIONS_PER_NOTICE_RUN, all_counted

LIMITS: Final = {
    "none": "",
    "runs_in_flight": '[limits.bench]\nrules = ["*"]\nruns_in_flight = 100000',
    "chain_runs_per": '[limits.bench]\nrules = ["*"]\nchain_runs_per = "100000/1h"',
}
"""Limits on every rule, too high to refuse a run: an in-flight slot (taken and given back)
and a window's use (taken)."""


def measure(
    storage: str, n: int, workers: int = 1, limit: str = "none", rate: float | None = None
) -> dict[str, Any]:
    case = Case(
        storage=storage,  # type: ignore[arg-type]
        n=n,
        workers=workers,
        limits=LIMITS[limit],
        rate=rate,
    )
    (figures,) = run_case(case)
    counted = figures["transactions"]
    everything = all_counted(counted)
    return {
        "bench": "transactions",
        "storage": storage,
        "n": n,
        "worker_processes": workers,
        "limit": limit,
        "rate": rate,
        "per_notice_run": counted["notice_run_with_publish"],
        "all_counted": everything,
        "all_counted_target": TRANSACTIONS_PER_NOTICE_RUN,
        "met": everything is not None and everything <= TRANSACTIONS_PER_NOTICE_RUN,
        "worker_per_run": counted["worker_per_run"],
        "publish_per_run": counted["publish_per_run"],
        "per_dispatch_pass": counted["dispatch_per_pass"],
        "dispatch_passes": counted["dispatch_passes"],
        "dispatch_per_run": counted["dispatch_per_run"],
        "worker": counted["worker"],
        "publish": counted["publish"],
        "dispatch": counted["dispatch"],
        "outcomes": figures["outcomes"],
        "notices": figures["notices"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transactions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument("--limit", nargs="+", choices=list(LIMITS), default=["none"])
    parser.add_argument(
        "--rate", type=float, default=None, help="events a second (default: all at once)"
    )
    args = parser.parse_args(argv)
    quiet_logging()
    for storage in args.storage:
        if not storage_available(storage):
            emit({"bench": "transactions", "storage": storage, "skipped": "a service is down"})
            continue
        for limit in args.limit:
            emit(measure(storage, args.n, args.workers, limit, args.rate))


if __name__ == "__main__":
    main()
