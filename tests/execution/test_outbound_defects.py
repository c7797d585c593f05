"""The outbound half's defects, each with the test that failed before its fix.

On real artifactr storage (in memory and SQLite) with a real Runner, through the harness of
:mod:`tests.execution.test_actions`:

- a retried ``post`` records what artifactr holds under its id as its kind, and the route the
  allowlist decided as its policy (it recorded ``message``/``turn``/``asked`` for a notice, and
  asked for a turn; then ``notice`` as the policy of a post the allowlist sent);
- an edit of an archived artifact is refused ``artifact_archived`` (it returned the artifact's
  id as if it had written, having written nothing);
- a storage error that outlasts relayr's retries fails the attempt ``storage_unavailable``
  with the write named (a raw SQLAlchemy error reached the run); an action with no relayr run
  behind it fails ``missing_run_context``.

The third defect, the allowlist's promised reload "at once on SIGHUP", is a promise in shipped
files, tested in :mod:`tests.project.test_deploy_allowlist`.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import ArchiveArtifact
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from reflexr.workspace import RunFailure
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.core.allowlist_toml import parse_allowlist
from relayr.execution.actions import MissingRunContext, acting
from tests.execution.test_actions import ALLOWLIST, TENANT, WORKSPACE, Harness, Note, Timeline
from tests.execution.test_actions import harness as harness  # the fixture, over memory and SQLite

GRANTED = ALLOWLIST + '\n[rules."ops:notify"]\nturns = true\n'
"""The test's allowlist with turns granted to ops:notify too."""


async def test_a_post_retried_after_turns_were_granted_records_the_notice_it_posted(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    first = await harness.attempt("ops:notify", thread, 1)
    message_id = await first.post("deploy of api finished: ok")
    harness.allowlists = parse_allowlist(GRANTED)

    again = await harness.attempt("ops:notify", thread, 2)
    assert await again.post("deploy of api finished: ok") == message_id

    [(message, _)] = await harness.messages(thread)
    assert (message.message_id, message.kind) == (message_id, "notice")
    assert await harness.turns(thread) == []
    run_id = (await harness.reaction("ops:notify", thread)).run_id
    records = await harness.records(run_id)
    assert [(r.attempt, r.kind, r.policy, r.outcome) for r in records] == [
        (1, "notice", "notice", "posted"),
        (2, "notice", "turn", "already_posted"),
    ]


async def test_a_post_retried_after_turns_were_revoked_records_the_message_it_sent(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    message_id = await first.post("Triage incident: db down")
    assert len(await harness.turns(thread)) == 1
    harness.allowlists = parse_allowlist("")

    again = await harness.attempt("ops:triage", thread, 2)
    assert await again.post("Triage incident: db down") == message_id

    assert len(await harness.turns(thread)) == 1
    run_id = (await harness.reaction("ops:triage", thread)).run_id
    records = await harness.records(run_id)
    assert [(r.attempt, r.kind, r.policy, r.outcome) for r in records] == [
        (1, "message", "turn", "posted"),
        (2, "message", "notice", "already_posted"),
    ]


async def archived(harness: Harness, artifact_id: str) -> Any:
    handle = await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)
    current = await handle.artifact(artifact_id)
    await handle.commit(ArchiveArtifact(artifact_id=artifact_id, base_version=current.version))
    return await handle.artifact(artifact_id)


async def test_a_direct_edit_of_an_archived_artifact_is_refused_and_writes_nothing(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    actions = await harness.attempt("ops:triage", thread)
    artifact_id = await actions.create(Timeline(text="# timeline"))
    before = await archived(harness, artifact_id)

    with pytest.raises(RunFailure) as refused:
        await actions.edit(artifact_id, "/text", "# timeline, edited")

    assert (refused.value.reason, refused.value.permanent) == ("artifact_archived", True)
    assert artifact_id in refused.value.message
    handle = await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)
    after = await handle.artifact(artifact_id)
    assert (after.version, after.data) == (before.version, before.data)


async def test_a_proposed_edit_of_an_archived_artifact_is_refused_unless_it_was_made(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    handle = await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)
    note = (await handle.create(Note(text="# note"))).artifact_id
    first = await harness.attempt("ops:triage", thread, 1)
    proposal_id = await first.edit(note, "/text", "# note, edited")
    assert proposal_id is not None
    await archived(harness, note)

    again = await harness.attempt("ops:triage", thread, 2)
    assert await again.edit(note, "/text", "# note, edited") == proposal_id

    with pytest.raises(RunFailure) as refused:
        await again.edit(note, "/text", "# note, edited twice")
    assert (refused.value.reason, refused.value.permanent) == ("artifact_archived", True)
    assert [p.id for p in await handle.proposals()] == [proposal_id]


class Down:
    """Fails every statement that matches, as a database that stays down would."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.failed = 0

    def before(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.pattern in statement:
            self.failed += 1
            raise connection.dialect.loaded_dbapi.OperationalError("disk I/O error (injected)")

    @contextmanager
    def on(self, engine: AsyncEngine) -> Iterator["Down"]:
        event.listen(engine.sync_engine, "before_cursor_execute", self.before)
        try:
            yield self
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", self.before)


async def test_a_storage_error_past_the_retries_fails_the_attempt_with_a_stable_reason(
    tmp_path: Path,
) -> None:
    engine = create_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path / 'artifacts.db'}")
    await migrate(engine)
    harness = Harness(ArtifactWorkspaces(SqlStorage(engine)))
    try:
        thread = await harness.thread()
        actions = await harness.attempt("ops:notify", thread)
        with Down("INSERT INTO artifactr_").on(engine) as down, pytest.raises(RunFailure) as failed:
            await actions.notice("deploy of api finished: ok")
    finally:
        await harness.runner.aclose()
        await engine.dispose()

    assert down.failed >= 3  # relayr tried the commit again before it gave up
    assert (failed.value.reason, failed.value.permanent) == ("storage_unavailable", False)
    message = failed.value.message
    assert message.startswith("posting notice msg_")
    assert "the storage failed (OperationalError" in message


async def test_an_action_with_no_relayr_run_behind_it_fails_with_a_stable_reason() -> None:
    harness = Harness(ArtifactWorkspaces(ArtifactMemory()))
    reaction = await harness.reaction("ops:notify", "thr_x")
    reaction.deps = None  # type: ignore[assignment]
    try:
        with pytest.raises(MissingRunContext) as missing:
            acting(reaction)
    finally:
        await harness.runner.aclose()

    assert (missing.value.reason, missing.value.permanent) == ("missing_run_context", True)
    assert isinstance(missing.value, RunFailure)
