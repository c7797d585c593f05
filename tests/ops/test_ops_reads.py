"""What ops read of runs is whole, on real storage (SQLite and PostgreSQL; a stalled turn on
artifactr in memory).

A list read with a smaller limit is the start of the longer one; a run's facts are read from its
firing; runs that do not exist are named, and a run id two workspaces hold is refused without
its workspace; a turn that went quiet is shown stalled. The runs are executed by relayr's
executor over reflexr and artifactr (:mod:`tests.ops.ops_harness`).
"""

import asyncio
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Session, function_model
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import SourceActor
from reflexr.sql import SqlStorage as RuleSql
from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.ledger import WorkspaceKey
from relayr.ops.report import show_run
from relayr.ops.rows import AmbiguousRun, RunFilter, find_run, list_runs
from relayr.ops.runs import cancel, find_runs
from tests.execution.test_actions import Note
from tests.ops.ops_harness import KEY, RULES, TENANT, WORKSPACE, Crashed, Flaked, Ops


async def test_a_shorter_list_is_the_start_of_the_longer_one(ops: Ops) -> None:
    """reflexr cuts each workspace's runs at the newest created: the list is in that order, so
    a run created first and changed last is on no page that read fewer runs (ordered by change,
    such a run could be on neither the first page nor the second)."""
    thread = await ops.thread()
    created = [
        await ops.fire(Flaked(thread_id=thread), workspace)
        for workspace in (WORKSPACE, "billing", WORKSPACE, "billing", WORKSPACE)
    ]
    oldest = await find_run(ops.rules, created[0], KEY)
    assert oldest is not None
    [cancelled] = await cancel(ops.rules, [oldest], reason="changed last")
    assert cancelled.ok

    whole = await list_runs(ops.rules, RunFilter(limit=None))
    assert [row.id for row in whole] == created[::-1]  # newest created first, every workspace
    for limit in range(1, len(created) + 1):
        shorter = await list_runs(ops.rules, RunFilter(limit=limit))
        assert [row.id for row in shorter] == [row.id for row in whole[:limit]], limit
    # what changed within a duration is found however long ago it was created
    after = await find_run(ops.rules, created[0], KEY)
    assert after is not None
    [changed] = await list_runs(ops.rules, RunFilter(since=after.updated_at, limit=1))
    assert (changed.id, changed.status) == (created[0], "cancelled")


async def test_a_runs_facts_are_read_from_the_event_that_fired_it(ops: Ops) -> None:
    thread = await ops.thread()
    handle = await ops.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
    for _ in range(5):  # a history before the run: its facts cannot be there
        await handle.publish(Crashed(thread_id="thr_elsewhere"))
    run_id = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(run_id) == "dead"
    row = await find_run(ops.rules, run_id)
    assert row is not None
    assert row.fired_seq > 5

    class Reading(RuleSql):
        """reflexr's SQL storage, noting where each read of the log starts."""

        starts: ClassVar[list[int]] = []

        async def read(self, workspace: WorkspaceRef, **window: Any) -> Any:
            self.starts.append(window.get("after_seq", 0))
            return await super().read(workspace, **window)

    [engine] = ops.runtime.application.engines
    rules = Workspaces(Reading(engine), events=[Flaked, Crashed], rules=RULES)
    artifacts, ledger = ops.runtime.application.artifacts, ops.runtime.bridge.ledger
    report = await show_run(rules, artifacts, ledger, row)
    assert Reading.starts == [row.fired_seq]
    assert [(a.attempt, a.outcome) for a in report.attempts] == [(1, "failed"), (2, "dead")]


async def test_runs_that_do_not_exist_are_named(ops: Ops) -> None:
    thread = await ops.thread()
    run_id = await ops.fire(Flaked(thread_id=thread))
    found, missing = await find_runs(
        ops.rules, [(None, run_id), (KEY, "fir_typo"), (None, "fir_gone")]
    )
    assert [row.id for row in found] == [run_id]
    assert [(m.run_id, m.workspace, m.ok, m.detail) for m in missing] == [
        ("fir_typo", str(KEY), False, f"no run fir_typo in {KEY}"),
        ("fir_gone", "*", False, "no run fir_gone"),
    ]


async def test_a_run_id_two_workspaces_hold_is_refused_without_its_workspace(ops: Ops) -> None:
    """reflexr's firing ids are unique within a workspace only: the same rule firing at the same
    seq in two workspaces makes the same id. Named without its workspace, such a run is refused,
    naming both, rather than the first found being changed."""
    thread = await ops.thread()
    here = await ops.fire(Flaked(thread_id=thread))
    there = await ops.fire(Flaked(thread_id=thread), "billing")
    assert here == there  # the premise: each workspace's first event, the same rule
    billing = WorkspaceKey(TENANT, "billing")
    with pytest.raises(AmbiguousRun, match=f"run {here} is in 2 workspaces"):
        await find_run(ops.rules, here)
    found, refused = await find_runs(ops.rules, [(None, here), (billing, here)])
    assert [(row.id, row.workspace) for row in found] == [(here, billing)]
    [refusal] = refused
    assert (refusal.run_id, refusal.ok) == (here, False)
    assert refusal.detail == (
        f"run {here} is in 2 workspaces ({billing}, {KEY}): name one with --workspace"
    )


TURN_START_S = 30.0
"""How long a turn sent on this loop may take to record its start, on a busy machine."""


async def test_a_turn_that_went_quiet_is_shown_stalled(tmp_path: Path) -> None:
    """artifactr never redoes a turn whose process died: ``runs show`` must tell ops."""
    from datetime import UTC, datetime

    from artifactr.workspace import InMemoryStorage as ArtifactMemory

    from relayr.ledger import InMemoryLedger
    from relayr.ops.report import STALLED_AFTER, _turns

    hold = asyncio.Event()

    async def never(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        await hold.wait()
        return ModelResponse(parts=[TextPart("late")])

    agent = Agent(
        function_model(never),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[Note])],
    )
    from artifactr.agent import Runner

    artifacts = ArtifactWorkspaces(ArtifactMemory())
    runner: Runner[None] = Runner(agent, app=None)
    handle = await artifacts.open(TENANT, WORKSPACE, actor=UserActor(id="alice"))
    thread = (await handle.create_thread("t")).id
    sent = await runner.send(handle, thread, "look", message_id="msg_1")
    assert sent.run is not None
    ledger = InMemoryLedger()
    from relayr.core.emissions import EmissionRecord

    record = EmissionRecord(
        kind="message", rule="ops:crash", run_id="fir_1", attempt=1, epoch=1,
        tenant_id=TENANT, workspace_id=WORKSPACE, thread_id=thread, message_id="msg_1",
        policy="turn", outcome="posted", content="look", emitted_at=datetime.now(UTC),
    )  # fmt: skip
    await ledger.record_emission(record)
    records = await ledger.emissions(KEY, "fir_1")
    try:
        deadline = time.monotonic() + TURN_START_S
        while True:  # until the turn has recorded its start, however busy the machine
            [now] = await _turns(artifacts, KEY, records, now=datetime.now(UTC))
            if now.status != "untaken" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        later = datetime.now(UTC) + STALLED_AFTER + timedelta(seconds=5)
        [quiet] = await _turns(artifacts, KEY, records, now=later)
    finally:
        await runner.aclose()
    assert (now.status, now.turn_id) == ("running", sent.run.run_id)
    assert quiet.status == "stalled"
    assert "post it again" in (quiet.reason or "")
