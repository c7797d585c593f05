"""The throughput targets, measured and judged: ``make bench``.

``python -m bench.targets`` runs, one after the other on this machine (nothing else of the
benchmark's runs meanwhile), the cases the targets name, each with the floor measured in the
same run (:mod:`bench.floor`), prints every case's figures as the other modules do (one JSON
object per line), then one verdict line per target::

    {"bench": "verdict", "target": "...", "limit": ..., "figure": ..., "verdict": "met"}

The targets (docs/performance.md), their limits the constants below:

1. N=1000 notice runs, one workspace, 2 worker processes, a burst, both orderings, embedded
   SQLite and Redis + PostgreSQL: at most 4 times the floor per run;
2. at most 4 SQL transactions per notice run, everything counted (publish, dispatcher, worker);
3. ``scope`` ordering within 1.5 times ``none``;
4. no duplicate delivery in a burst of 5,000 with default settings, N=5000 within 1.2 times
   N=200 per run, and a pool process's peak RSS flat (within 10 % of N=200's at N=5000);
5. 8 workspaces on PostgreSQL: 2 worker processes at least 1.7 times the throughput of 1.

``--quick`` runs N=200 instead of 1000, and 1000 and 100 instead of 5000 and 200 (for a first
look); ``--tiny`` runs N=6, and 12 and 6 (for a test that everything runs). Neither judges the
targets: their verdicts say so. ``--storage`` chooses the storages of the per-storage cases
(both by default, PostgreSQL only when it and Redis answer); the burst cases of target 4 run on
the embedded SQLite, which they name.
"""

import argparse
from collections.abc import Mapping, Sequence
from typing import Any, Final

from bench import floor
from bench.cases import Case, run_case
from bench.common import (
    STORAGES,
    StorageKind,
    emit,
    machine,
    note,
    quiet_logging,
    storage_available,
)
from bench.verdicts import Target, divided

DEFAULT_DISPATCH_INTERVAL_S: Final = 1.0
"""``RELAYR_DISPATCH_INTERVAL_S``'s default, for the case that must run on default settings."""

FLOOR_RATIO: Final = 4.0
"""Target 1: a notice run may cost at most this many times one bare notice commit."""

TRANSACTIONS_PER_NOTICE_RUN: Final = 4.0
"""Target 2: SQL transactions per notice run, everything counted (the workers', the publish's
and the dispatcher's share). :mod:`bench.transactions` judges the same figure against it."""

SCOPE_OVER_NONE: Final = 1.5
"""Target 3: how much slower per run reflexr's default ordering may be than ``none``."""

BIG_OVER_SMALL: Final = 1.2
"""Target 4: how much slower per run a burst of 5,000 may be than one of 200."""

RSS_FLAT: Final = 1.10
"""Target 4: how much a pool process's peak RSS may grow from 200 runs to 5,000 and still be
flat."""

TWO_OVER_ONE: Final = 1.7
"""Target 5: the throughput 2 worker processes must reach over 1, on 8 workspaces."""

DECLINED: Final = frozenset({"not_due", "contended", "missing"})
"""The outcomes of a delivery a worker declined, doing nothing: a duplicate or stale message.
A run that failed (``retrying``, ``dead``) or was ``abandoned`` is no duplicate delivery."""

SIZES: Final[Mapping[str, tuple[int, int, int]]] = {
    "full": (1000, 5000, 200),
    "quick": (200, 1000, 100),
    "tiny": (6, 12, 6),
}
"""N of the per-storage cases, then the big and the small burst of target 4, by size."""


