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
from pathlib import Path
from typing import Any

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import EditArtifact, JsonPatch, Rejection
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from reflexr.workspace import RunFailure
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from relayr.core import reasons
from relayr.ledger import SqlLedger
from relayr.runtime.bridge import Bridge
from tests.test_actions import ALLOWLIST, NOW, TENANT, WORKSPACE, Harness, Timeline

GRANTED = ALLOWLIST + '\n[rules."ops:notify"]\nturns = true\n'


class Watch:
    """artifactr's ``authorize`` hook: counts what the rule's participant asks to read, and
    answers the agent's turn start as ``turn_start`` says (None: allowed)."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.turn_start: type[Rejection] | bool | None = None

    async def __call__(self, tenant: str, workspace: str | None, actor: Any, access: Any) -> bool:
        if actor.kind == "external_agent" and access.action.startswith("artifactr:read"):
            self.reads.append(access.action)
        starting = actor.kind == "agent" and access.action == "artifactr:record"
        if starting and isinstance(self.turn_start, type):
            raise self.turn_start("the turn's thread is being moved (injected)")
        return not (starting and self.turn_start is False)


class OnceHarness(Harness):
    """The actions' harness on artifactr workspaces that ``watch`` authorizes; on SQL, with
    the ledger on the storage's engine, as relayr wires it."""

    def __init__(self, storage: Any, engine: AsyncEngine | None) -> None:
        self.watch = Watch()
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


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OnceHarness]:
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
