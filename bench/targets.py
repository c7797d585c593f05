"""The throughput targets, measured and judged: ``make bench``.

``python -m bench.targets`` runs, one after the other on this machine (nothing else of the
benchmark's runs meanwhile), the cases the targets name, each with the floor measured in the
same run (:mod:`bench.floor`), prints every case's figures as the other modules do (one JSON
object per line), then one verdict line per target::

    {"bench": "verdict", "target": "...", "limit": ..., "figure": ..., "verdict": "met"}

The targets (docs/performance.md):

1. N=1000 notice runs, one workspace, 2 worker processes, a burst, both orderings, embedded
   SQLite and Redis + PostgreSQL: at most 4 times the floor per run;
2. at most 4 SQL transactions per notice run, everything counted (publish, dispatcher, worker);
3. ``scope`` ordering within 1.5 times ``none``;
4. no duplicate delivery in a burst of 5,000 with default settings, N=5000 within 1.2 times
   N=200 per run, and a pool process's peak RSS flat (within 10 % of N=200's at N=5000);
5. 8 workspaces on PostgreSQL: 2 worker processes at least 1.7 times the throughput of 1.

``--quick`` runs N=200 instead of 1000 and 1000 instead of 5000 (for a first look; its
verdicts do not judge the targets).
"""

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from bench import floor
from bench.cases import Case, run_case
from bench.common import emit, machine, note, quiet_logging, storage_available

DEFAULT_DISPATCH_INTERVAL_S: Final = 1.0
"""``RELAYR_DISPATCH_INTERVAL_S``'s default, for the case that must run on default settings."""

RSS_FLAT: Final = 1.10
"""How much a pool process's peak RSS may grow from 200 runs to 5,000 and still be flat."""


@dataclass(frozen=True)
class Target:
    name: str
    limit: float
    figure: float | None
    higher_is_better: bool = False

    def line(self, quick: bool) -> dict[str, Any]:
        if self.figure is None:
            verdict = "not measured"
        elif self.higher_is_better:
            verdict = "met" if self.figure >= self.limit else "missed"
        else:
            verdict = "met" if self.figure <= self.limit else "missed"
        return {
            "bench": "verdict",
            "target": self.name,
            "limit": self.limit,
            "figure": self.figure,
            "verdict": verdict + (" (quick run: not judged)" if quick else ""),
        }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.targets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller N, verdicts not judged")
    args = parser.parse_args(argv)
    quiet_logging()
    emit({"bench": "machine", **machine()})
    n, big, small = (200, 1000, 100) if args.quick else (1000, 5000, 200)
    storages = [kind for kind in ("sqlite", "postgres") if storage_available(kind)]
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
        measured = floor.measure(storage, n)  # type: ignore[arg-type]
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
                    4.0,
                    ratio(f"{storage}-{ordering}", storage),
                )
            )
            transactions = figures[f"{storage}-{ordering}"]["transactions"]
            targets.append(
                Target(
                    f"{storage} {ordering}: SQL transactions per notice run, all counted",
                    4.0,
                    round(
                        transactions["notice_run_with_publish"] + transactions["dispatch_per_run"],
                        2,
                    ),
                )
            )
        scope, none = (figures[f"{storage}-{o}"]["ms_per_run"] for o in ("scope", "none"))
        targets.append(Target(f"{storage}: scope / none per run", 1.5, _divided(scope, none)))
    burst, first = figures[f"sqlite-n{big}"], figures[f"sqlite-n{small}"]
    targets += [
        Target(f"sqlite: duplicate deliveries in a burst of {big}", 0, _duplicates(burst)),
        Target(
            f"sqlite: per run, N={big} / N={small}",
            1.2,
            _divided(burst["ms_per_run"], first["ms_per_run"]),
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
                1.7,
                _divided(one, two),
                higher_is_better=True,
            )
        )
    for target in targets:
        emit(target.line(args.quick))


def _duplicates(figures: dict[str, Any]) -> int:
    """Deliveries the workers declined (the run was done or held), plus the dispatcher's copies."""
    declined = sum(
        count for outcome, count in figures["outcomes"].items() if outcome != "succeeded"
    )
    return declined + int(figures["copies"])


def _peak(later: dict[str, Any], earlier: dict[str, Any]) -> float | None:
    """The highest pool process peak RSS of ``later`` over that of ``earlier``."""
    highest = [max(f["rss_kib"][pid]["VmHWM"] for pid in f["rss_kib"]) for f in (later, earlier)]
    return _divided(highest[0], highest[1])


def _divided(top: float | None, bottom: float | None) -> float | None:
    if top is None or not bottom:
        return None
    return round(top / bottom, 2)


if __name__ == "__main__":
    main()
