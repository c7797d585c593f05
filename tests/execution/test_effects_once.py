"""Each effect of a run made once, found on a retry from the ledger rows that ride its write.

On real artifactr storage (in memory, SQLite, PostgreSQL) with a real Runner, through the
actions' harness of :mod:`tests.test_actions`. On SQL the ledger is relayr's own wiring: a
:class:`~relayr.ledger.SqlLedger` on the storage's engine, so its rows ride artifactr's commits.
Each test failed before its fix:

- a direct edit retried after a person changed the artifact leaves the person's change (the
  retry applied its edit again, over it);
- a retried post finds what it posted in the ledger, reading no log (it read the whole thread);
- a retried send whose turn ``authorize`` refuses fails ``forbidden``, and an artifactr
  refusal met where relayr expected none fails with its named reason (an ``InvalidState`` from
  ``ask`` escaped unclassified).
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import EditArtifact, InvalidState, JsonPatch, Rejection
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from reflexr.workspace import RunFailure
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from relayr.core import reasons
from relayr.core.refusals import classify
from relayr.execution.actions import acting
from relayr.ledger import SqlLedger
from relayr.runtime.bridge import Bridge
from tests.execution.test_actions import KEY, NOW, TENANT, WORKSPACE, Harness, Timeline
from tests.execution.test_outbound_defects import Down


class Watch:
    """artifactr's ``authorize`` hook: counts what the rule's participant asks to read, and
    answers the checks of a turn's start (``artifactr:record`` as the agent) one by one from
    ``turn_starts`` (True allows, False refuses, a rejection class raises), then allows."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.turn_starts: list[bool | type[Rejection]] = []

    async def __call__(self, tenant: str, workspace: str | None, actor: Any, access: Any) -> bool:
        if actor.kind == "external_agent" and access.action.startswith("artifactr:read"):
            self.reads.append(access.action)
        if actor.kind != "agent" or access.action != "artifactr:record" or not self.turn_starts:
            return True
        answer = self.turn_starts.pop(0)
        if isinstance(answer, bool):
            return answer
        raise answer("the turn's thread is being moved (injected)")


class OnceHarness(Harness):
    """The actions' harness on artifactr workspaces that ``watch`` authorizes; on SQL, with
    the ledger on the storage's engine, as relayr wires it."""

    def __init__(self, storage: Any, engine: AsyncEngine | None) -> None:
        self.watch = Watch()
        self.engine = engine
        super().__init__(ArtifactWorkspaces(storage, authorize=self.watch))
        if engine is not None:
            self.ledger = SqlLedger(engine)  # type: ignore[assignment]
            self.bridge = Bridge(
                artifacts=self.artifacts,
                ledger=self.ledger,
                allowlists=lambda: self.allowlists,
                runner=self.runner,
                clock=lambda: NOW,
            )


@asynccontextmanager
async def opened(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OnceHarness]:
    engine: AsyncEngine | None = None
    storage: Any = ArtifactMemory()
    if request.param != "memory":
        if request.param == "sqlite":
            engine = create_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path / 'relayr.db'}")
        else:
            engine = create_async_engine(request.getfixturevalue("postgres_url"))
        await migrate(engine)
        storage = SqlStorage(engine)
    subject = OnceHarness(storage, engine)
    try:
        yield subject
    finally:
        await subject.runner.aclose()
        if engine is not None:
            await engine.dispose()


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OnceHarness]:
    async with opened(request, tmp_path) as subject:
        yield subject


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def sql_harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OnceHarness]:
    """The harness on SQL only: the ledger's own transaction can fail there."""
    async with opened(request, tmp_path) as subject:
        yield subject


async def person(harness: Harness) -> Any:
    return await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)


