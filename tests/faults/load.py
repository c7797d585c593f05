"""A fault scenario's load: real workers, the dispatcher, the example's runs published in parts.

A scenario (tests/execution/test_faults.py) starts a Redis of its own
(:mod:`tests.faults.private_redis`)
and real ``celery worker`` processes (:mod:`tests.workers`) running the fault application
(:mod:`tests.faults.app`), and runs the dispatcher in the test process
(:mod:`tests.faults.relay`). Its fault (:mod:`tests.faults.breaks`) publishes the load part by
part, and breaks something while runs are known to be inside their actions: it asks for holds
(:mod:`tests.faults.holds`) before it publishes the part whose runs will take them. What the
fault did not publish is published once it is over, so no fault runs out of load on a fast
machine, and every fault is followed by more load. When every run has ended,
:func:`tests.faults.checker.check_invariants` reads the stores and names every broken promise.

Each scenario returns its figures (one JSON line with ``pytest -s``) and its problems.
"""

import asyncio
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifactr.core import RunEnded
from reflexr import Event
from reflexr.core import FINISHED

from relayr.demo import CLI_USER, DEMO_PUBLISHER, Plan, publish_scenario
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import DEPLOY_NOTICE, INCIDENT_TRIAGE, DeployFinished, IncidentOpened
from tests.faults.app import POISON_RULE, Poisoned
from tests.faults.checker import Report, check_invariants
from tests.faults.constants import (
    DEFAULT_PLAN,
    FULL_LOAD_VARIABLE,
    FULL_PLAN,
    RUNS_WAIT_S,
    STORE_POLL_S,
    TENANT,
    TURN_SETTLE_S,
    WORKSPACE,
)
from tests.faults.holds import BEFORE, Held, Holds, Point
from tests.faults.relay import Handed, dispatching, log_lines, lost_task, outcome_of
from tests.workers import RelayrProcess, start_worker


def load_plan() -> Plan:
    """:data:`FULL_PLAN` when ``FAULTS_FULL_LOAD=1``, else :data:`DEFAULT_PLAN`."""
    return FULL_PLAN if os.environ.get(FULL_LOAD_VARIABLE) == "1" else DEFAULT_PLAN


@dataclass
class Load:
    """What a fault works with: the settings, the workers, the holds, the figures so far."""

    scenario: str
    settings: Settings
    environment: dict[str, str]
    log_dir: Path
    plan: Plan
    runtime: Runtime
    holds: Holds
    handed: Handed
    extras: int = 0
    """Runs of events published before the plan (a poison run)."""
    published: Plan = field(default_factory=lambda: Plan(deploys=0, incidents=0))
    parts: int = 0
    expected: Mapping[str, int] = field(default_factory=dict)
    workers: list[RelayrProcess] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    attempts_at_fault: dict[str, int] = field(default_factory=dict)
    """The attempts (run id: epoch) the fault must let finish, if it keeps them."""
    killed: dict[str, int] = field(default_factory=dict)
    """The attempts (run id: attempt) the fault killed inside their action: each run must have
    succeeded in a later attempt."""
    started: float = field(default_factory=time.monotonic)

    def count(self, name: str, by: int = 1) -> None:
        self.figures[name] = self.figures.get(name, 0) + by

    @property
    def total(self) -> int:
        return sum(self.expected.values())

    @property
    def published_runs(self) -> int:
        """How many runs the events published so far make."""
        return self.extras + self.published.runs

    # ─── workers ──────────────────────────────────────────────────────────────

    async def start_worker(self, *, concurrency: int = 2, **settings: object) -> RelayrProcess:
        """Start one more worker (on this load's queue, with extra settings if given)."""
        environment = dict(self.environment)
        for name, value in settings.items():
            environment[f"RELAYR_{name.upper()}"] = str(value)
        worker = await asyncio.to_thread(
            start_worker, environment, self.log_dir, concurrency=concurrency
        )
        self.workers.append(worker)
        return worker

    # ─── publishing the plan in parts ────────────────────────────────────────

    async def publish(self, share: float) -> Plan:
        """Publish the next ``share`` of the plan (at least one run); return that part.

        Raises:
            AssertionError: If the plan has no run left: a fault that needs a run to take its
                hold must be given one.
        """
        left = Plan(
            deploys=self.plan.deploys - self.published.deploys,
            incidents=self.plan.incidents - self.published.incidents,
        )
        part = Plan(
            deploys=min(left.deploys, round(self.plan.deploys * share)),
            incidents=min(left.incidents, round(self.plan.incidents * share)),
        )
        if part.runs == 0:
            part = Plan(deploys=min(left.deploys, 1), incidents=0 if left.deploys else 1)
        assert part.runs > 0, f"the plan of {self.scenario} has no run left to publish"
        await self._publish(part)
        return part

    async def publish_rest(self) -> None:
        """Publish what is left of the plan, if anything."""
        rest = Plan(
            deploys=self.plan.deploys - self.published.deploys,
            incidents=self.plan.incidents - self.published.incidents,
        )
        if rest.runs:
            await self._publish(rest)

    async def _publish(self, part: Plan) -> None:
        self.parts += 1
        prefix = f"{self.scenario}-{self.parts}"
        await publish_scenario(self.runtime, TENANT, WORKSPACE, part, prefix=prefix)
        self.published = Plan(
            deploys=self.published.deploys + part.deploys,
            incidents=self.published.incidents + part.incidents,
        )

    async def hold(self, *wanted: tuple[str, Point], share: float) -> list[Held]:
        """Ask for holds (label, point), publish the next ``share`` of the plan, whose runs are
        sure to take them, and wait until runs did: each is then inside its action."""
        for label, point in wanted:
            self.holds.want(label, point)
        await self.publish(share)
        return [await self.holds.wait_held(label) for label, _ in wanted]

    async def hold_one(self, label: str, *, share: float, point: Point = BEFORE) -> Held:
        (held,) = await self.hold((label, point), share=share)
        return held

    # ─── the runs, in reflexr's store ────────────────────────────────────────

    async def runs(self) -> list[Any]:
        """The workspace's runs; a storage fault (a cut connection) reads as none yet."""
        rules = await self.runtime.application.rules.open(TENANT, WORKSPACE, actor=DEMO_PUBLISHER)
        try:
            return list(await rules.runs())
        except Exception:
            return []

    async def finished(self) -> int:
        return sum(run.status in FINISHED for run in await self.runs())

    async def wait_finished(self, count: int, timeout_s: float = RUNS_WAIT_S) -> None:
        """Wait until at least ``count`` runs ended (the load is that far along)."""
        deadline = time.monotonic() + timeout_s
        while await self.finished() < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} runs ended in {timeout_s} s")
            await asyncio.sleep(STORE_POLL_S)

    async def wait_published_ended(self) -> None:
        """Wait until every run published so far ended: nothing of the load runs or waits."""
        await self.wait_finished(self.published_runs)

    async def run_ended(self, run_id: str) -> bool:
        return any(run.id == run_id and run.status in FINISHED for run in await self.runs())


