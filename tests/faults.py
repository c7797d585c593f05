"""Fault scenarios' machinery: a Redis of the test's own, the load, the faults, one checker.

A scenario (tests/test_faults.py) starts a Redis of its own (AOF on, its own port and folder),
real ``celery worker`` processes (:mod:`tests.workers`), and runs the dispatcher in the test
process while it publishes a load of the example's events; a fault coroutine breaks something
meanwhile (kills a pool process, the worker, Redis, PostgreSQL's connections). When every run
has ended, :func:`check_invariants` reads reflexr's store, artifactr's log and relayr's ledger
and names every broken promise:

- every run ended: succeeded, or dead with a reason the scenario allows;
- exactly one notice per notice run, exactly one message per send run, each taken by a turn
  (named by a ``run_started`` or at or below the thread's *taken* cursor, LIBRARIES.md A5);
- no message id twice, no rule text twice in one thread;
- the ledger holds the cause of every rule's write, naming the run that made it; every turn
  that took a rule's message is traced back to it (``turn_cause``).

Turns that started and never ended are counted (``turns.unended``), not refused: a turn runs
on the event loop of the pool process whose task sent its message, so a fault that kills that
process kills the turn, and artifactr leaves it ``running`` with its message taken (LIBRARIES.md
A7). Scenarios in which no process dies assert there are none.

Each scenario prints its figures as one JSON line. A private Redis rather than the shared one:
a short visibility timeout or a restart must not touch other tests' messages, and kombu's
``unacked`` hash is global to a Redis database.
"""

import asyncio
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import redis
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import MessagePosted, RunEnded, RunStarted
from reflexr import Event, RetryPolicy, Rule, on
from reflexr import run as action
from reflexr.core import FINISHED
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.application import Application, open_storage
from relayr.demo import CLI_USER, DEMO_PUBLISHER, Plan, publish_scenario
from relayr.dispatch import Dispatcher
from relayr.ledger.port import WorkspaceKey
from relayr.runtime import Runtime
from relayr.settings import Settings
from relayr.turns import turn_cause
from rules.example import (
    ACTIONS,
    DEPLOY_NOTICE,
    INCIDENT_TRIAGE,
    RULES,
    DeployFinished,
    IncidentOpened,
    TriageNote,
    deploy_notice,
    triage_agent,
)
from tasks.app import create_celery
from tasks.runs import OUTCOMES, RunIds, send_run
from tests.workers import WorkerProcess, start_worker

TENANT: Final = "faults"
WORKSPACE: Final = "ops"

DEFAULT_PLAN: Final = Plan(deploys=120, incidents=12)
"""The load by default: big enough that every fault lands mid-load, small enough that a
scenario takes about a minute on a 2-core machine shared with other test runs."""

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

TURN_SETTLE_S: Final = 30.0
"""How long, once every run ended, the checker waits for the turns still running."""

POLL_S: Final = 0.5


def load_plan() -> Plan:
    """:data:`FULL_PLAN` when ``FAULTS_FULL_LOAD=1``, else :data:`DEFAULT_PLAN`."""
    return FULL_PLAN if os.environ.get(FULL_LOAD_VARIABLE) == "1" else DEFAULT_PLAN


# ─── a Redis of the test's own ───────────────────────────────────────────────


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class PrivateRedis:
    """A ``redis-server`` with AOF on (fsync at every write), on its own port and folder.

    ``appendfsync always``: a write Redis acknowledged survives a SIGKILL of the server, as in
    the deployment's compose file (AOF, ``noeviction``); what a restart may lose is only what
    the broker's clients had in flight.
    """

    folder: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.folder / "redis.log"),
        ]
        self.process = subprocess.Popen(command, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "redis.log").read_text(errors="replace")
                self.kill()
                raise AssertionError(f"redis-server did not start on {self.port}:\n{log}")
            time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """SIGKILL the server, as a crashed host would."""
        if self.process is not None:
            with suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self, down_s: float) -> None:
        """Kill the server, leave it down ``down_s``, start it again on its AOF."""
        self.kill()
        time.sleep(down_s)
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        self.kill()


