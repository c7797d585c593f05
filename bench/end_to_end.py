"""End to end: ``deploy:finished`` events published, notices committed by real workers.

``python -m bench.end_to_end`` measures, for each case, how fast the example application turns
published events into committed notices: one ``deploy:finished`` event per ``publish`` call
(one SQL transaction each, as a source publishes), the dispatcher in this process (relayr's
evaluation, then each due run enqueued on Celery; it follows artifactr's log back into reflexr
unless ``--no-follow``), and ``celery worker`` processes (:mod:`bench.workers`) executing the
runs. Every case has a storage of its own (:func:`bench.common.case_storage`).

Figures, per case, one JSON object per line on stdout:

- ``runs_per_s`` and ``ms_per_run``: the case's events over the time from the first event's
  publish (the reflexr envelope's ``ts``) to the last notice's commit (the artifactr envelope's
  ``ts``): both stamped by the storage's writers, so polling adds nothing to them;
- ``latency_ms``: each event's notice ``ts`` minus its publish ``ts``, p50/p95/p99/max. Events
  are published as fast as one publisher can (a burst), unless ``--rate`` paces them, so in a
  burst the latency is mostly the wait in the queue;
- ``transactions``: SQL transactions (``begin`` events of each engine), per run in the workers
  (every pool process counts its own, :func:`bench.common.create_app`), per publish, per
  dispatcher pass, and the benchmark's own polling apart;
- ``cpu_ms_per_run``: CPU time used per run by the workers' main processes, their pool
  processes, this process (publisher, dispatcher, poller) and PostgreSQL's backends;
- ``rss_kib``: each pool process's peak (``VmHWM``) and current RSS after the case;
- ``outcomes``: what the workers' run tasks did (``succeeded``, and declined duplicates);
- ``copies``: runs the dispatcher enqueued again because it presumed their message lost;
- ``floor_ms_per_commit`` and ``ratio_to_floor``: :mod:`bench.floor` on the same storage.

"Workers" is the number of pool processes: one ``celery worker`` with prefork concurrency 1 or
2 by default (``--worker-mode separate``: that many workers of concurrency 1).

``--full`` runs a sweep: N 200, 1000 and 5000 with 1 and 2 workers, N=1000 on 8 workspaces with
1 and 2 workers, and N=1000 with every rule ordered by scope (reflexr's default), on each
storage asked for; ``--all`` adds :mod:`bench.transactions` and :mod:`bench.memory`. The
targets' cases are :mod:`bench.targets`' (``make bench``).
"""

import argparse
from collections.abc import Sequence

from bench.cases import DISPATCH_INTERVAL_S, Case, run_case
from bench.common import APPS, STORAGES, emit, machine, quiet_logging, storage_available


def full_sweep(args: argparse.Namespace) -> list[Case]:
    """The ``--full`` sweep: sizes and worker counts, 8 workspaces, and ``scope``, per storage."""
    cases = [
        Case(storage=storage, n=n, workers=workers)
        for storage in args.storage
        for n in (200, 1000, 5000)
        for workers in (1, 2)
    ]
    cases += [
        Case(storage=storage, n=1000, workers=workers, workspaces=8)
        for storage in args.storage
        for workers in (1, 2)
    ]
    cases += [Case(storage=storage, n=1000, ordering="scope") for storage in args.storage]
    return cases


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.end_to_end",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1000], help="events per case")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool processes")
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument("--workspaces", type=int, nargs="+", default=[1])
    parser.add_argument("--ordering", choices=sorted(APPS), default="none")
    parser.add_argument("--worker-mode", choices=["prefork", "separate"], default="prefork")
    parser.add_argument("--rate", type=float, default=None, help="events/s (default: a burst)")
    parser.add_argument("--dispatch-interval-s", type=float, default=DISPATCH_INTERVAL_S)
    parser.add_argument("--profile", action="store_true", help="cProfile the pool processes")
    parser.add_argument(
        "--no-follow",
        action="store_true",
        help="the dispatcher does not follow artifactr's log back (the outbound path alone)",
    )
    parser.add_argument("--no-floor", action="store_true", help="skip bench.floor")
    parser.add_argument("--keep", action="store_true", help="keep each case's home")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="stop waiting for a round's notices after this long (default 300 s + 2 s per event);"
        " the figures then cover the notices in by then, with complete=false",
    )
    parser.add_argument(
        "--full", action="store_true", help="a sweep: N, workers, 8 workspaces, scope ordering"
    )
    parser.add_argument("--all", action="store_true", help="--full, transactions and memory")
    args = parser.parse_args(argv)
    from bench import floor

    quiet_logging()
    storages = [kind for kind in args.storage if storage_available(kind)]
    for kind in set(args.storage) - set(storages):
        emit({"bench": "end_to_end", "storage": kind, "skipped": "PostgreSQL or Redis is down"})
    args.storage = storages
    emit({"bench": "machine", **machine()})
    if args.full or args.all:
        cases = full_sweep(args)
    else:
        cases = [
            Case(
                storage=storage,
                n=n,
                workers=workers,
                worker_mode=args.worker_mode,
                workspaces=workspaces,
                ordering=args.ordering,
                rate=args.rate,
                dispatch_interval_s=args.dispatch_interval_s,
                profile=args.profile,
                timeout_s=args.timeout_s,
                follow=not args.no_follow,
            )
            for storage in storages
            for n in args.n
            for workspaces in args.workspaces
            for workers in args.workers
        ]
    floors: dict[tuple[str, int], float] = {}
    if not args.no_floor:
        for storage, n in sorted({(case.storage, case.n) for case in cases}):
            figures = floor.measure(storage, n)
            emit(figures)
            floors[(storage, n)] = figures["ms_per_commit"]
    for case in cases:
        for figures in run_case(case, keep=args.keep):
            base = floors.get((case.storage, case.n))
            if base is not None and figures.get("ms_per_run"):
                figures["floor_ms_per_commit"] = base
                figures["ratio_to_floor"] = round(figures["ms_per_run"] / base, 2)
            emit({"bench": "end_to_end", **figures})
    if args.all:
        from bench import memory, transactions

        for storage in storages:
            transactions.main(["--storage", storage])
            memory.main(["--storage", storage])


if __name__ == "__main__":
    main()
