"""Which chain a bridged artifact or proposal event continues, on real storage (in memory, SQLite,
PostgreSQL), with runs executed in-process (:class:`tests.follow.follow_world.World`).

A direct write to an artifact continues the chain of the run that made that very change, found
in the ledger under the revision it made (ADR-0065), however many runs write the artifact: so
rules that edit one artifact in a loop stop at reflexr's depth limit. A proposal continues its
run's chain, also when artifactr made a proposal of a write the rule made directly (the kind's
write policy); whoever resolves a proposal starts a chain of their own (a person), as anything
they write does.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from artifactr import Artifact, ExternalAgentActor
from artifactr.core import EditArtifact, JsonPatch, RespondToProposal
from reflexr.core import Envelope

from relayr.follow.events import ArtifactChanged, ProposalCreated, ProposalResolved
from relayr.ledger.port import Cause
from tests.follow.follow_app import (
    MAX_DEPTH,
    Counted,
    FollowCounter,
    FollowDraft,
    FollowPlan,
    Noted,
)
from tests.follow.follow_world import KEY, PERSON, World, opened
from tests.services import STORAGES, storage_url


@pytest.fixture(params=STORAGES)
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    async with opened(storage_url(request, tmp_path), tmp_path) as world:
        yield world


async def _created(world: World, artifact: Artifact) -> str:
    """Create ``artifact`` as a person; its id."""
    handle = await world.runtime.application.artifacts.open(
        KEY.tenant_id, KEY.workspace_id, actor=PERSON
    )
    created = await handle.create(artifact)
    artifact_id = getattr(created, "artifact_id", None)
    assert isinstance(artifact_id, str)
    return artifact_id


def _by(rule: str, envelopes: list[Envelope], kind: type) -> list[Envelope]:
    """The bridged events of ``kind`` a rule's run wrote, in order."""
    return [
        e
        for e in envelopes
        if isinstance(e.event, kind) and e.event.author == f"external_agent:reflexr:{rule}"  # type: ignore[attr-defined]
    ]


async def test_each_direct_edit_of_one_artifact_continues_the_chain_of_the_run_that_made_it(
    world: World,
) -> None:
    artifact_id = await _created(world, FollowCounter())

    await world.publish(Noted(artifact_id=artifact_id, note="first"))
    await world.settle()
    await world.publish(Noted(artifact_id=artifact_id, note="second"))
    await world.settle()

    first, second = sorted(
        await (await world.rules()).runs(rule="edit:note"), key=lambda r: r.fired_seq
    )
    assert first.output == second.output == {"written": artifact_id}
    edits = _by("edit:note", await world.bridged(), ArtifactChanged)
    assert [e.event.version for e in edits] == [2, 3]  # type: ignore[attr-defined]
    for edit, run in zip(edits, (first, second), strict=True):
        assert edit.causation is not None
        assert (edit.causation.run_id, edit.depth) == (run.id, 1)
        assert edit.correlation_id == run.correlation_id
    assert first.correlation_id != second.correlation_id


async def test_rules_that_edit_one_artifact_directly_in_a_loop_stop_at_the_depth_limit(
    world: World,
) -> None:
    artifact_id = await _created(world, FollowCounter())

    await world.publish(Counted(artifact_id=artifact_id))
    await world.settle()

    handle = await world.runtime.application.artifacts.open(
        KEY.tenant_id, KEY.workspace_id, actor=PERSON
    )
    counter = await handle.get(FollowCounter, artifact_id)
    assert counter.data.count == MAX_DEPTH
    rules = await world.rules()
    [start] = await rules.runs(rule="loop:count")
    recounts = await rules.runs(rule="loop:recount")
    assert sorted(run.depth for run in recounts) == list(range(1, MAX_DEPTH))
    assert {run.correlation_id for run in recounts} == {start.correlation_id}
    edits = _by("loop:recount", await world.bridged(), ArtifactChanged)
    assert sorted(e.depth for e in edits) == list(range(2, MAX_DEPTH + 1))
    dead = await rules.dead_letters(rule="loop:recount")
    assert len(dead) == 1
    assert f"beyond the limit of {MAX_DEPTH}" in dead[0].error


async def test_a_proposal_continues_its_run_s_chain_and_a_person_s_acceptance_starts_one(
    world: World,
) -> None:
    artifact_id = await _created(world, FollowDraft())

    await world.publish(Noted(artifact_id=artifact_id, note="proposed"))
    await world.settle()
    [run] = await (await world.rules()).runs(rule="edit:note")
    proposal_id = run.output["written"]  # type: ignore[index]
    handle = await world.runtime.application.artifacts.open(
        KEY.tenant_id, KEY.workspace_id, actor=PERSON
    )
    await handle.commit(RespondToProposal(proposal_id=str(proposal_id), decision="accept"))
    await world.settle()

    bridged = await world.bridged()
    [proposed] = _by("edit:note", bridged, ProposalCreated)
    assert proposed.event.proposal_id == proposal_id  # type: ignore[attr-defined]
    assert proposed.causation is not None
    assert (proposed.causation.run_id, proposed.depth) == (run.id, 1)
    assert proposed.correlation_id == run.correlation_id
    [resolved] = [e for e in bridged if isinstance(e.event, ProposalResolved)]
    [applied] = [
        e
        for e in bridged
        if isinstance(e.event, ArtifactChanged) and e.event.proposal_id == proposal_id
    ]
    for envelope in (resolved, applied):
        assert envelope.event.author == "user:alice"  # type: ignore[attr-defined]
        assert envelope.causation is None
        assert envelope.correlation_id == envelope.id
    assert await world.store.dead_letters(KEY) == []


async def test_a_direct_write_that_artifactr_makes_a_proposal_continues_its_run_s_chain(
    world: World,
) -> None:
    artifact_id = await _created(world, FollowPlan())

    await world.publish(Noted(artifact_id=artifact_id, note="planned"))
    await world.settle()

    [run] = await (await world.rules()).runs(rule="edit:note")
    [proposed] = _by("edit:note", await world.bridged(), ProposalCreated)
    assert proposed.causation is not None
    assert (proposed.causation.run_id, proposed.depth) == (run.id, 1)
    assert await world.store.dead_letters(KEY) == []


async def test_a_direct_edit_recorded_under_its_artifact_s_id_is_still_found(
    world: World,
) -> None:
    """A rule's direct edit made before causes were kept by revision (under the artifact's id)
    is still bridged in the chain recorded then."""
    artifact_id = await _created(world, FollowCounter())
    handle = await world.runtime.application.artifacts.open(
        KEY.tenant_id, KEY.workspace_id, actor=PERSON
    )
    earlier = handle.as_actor(
        ExternalAgentActor(client_id="reflexr:ops:earlier", name="ops:earlier")
    )
    cause = Cause(
        correlation_id="cor-earlier", firing_id="fir-earlier", run_id="run-earlier", depth=2
    )
    await world.runtime.bridge.ledger.record_cause(KEY, "artifact", artifact_id, cause)
    patch = JsonPatch(ops=({"op": "add", "path": "/note", "value": "then"},))
    await earlier.commit(EditArtifact(artifact_id=artifact_id, base_version=1, patch=patch))

    await world.settle()

    [edit] = _by("ops:earlier", await world.bridged(), ArtifactChanged)
    assert edit.causation is not None
    assert (edit.causation.run_id, edit.depth, edit.correlation_id) == (
        "run-earlier",
        3,
        "cor-earlier",
    )