@contextmanager
def private_redis(folder: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# ─── processes ────────────────────────────────────────────────────────────────


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (a worker's pool processes), from /proc."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ─── the fault application: the example's rules, plus a slow deploy and a poison run ──────

SLOW_STATUS: Final = "slow"
"""A ``deploy:finished`` with this status makes its notice run wait for the test's release."""

SLOW_RELEASE_FILE: Final = "release-slow-runs"
"""Created in ``RELAYR_HOME`` by the test once the broker handed the slow run over again."""

SLOW_ACTION_MAX_S: Final = 50.0
"""The longest a slow run waits for its release: below the example rules' 60 s timeout, so
a test that never releases it still sees it succeed."""

RELEASE_POLL_S: Final = 0.1


class FaultEvent(Event, abstract=True, event_namespace="faults"):
    """Events of the fault application's own rule."""


class Poisoned(FaultEvent, name="poisoned"):
    """Makes rule ``faults:poison`` fire: its action kills the pool process running it."""

    label: str


POISON_RULE: Final = Rule(
    name="faults:poison",
    when=on(Poisoned),
    then=action("poison"),
    ordering="none",
    start="beginning",
    retry=RetryPolicy(
        max_attempts=10,
        backoff=timedelta(milliseconds=200),
        max_backoff=timedelta(seconds=1),
    ),
    description="Kill the process that runs it, as an out-of-memory kill would.",
)
"""More attempts than ``max_redeliveries`` allows deliveries, so what stops it is relayr's
bound on a task that keeps killing its worker, not the rule's retry policy."""


def slow_or_deploy_notice(release: Path) -> Any:
    """The example's ``deploy_notice``; a ``slow`` deploy's run first waits until ``release``
    exists (at most :data:`SLOW_ACTION_MAX_S`), so it is still running when the test needs."""

    async def action(reaction: Reaction[Any]) -> dict[str, str]:
        event = reaction.events[-1].event
        if isinstance(event, DeployFinished) and event.status == SLOW_STATUS:
            for _ in range(int(SLOW_ACTION_MAX_S / RELEASE_POLL_S)):
                if await asyncio.to_thread(release.exists):
                    break
                await asyncio.sleep(RELEASE_POLL_S)
        return await deploy_notice(reaction)

    return action


async def poison(reaction: Reaction[Any]) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def create_fault_app(settings: Settings) -> Application:
    """``RELAYR_APP=tests.faults:create_fault_app``: the example plus slow runs and poison."""
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts, types=[TriageNote]),
        rules=RuleWorkspaces(
            storage.rules,
            events=[DeployFinished, IncidentOpened, Poisoned],
            rules=[*RULES, POISON_RULE],
        ),
        actions={
            **ACTIONS,
            "deploy_notice": slow_or_deploy_notice(settings.home.absolute() / SLOW_RELEASE_FILE),
            "poison": poison,
        },
        agent=triage_agent(),
        engines=storage.engines,
    )


# ─── the load and its faults ──────────────────────────────────────────────────