async def test_a_direct_edit_retried_after_a_persons_change_leaves_the_persons_change(
    harness: OnceHarness,
) -> None:
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    timeline = await first.create(Timeline(text="# timeline"))
    assert await first.edit(timeline, "/text", "# timeline: db down") == timeline
    handle = await person(harness)
    edited = await handle.artifact(timeline)
    patch = JsonPatch(ops=({"op": "replace", "path": "/text", "value": "# db back, alice"},))
    await handle.commit(
        EditArtifact(artifact_id=timeline, base_version=edited.version, patch=patch)
    )

    again = await harness.attempt("ops:triage", thread, 2)
    assert await again.create(Timeline(text="# timeline")) == timeline
    assert await again.edit(timeline, "/text", "# timeline: db down") == timeline

    after = await handle.artifact(timeline)
    assert (after.version, after.data.text) == (edited.version + 1, "# db back, alice")
    assert len(await handle.revisions(timeline)) == after.version


async def test_a_direct_edit_of_another_value_on_a_retry_is_made(harness: OnceHarness) -> None:
    """The edit's row names its value: an action that sets another value makes that edit."""
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    timeline = await first.create(Timeline(text="# timeline"))
    await first.edit(timeline, "/text", "# timeline: db down")

    again = await harness.attempt("ops:triage", thread, 2)
    await again.create(Timeline(text="# timeline"))
    await again.edit(timeline, "/text", "# timeline: db down, cache too")

    after = await (await person(harness)).artifact(timeline)
    assert (after.version, after.data.text) == (3, "# timeline: db down, cache too")


async def test_a_direct_edit_refused_leaves_no_row_and_its_retry_makes_it(
    harness: OnceHarness,
) -> None:
    """A refused edit's row is not kept (it would make the retry skip an edit never made)."""
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    timeline = await first.create(Timeline(text="# timeline"))
    with pytest.raises(RunFailure) as refused:
        await first.edit(timeline, "/text", "bad\x00value")
    assert refused.value.reason in (reasons.VALIDATION_FAILED, reasons.STORAGE_UNAVAILABLE)
    await harness.records("unused")  # the attempt's completion commits what it left

    again = await harness.attempt("ops:triage", thread, 2)
    await again.create(Timeline(text="# timeline"))
    with pytest.raises(RunFailure):
        await again.edit(timeline, "/text", "bad\x00value")
    after = await (await person(harness)).artifact(timeline)
    assert after.version == 1


@pytest.mark.parametrize(("rule", "route"), [("ops:notify", "notice"), ("ops:triage", "turn")])
async def test_a_retried_post_finds_what_it_posted_in_the_ledger_and_reads_no_log(
    harness: OnceHarness, rule: str, route: str
) -> None:
    thread = await harness.thread()
    handle = await person(harness)
    for n in range(3):  # a thread with a history before the run's message
        await handle.post_message(thread, f"update {n}", kind="notice")
    first = await harness.attempt(rule, thread, 1)
    message_id = await first.post("deploy of api finished: ok")
    await harness.settle_turns()

    harness.watch.reads.clear()
    again = await harness.attempt(rule, thread, 2)
    assert await again.post("deploy of api finished: ok") == message_id

    assert "artifactr:read_events" not in harness.watch.reads
    run_id = (await harness.reaction(rule, thread)).run_id
    records = await harness.ledger.emissions(KEY, run_id)
    kind = "notice" if route == "notice" else "message"
    outcome = "already_posted" if route == "notice" else "asked"
    assert [(r.attempt, r.kind, r.policy, r.outcome) for r in records] == [
        (1, kind, route, "posted"),
        (2, kind, route, outcome),
    ]


async def test_a_sends_record_is_in_the_ledger_as_the_send_returns(harness: OnceHarness) -> None:
    """Before the run's completion: its process may die right after the send (ADR-0103)."""
    thread = await harness.thread()
    actions = await harness.attempt("ops:triage", thread, 1)
    message_id = await actions.send("Triage incident: db down")

    run_id = (await harness.reaction("ops:triage", thread)).run_id
    [record] = await harness.ledger.emissions(KEY, run_id)
    assert (record.message_id, record.kind, record.outcome) == (message_id, "message", "posted")
    assert not actions.pending.emissions