type Fault = Callable[[Load], Awaitable[None]]


def expected_runs(plan: Plan, extra: Sequence[tuple[str, Event]]) -> dict[str, int]:
    expected: Counter[str] = Counter(
        {DEPLOY_NOTICE.name: plan.deploys, INCIDENT_TRIAGE.name: plan.incidents}
    )
    for _, event in extra:
        if isinstance(event, DeployFinished):
            expected[DEPLOY_NOTICE.name] += 1
        elif isinstance(event, IncidentOpened):
            expected[INCIDENT_TRIAGE.name] += 1
        elif isinstance(event, Poisoned):
            expected[POISON_RULE.name] += 1
    return dict(expected)


async def run_load(
    scenario: str,
    environment: dict[str, str],
    log_dir: Path,
    fault: Fault,
    *,
    plan: Plan,
    initial_workers: int = 1,
    extra: Callable[[str], Sequence[tuple[str, Event]]] = lambda _thread: (),
    dead_allowed: Mapping[str, frozenset[str]] | None = None,
    timeout_s: float = 240.0,
) -> Report:
    """Publish ``extra`` events, run ``fault`` (which publishes parts of ``plan``), publish
    the rest of the plan, dispatch until every run ended; then check the invariants. Workers
    started here are always stopped, and no run is left held.

    ``extra`` gets a thread of its own and returns (id, event)s, published before the plan,
    so their runs are among the first.
    """
    settings = Settings.from_env(environment)
    runtime = await Runtime.start(settings, role="dispatcher")
    holds = Holds(settings.home)
    load: Load | None = None
    try:
        artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=CLI_USER)
        async with dispatching(runtime, settings) as handed:
            load = Load(scenario, settings, environment, log_dir, plan, runtime, holds, handed)
            for _ in range(initial_workers):
                await load.start_worker()
            load.started = time.monotonic()
            extras = extra((await artifacts.create_thread("faults")).id)
            load.expected = expected_runs(plan, extras)
            load.extras = len(extras)
            if extras:
                rules = await runtime.application.rules.open(
                    TENANT, WORKSPACE, actor=DEMO_PUBLISHER
                )
                await rules.publish_many([e for _, e in extras], ids=[i for i, _ in extras])
            try:
                async with asyncio.timeout(timeout_s):
                    await fault(load)
            finally:
                holds.close()
            await load.publish_rest()
            runs_s = await _wait_for_runs(load, timeout_s)
            turns_s = await _wait_for_turns(artifacts, load.expected.get(INCIDENT_TRIAGE.name, 0))
        report = await check_invariants(runtime, load.expected, dead_allowed=dead_allowed or {})
        figures = {
            "scenario": scenario,
            "runs": load.total,
            "plan": dataclasses.asdict(plan),
            "parts": load.parts,
            "duration_s": round(runs_s, 1) if runs_s is not None else None,
            "turns_settled_s": turns_s,
            **load.figures,
            "enqueued": handed.enqueued,
            "messages": handed.messages,
            "enqueued_again": handed.enqueued - len(handed.runs),
            "enqueue_failures": handed.failures,
            **worker_figures(load, log_dir),
            **report.figures,
        }
        problems = list(report.problems)
        problems += await _kept_attempts(load)
        problems += await _killed_attempts_redone(load)
        if runs_s is None:
            problems.insert(0, f"the runs did not all end within {timeout_s} s")
        return Report(figures, problems)
    finally:
        holds.close()
        if load is not None:
            await asyncio.gather(
                *(asyncio.to_thread(worker.stop) for worker in load.workers),
                return_exceptions=True,
            )
        await runtime.aclose()


