"""relayr's benchmarks: each prints its figures as JSON, one object per line, on stdout.

- :mod:`bench.end_to_end` (``make bench``): publish ``deploy:finished`` events, run them on real
  ``celery worker`` processes, measure runs per second and publish-to-notice latency; with
  ``--all``, the whole sweep, the floor, the transaction counts and the memory check.
- :mod:`bench.floor`: the same storage's floor, bare notice commits as an external agent.
- :mod:`bench.transactions`: SQL transactions per notice run, publish included, and per
  dispatcher pass, counted in every process.
- :mod:`bench.memory`: a pool process's peak RSS after 200 runs and after 5,000.

They are measurements, not tests: nothing here asserts a target. ``docs/performance.md`` has
the figures and what bounds them; ``tests/test_bench.py`` only checks that each one runs.
"""