@dataclass
class Load:
    """What a fault coroutine works with: the settings, the workers, the figures so far."""

    settings: Settings
    environment: dict[str, str]
    log_dir: Path
    plan: Plan
    expected: Mapping[str, int]
    runtime: Runtime
    workers: list[WorkerProcess] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    enqueued: int = 0
    enqueued_runs: set[str] = field(default_factory=set)
    enqueue_failures: int = 0
    attempts_at_fault: dict[str, int] = field(default_factory=dict)
    """The attempts (run id: epoch) running when the fault struck, if the fault keeps them."""
    started: float = field(default_factory=time.monotonic)

    def count(self, name: str, by: int = 1) -> None:
        self.figures[name] = self.figures.get(name, 0) + by

    async def start_worker(self, *, concurrency: int = 2, **settings: object) -> WorkerProcess:
        """Start one more worker (on this load's queue, with extra settings if given)."""
        environment = dict(self.environment)
        for name, value in settings.items():
            environment[f"RELAYR_{name.upper()}"] = str(value)
        worker = await asyncio.to_thread(
            start_worker, environment, self.log_dir, concurrency=concurrency
        )
        self.workers.append(worker)
        return worker

    async def runs(self) -> list[Any]:
        """The workspace's runs; a storage fault (a cut connection) reads as none yet."""
        rules = await self.runtime.application.rules.open(TENANT, WORKSPACE, actor=DEMO_PUBLISHER)
        try:
            return list(await rules.runs())
        except Exception:
            return []

    async def finished(self) -> int:
        return sum(run.status in FINISHED for run in await self.runs())

    async def wait_finished(self, count: int, timeout_s: float = 120.0) -> None:
        """Wait until at least ``count`` runs ended (the load is that far along)."""
        deadline = time.monotonic() + timeout_s
        while await self.finished() < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} runs ended in {timeout_s} s")
            await asyncio.sleep(0.1)

    async def running(self) -> list[Any]:
        return [run for run in await self.runs() if run.status == "running"]

    async def wait_running(self, timeout_s: float = 60.0) -> list[Any]:
        """Wait until an attempt runs, so a fault lands mid-run; return the running runs."""
        deadline = time.monotonic() + timeout_s
        while not (running := await self.running()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no run was running within {timeout_s} s")
            await asyncio.sleep(0.02)
        return running

    @property
    def total(self) -> int:
        return sum(self.expected.values())


type Fault = Callable[[Load], Awaitable[None]]


async def no_fault(load: Load) -> None:
    """Break nothing: for a scenario whose fault is in the load itself (a poison run)."""


@dataclass(frozen=True)
class Report:
    """A scenario's outcome: its figures and every broken promise the checker found."""

    figures: dict[str, Any]
    problems: list[str]

    def line(self) -> str:
        return json.dumps({**self.figures, "problems": self.problems[:20]}, default=str)


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
    """Publish ``plan`` (and ``extra`` events), dispatch until every run ended, meanwhile run
    ``fault``; then check the invariants. Workers started here are always stopped.

    ``extra`` gets a thread of its own and returns (id, event)s, published before the plan,
    so their runs are among the first.
    """
    settings = Settings.from_env(environment)
    runtime = await Runtime.start(settings, role="dispatcher")
    load: Load | None = None
    try:
        app = create_celery(settings)
        artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=CLI_USER)
        load = Load(settings, environment, log_dir, plan, expected={}, runtime=runtime, figures={})
        for _ in range(initial_workers):
            await load.start_worker()

        async def enqueue(tenant_id: str, workspace_id: str, run_id: str) -> None:
            ids = RunIds(tenant_id, workspace_id, run_id)
            try:
                await asyncio.to_thread(send_run, app, settings.queue, ids)
            except Exception:
                load.enqueue_failures += 1
                raise
            load.enqueued += 1
            load.enqueued_runs.add(run_id)

        stop = asyncio.Event()
        dispatcher = asyncio.create_task(Dispatcher(runtime).serve(enqueue, stop))
        try:
            load.started = time.monotonic()
            extras = extra((await artifacts.create_thread("faults")).id)
            load.expected = expected_runs(plan, extras)
            if extras:
                rules = await runtime.application.rules.open(
                    TENANT, WORKSPACE, actor=DEMO_PUBLISHER
                )
                await rules.publish_many([e for _, e in extras], ids=[i for i, _ in extras])
            await publish_scenario(runtime, TENANT, WORKSPACE, plan, prefix=scenario)
            faulting = asyncio.create_task(fault(load))
            try:
                runs_s = await _wait_for_runs(load, faulting, timeout_s)
            finally:
                if not faulting.done():
                    faulting.cancel()
                with suppress(asyncio.CancelledError):
                    await faulting
            turns_s = await _wait_for_turns(artifacts, load.expected.get(INCIDENT_TRIAGE.name, 0))
        finally:
            stop.set()
            await dispatcher
        report = await check_invariants(runtime, load.expected, dead_allowed=dead_allowed or {})
        figures = {
            "scenario": scenario,
            "runs": load.total,
            "plan": dataclasses.asdict(plan),
            "duration_s": round(runs_s, 1) if runs_s is not None else None,
            "turns_settled_s": turns_s,
            **load.figures,
            "enqueued": load.enqueued,
            "enqueued_again": load.enqueued - len(load.enqueued_runs),
            "enqueue_failures": load.enqueue_failures,
            **worker_figures(load, log_dir),
            **report.figures,
        }
        problems = list(report.problems)
        problems += await _kept_attempts(load)
        if runs_s is None:
            problems.insert(0, f"the runs did not all end within {timeout_s} s")
        return Report(figures, problems)
    finally:
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


