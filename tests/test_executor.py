"""Executing one run by id, on real reflexr storage: in memory, SQLite and PostgreSQL.

Runs are created the way production creates them (reflexr's Reactor evaluates published
events) and executed through ``execute_run`` as a worker would; the assertions read what the
store holds afterwards: the run, and the ``reflexr:run_*`` facts in the log.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from pydantic import BaseModel
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.core import Run, start
from reflexr.workspace import (
    Reaction,
    Reactor,
    RunFailure,
    WorkspaceRef,
    run_lease,
    with_params,
)
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import event

from relayr.application import Application, SharedStorage, open_storage
from relayr.bridge import Bridge
from relayr.core.allowlist import Allowlists
from relayr.executor import Executed, execute_run, execute_runs, fail_run, is_transient
from relayr.runtime import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.services import SQL_STORAGES, STORAGES, storage_url

TENANT, WORKSPACE = "acme", "ops"
REF = WorkspaceRef(TENANT, WORKSPACE)
BACKOFF = timedelta(milliseconds=400)


class ExecTestEvent(Event, abstract=True, event_namespace="exectest"):
    pass


class Asked(ExecTestEvent, name="asked"):
    """``mode`` says what the action does: ok, fail, permanent, wait, slow, not_json."""

    mode: str


class Keyed(ExecTestEvent, name="keyed"):
    key: str
    mode: str = "ok"


class Timed(ExecTestEvent, name="timed"):
    pass


RULES = [
    Rule(
        name="exec:work",
        when=on(Asked),
        then=run("work"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=BACKOFF),
    ),
    Rule(
        name="exec:ordered",
        when=on(Keyed),
        scope=by(F.key),
        then=run("work"),
        ordering="scope",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=BACKOFF),
    ),
    Rule(
        name="exec:timed",
        when=on(Timed),
        then=run("slow"),
        start="beginning",
        timeout=timedelta(milliseconds=300),
        retry=RetryPolicy(max_attempts=3, backoff=BACKOFF),
    ),
]


def _gates(reaction: Reaction[Bridge]) -> Gates:
    gates = reaction.deps.app
    assert isinstance(gates, Gates)
    return gates


async def work(reaction: Reaction[Bridge]) -> object:
    gates = _gates(reaction)
    gates.calls += 1
    mode = reaction.events[-1].data.get("mode", "ok")
    if mode == "fail":
        raise RuntimeError("flaky")
    if mode == "permanent":
        raise RunFailure("will not do that", reason="bad_input", permanent=True)
    if mode == "wait":
        gates.started.set()
        await gates.release.wait()
    if mode == "not_json":
        return object()
    return {"attempt": reaction.attempt, "rule": reaction.rule.name}


async def slow(reaction: Reaction[Bridge]) -> None:
    await asyncio.sleep(30)


ACTIONS = {"work": work, "slow": slow}


class Harness:
    """A worker's runtime on real storage, and a way to make runs as the dispatcher would."""

    def __init__(self, settings: Settings, storage: SharedStorage, runtime: Runtime) -> None:
        self.settings = settings
        self.storage = storage
        self.runtime = runtime
        self.application = runtime.application
        self.rules = self.application.rules
        self.reactor = Reactor(self.rules, actions=ACTIONS)
        gates = self.application.app_deps
        assert isinstance(gates, Gates)
        self.gates = gates

    @classmethod
    async def open(cls, settings: Settings) -> "Harness":
        storage = await open_storage(settings)
        application = Application(
            artifacts=ArtifactWorkspaces(storage.artifacts),
            rules=RuleWorkspaces(storage.rules, events=[Asked, Keyed, Timed], rules=RULES),
            actions=ACTIONS,
            app_deps=Gates(),
            engines=storage.engines,
        )
        runtime = await Runtime.start(
            settings, role="worker", application=application, allowlists=Allowlists.empty
        )
        return cls(settings, storage, runtime)

    async def fire(self, event: Event) -> str:
        """Publish an event, evaluate, and return the id of the run it made."""
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        published = await source.publish(event)
        await self.reactor.evaluate()
        [made] = [r for r in await source.runs(limit=1000) if published.envelope.seq in r.matched]
        return made.id

    async def execute(self, run_id: str, runtime: Runtime | None = None) -> Executed:
        return await execute_run(runtime or self.runtime, TENANT, WORKSPACE, run_id)

    async def run(self, run_id: str) -> Run:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        return await source.run(run_id)

    async def facts(self, run_id: str) -> list[str]:
        """The ``reflexr:run_*`` facts of a run, in log order."""
        envelopes = await self.rules.storage.read(REF)
        return [
            e.event_type.removeprefix("reflexr:")
            for e in envelopes
            if getattr(e.event, "run_id", None) == run_id
        ]

    async def head(self) -> int:
        return await self.rules.storage.head_seq(REF)

    def other_worker(self, **settings: Any) -> Runtime:
        """Another process's runtime over the same storage: its own lease holder."""
        return dataclasses.replace(
            self.runtime,
            holder=f"{self.runtime.holder}-other",
            executing=set(),
            settings=self.settings.changed(**settings),
        )

    def redeployed(self, application: Application) -> Runtime:
        """This worker after a deploy changed the application's actions or rules."""
        return dataclasses.replace(self.runtime, application=application, executing=set())

    async def aclose(self) -> None:
        await self.runtime.aclose()


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    settings = Settings(home=tmp_path, database_url=database_url, lease_ttl_s=5, turn_grace_s=0)
    opened = await Harness.open(settings)
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_a_due_run_succeeds(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    executed = await harness.execute(run_id)

    assert executed.outcome == "succeeded"
    assert executed.run is not None
    assert executed.run.id == run_id
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.epoch) == ("succeeded", 1, 1)
    assert stored.output == {"attempt": 1, "rule": "exec:work"}
    assert await harness.facts(run_id) == ["run_started", "run_succeeded"]


