"""An artifact write reports what artifactr made of it, on real storage (in memory, SQLite,
PostgreSQL), each with the test that failed before its fix:

- a write the allowlist makes ``direct`` to a kind whose write policy makes agents propose
  (``write_policy = "propose"``) is a proposal: relayr returns the proposal's id (it returned
  the artifact's, as if applied), a retried edit of it finds its proposal (it was refused
  ``artifact_archived``, permanent, with nothing archived), and no revision's cause is kept for
  a version the write did not make (a person's acceptance of it starts a chain of its own);
- the same in a thread in ``suggest`` mode, where artifactr makes agents propose too;
- a proposed edit or archiving of an artifact archived between relayr's read and its commit is
  refused ``artifact_archived`` or found done (relayr returned the id of a proposal artifactr
  never made);
- the read that confirms a proposal fails the attempt ``storage_unavailable`` when the storage
  stays down (it raised the raw storage error).
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, Final

import pytest
from artifactr import Artifact, WritePolicy
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import ArchiveArtifact, RespondToProposal, SetThreadMode
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from reflexr.workspace import RunFailure
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from relayr.core.allowlist_toml import parse_allowlist
from relayr.execution.actions import RunActions
from relayr.follow.events import ArtifactChanged, ProposalCreated
from relayr.ledger.port import revision_key
from tests.execution.test_actions import ALLOWLIST, KEY, TENANT, WORKSPACE, Harness, Note
from tests.execution.test_outbound_defects import Down
from tests.follow.follow_app import FollowPlan, Noted
from tests.follow.follow_world import KEY as WORLD_KEY
from tests.follow.follow_world import PERSON as WORLD_PERSON
from tests.follow.follow_world import World, opened
from tests.services import SQL_STORAGES, STORAGES, storage_url

RULE = "ops:triage"


class OutcomePlan(Artifact):
    """A kind agents must propose changes to, whatever the allowlist says."""

    write_policy: ClassVar[WritePolicy] = "propose"
    text: str = ""


class OutcomeLog(Artifact):
    """A kind the allowlist makes direct, with the default write policy."""

    text: str = ""


POLICY_ALLOWLIST = ALLOWLIST.replace(
    'direct = ["timeline"]', 'direct = ["timeline", "outcome_plan", "outcome_log"]'
)


class Gate:
    """artifactr's ``authorize`` hook that runs ``then`` once, as the rule asks for ``action``:
    after relayr's read, before its commit, so something happens between the two."""

    def __init__(self) -> None:
        self.action: str | None = None
        self.then: Callable[[], Awaitable[None]] | None = None

    async def __call__(self, tenant: str, workspace: str | None, actor: Any, access: Any) -> bool:
        if actor.kind == "external_agent" and access.action == self.action and self.then:
            then, self.then = self.then, None
            await then()
        return True


class GatedHarness(Harness):
    """The actions' harness on artifactr workspaces that ``gate`` authorizes, with
    :data:`POLICY_ALLOWLIST`; ``engine`` is the SQL storage's, None in memory."""

    def __init__(self, storage: Any, engine: AsyncEngine | None) -> None:
        self.gate = Gate()
        self.engine = engine
        super().__init__(ArtifactWorkspaces(storage, authorize=self.gate))
        self.allowlists = parse_allowlist(POLICY_ALLOWLIST)


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[GatedHarness]:
    engine: AsyncEngine | None = None
    if request.param == "memory":
        storage: Any = ArtifactMemory()
    else:
        if request.param == "sqlite":
            engine = create_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path / 'artifacts.db'}")
        else:
            engine = create_async_engine(request.getfixturevalue("postgres_url"))
        await migrate(engine)
        storage = SqlStorage(engine)
    subject = GatedHarness(storage, engine)
    try:
        yield subject
    finally:
        await subject.runner.aclose()
        if engine is not None:
            await engine.dispose()


async def person(harness: GatedHarness) -> Any:
    return await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)


