"""Fault scenarios' machinery: every run's effects happen once while processes and services fail.

- :mod:`~tests.faults.load`: the workers, the dispatcher, the load published in parts, figures;
- :mod:`~tests.faults.holds`: runs held inside their actions, so a fault lands while they run;
- :mod:`~tests.faults.breaks`: what each scenario breaks, and when;
- :mod:`~tests.faults.checker`: the invariants, read in the stores;
- :mod:`~tests.faults.app`: the fault application (holdable actions, a poison rule);
- :mod:`~tests.faults.private_redis`: a Redis of the test's own;
- :mod:`~tests.faults.relay`: the one place that knows the dispatcher and the run task;
- :mod:`~tests.faults.constants`: every constant, with why.

The scenarios are in tests/execution/test_faults.py;
docs/adr/0040-fault-tests-break-real-processes.md
says why they are built this way.
"""