async def test_a_failing_run_retries_then_dies_under_its_policy(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="fail"))

    first = await harness.execute(run_id)
    early = await harness.execute(run_id)
    await asyncio.sleep(BACKOFF.total_seconds() * 1.5)
    second = await harness.execute(run_id)

    assert first.outcome == "retrying"
    assert first.detail.endswith("retrying: RuntimeError: flaky")
    assert early.outcome == "not_due"
    assert "is due at" in early.detail
    assert second.outcome == "dead"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.epoch) == ("dead", 2, 2)
    assert await harness.facts(run_id) == [
        "run_started",
        "run_retrying",
        "run_started",
        "run_dead_lettered",
    ]


async def test_a_permanent_failure_dies_at_once(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="permanent"))

    executed = await harness.execute(run_id)

    assert executed.outcome == "dead"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.reason) == ("dead", 1, "bad_input")
    assert stored.error == "will not do that"


async def test_an_output_that_is_not_json_fails_the_attempt(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="not_json"))

    executed = await harness.execute(run_id)

    assert executed.outcome == "retrying"
    assert (await harness.run(run_id)).error == "the action returned a value that is not JSON"


async def test_an_unknown_action_is_a_permanent_failure(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))
    without = dataclasses.replace(harness.application, actions={"slow": slow})

    executed = await harness.execute(run_id, harness.redeployed(without))

    assert executed.outcome == "dead"
    stored = await harness.run(run_id)
    assert (stored.status, stored.reason) == ("dead", "unknown_action")
    assert stored.error == "rule exec:work runs 'work', which is not among the actions"
    assert harness.gates.calls == 0


class NeedsChannel(BaseModel):
    channel: str


async def test_params_the_action_no_longer_accepts_are_a_permanent_failure(
    harness: Harness,
) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    async def typed(reaction: Reaction[Bridge], params: NeedsChannel) -> None:
        return None

    changed = dataclasses.replace(
        harness.application, actions={**ACTIONS, "work": with_params(typed, NeedsChannel)}
    )

    executed = await harness.execute(run_id, harness.redeployed(changed))

    assert executed.outcome == "dead"
    assert (await harness.run(run_id)).reason == "invalid_params"


async def test_a_run_whose_rule_is_gone_is_cancelled(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))
    without_rule = dataclasses.replace(
        harness.application,
        rules=RuleWorkspaces(harness.storage.rules, events=[Asked, Keyed, Timed], rules=RULES[1:]),
    )

    executed = await harness.execute(run_id, harness.redeployed(without_rule))

    assert executed.outcome == "cancelled"
    assert (await harness.run(run_id)).status == "cancelled"
    [cancelled] = [
        e for e in await harness.rules.storage.read(REF) if e.event_type.endswith("run_cancelled")
    ]
    assert cancelled.data["reason"] == "rule_gone"


