"""The fault suite's constants, each with why it has its value.

Waits for a condition poll at a named interval and give up after a named, generous bound: a
bound that passes fails the scenario, it never makes anything happen.
"""

from collections.abc import Mapping
from datetime import timedelta
from typing import Final

from relayr.demo import Plan

TENANT: Final = "faults"
WORKSPACE: Final = "ops"

DEFAULT_PLAN: Final = Plan(deploys=120, incidents=12)
"""The load by default: big enough to be split into parts around every fault, small enough
that a scenario takes about a minute on a 2-core machine shared with other test runs."""

FULL_PLAN: Final = Plan(deploys=300, incidents=30)
"""The full load, with ``FAULTS_FULL_LOAD=1``: 300 deploy notices and 30 incident triage
turns under each fault, a load at which every fault lands among hundreds of runs."""

FULL_LOAD_VARIABLE: Final = "FAULTS_FULL_LOAD"

RULE_AUTHOR_PREFIX: Final = "external_agent:reflexr:"

TAKEN_CURSOR: Final = "artifactr.runner/{thread_id}/taken"
"""artifactr's Runner's cursor: messages of a thread up to this seq were taken by a turn."""

POLL_S: Final = 0.1
"""How often a wait for a file, a process or a log line looks again: often enough that a fault
follows its trigger closely, and each look costs next to nothing."""

STORE_POLL_S: Final = 0.25
"""How often a wait for the runs' state reads reflexr's store: each read loads every run of the
workspace, so it looks less often than :data:`POLL_S`."""

TURN_SETTLE_S: Final = 30.0
"""How long, once every run ended, the checker waits for the turns still running."""

HOLD_MAX_S: Final = 240.0
"""The longest an action stays held, for a test that died without releasing it: far longer
than any fault keeps a run held, so a held run waits for the test's release, never for a clock.

The longest hold is the visibility scenario's: the visibility timeout (4 s), a second worker's
start (``READY_TIMEOUT_S``, 60 s at most) and the wait for the redelivery's refusal
(:data:`REFUSAL_WAIT_S`) all pass while its run is held (the scenario checks that they fit).
A hold that gave up all the same fails its scenario, naming it
(:meth:`tests.faults.holds.Holds.check_held`): the fault would strike a run that went on."""

HELD_ACTION_TIMEOUT: Final = timedelta(seconds=HOLD_MAX_S + 60)
"""The action timeout of the fault application's rules: the example's 60 s on top of the
longest hold, so reflexr never cancels an action while it is held (the attempt would fail
``timeout`` and the run go on without the test)."""

FAULT_SETTINGS: Final[Mapping[str, object]] = {
    # a killed attempt's lease lapses in seconds, not the default half minute
    "lease_ttl_s": 4,
    # a message a broker fault lost is sent again after this long
    "requeue_after_s": 30,
    # a warm shutdown waits this long for turns; the tests give it 60 s in all
    "turn_grace_s": 10,
    # a task's time limits above the longest held action, so Celery never interrupts a run
    # the test holds (their order below the visibility timeout is the settings' own rule)
    "soft_time_limit_s": HELD_ACTION_TIMEOUT.total_seconds() + 60,
    "time_limit_s": HELD_ACTION_TIMEOUT.total_seconds() + 120,
    # the scenarios queue runs in the broker behind busy pool processes, so that a fault strikes
    # messages the broker holds; fair dispatch's bound on one workspace's waiting messages would
    # keep them in the store instead
    "fair_messages": 10_000,
}
"""Settings every scenario runs with, on top of its own: shorter waits, same mechanisms."""

HOLD_WAIT_S: Final = 120.0
"""How long the test waits for a run to take a hold it asked for: the part of the load
published after the request must reach a pool process, behind whatever was queued before."""

RUNS_WAIT_S: Final = 180.0
"""How long the test waits for the runs published so far to end, on a busy machine."""

PROCESS_WAIT_S: Final = 60.0
"""How long a pool process may take to be replaced, or a worker to react to a signal."""

REFUSAL_WAIT_S: Final = 120.0
"""How long, once the sweeping worker is ready, the test waits for the held run's message to be
handed to a worker again and refused: kombu sweeps at the worker's start and every 10 s after,
and the message put back then waits for a free pool process."""

WORKER_EXIT_S: Final = 90.0
"""How long a warm shutdown may take: the held runs, then each pool process's turn grace."""

REDIS_START_S: Final = 20.0
"""How long ``redis-server`` may take to answer a ping after it was started."""