async def test_a_direct_create_of_a_kind_that_takes_proposals_returns_its_proposal(
    harness: GatedHarness,
) -> None:
    thread = await harness.thread()
    for attempt in (1, 2):
        actions = await harness.attempt(RULE, thread, attempt)
        made = await actions.create(OutcomePlan(text="# plan"))
        assert made.startswith("prp_"), made
    handle = await person(harness)
    [proposal] = await handle.proposals()
    assert proposal.id == made
    assert await handle.artifacts(OutcomePlan) == []
    assert await harness.ledger.cause(KEY, "proposal", made) is not None
    artifact_id = proposal.change.artifact_id
    assert await harness.ledger.cause(KEY, "revision", revision_key(artifact_id, 1)) is None


DIRECT_CHANGES: Final[dict[str, Callable[[RunActions, str], Awaitable[str | None]]]] = {
    "edit": lambda actions, plan: actions.edit(plan, "/text", "# plan v2"),
    "archive": lambda actions, plan: actions.archive(plan),
}
"""A direct change of an existing artifact, as a rule's action makes it."""


@pytest.mark.parametrize("change", DIRECT_CHANGES)
async def test_a_retried_direct_change_of_a_kind_that_takes_proposals_finds_its_proposal(
    harness: GatedHarness, change: str
) -> None:
    thread = await harness.thread()
    handle = await person(harness)
    plan = (await handle.create(OutcomePlan(text="# plan"))).artifact_id

    made = []
    for attempt in (1, 2):
        actions = await harness.attempt(RULE, thread, attempt)
        made.append(await DIRECT_CHANGES[change](actions, plan))

    assert made[0] is not None
    assert made[0].startswith("prp_")
    assert made[1] == made[0]
    assert [p.id for p in await handle.proposals()] == [made[0]]
    current = await handle.artifact(plan)
    assert (current.version, current.archived) == (1, False)
    assert await harness.ledger.cause(KEY, "revision", revision_key(plan, 2)) is None


async def test_a_direct_create_in_a_thread_in_suggest_mode_returns_its_proposal(
    harness: GatedHarness,
) -> None:
    thread = await harness.thread()
    handle = await person(harness)
    await handle.commit(SetThreadMode(thread_id=thread, mode="suggest"))

    actions = await harness.attempt(RULE, thread)
    made = await actions.create(OutcomeLog(text="# log"), thread_id=thread)

    assert made.startswith("prp_"), made
    [proposal] = await handle.proposals()
    assert proposal.id == made
    artifact_id = proposal.change.artifact_id
    assert await harness.ledger.cause(KEY, "revision", revision_key(artifact_id, 1)) is None


async def test_a_direct_write_that_is_applied_keeps_its_revision_s_cause(
    harness: GatedHarness,
) -> None:
    thread = await harness.thread()
    actions = await harness.attempt(RULE, thread)
    log = await actions.create(OutcomeLog(text="# log"), thread_id=thread)
    assert log.startswith("art_")
    assert await actions.edit(log, "/text", "# log v2") == log
    for version in (1, 2):
        assert await harness.ledger.cause(KEY, "revision", revision_key(log, version))


async def archive_as_person(
    harness: GatedHarness, artifact_id: str
) -> Callable[[], Awaitable[None]]:
    handle = await person(harness)

    async def archive() -> None:
        current = await handle.artifact(artifact_id)
        await handle.commit(ArchiveArtifact(artifact_id=artifact_id, base_version=current.version))

    return archive


async def test_a_proposed_edit_of_an_artifact_archived_after_the_read_is_refused(
    harness: GatedHarness,
) -> None:
    thread = await harness.thread()
    handle = await person(harness)
    note = (await handle.create(Note(text="# note"))).artifact_id
    gate = harness.gate
    gate.action, gate.then = "artifactr:propose_change", await archive_as_person(harness, note)

    actions = await harness.attempt(RULE, thread)
    with pytest.raises(RunFailure) as refused:
        await actions.edit(note, "/text", "# note, edited")

    assert gate.then is None  # the artifact was archived between the read and the commit
    assert (refused.value.reason, refused.value.permanent) == ("artifact_archived", True)
    assert note in refused.value.message
    assert await handle.proposals(status=None) == []


