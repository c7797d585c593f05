"""Ops on real storage: dead runs listed, shown and retried safely, and what ops read is whole.

A dead run retried posts its notice once (a); a send whose worker died between its commit and
its ask gets exactly one turn (b); a list read with a smaller limit is the start of the longer
one; a run's facts are read from its firing; an enqueue that fails for good still reports every
run retried. The runs are executed by relayr's executor over reflexr and artifactr on SQLite (and
PostgreSQL); the retry goes through reflexr's operator retry, and what the retry enqueues is
executed as a worker would.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Session, function_model
from artifactr.core import MessagePosted, PostMessage, RunStarted
from artifactr.sql import SqlStorage as ArtifactSql
from kombu.exceptions import EncodeError
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, RetryPolicy, Rule, SourceActor, on, run
from reflexr.sql import SqlStorage as RuleSql
from reflexr.workspace import Reaction, Reactor, RunFailure, WorkspaceRef, Workspaces
from structlog.testing import capture_logs

from relayr.actions import acting
from relayr.application import Application, create_engine, migrate
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.ids import IdDeriver, digest
from relayr.executor import execute_run
from relayr.ledger import WorkspaceKey
from relayr.ops import ENQUEUE_FAILED, cancel, find_runs, not_enqueued, retry, skip
from relayr.run_report import show_run
from relayr.run_rows import AmbiguousRun, RunFilter, find_run, list_runs
from relayr.runtime import Runtime
from relayr.settings import Settings
from tests.test_actions import Note

TENANT, WORKSPACE = "acme", "ops"
KEY = WorkspaceKey(TENANT, WORKSPACE)


class OpsTestEvent(Event, abstract=True, event_namespace="opstest"):
    pass


class Flaked(OpsTestEvent, name="flaked"):
    thread_id: str


class Crashed(OpsTestEvent, name="crashed"):
    thread_id: str


@dataclass
class World:
    """What the actions consult: whether the flaky one may succeed yet, and what crashed."""

    fixed: bool = False
    crashed: set[str] = field(default_factory=set)


WORLD = World()


async def flaky(reaction: Reaction[Any]) -> None:
    await acting(reaction).notice("checking the backup")
    if not WORLD.fixed:
        raise RunFailure("the backup host is down", reason="backup_down")


async def crashing_send(reaction: Reaction[Any]) -> None:
    """Commits its message as send would, then dies before asking, on its first attempt."""
    content = "Triage incident: backup down"
    actions = acting(reaction)
    if reaction.run_id not in WORLD.crashed:
        WORLD.crashed.add(reaction.run_id)
        thread = actions.threads[0]
        message_id = IdDeriver(reaction.run_id).next(
            "msg", segment=0, operation="post_message", subject=(thread, digest(content))
        )
        died = await reaction.deps.artifacts.open(TENANT, WORKSPACE, actor=actions.actor)
        await died.commit(PostMessage(thread_id=thread, content=content, message_id=message_id))
        raise RunFailure("the worker died between commit and ask", reason="crash", permanent=True)
    await actions.send(content)


RULES = [
    Rule(
        name="ops:flaky",
        when=on(Flaked),
        then=run("flaky"),
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=timedelta(milliseconds=1)),
    ),
    Rule(name="ops:crash", when=on(Crashed), then=run("crash"), start="beginning"),
]


async def _respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart("looking")])


AGENT = Agent(
    function_model(_respond),
    deps_type=Session[None],
    capabilities=[ArtifactWorkspace(types=[Note])],
)


@dataclass
class Ops:
    runtime: Runtime
    reactor: Reactor[Any]
    enqueued: list[str] = field(default_factory=list)

    @property
    def rules(self) -> Workspaces:
        return self.runtime.application.rules

    async def enqueue(self, tenant_id: str, workspace_id: str, run_id: str) -> None:
        self.enqueued.append(run_id)

    async def until_ended(self, run_id: str) -> str:
        for _ in range(50):
            await execute_run(self.runtime, TENANT, WORKSPACE, run_id)
            current = await self.rules.storage.run(_ref(), run_id)
            assert current is not None
            if current.status in ("succeeded", "dead", "cancelled", "skipped"):
                return current.status
            await asyncio.sleep(0.01)
        raise AssertionError(f"run {run_id} did not end")

    async def fire(self, event: Event, workspace: str = WORKSPACE) -> str:
        handle = await self.rules.open(TENANT, workspace, actor=SourceActor(name="test"))
        published = await handle.publish(event)
        await self.reactor.evaluate()
        [fired] = [r for r in await handle.runs() if published.envelope.seq in r.matched]
        return fired.id

    async def thread(self) -> str:
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return (await handle.create_thread("backups")).id

    async def posted(self, thread: str) -> list[tuple[MessagePosted, str]]:
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return [
            (e.event, e.actor.participant)
            for e in await handle.read(threads={thread})
            if isinstance(e.event, MessagePosted)
        ]

    async def turns(self, thread: str) -> list[RunStarted]:
        await self.runtime._grace(10)
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return [
            e.event for e in await handle.read(threads={thread}) if isinstance(e.event, RunStarted)
        ]


def _ref() -> Any:
    from reflexr.workspace import WorkspaceRef

    return WorkspaceRef(TENANT, WORKSPACE)


async def _ops(url: str, home: Path) -> Ops:
    engine = create_engine(url)
    await migrate(engine)
    actions = {"flaky": flaky, "crash": crashing_send}
    application = Application(
        artifacts=ArtifactWorkspaces(ArtifactSql(engine)),
        rules=Workspaces(RuleSql(engine), events=[Flaked, Crashed], rules=RULES),
        actions=actions,
        agent=AGENT,
        engines=(engine,),
    )
    settings = Settings(home=home, database_url=url, lease_ttl_s=5.0)
    allowlists = parse_allowlist('[rules."ops:crash"]\nturns = true\n')
    runtime = await Runtime.start(
        settings, role="cli", application=application, allowlists=lambda: allowlists
    )
    return Ops(runtime, Reactor(application.rules, actions=actions))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def ops(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Ops]:
    WORLD.fixed = False
    WORLD.crashed.clear()
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'relayr.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    subject = await _ops(url, tmp_path)
    try:
        yield subject
    finally:
        await subject.runtime.aclose()


async def test_a_dead_run_is_listed_retried_and_posts_one_notice(ops: Ops) -> None:
    thread = await ops.thread()
    run_id = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(run_id) == "dead"

    [row] = await list_runs(ops.rules, RunFilter(status="dead"))
    assert (row.id, row.rule, row.reason, row.attempts) == (run_id, "ops:flaky", "backup_down", 2)
    assert "backup host is down" in (row.error or "")
    assert await list_runs(ops.rules, RunFilter(status="dead", rule="ops:other")) == []

    WORLD.fixed = True
    [done] = await retry(ops.rules, [row], ops.enqueue)
    assert (done.ok, done.status) == (True, "pending")
    assert ops.enqueued == [run_id]
    assert await ops.until_ended(run_id) == "succeeded"

    notices = [m for m, author in await ops.posted(thread) if author.endswith("ops:flaky")]
    assert [(m.kind, m.content) for m in notices] == [("notice", "checking the backup")]
    report = await show_run(
        ops.rules, ops.runtime.application.artifacts, ops.runtime.bridge.ledger, row
    )
    assert [(a.attempt, a.outcome, a.reason) for a in report.attempts] == [
        (1, "failed", "backup_down"),
        (2, "dead", "backup_down"),
        (1, "succeeded", None),
    ]
    assert [r.outcome for r in report.emissions] == ["posted", "already_posted", "already_posted"]

    [refused] = await retry(ops.rules, [row], ops.enqueue)
    assert not refused.ok
    assert "succeeded" in refused.detail


async def test_b_a_send_killed_between_commit_and_ask_gets_exactly_one_turn(ops: Ops) -> None:
    thread = await ops.thread()
    run_id = await ops.fire(Crashed(thread_id=thread))
    assert await ops.until_ended(run_id) == "dead"
    assert await ops.turns(thread) == []

    [row] = await list_runs(ops.rules, RunFilter(status="dead", rule="ops:crash"))
    [done] = await retry(ops.rules, [row], ops.enqueue)
    assert done.ok
    assert await ops.until_ended(run_id) == "succeeded"

    turns = await ops.turns(thread)
    mine = [m for m, author in await ops.posted(thread) if author.endswith("ops:crash")]
    assert len(mine) == 1
    assert len(turns) == 1
    assert mine[0].message_id in turns[0].message_ids
    report = await show_run(
        ops.rules, ops.runtime.application.artifacts, ops.runtime.bridge.ledger, row
    )
    [turn] = report.turns
    assert (turn.message_id, turn.status) == (mine[0].message_id, "completed")
    assert [r.outcome for r in report.emissions] == ["asked"]


async def test_dry_run_changes_nothing_and_cancel_and_skip_are_reflexrs(ops: Ops) -> None:
    thread = await ops.thread()
    first = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(first) == "dead"
    row = await find_run(ops.rules, first)
    assert row is not None
    [would] = await retry(ops.rules, [row], ops.enqueue, dry_run=True)
    assert (would.ok, would.detail) == (True, "would retry")
    assert ops.enqueued == []
    assert (await ops.rules.storage.run(_ref(), first)).status == "dead"  # type: ignore[union-attr]

    [skipped] = await skip(ops.rules, [row], reason="backup retired")
    assert (skipped.ok, skipped.status) == (True, "skipped")
    [again] = await cancel(ops.rules, [row], reason="no")
    assert not again.ok
    assert "skipped" in again.detail
    assert await find_run(ops.rules, "fir_missing") is None


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


async def test_an_enqueue_that_fails_for_good_leaves_every_run_retried_and_reported(
    ops: Ops,
) -> None:
    """A message the broker cannot take (EncodeError), credentials it refuses, a folder that
    cannot be written: not transient, so the enqueue raises it as it is, after reflexr's retry
    changed the run. Every run still gets its result; the broker is not tried again."""
    thread = await ops.thread()
    run_ids = [await ops.fire(Flaked(thread_id=thread)) for _ in range(2)]
    for run_id in run_ids:
        assert await ops.until_ended(run_id) == "dead"
    rows, missing = await find_runs(ops.rules, [(KEY, run_id) for run_id in run_ids])
    assert missing == []
    tried: list[str] = []

    async def refusing(tenant_id: str, workspace_id: str, run_id: str) -> None:
        tried.append(run_id)
        raise EncodeError("Object of type bytes is not JSON serializable")

    with capture_logs() as logs:
        results = await retry(ops.rules, rows, refusing)
    assert tried == run_ids[:1]
    assert [(r.run_id, r.ok, r.status, r.enqueued) for r in results] == [
        (run_id, True, "pending", False) for run_id in run_ids
    ]
    assert {r.enqueue_error for r in results} == {ENQUEUE_FAILED}
    assert all("EncodeError: Object of type bytes" in r.detail for r in results)
    for run_id in run_ids:
        current = await ops.rules.storage.run(_ref(), run_id)
        assert current is not None
        assert current.status == "pending"
    [logged] = [line for line in logs if line["log_level"] == "error"]
    assert (logged["run_id"], logged["workspace"]) == (run_ids[0], str(KEY))
    problem = not_enqueued(results, "redis://broker:6379/0")
    assert problem is not None
    assert problem.startswith("the enqueue on broker redis://broker:6379/0 failed")
    assert problem.endswith(f"{run_ids[1]} ({KEY}); the dispatcher will enqueue them")


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
    from relayr.run_report import STALLED_AFTER, _turns

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