async def test_a_missing_run_does_nothing(harness: Harness) -> None:
    head = await harness.head()

    executed = await harness.execute("fir_0000000000000000")

    assert executed == Executed(
        "missing",
        None,
        f"run fir_0000000000000000 does not exist in {TENANT}/{WORKSPACE}",
        "fir_0000000000000000",
    )
    assert await harness.head() == head


async def test_a_finished_run_is_not_due_and_nothing_is_written(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))
    await harness.execute(run_id)
    before = await harness.run(run_id)
    head = await harness.head()

    again = await harness.execute(run_id)

    assert again.outcome == "not_due"
    assert again.detail == f"run {run_id} is succeeded"
    assert await harness.run(run_id) == before
    assert await harness.head() == head
    assert harness.gates.calls == 1


async def test_a_run_executed_twice_at_once_makes_one_attempt(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="wait"))
    first = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    same_process = await harness.execute(run_id)
    other_process = await harness.execute(run_id, harness.other_worker())
    harness.gates.release.set()
    executed = await first
    after = await harness.execute(run_id, harness.other_worker())

    assert same_process.outcome == "contended"
    assert "in this process" in same_process.detail
    assert other_process.outcome == "contended"
    assert executed.outcome == "succeeded"
    assert after.outcome in ("contended", "not_due")
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("succeeded", 1)
    assert harness.gates.calls == 1
    assert await harness.facts(run_id) == ["run_started", "run_succeeded"]


async def test_an_attempt_whose_executor_stopped_is_recorded_abandoned(harness: Harness) -> None:
    """A worker killed mid-action leaves the run running, under a lease it no longer renews."""
    run_id = await harness.fire(Asked(mode="ok"))
    storage = harness.rules.storage
    ttl = timedelta(seconds=1.5)
    assert await storage.acquire_lease(REF, run_lease(run_id), "killed-worker", ttl)
    async with storage.transaction(REF) as transaction:
        pending = await transaction.run(run_id)
        assert pending is not None
        started, _ = start(pending, now=harness.rules.clock())
        await transaction.save_runs([started])

    while_held = await harness.execute(run_id)
    await asyncio.sleep(ttl.total_seconds() * 1.5)
    lapsed = await harness.execute(run_id)
    await asyncio.sleep(BACKOFF.total_seconds() * 1.5)
    retried = await harness.execute(run_id)

    assert while_held.outcome == "contended"
    assert lapsed.outcome == "abandoned"
    assert lapsed.run is not None
    assert (lapsed.run.status, lapsed.run.reason) == ("retrying", "abandoned")
    assert retried.outcome == "succeeded"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.epoch) == ("succeeded", 2, 2)
    assert harness.gates.calls == 1


async def test_a_run_whose_attempts_keep_losing_their_worker_dies_worker_lost(
    harness: Harness,
) -> None:
    """An action that kills its worker: each claim finds its attempt abandoned; past the bound
    the run is failed for good, before its retry policy (3 attempts) would let it kill more."""
    run_id = await harness.fire(Timed())
    worker = harness.other_worker(max_redeliveries=1)
    storage = harness.rules.storage
    outcomes = []
    for _ in range(2):
        async with storage.transaction(REF) as transaction:
            waiting = await transaction.run(run_id)
            assert waiting is not None
            started, _ = start(waiting, now=harness.rules.clock())  # then its worker dies
            await transaction.save_runs([started])
        executed = await harness.execute(run_id, worker)
        assert executed.run is not None
        outcomes.append((executed.outcome, executed.run.status, executed.run.reason))

    assert outcomes == [
        ("abandoned", "retrying", "abandoned"),
        ("abandoned", "dead", "worker_lost"),
    ]
    stored = await harness.run(run_id)
    assert stored.error is not None
    assert "(2 attempts lost in a row)" in stored.error
    assert harness.gates.calls == 0


async def test_the_rule_timeout_is_honoured(harness: Harness) -> None:
    run_id = await harness.fire(Timed())

    executed = await asyncio.wait_for(harness.execute(run_id), 5)

    assert executed.outcome == "retrying"
    stored = await harness.run(run_id)
    assert (stored.status, stored.reason) == ("retrying", "timeout")
    assert stored.error == "the action timed out after 0:00:00.300000"