def all_counted(transactions: Mapping[str, Any]) -> float | None:
    """A case's SQL transactions per notice run, everything counted (target 2)."""
    with_publish = transactions["notice_run_with_publish"]
    dispatch = transactions["dispatch_per_run"]
    if with_publish is None or dispatch is None:
        return None
    return round(with_publish + dispatch, 2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.targets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="smaller N, verdicts not judged")
    sizes.add_argument("--tiny", action="store_true", help="N of a few, verdicts not judged")
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    quiet_logging()
    emit({"bench": "machine", **machine()})
    n, big, small = SIZES[size]
    wanted: list[StorageKind] = args.storage
    storages = [kind for kind in ("sqlite", "postgres") if kind in wanted]
    for kind in storages:
        if not storage_available(kind):
            emit({"bench": "targets", "storage": kind, "skipped": "PostgreSQL or Redis is down"})
    storages = [kind for kind in storages if storage_available(kind)]
    figures: dict[str, dict[str, Any]] = {}

    def case(key: str, **fields: Any) -> dict[str, Any]:
        note(f"target case {key}")
        results = run_case(Case(**fields))
        for result in results:
            emit({"bench": "end_to_end", "case": key, **result})
        figures[key] = results[-1]
        return results[-1]

    floors = {}
    for storage in storages:
        measured = floor.measure(storage, n)
        emit(measured)
        floors[storage] = measured["ms_per_commit"]
    for storage in storages:
        for ordering in ("none", "scope"):
            case(f"{storage}-{ordering}", storage=storage, n=n, workers=2, ordering=ordering)
    for count in (small, big):
        case(
            f"sqlite-n{count}",
            storage="sqlite",
            n=count,
            workers=2,
            dispatch_interval_s=DEFAULT_DISPATCH_INTERVAL_S,
        )
    if "postgres" in storages:
        for workers in (1, 2):
            case(f"postgres-ws8-w{workers}", storage="postgres", n=n, workers=workers, workspaces=8)

    targets: list[Target] = []

    def ratio(key: str, storage: str) -> float | None:
        found = figures.get(key, {}).get("ms_per_run")
        return None if found is None else round(found / floors[storage], 2)

    for storage in storages:
        for ordering in ("none", "scope"):
            targets.append(
                Target(
                    f"{storage} {ordering}: ms per run / floor",
                    FLOOR_RATIO,
                    ratio(f"{storage}-{ordering}", storage),
                )
            )
            targets.append(
                Target(
                    f"{storage} {ordering}: SQL transactions per notice run, all counted",
                    TRANSACTIONS_PER_NOTICE_RUN,
                    all_counted(figures[f"{storage}-{ordering}"]["transactions"]),
                )
            )
        scope, none = (figures[f"{storage}-{o}"]["ms_per_run"] for o in ("scope", "none"))
        targets.append(
            Target(f"{storage}: scope / none per run", SCOPE_OVER_NONE, divided(scope, none))
        )
    burst, first = figures[f"sqlite-n{big}"], figures[f"sqlite-n{small}"]
    targets += [
        Target(f"sqlite: duplicate deliveries in a burst of {big}", 0, _duplicates(burst)),
        Target(
            f"sqlite: per run, N={big} / N={small}",
            BIG_OVER_SMALL,
            divided(burst["ms_per_run"], first["ms_per_run"]),
        ),
        Target(
            f"sqlite: pool peak RSS, N={big} / N={small}",
            RSS_FLAT,
            _peak(burst, first),
        ),
    ]
    if "postgres" in storages:
        one, two = (figures[f"postgres-ws8-w{w}"]["ms_per_run"] for w in (1, 2))
        targets.append(
            Target(
                "postgres, 8 workspaces: throughput of 2 worker processes / 1",
                TWO_OVER_ONE,
                divided(one, two),
                higher_is_better=True,
            )
        )
    for target in targets:
        emit(target.line(size))


def _duplicates(figures: dict[str, Any]) -> int:
    """Deliveries the workers declined (the run was not due, held or missing:
    :data:`DECLINED`), plus the runs the dispatcher enqueued again (its copies)."""
    declined = sum(count for outcome, count in figures["outcomes"].items() if outcome in DECLINED)
    return declined + int(figures["copies"])


def _peak(later: dict[str, Any], earlier: dict[str, Any]) -> float | None:
    """The highest pool process peak RSS of ``later`` over that of ``earlier``."""
    highest = [max(f["rss_kib"][pid]["VmHWM"] for pid in f["rss_kib"]) for f in (later, earlier)]
    return divided(highest[0], highest[1])


if __name__ == "__main__":
    main()