async def test_a_retried_send_whose_turn_authorize_refuses_fails_forbidden(
    harness: OnceHarness,
) -> None:
    """``Runner.ask``'s own refusal: the message is there, its turn may not start."""
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    await first.send("Triage incident: db down")
    assert len(await harness.turns(thread)) == 1
    harness.watch.turn_starts = [True, False]  # the send's own check, then the ask's

    again = await harness.attempt("ops:triage", thread, 2)
    with pytest.raises(RunFailure) as refused:
        await again.send("Triage incident: db down")

    assert (refused.value.reason, refused.value.permanent) == ("forbidden", True)
    assert "asking for the turn of message msg_" in refused.value.message
    run_id = (await harness.reaction("ops:triage", thread)).run_id
    records = await harness.ledger.emissions(KEY, run_id)
    assert [(r.attempt, r.outcome) for r in records] == [(1, "posted")]


async def test_an_invalid_state_from_ask_fails_the_attempt_with_its_reason(
    harness: OnceHarness,
) -> None:
    """An artifactr refusal relayr does not read itself is classified, never raised raw."""
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    await first.send("Triage incident: db down")
    await harness.settle_turns()
    harness.watch.turn_starts = [True, InvalidState]  # the send's own check, then the ask's

    again = await harness.attempt("ops:triage", thread, 2)
    with pytest.raises(RunFailure) as refused:
        await again.send("Triage incident: db down")

    assert (refused.value.reason, refused.value.permanent) == ("invalid_state", True)
    assert "being moved" in refused.value.message


def _rejections(root: type[Rejection]) -> list[type[Rejection]]:
    found = [root]
    for sub in root.__subclasses__():
        found += _rejections(sub)
    return found


@pytest.mark.parametrize("rejection", _rejections(Rejection), ids=lambda r: r.__name__)
def test_every_artifactr_refusal_is_classified_with_a_named_reason(
    rejection: type[Rejection],
) -> None:
    code = getattr(rejection, "code", None) or rejection.__name__
    refusal = classify(str(code), "refused", doing="posting notice msg_1")

    assert refusal.reason in reasons.WRITE_REFUSALS, f"{rejection.__name__} has no named reason"


async def test_a_record_the_ledger_cannot_write_fails_the_attempt_io_error_and_the_retry_writes_it(
    sql_harness: OnceHarness,
) -> None:
    harness = sql_harness
    assert harness.engine is not None
    thread = await harness.thread()
    first = await harness.attempt("ops:notify", thread, 1)
    message_id = await first.notice("deploy of api finished: ok")

    again = await harness.attempt("ops:notify", thread, 2)
    with (
        Down("INSERT INTO relayr_emissions").on(harness.engine),
        pytest.raises(RunFailure) as failed,
    ):
        await again.notice("deploy of api finished: ok")
    assert (failed.value.reason, failed.value.permanent) == ("io_error", False)
    assert f"recording the already_posted notice {message_id}" in failed.value.message

    third = await harness.attempt("ops:notify", thread, 3)
    await third.notice("deploy of api finished: ok")
    run_id = (await harness.reaction("ops:notify", thread)).run_id
    records = await harness.ledger.emissions(KEY, run_id)
    assert [(r.attempt, r.outcome) for r in records] == [(1, "posted"), (3, "already_posted")]


async def test_a_post_whose_record_cannot_validate_is_refused_before_anything_is_written(
    harness: OnceHarness,
) -> None:
    """The request is checked whole, its record included, at the boundary (ADR-0105)."""
    thread = await harness.thread()
    reaction = await harness.reaction("ops:triage", thread)
    reaction.run = reaction.run.model_copy(update={"attempts": 3, "epoch": 2})
    actions = acting(reaction)

    for write in (actions.notice, actions.send):
        with pytest.raises(RunFailure) as refused:
            await write("Triage incident: db down")
        assert (refused.value.reason, refused.value.permanent) == ("invalid_emission", True)
        assert "INVALID_CONTEXT" in refused.value.message

    assert await harness.messages(thread) == []
    assert await harness.ledger.emissions(KEY, reaction.run_id) == []
    assert not actions.pending