async def test_a_proposed_archive_of_an_artifact_archived_after_the_read_is_done(
    harness: GatedHarness,
) -> None:
    thread = await harness.thread()
    handle = await person(harness)
    note = (await handle.create(Note(text="# note"))).artifact_id
    gate = harness.gate
    gate.action, gate.then = "artifactr:propose_change", await archive_as_person(harness, note)

    actions = await harness.attempt(RULE, thread)
    assert await actions.archive(note) is None

    assert gate.then is None
    assert (await handle.artifact(note)).archived
    assert await handle.proposals(status=None) == []


async def test_a_direct_edit_of_an_artifact_archived_after_the_read_is_refused(
    harness: GatedHarness,
) -> None:
    thread = await harness.thread()
    actions = await harness.attempt(RULE, thread)
    log = await actions.create(OutcomeLog(text="# log"))
    gate = harness.gate
    gate.action, gate.then = "artifactr:edit_artifact", await archive_as_person(harness, log)

    with pytest.raises(RunFailure) as refused:
        await actions.edit(log, "/text", "# log v2")

    assert gate.then is None
    assert (refused.value.reason, refused.value.permanent) == ("artifact_archived", True)


@pytest.mark.parametrize("harness", SQL_STORAGES, indirect=True)
async def test_the_read_that_confirms_a_proposal_fails_as_storage_unavailable(
    harness: GatedHarness,
) -> None:
    engine = harness.engine
    thread = await harness.thread()
    handle = await person(harness)
    note = (await handle.create(Note(text="# note"))).artifact_id
    first = await harness.attempt(RULE, thread, 1)
    await first.edit(note, "/text", "# note, edited")
    current = await handle.artifact(note)
    await handle.commit(ArchiveArtifact(artifact_id=note, base_version=current.version))

    again = await harness.attempt(RULE, thread, 2)
    with Down("FROM artifactr_proposals").on(engine) as down, pytest.raises(RunFailure) as failed:
        await again.edit(note, "/text", "# note, edited")

    assert down.failed >= 3  # relayr tried the read again before it gave up
    assert (failed.value.reason, failed.value.permanent) == ("storage_unavailable", False)


@pytest.fixture(params=STORAGES)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    async with opened(storage_url(request, tmp_path), tmp_path) as world:
        yield world


async def test_a_person_accepting_what_artifactr_proposed_of_a_direct_edit_starts_a_chain(
    world: World,
) -> None:
    """The follower's world, with the ledger on the storage's own database: the run's edit of a
    ``follow_plan`` (direct by the allowlist, proposed by its write policy) keeps its cause
    under its proposal only, and the version a person's acceptance makes is theirs."""
    handle = await world.runtime.application.artifacts.open(
        WORLD_KEY.tenant_id, WORLD_KEY.workspace_id, actor=WORLD_PERSON
    )
    plan = (await handle.create(FollowPlan())).artifact_id
    await world.publish(Noted(artifact_id=plan, note="planned"))
    await world.settle()
    [run] = await (await world.rules()).runs(rule="edit:note")
    proposal_id = run.output["written"]  # type: ignore[index]
    assert isinstance(proposal_id, str), proposal_id
    assert proposal_id.startswith("prp_"), proposal_id
    ledger = world.runtime.bridge.ledger
    assert await ledger.cause(WORLD_KEY, "revision", revision_key(plan, 2)) is None

    await handle.commit(RespondToProposal(proposal_id=proposal_id, decision="accept"))
    await world.settle()

    bridged = await world.bridged()
    [proposed] = [e for e in bridged if isinstance(e.event, ProposalCreated)]
    assert proposed.causation is not None
    assert proposed.causation.run_id == run.id
    [accepted] = [
        e
        for e in bridged
        if isinstance(e.event, ArtifactChanged) and e.event.proposal_id == proposal_id
    ]
    assert accepted.event.author == "user:alice"  # type: ignore[attr-defined]
    assert accepted.causation is None
    assert await ledger.cause(WORLD_KEY, "revision", revision_key(plan, 2)) is None