async def _kept_attempts(load: Load) -> list[str]:
    """Problems with the attempts the fault should have let finish: each must have succeeded
    in the attempt that was running (same epoch), none taken over by another."""
    runs = {run.id: run for run in await load.runs()}
    problems = []
    for run_id, epoch in load.attempts_at_fault.items():
        run = runs.get(run_id)
        if run is None or (run.status, run.epoch) != ("succeeded", epoch):
            problems.append(
                f"attempt {epoch} of run {run_id}, running at the fault, did not finish: "
                f"the run is {None if run is None else (run.status, run.epoch, run.reason)}"
            )
    return problems


async def _killed_attempts_redone(load: Load) -> list[str]:
    """Problems with the attempts the fault killed: each run must have succeeded in a later
    attempt (the killed one could not complete)."""
    runs = {run.id: run for run in await load.runs()}
    problems = []
    for run_id, attempt in load.killed.items():
        run = runs.get(run_id)
        if run is None or run.status != "succeeded" or run.attempts <= attempt:
            problems.append(
                f"run {run_id}, killed in attempt {attempt}, did not succeed in a later one: "
                f"{None if run is None else (run.status, run.attempts, run.reason)}"
            )
    return problems


async def _wait_for_runs(load: Load, timeout_s: float) -> float | None:
    """Seconds from the start until every expected run ended, or None on timeout."""
    deadline = load.started + timeout_s
    while time.monotonic() < deadline:
        runs = await load.runs()
        if len(runs) >= load.total and all(run.status in FINISHED for run in runs):
            return time.monotonic() - load.started
        await asyncio.sleep(STORE_POLL_S)
    return None


async def _wait_for_turns(artifacts: Any, turns: int) -> float:
    """Wait up to :data:`TURN_SETTLE_S` for ``turns`` turns to end; return the wait."""
    started = time.monotonic()
    while time.monotonic() - started < TURN_SETTLE_S:
        with suppress(Exception):
            ended = sum(isinstance(e.event, RunEnded) for e in await artifacts.read())
            if ended >= turns:
                break
        await asyncio.sleep(STORE_POLL_S)
    return round(time.monotonic() - started, 1)


# ─── figures from the workers' logs ──────────────────────────────────────────


def worker_figures(load: Load, log_dir: Path) -> dict[str, Any]:
    """Deliveries the workers' logs show, by outcome, and the tasks whose worker was lost.

    A message names one or more runs; a delivery that ran to its end logs one outcome line per
    run with the task id; one whose pool process died logs none, but its worker logs a
    ``WorkerLostError`` naming the task. A run seen with an outcome more than once under one
    task id was delivered again by the broker (a restored unacknowledged message); a task
    retried after its worker was lost is split into new messages, one per run. A message the
    dispatcher sent and never seen with an outcome was lost, or its delivery was stopped
    without one (a task Celery terminated on a broker connection loss, one of a SIGKILLed main
    process).
    """
    outcomes: Counter[str] = Counter()
    per_delivery: Counter[tuple[str, str]] = Counter()
    tasks: set[str] = set()
    ends: dict[tuple[str, str], list[tuple[str, str]]] = {}
    lost = 0
    for line in log_lines(log_dir):
        task = lost_task(line)
        if task is not None:
            lost += 1
            tasks.add(task)
            continue
        ended = outcome_of(line)
        if ended is None:
            continue
        task_id, run_id, outcome = ended
        outcomes[outcome] += 1
        tasks.add(task_id)
        per_delivery[(task_id, run_id)] += 1
        ends.setdefault((task_id, run_id), []).append((str(line["timestamp"]), outcome))
    return {
        "deliveries": sum(per_delivery.values()),
        "redeliveries": sum(count - 1 for count in per_delivery.values()),
        "redelivered_while_running": sum(
            _overlapped(sorted(found)) for found in ends.values() if len(found) > 1
        ),
        "tasks_lost_with_their_process": lost,
        "messages_without_outcome": max(load.handed.messages - len(tasks), 0),
        "outcomes": dict(sorted(outcomes.items())),
        "workers": len(load.workers),
    }


def _overlapped(ends: list[tuple[str, str]]) -> bool:
    """Whether a delivery of a run was refused (the run held) before another delivery of the
    same message finished it: the broker handed over a message whose run was still running."""
    finished = [at for at, outcome in ends if outcome == "succeeded"]
    return bool(finished) and any(
        outcome == "contended" and at < finished[0] for at, outcome in ends
    )