async def test_an_attempt_cancelled_by_an_operator_mid_action_is_interrupted(
    harness: Harness,
) -> None:
    """A short lease: the renewal finds the attempt cancelled and stops the action."""
    run_id = await harness.fire(Asked(mode="wait"))
    worker = harness.other_worker(lease_ttl_s=0.3)
    executing = asyncio.create_task(harness.execute(run_id, worker))
    await asyncio.wait_for(harness.gates.started.wait(), 5)
    operator = await harness.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="operator"))

    await operator.cancel_run(run_id, reason="not needed")
    executed = await asyncio.wait_for(executing, 5)

    assert executed.outcome == "interrupted"
    assert not harness.gates.release.is_set()
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("cancelled", 1)
    assert await harness.facts(run_id) == ["run_started", "run_cancelled"]


async def test_an_outcome_after_an_operator_cancel_is_dropped(harness: Harness) -> None:
    """A long lease: the action ends before any renewal, and its outcome is not recorded."""
    run_id = await harness.fire(Asked(mode="wait"))
    executing = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)
    operator = await harness.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="operator"))

    await operator.cancel_run(run_id)
    harness.gates.release.set()
    executed = await asyncio.wait_for(executing, 5)

    assert executed.outcome == "dropped"
    assert "no longer current (the run is cancelled)" in executed.detail
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("cancelled", 1)
    assert await harness.facts(run_id) == ["run_started", "run_cancelled"]


async def test_an_ordered_scope_goes_on_with_its_next_runs_in_one_execution(
    harness: Harness,
) -> None:
    first = await harness.fire(Keyed(key="api"))
    second = await harness.fire(Keyed(key="api"))
    third = await harness.fire(Keyed(key="api"))
    other_scope = await harness.fire(Keyed(key="db"))

    too_early = await harness.execute(second)
    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert too_early.outcome == "not_due"
    assert too_early.detail == f"run {second} waits: it is not first in its scope"
    assert [(e.outcome, e.run.id if e.run else None) for e in executed] == [
        ("succeeded", first),
        ("succeeded", second),
        ("succeeded", third),
    ]
    envelopes = await harness.rules.storage.read(REF)
    order = [
        (e.event.run_id, e.event_type.removeprefix("reflexr:"))
        for e in envelopes
        if getattr(e.event, "run_id", None) in (first, second, third)
    ]
    assert order == [
        (run_id, fact)
        for run_id in (first, second, third)
        for fact in ("run_started", "run_succeeded")
    ]
    assert (await harness.run(other_scope)).status == "pending"


async def test_a_scope_whose_run_fails_goes_no_further(harness: Harness) -> None:
    first = await harness.fire(Keyed(key="api", mode="fail"))
    second = await harness.fire(Keyed(key="api"))

    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert [e.outcome for e in executed] == ["retrying"]
    assert (await harness.run(second)).status == "pending"


async def test_an_unordered_run_is_executed_alone(harness: Harness) -> None:
    first = await harness.fire(Asked(mode="ok"))
    other = await harness.fire(Asked(mode="ok"))

    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert [e.outcome for e in executed] == ["succeeded"]
    assert (await harness.run(other)).status == "pending"


async def test_the_runs_of_one_message_are_claimed_and_executed_together(
    harness: Harness,
) -> None:
    ok = [await harness.fire(Asked(mode="ok")) for _ in range(3)]
    failing = await harness.fire(Asked(mode="fail"))
    finished = await harness.fire(Asked(mode="ok"))
    await harness.execute(finished)

    executed = await execute_runs(
        harness.runtime, TENANT, WORKSPACE, [*ok, failing, finished, "fir_missing", ok[0]]
    )

    assert [e.outcome for e in executed] == [
        "succeeded",
        "succeeded",
        "succeeded",
        "retrying",
        "not_due",
        "missing",
    ]
    for run_id in ok:
        assert (await harness.run(run_id)).status == "succeeded"
    assert (await harness.run(failing)).status == "retrying"
    assert harness.runtime.executing == set()


