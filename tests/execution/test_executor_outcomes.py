"""What one execution of a run records, on real reflexr storage: in memory, SQLite and PostgreSQL.

An action that succeeds, fails (and is retried under its rule's policy, or fails for good),
times out, returns what is not JSON; an action, a rule or a workspace that a deploy changed
under a waiting run; a run that is missing or finished. Each run is made by the dispatcher's
evaluation and executed through ``execute_run`` (:mod:`tests.execution.executor_harness`); the
assertions read the run and its ``reflexr:run_*`` facts in the store. And which storage errors
the executor takes for transient, a plain table.
"""

import asyncio
import dataclasses
from typing import Any

from pydantic import BaseModel
from reflexr.workspace import Reaction, with_params
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.execution.executor import Executed, is_transient
from relayr.runtime.bridge import Bridge
from tests.execution.executor_harness import (
    ACTIONS,
    BACKOFF,
    REF,
    RULES,
    TENANT,
    WORKSPACE,
    Asked,
    Harness,
    Keyed,
    Timed,
    slow,
)
from tests.execution.executor_harness import database_url as database_url  # the storage, a fixture
from tests.execution.executor_harness import harness as harness  # the fixture, on every storage


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


async def test_the_rule_timeout_is_honoured(harness: Harness) -> None:
    run_id = await harness.fire(Timed())

    executed = await asyncio.wait_for(harness.execute(run_id), 5)

    assert executed.outcome == "retrying"
    stored = await harness.run(run_id)
    assert (stored.status, stored.reason) == ("retrying", "timeout")
    assert stored.error == "the action timed out after 0:00:00.300000"


async def test_an_actions_own_timeout_error_is_its_failure_not_the_rules_timeout(
    harness: Harness,
) -> None:
    run_id = await harness.fire(Asked(mode="own_timeout"))  # exec:work has no timeout

    executed = await harness.execute(run_id)

    assert executed.outcome == "retrying"
    stored = await harness.run(run_id)
    assert stored.reason != "timeout"
    assert stored.error == "TimeoutError: the upstream API timed out"


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


def test_transient_storage_errors_are_told_apart() -> None:
    from sqlalchemy.exc import IntegrityError, OperationalError

    assert is_transient(OperationalError("BEGIN", {}, Exception("database is locked")))
    assert is_transient(ConnectionResetError())
    assert not is_transient(IntegrityError("INSERT", {}, Exception("unique")))
    assert not is_transient(ValueError("no"))
