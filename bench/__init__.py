"""relayr's benchmarks: each prints its figures as JSON, one object per line, on stdout.

``make bench`` runs seven of them:

- :mod:`bench.targets`: the cases the throughput targets name, each with the floor of the same
  run, then one verdict line per target (docs/performance.md, "Targets");
- :mod:`bench.latency`: publish to notice, one event a second, on ``relayr run``;
- :mod:`bench.fairness`: a quiet workspace's latency alone and beside another's flood, and the
  flood's throughput alone and beside it;
- :mod:`bench.idle`: ``relayr dispatch``'s CPU watching many workspaces with nothing new, and
  how fast it decides one new event in each of many;
- :mod:`bench.broker`: messages per second through kombu's filesystem transport and relayr's
  (ADR-0013);
- :mod:`bench.cli`: each command's wall time beside its reference (ADR-0050);
- :mod:`bench.console`: each console page's answer time with 100,000 runs in the store
  (ADR-0109).

The others measure one thing each, by hand:

- :mod:`bench.end_to_end`: publish ``deploy:finished`` events, run them on real
  ``celery worker`` processes, measure runs per second, publish-to-notice latency, SQL
  transactions, CPU and memory per case; ``--full`` a sweep of sizes, worker counts, storages,
  8 workspaces and the ``scope`` ordering, ``--all`` with the two below;
- :mod:`bench.floor`: the same storage's floor, bare notice commits as an external agent;
- :mod:`bench.transactions`: SQL transactions per notice run, publish included, and per
  dispatcher pass, counted in every process;
- :mod:`bench.memory`: a pool process's peak RSS after 200 runs and after 5,000.

What they share: :mod:`bench.cases` runs one end-to-end case (its storage, workers, publisher,
dispatcher), :mod:`bench.figures` computes a case's figures, :mod:`bench.workers` starts the
``celery worker`` processes, and :mod:`bench.common` holds the storage per case, the counting
application the workers run and what is read from ``/proc``. The latency, fairness and idle
benchmarks use relayr's command line and the stores alone, never the dispatcher's code, so they
measure whichever dispatcher ``relayr`` runs: :mod:`bench.deployed` starts relayr's commands on a
case's storage and publishes with ``relayr publish``, :mod:`bench.stamps` reads the publish and
notice times from the stores, and :mod:`bench.verdicts` prints every benchmark's verdict lines.

They are measurements, not tests: :mod:`bench.targets`, :mod:`bench.latency`,
:mod:`bench.fairness`, :mod:`bench.idle` and :mod:`bench.console` judge their targets (and
:mod:`bench.cli` says ``met`` per command), and their verdicts are printed, never asserted.
``docs/performance.md`` has the figures and what bounds them; ``tests/project/test_bench.py``,
``tests/project/test_bench_cli.py``, ``tests/project/test_bench_deciding.py`` and
``tests/project/test_bench_console.py`` only check that each one runs, at a tiny size, and prints
figures of the right shape.
"""