async def test_fail_run_kills_a_running_attempt_for_good(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="wait"))
    executing = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    failed = await fail_run(
        harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed 3 times"
    )
    harness.gates.release.set()
    late = await asyncio.wait_for(executing, 5)

    assert failed.outcome == "dead"
    assert late.outcome == "dropped"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.reason) == ("dead", 1, "worker_lost")
    assert stored.error == "killed 3 times"


async def test_fail_run_counts_the_attempt_of_a_due_run(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    failed = await fail_run(
        harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed"
    )
    finished = await fail_run(
        harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed"
    )

    assert failed.outcome == "dead"
    assert finished.outcome == "not_due"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts) == ("dead", 1)
    assert harness.gates.calls == 0
    assert await harness.facts(run_id) == ["run_started", "run_dead_lettered"]


async def test_fail_run_of_a_missing_run(harness: Harness) -> None:
    executed = await fail_run(harness.runtime, TENANT, WORKSPACE, "fir_x", reason="r", error="e")

    assert executed.outcome == "missing"


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_a_successful_run_costs_three_transactions(harness: Harness) -> None:
    """Take the lease, claim, complete: a succeeded run's lease is left to lapse (ADR-0002)."""
    run_id = await harness.fire(Asked(mode="ok"))
    [engine] = harness.application.engines
    begun: list[object] = []
    listener: Callable[..., None] = lambda connection: begun.append(connection)  # noqa: E731
    event.listen(engine.sync_engine, "begin", listener)
    try:
        executed = await harness.execute(run_id)
    finally:
        event.remove(engine.sync_engine, "begin", listener)

    assert executed.outcome == "succeeded"
    assert len(begun) == 3


def test_transient_storage_errors_are_told_apart() -> None:
    from sqlalchemy.exc import IntegrityError, OperationalError

    assert is_transient(OperationalError("BEGIN", {}, Exception("database is locked")))
    assert is_transient(ConnectionResetError())
    assert not is_transient(IntegrityError("INSERT", {}, Exception("unique")))
    assert not is_transient(ValueError("no"))


async def test_a_disabled_rules_run_waits(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))
    disabled = [
        r.model_copy(update={"enabled": False}) if r.name == "exec:work" else r for r in RULES
    ]
    paused = dataclasses.replace(
        harness.application,
        rules=RuleWorkspaces(harness.storage.rules, events=[Asked, Keyed, Timed], rules=disabled),
    )

    executed = await harness.execute(run_id, harness.redeployed(paused))

    assert executed.outcome == "not_due"
    assert executed.detail == f"run {run_id} waits: rule exec:work is disabled"
    assert (await harness.run(run_id)).status == "pending"


async def test_a_rule_refused_its_workspace_fails_for_good(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    async def refuse_runs(
        tenant_id: str, workspace_id: str | None, actor: Any, access: Any
    ) -> bool:
        return actor.kind != "agent"

    guarded = dataclasses.replace(
        harness.application,
        rules=RuleWorkspaces(
            harness.storage.rules, events=[Asked, Keyed, Timed], rules=RULES, authorize=refuse_runs
        ),
    )

    executed = await harness.execute(run_id, harness.redeployed(guarded))

    assert executed.outcome == "dead"
    assert (await harness.run(run_id)).reason == "forbidden"
    assert harness.gates.calls == 0


async def test_an_executor_cancelled_by_its_caller_lets_the_next_claim_recover(
    harness: Harness,
) -> None:
    """A time limit or a shutdown cancels the executor: its lease is released at once."""
    run_id = await harness.fire(Asked(mode="wait"))
    executing = asyncio.create_task(harness.execute(run_id))
    await asyncio.wait_for(harness.gates.started.wait(), 5)

    executing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await executing
    recovered = await harness.execute(run_id, harness.other_worker())

    assert recovered.outcome == "abandoned"
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.reason) == ("retrying", 1, "abandoned")


class Answer(BaseModel):
    answered: str


async def test_a_model_output_is_stored_as_json(harness: Harness) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    async def answer(reaction: Reaction[Bridge]) -> Answer:
        return Answer(answered=reaction.run_id)

    answering = dataclasses.replace(harness.application, actions={**ACTIONS, "work": answer})

    executed = await harness.execute(run_id, harness.redeployed(answering))

    assert executed.outcome == "succeeded"
    assert (await harness.run(run_id)).output == {"answered": run_id}