async def _wait_for_runs(
    load: Load, faulting: "asyncio.Task[None]", timeout_s: float
) -> float | None:
    """Seconds until every expected run ended and the fault is over, or None on timeout."""
    deadline = load.started + timeout_s
    while time.monotonic() < deadline:
        runs = await load.runs()
        if faulting.done():
            faulting.result()  # a fault that failed fails the scenario
            if len(runs) >= load.total and all(run.status in FINISHED for run in runs):
                return time.monotonic() - load.started
        await asyncio.sleep(POLL_S)
    return None


async def _wait_for_turns(artifacts: Any, turns: int) -> float:
    """Wait up to :data:`TURN_SETTLE_S` for ``turns`` turns to end; return the wait."""
    started = time.monotonic()
    while time.monotonic() - started < TURN_SETTLE_S:
        with suppress(Exception):
            ended = sum(isinstance(e.event, RunEnded) for e in await artifacts.read())
            if ended >= turns:
                break
        await asyncio.sleep(POLL_S)
    return round(time.monotonic() - started, 1)


# ─── figures from the workers' logs ──────────────────────────────────────────

_OUTCOME_MESSAGES: Final = {message: outcome for outcome, (_, message) in OUTCOMES.items()}
TASK_ID: Final = re.compile(r"\[([0-9a-f-]{36})\]")

_OTHER_ENDS: Final = {
    "run interrupted by the task's soft time limit": "soft_time_limit",
    "run's task killed its worker too often: failing the run": "worker_lost_bound",
}


