"""relayr's evaluation against reflexr's reactor, on real storage: the same runs, facts and state.

One log is evaluated by reflexr's ``Reactor.evaluate`` in one storage and by
:func:`relayr.dispatch.evaluation.evaluate_all` in another; the runs they create (ids are derived
from the rule, scope and seq, so they compare across storages), the rules' cursors and the facts
they append must be the same. Then what only relayr's does: one transaction per workspace and pass,
a bound at the pass's head, and two evaluators at once firing each run once.
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from reflexr import Event, F, Rule, SourceActor, by, on, run
from reflexr.core import Envelope
from reflexr.workspace import Reaction, Reactor, WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.dispatch import evaluation
from relayr.dispatch.evaluation import evaluate_all, evaluate_workspace
from relayr.runtime.application import open_storage
from relayr.settings import Settings
from tests.services import SQL_STORAGES, STORAGES, storage_url

TENANT, WORKSPACE = "acme", "evals"
REF = WorkspaceRef(TENANT, WORKSPACE)


class EvalEvent(Event, abstract=True, event_namespace="evaltest"):
    pass


class Reading(EvalEvent, name="reading"):
    sensor: str
    value: int


RULES = [
    Rule(name="eval:every", when=on(Reading), then=run("act"), start="beginning"),
    Rule(
        name="eval:high",
        when=on(Reading).where(F.value >= 7),
        scope=by(F.sensor),
        then=run("act"),
        start="beginning",
    ),
    Rule(
        name="eval:twice",
        when=on(Reading).count(at_least=2, within=timedelta(hours=1)),
        scope=by(F.sensor),
        then=run("act"),
        ordering="none",
        start="beginning",
    ),
]


async def act(reaction: Reaction[None]) -> None:
    return None


READINGS = [Reading(sensor=f"s{i % 3}", value=i % 10) for i in range(40)]


_ENGINES: list[AsyncEngine] = []
"""Engines the tests opened, disposed of after each test (:func:`disposed`)."""


async def _workspaces(url: str, rules: list[Rule] = RULES) -> RuleWorkspaces:
    storage = await open_storage(Settings(database_url=url))
    _ENGINES.extend(storage.engines)
    return RuleWorkspaces(storage.rules, events=[Reading], rules=rules)


@pytest.fixture(autouse=True)
async def disposed() -> AsyncIterator[None]:
    yield
    while _ENGINES:
        await _ENGINES.pop().dispose()


async def _publish(rules: RuleWorkspaces, start: int, stop: int) -> None:
    """Publish READINGS[start:stop], each under the id of its place (a repeat adds nothing)."""
    source = await rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
    for index in range(start, stop):
        await source.publish(READINGS[index], id=f"reading-{index}")


async def _picture(rules: RuleWorkspaces) -> tuple[object, ...]:
    """What evaluation left: runs, cursors, and the log's event types, comparable across stores."""
    source = await rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
    runs = sorted((r.id, r.rule, r.scope_key, r.matched) for r in await source.runs(limit=1000))
    progress = await rules.storage.progress(REF)
    cursors = {name: p.cursor for name, p in progress.items()}
    log: list[Envelope] = await rules.storage.read(REF)
    types = sorted(e.event_type for e in log)
    return runs, cursors, types


