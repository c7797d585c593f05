"""The fault suite's constants, each with why it has its value.

Waits for a condition poll at a named interval and give up after a named, generous bound: a
bound that passes fails the scenario, it never makes anything happen.
"""

from collections.abc import Mapping
from typing import Final

from relayr.demo import Plan

TENANT: Final = "faults"
WORKSPACE: Final = "ops"

DEFAULT_PLAN: Final = Plan(deploys=120, incidents=12)
"""The load by default: big enough to be split into parts around every fault, small enough
that a scenario takes about a minute on a 2-core machine shared with other test runs."""

FULL_PLAN: Final = Plan(deploys=300, incidents=30)
"""The issue's load (N >= 300 notices and >= 30 turns), with ``FAULTS_FULL_LOAD=1``."""

FULL_LOAD_VARIABLE: Final = "FAULTS_FULL_LOAD"

FAULT_SETTINGS: Final[Mapping[str, object]] = {
    # a killed attempt's lease lapses in seconds, not the default half minute
    "lease_ttl_s": 4,
    # a message a broker fault lost is sent again after this long
    "requeue_after_s": 30,
    # a warm shutdown waits this long for turns; the tests give it 60 s in all
    "turn_grace_s": 10,
}
"""Settings every scenario runs with, on top of its own: shorter waits, same mechanisms."""

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

HOLD_MAX_S: Final = 50.0
"""The longest an action stays held: below the example rules' 60 s timeout, so a hold the test
never releases still ends in a run that succeeds (and is reported as given up)."""

HOLD_WAIT_S: Final = 120.0
"""How long the test waits for a run to take a hold it asked for: the part of the load
published after the request must reach a pool process, behind whatever was queued before."""

RUNS_WAIT_S: Final = 180.0
"""How long the test waits for the runs published so far to end, on a busy machine."""

PROCESS_WAIT_S: Final = 60.0
"""How long a pool process may take to be replaced, or a worker to react to a signal."""

REFUSAL_WAIT_S: Final = 60.0
"""How long, once the sweeping worker is ready, the test waits for the held run's message to be
handed to a worker again and refused."""

WORKER_EXIT_S: Final = 90.0
"""How long a warm shutdown may take: the held runs, then each pool process's turn grace."""

REDIS_START_S: Final = 20.0
"""How long ``redis-server`` may take to answer a ping after it was started."""