def log_lines(log_dir: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(log_dir.glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with suppress(ValueError):
                    yield json.loads(line)


def worker_figures(load: Load, log_dir: Path) -> dict[str, Any]:
    """Deliveries the workers' logs show, by outcome, and the tasks whose worker was lost.

    A delivery that ran to its end logs one outcome line with its task id; one whose pool
    process died logs none, but its worker logs a ``WorkerLostError`` naming the task. A task
    id seen more than once was delivered again: by the broker (a restored unacknowledged
    message) or by Celery (a task retried after its worker was lost). A message sent and never
    seen with an outcome was lost, or its delivery was stopped without one (a task Celery
    terminated on a broker connection loss, one of a SIGKILLed main process).
    """
    outcomes: Counter[str] = Counter()
    per_task: Counter[str] = Counter()
    ends: dict[str, list[tuple[str, str]]] = {}
    lost = 0
    for line in log_lines(log_dir):
        event = str(line.get("event", ""))
        if "WorkerLostError" in event:
            lost += 1
            found = TASK_ID.search(event)
            if found:
                per_task[found.group(1)] += 1
            continue
        outcome = _OUTCOME_MESSAGES.get(event) or _OTHER_ENDS.get(event)
        if outcome is None or "task_id" not in line:
            continue
        outcomes[outcome] += 1
        per_task[str(line["task_id"])] += 1
        ends.setdefault(str(line["task_id"]), []).append((str(line["timestamp"]), outcome))
    return {
        "deliveries": sum(per_task.values()),
        "redeliveries": sum(count - 1 for count in per_task.values()),
        "redelivered_while_running": sum(
            _overlapped(sorted(found)) for found in ends.values() if len(found) > 1
        ),
        "tasks_lost_with_their_process": lost,
        "messages_without_outcome": max(load.enqueued - len(per_task), 0),
        "outcomes": dict(sorted(outcomes.items())),
        "workers": len(load.workers),
    }


def _overlapped(ends: list[tuple[str, str]]) -> bool:
    """Whether a delivery of a task was refused (the run held) before another one of the same
    task finished the run: the broker handed over a message whose run was still running."""
    finished = [at for at, outcome in ends if outcome == "succeeded"]
    return bool(finished) and any(
        outcome == "contended" and at < finished[0] for at, outcome in ends
    )


# ─── the invariant checker ────────────────────────────────────────────────────


async def check_invariants(
    runtime: Runtime,
    expected: Mapping[str, int],
    *,
    dead_allowed: Mapping[str, frozenset[str]],
    tenant_id: str = TENANT,
    workspace_id: str = WORKSPACE,
) -> Report:
    """Every promise relayr makes about one workspace's runs, checked in the stores.

    Args:
        expected: How many runs each rule should have.
        dead_allowed: For a rule, the reasons its runs may end ``dead`` with; any other run
            must have succeeded.
    """
    problems: list[str] = []
    application = runtime.application
    ledger = runtime.bridge.ledger
    key = WorkspaceKey(tenant_id, workspace_id)
    rules = await application.rules.open(tenant_id, workspace_id, actor=DEMO_PUBLISHER)
    artifacts = await application.artifacts.open(tenant_id, workspace_id, actor=CLI_USER)
    runs = {run.id: run for run in await rules.runs()}

    by_rule: Counter[str] = Counter(run.rule for run in runs.values())
    for rule, count in expected.items():
        if by_rule[rule] != count:
            problems.append(f"rule {rule} has {by_rule[rule]} runs, expected {count}")
    for rule in set(by_rule) - set(expected):
        problems.append(f"rule {rule} has {by_rule[rule]} runs, expected none")
    statuses: Counter[str] = Counter()
    dead_reasons: Counter[str] = Counter()
    for run in runs.values():
        statuses[run.status] += 1
        if run.status == "succeeded":
            continue
        allowed = dead_allowed.get(run.rule, frozenset())
        if run.status == "dead":
            dead_reasons[f"{run.rule}:{run.reason}"] += 1
            if run.reason in allowed:
                continue
        problems.append(
            f"run {run.id} of {run.rule} ended {run.status} (reason {run.reason}, "
            f"attempts {run.attempts}): {run.error}"
        )

    envelopes = list(await artifacts.read())
    ids: Counter[str] = Counter()
    texts: Counter[tuple[str, str, str]] = Counter()
    posted: dict[str, list[tuple[int, MessagePosted]]] = {}
    seq_of: dict[str, int] = {}
    thread_of: dict[str, str] = {}
    started: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    turns: Counter[str] = Counter()
    ended_turns: set[str] = set()
    for envelope in envelopes:
        event = envelope.event
        if isinstance(event, MessagePosted):
            ids[event.message_id] += 1
            seq_of[event.message_id] = envelope.seq
            thread_of[event.message_id] = event.thread_id
            author = envelope.actor.participant
            if not author.startswith(RULE_AUTHOR_PREFIX):
                continue
            rule = author.removeprefix(RULE_AUTHOR_PREFIX)
            texts[(event.thread_id, rule, event.content)] += 1
            cause = await ledger.cause(key, "message", event.message_id)
            if cause is None:
                problems.append(f"message {event.message_id} of {rule}: no cause in the ledger")
                continue
            run = runs.get(cause.run_id)
            if run is None or run.rule != rule:
                problems.append(
                    f"message {event.message_id} of {rule}: the ledger names run "
                    f"{cause.run_id}, not one of that rule"
                )
                continue
            posted.setdefault(run.id, []).append((envelope.seq, event))
        elif isinstance(event, RunStarted):
            started.setdefault(event.thread_id, []).append((event.run_id, event.message_ids))
        elif isinstance(event, RunEnded):
            turns[event.status] += 1
            ended_turns.add(event.run_id)
    turns["started"] = sum(len(s) for s in started.values())
    unended = [
        (thread, turn)
        for thread, starts in started.items()
        for turn, _ in starts
        if turn not in ended_turns
    ]
    turns["unended"] = len(unended)

    for message_id, count in ids.items():
        if count > 1:
            problems.append(f"message id {message_id} posted {count} times")
    for (thread, rule, content), count in texts.items():
        if count > 1:
            problems.append(f"{rule} posted {content!r} {count} times in thread {thread}")

    kinds = {DEPLOY_NOTICE.name: "notice", INCIDENT_TRIAGE.name: "message"}
    untaken = 0
    for run in runs.values():
        kind = kinds.get(run.rule)
        if kind is None or run.status != "succeeded":
            continue
        messages = posted.get(run.id, [])
        if len(messages) != 1:
            problems.append(f"run {run.id} of {run.rule} posted {len(messages)} messages")
            continue
        seq, message = messages[0]
        if message.kind != kind:
            problems.append(f"run {run.id} of {run.rule} posted a {message.kind}, not a {kind}")
        output = run.output if isinstance(run.output, dict) else {}
        if output.get("message_id") != message.message_id:
            problems.append(
                f"run {run.id} returned {output.get('message_id')}, but posted {message.message_id}"
            )
        if not await ledger.emissions(key, run.id):
            problems.append(f"run {run.id} of {run.rule} left no emission record")
        if kind != "message":
            continue
        thread = message.thread_id
        named = [turn for turn, taken in started.get(thread, []) if message.message_id in taken]
        cursor = await artifacts.cursor(TAKEN_CURSOR.format(thread_id=thread))
        if not named and seq > cursor:
            untaken += 1
            problems.append(
                f"message {message.message_id} of run {run.id} was taken by no turn "
                f"(thread {thread}, seq {seq}, taken cursor {cursor})"
            )
    for thread, starts in started.items():
        for turn, message_ids in starts:
            if not message_ids:
                continue
            cause = await turn_cause(ledger, key, message_ids)
            if cause is None or cause.run_id not in runs:
                problems.append(f"turn {turn} in {thread} is traced to no run ({message_ids})")

    figures = {
        "runs_by_status": dict(sorted(statuses.items())),
        "dead_reasons": dict(sorted(dead_reasons.items())),
        "attempts": sum(run.attempts for run in runs.values()),
        "messages_by_rules": sum(len(p) for p in posted.values()),
        "turns": dict(sorted(turns.items())),
        "turns_unended": [f"{turn} in {thread}" for thread, turn in unended[:10]],
        "sends_untaken": untaken,
    }
    return Report(figures, problems)


# ─── faults ───────────────────────────────────────────────────────────────────


def kill_pool_processes(
    kills: int, *, every_s: tuple[float, float], seed: int, concurrency: int = 2
) -> Fault:
    """SIGKILL a random pool process of the first worker ``kills`` times, at random moments
    ``every_s`` apart, once the load is under way; Celery forks a replacement each time."""

    async def fault(load: Load) -> None:
        rng = random.Random(seed)
        worker = load.workers[0]
        await load.wait_finished(1)
        while load.figures.get("kills", 0) < kills:
            await asyncio.sleep(rng.uniform(*every_s))
            pool = children(worker.process.pid)
            if not pool:
                continue
            running = len(await load.running())
            os.kill(rng.choice(pool), signal.SIGKILL)
            load.count("kills")
            load.count("kills_while_runs_ran", running > 0)
        load.figures["pool_replaced_in_s"] = await _pool_replaced(worker, concurrency)

    return fault


async def _pool_replaced(worker: WorkerProcess, size: int, timeout_s: float = 60.0) -> float:
    """Seconds until the worker has ``size`` live pool processes again."""
    started = time.monotonic()
    while sum(alive(pid) for pid in children(worker.process.pid)) != size:
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"the worker's pool was not back to {size} in {timeout_s} s")
        await asyncio.sleep(0.1)
    return round(time.monotonic() - started, 1)


def kill_worker(*, after_finished: int) -> Fault:
    """SIGKILL the first worker's main process once ``after_finished`` runs ended, then start
    a new worker; the old worker's pool processes are left to themselves, as orphans."""

    async def fault(load: Load) -> None:
        old = load.workers[0]
        await load.wait_finished(after_finished)
        pool = children(old.process.pid)
        load.figures["runs_running_at_kill"] = len(await load.wait_running())
        os.kill(old.process.pid, signal.SIGKILL)
        load.count("kills")
        await asyncio.to_thread(old.process.wait)
        await load.start_worker()
        await asyncio.sleep(5)
        load.figures["orphans_alive_5s_after"] = sum(alive(pid) for pid in pool)

    return fault


def restart_redis(server: PrivateRedis, *, after_finished: int, down_s: float) -> Fault:
    """Kill Redis once ``after_finished`` runs ended, leave it down ``down_s``, start it again."""

    async def fault(load: Load) -> None:
        await load.wait_finished(after_finished)
        load.figures["runs_running_at_kill"] = len(await load.wait_running())
        await asyncio.to_thread(server.restart, down_s)
        load.count("kills")
        load.figures["redis_down_s"] = down_s

    return fault


def cut_postgres(database_url: str, *, cuts: int, every_s: float, after_finished: int) -> Fault:
    """``pg_terminate_backend`` every connection to the test's database, ``cuts`` times."""
    database = database_url.rsplit("/", 1)[1]

    async def fault(load: Load) -> None:
        import asyncpg

        from tests.services import ADMIN_DSN

        await load.wait_finished(after_finished)
        for _ in range(cuts):
            connection = await asyncpg.connect(ADMIN_DSN)
            try:
                cut = await connection.fetchval(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM "
                    "pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()) AS t",
                    database,
                )
            finally:
                await connection.close()
            load.count("kills")
            load.count("connections_cut", int(cut))
            await asyncio.sleep(every_s)

    return fault


def sweep_with_a_short_visibility_timeout(*, visibility_timeout_s: float) -> Fault:
    """Once a slow run has run longer than ``visibility_timeout_s``, start a second worker
    whose visibility timeout is that short, on a queue of its own: at start, its transport
    puts back every message unacknowledged for longer (kombu's ``restore_visible``), the slow
    run's included, at the head of the queue, and the first worker is handed a run it is still
    running. The slow run is released once that delivery was refused (``contended``)."""

    async def fault(load: Load) -> None:
        while True:
            slow = [
                run
                for run in await load.running()
                if run.rule == DEPLOY_NOTICE.name
                and (_now() - run.updated_at).total_seconds() > visibility_timeout_s + 1
            ]
            if slow:
                break
            await asyncio.sleep(0.2)
        load.figures["runs_running_at_sweep"] = len(await load.running())
        held = time.monotonic()
        sweeper = await load.start_worker(
            concurrency=1,
            queue=f"{load.settings.queue}.sweeper",
            visibility_timeout_s=visibility_timeout_s,
            soft_time_limit_s=visibility_timeout_s / 4,
            time_limit_s=visibility_timeout_s / 2,
        )
        load.count("sweeps")
        try:
            load.figures["slow_run_refused_again"] = await _refused(
                load.log_dir, {run.id for run in slow}, timeout_s=30.0
            )
        finally:
            (load.settings.home.absolute() / SLOW_RELEASE_FILE).touch()
            load.figures["slow_run_held_s"] = round(time.monotonic() - held, 1)
            await asyncio.to_thread(sweeper.stop)

    return fault


async def _refused(log_dir: Path, run_ids: set[str], *, timeout_s: float) -> bool:
    """Wait until a worker logged a delivery of one of ``run_ids`` refused as ``contended``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_lines(log_dir):
            if line.get("outcome") == "contended" and line.get("run_id") in run_ids:
                return True
        await asyncio.sleep(0.5)
    return False


def terminate_worker(*, after_finished: int) -> Fault:
    """SIGTERM the first worker once ``after_finished`` runs ended (a warm shutdown), wait for
    it to exit, then start a new worker to finish the load."""

    async def fault(load: Load) -> None:
        old = load.workers[0]
        await load.wait_finished(after_finished)
        running = await load.wait_running()
        old.signal(signal.SIGTERM)
        load.figures["runs_running_at_sigterm"] = len(running)
        load.attempts_at_fault = {run.id: run.epoch for run in running}
        sent = time.monotonic()
        load.figures["exit_code"] = await asyncio.to_thread(old.wait, 90)
        load.figures["stopped_in_s"] = round(time.monotonic() - sent, 1)
        load.count("kills")
        await load.start_worker()

    return fault


def _now() -> datetime:
    return datetime.now(UTC)