@pytest.fixture(params=STORAGES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@pytest.fixture
async def reference() -> RuleWorkspaces:
    """reflexr's own reactor over the same events, in memory."""
    rules = await _workspaces("memory://")
    await _publish(rules, 0, 25)
    reactor = Reactor(rules, actions={"act": act})
    await reactor.evaluate()
    await _publish(rules, 25, len(READINGS))
    await reactor.evaluate()
    return rules


async def _settled(rules: RuleWorkspaces, *more: RuleWorkspaces) -> int:
    """Passes until the log stops moving (a pass leaves its own facts to the next one, where
    reflexr's reactor evaluates them in the same call); the runs they made."""
    made = 0
    for _ in range(10):
        head = await rules.storage.head_seq(REF)
        made += sum(
            len(found)
            for found in await asyncio.gather(*(evaluate_all(each) for each in (rules, *more)))
        )
        if await rules.storage.head_seq(REF) == head:
            return made
    raise AssertionError("evaluation did not settle in 10 passes")


async def test_relayr_evaluates_as_reflexr_does(url: str, reference: RuleWorkspaces) -> None:
    rules = await _workspaces(url)
    await _publish(rules, 0, 25)
    first = await _settled(rules)
    await _publish(rules, 25, len(READINGS))
    second = await _settled(rules)

    assert await _picture(rules) == await _picture(reference)
    assert first + second == len((await _picture(reference))[0])


async def test_one_workspace_costs_one_transaction(tmp_path: Path) -> None:
    """One transaction evaluates every rule over up to BATCH_ENVELOPES envelopes."""
    url = f"sqlite+aiosqlite:///{tmp_path}/relayr.db"
    rules = await _workspaces(url)
    await _publish(rules, 0, evaluation.BATCH_ENVELOPES)
    begun: list[object] = []
    counted = await _workspaces(url)
    [engine] = _ENGINES[-1:]
    event.listen(engine.sync_engine, "begin", lambda connection: begun.append(connection))

    evaluated = await evaluate_workspace(counted, REF)

    assert evaluated.caught_up
    assert evaluated.runs
    assert len(begun) == 1


async def test_a_pass_stops_at_the_head_it_found(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Envelopes appended after the pass read the head wait for the next pass."""
    monkeypatch.setattr(evaluation, "BATCH_ENVELOPES", 10)
    rules = await _workspaces(url)
    await _publish(rules, 0, 30)
    head = await rules.storage.head_seq(REF)

    first = await evaluate_workspace(rules, REF, up_to=head)
    assert (first.up_to, first.caught_up) == (head, False)
    while not (done := await evaluate_workspace(rules, REF, up_to=head)).caught_up:
        pass
    progress = await rules.storage.progress(REF)

    assert done.up_to == head
    assert {p.cursor for p in progress.values()} == {head}


@pytest.mark.parametrize("url", SQL_STORAGES, indirect=True)
async def test_two_evaluators_at_once_fire_each_run_once(
    url: str, reference: RuleWorkspaces
) -> None:
    rules = await _workspaces(url)
    other = await _workspaces(url)
    await _publish(rules, 0, 25)
    await _settled(rules, other)
    await _publish(rules, 25, len(READINGS))
    await _settled(rules, other)

    assert await _picture(rules) == await _picture(reference)


async def test_a_changed_rule_starts_again_at_the_head(url: str) -> None:
    rules = await _workspaces(url)
    await _publish(rules, 0, 10)
    await evaluate_all(rules)
    changed = [
        rule.model_copy(update={"description": "changed"}) if rule.name == "eval:every" else rule
        for rule in RULES
    ]
    changed[0] = changed[0].model_copy(update={"when": on(Reading).where(F.value >= 5)})
    again = RuleWorkspaces(rules.storage, events=[Reading], rules=changed)
    head = await rules.storage.head_seq(REF)

    await evaluate_all(again)
    log = await rules.storage.read(REF, after_seq=head)

    assert [e.event_type for e in log] == ["reflexr:rule_reset"]
    assert (await rules.storage.progress(REF))["eval:every"].cursor == head


async def test_a_disabled_rule_keeps_its_cursor(url: str) -> None:
    rules = await _workspaces(url)
    await _publish(rules, 0, 5)
    await evaluate_all(rules)
    held = [
        rule.model_copy(update={"enabled": False}) if rule.name == "eval:every" else rule
        for rule in RULES
    ]
    paused = RuleWorkspaces(rules.storage, events=[Reading], rules=held)
    before = (await rules.storage.progress(REF))["eval:every"].cursor
    await _publish(rules, 5, 10)

    await evaluate_all(paused)

    assert (await rules.storage.progress(REF))["eval:every"].cursor == before
    assert (await rules.storage.progress(REF))["eval:high"].cursor > before


async def test_a_workspace_whose_head_has_not_moved_is_not_evaluated_again(
    tmp_path: Path,
) -> None:
    """Only its head is read: no evaluation transaction, so no workspace lock."""
    url = f"sqlite+aiosqlite:///{tmp_path}/relayr.db"
    rules = await _workspaces(url)
    [engine] = _ENGINES[-1:]
    await _publish(rules, 0, 5)
    known: dict[WorkspaceRef, int] = {}
    first = await evaluate_all(rules, evaluated_to=known)
    await evaluate_all(rules, evaluated_to=known)  # the facts the first one appended
    statements: list[str] = []
    event.listen(
        engine.sync_engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, *_: statements.append(statement),
    )

    idle = await evaluate_all(rules, evaluated_to=known)
    quiet = list(statements)
    await _publish(rules, 5, 8)
    again = await evaluate_all(rules, evaluated_to=known)

    assert first
    assert idle == []
    assert not any("reflexr_progress" in statement for statement in quiet), quiet
    assert again  # new readings fire "eval:every" again
