"""A rule writes only in its run's tenant and workspace, and only in its chain under ``chain``.

Hypothesis draws the rule's allowlist and a sequence of what its action asks (notice, send,
post, create_thread, create, edit, archive) with targets from: its chain thread, other threads
of its workspace, a thread and an artifact of another workspace of its tenant and of another
tenant, ids that do not exist, and garbage. Storage is real artifactr (in memory and SQLite)
with a real Runner; the run is attempted once or twice, as a retry would.

The hostile twist: the other workspace and the other tenant each hold a twin of the run, with
the same run id (reflexr derives it from the rule and the event's seq, not the workspace) and
a thread with the same id as the run's chain thread, and the twin has made the same writes
first. So every id the run derives is already used next door. Afterwards:

- the other workspace's and the other tenant's logs are exactly as before, and the ledger was
  only written under the run's own workspace;
- every id an operation returned names a write in the run's own workspace;
- with ``threads = "chain"``, no thread of the workspace outside the chain (and the threads
  the run created) got any event, from the rule or from a turn it started;
- the rule never resolves a proposal.

How each hostile id is refused is pinned by :mod:`tests.execution.test_hostile_ids`; the world is
:mod:`tests.execution.isolation_world`.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifactr import Workspace as ArtifactWorkspace
from artifactr.core import CreateThread, ProposalResolved
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reflexr.workspace import RunFailure

from relayr.core.allowlist_toml import parse_allowlist
from relayr.execution.actions import RunActions
from tests.execution.isolation_world import (
    HOME,
    KINDS,
    NEIGHBOUR,
    RULE,
    RULE_AUTHOR,
    STRANGER,
    IsolationNote,
    IsolationTimeline,
    StorageKind,
    World,
    opened,
)
from tests.execution.isolation_world import (
    template as template,  # the fixture, a migrated SQLite file
)

# ─── the places a rule may be asked to write ──────────────────────────────────


@dataclass
class Places:
    """The ids of one world: threads and artifacts here, next door and in another tenant."""

    chain: str
    others: tuple[str, str]
    neighbour_thread: str
    stranger_thread: str
    artifacts: dict[str, str]

    def thread(self, target: str, created: list[str]) -> str | None:
        match target:
            case "none":
                return None
            case "chain":
                return self.chain
            case "other":
                return self.others[0]
            case "other2":
                return self.others[1]
            case "created":
                return created[-1] if created else self.others[1]
            case "neighbour":
                return self.neighbour_thread
            case "stranger":
                return self.stranger_thread
            case "missing":
                return "thr_0000000000000000"
        return target.removeprefix("garbage:")

    def artifact(self, target: str, made: list[str]) -> str:
        if target == "made":
            return made[-1] if made else self.artifacts["free"]
        if target.startswith("garbage:"):
            return target.removeprefix("garbage:")
        return self.artifacts[target]


async def furnish(world: World) -> Places:
    """Threads and artifacts in the three workspaces; the chain thread's id is in all three."""
    home = await world.handle(HOME)
    chain = (await home.create_thread("incident")).id
    others = ((await home.create_thread("billing")).id, (await home.create_thread("chat")).id)
    artifacts = {
        "in_chain": await _create(home, IsolationNote(text="chain notes"), chain),
        "in_other": await _create(home, IsolationNote(text="billing notes"), others[0]),
        "free": await _create(home, IsolationNote(text="free notes"), None),
        "timeline": await _create(home, IsolationTimeline(text="timeline"), None),
    }
    far: dict[str, str] = {}
    for key, name in ((NEIGHBOUR, "neighbour"), (STRANGER, "stranger")):
        there = await world.handle(key)
        await there.commit(CreateThread(thread_id=chain, title="same id, elsewhere"))
        far[name] = (await there.create_thread(f"{name} thread")).id
        artifacts[name] = await _create(there, IsolationNote(text=f"{name} notes"), far[name])
    artifacts["missing"] = "art_0000000000000000"
    return Places(chain, others, far["neighbour"], far["stranger"], artifacts)


async def _create(handle: ArtifactWorkspace, artifact: Any, thread_id: str | None) -> str:
    applied = await handle.create(artifact, thread_id=thread_id)
    artifact_id = getattr(applied, "artifact_id", None)
    assert isinstance(artifact_id, str)
    return artifact_id


# ─── operations ───────────────────────────────────────────────────────────────

GARBAGE = [
    "garbage:",
    "garbage: ",
    "garbage:../ops",
    "garbage:thr_" + "f" * 300,
    "garbage:\x00",
    "garbage:%s",
    "garbage:" + chr(0xD800),
]
THREAD_TARGETS = [
    "none",
    "chain",
    "other",
    "other2",
    "created",
    "neighbour",
    "stranger",
    "missing",
    *GARBAGE,
]
ARTIFACT_TARGETS = [
    "in_chain",
    "in_other",
    "free",
    "timeline",
    "made",
    "neighbour",
    "stranger",
    "missing",
    *GARBAGE,
]


@dataclass(frozen=True)
class Op:
    name: str
    target: str
    text: str


texts = st.sampled_from(["status: ok", "status: ok", "é 🚀 שלום", "postmortem"])
thread_targets = st.sampled_from(THREAD_TARGETS)
operations = st.one_of(
    st.builds(Op, st.sampled_from(["notice", "send", "post"]), thread_targets, texts),
    st.builds(Op, st.just("create_thread"), st.just("none"), texts),
    st.builds(Op, st.just("create"), thread_targets, texts),
    st.builds(Op, st.sampled_from(["edit", "archive"]), st.sampled_from(ARTIFACT_TARGETS), texts),
)


@st.composite
def allowlist_texts(draw: st.DrawFn) -> str:
    lines = [f'[rules."{RULE}"]']
    if draw(st.booleans()):
        lines.append(f"turns = {'true' if draw(st.booleans()) else 'false'}")
    if draw(st.booleans()):
        lines.append(f'threads = "{draw(st.sampled_from(["chain", "any"]))}"')
    if draw(st.booleans()):
        lines.append("create_threads = true")
    direct = draw(st.lists(st.sampled_from(KINDS), unique=True))
    lines.append(f"direct = {direct!r}".replace("'", '"'))
    return "\n".join(lines) + "\n"


@dataclass
class Done:
    """What the operations returned and how they were refused."""

    threads: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    made: list[str] = field(default_factory=list)
    proposals: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


async def perform(actions: RunActions, ops: list[Op], places: Places, done: Done) -> None:
    """Ask for each operation; a refusal is noted, and the action goes on as a rule's might."""
    for op in ops:
        try:
            await _perform(actions, op, places, done)
        except RunFailure as refused:
            done.refusals.append(refused.reason or "none")
        except Exception as escaped:
            done.refusals.append(type(escaped).__name__)


async def _perform(actions: RunActions, op: Op, places: Places, done: Done) -> None:
    if op.name in ("notice", "send", "post"):
        write: Callable[..., Any] = getattr(actions, op.name)
        done.messages.append(await write(op.text, thread_id=places.thread(op.target, done.threads)))
    elif op.name == "create_thread":
        done.threads.append(await actions.create_thread(op.text))
    elif op.name == "create":
        thread = places.thread(op.target, done.threads)
        made = await actions.create(IsolationNote(text=op.text), thread_id=thread)
        (done.made if made.startswith("art_") else done.proposals).append(made)
    else:
        artifact = places.artifact(op.target, done.made)
        if op.name == "edit":
            changed = await actions.edit(artifact, "/text", op.text)
        else:
            changed = await actions.archive(artifact)
        if changed is not None:
            (done.made if changed.startswith("art_") else done.proposals).append(changed)


# ─── the property ─────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Story:
    """What one example asks: the rule's allowlist, the thread its event names (usually its
    own; a hostile publisher may name another tenant's or none that exists), and the writes."""

    allowlist: str
    fired_in: str
    ops: list[Op]
    attempts: int


stories = st.builds(
    Story,
    allowlist_texts(),
    st.sampled_from(["chain", "chain", "chain", "stranger", "missing"]),
    st.lists(operations, min_size=1, max_size=8),
    st.integers(min_value=1, max_value=2),
)


async def scenario(kind: StorageKind, template: Path | None, story: Story) -> None:
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(story.allowlist)
        places = await furnish(world)
        fired_in = places.thread(story.fired_in, [])
        assert fired_in is not None
        for key in (NEIGHBOUR, STRANGER):  # the twins write first, with the same ids
            twin = await world.attempt(key, fired_in)
            await perform(twin, story.ops, places, Done())
        await world.settle()
        before = {key: await world.log(key) for key in (HOME, NEIGHBOUR, STRANGER)}
        world.ledger.written.clear()
        world.ledger.read.clear()

        done = Done()
        for attempt in range(1, story.attempts + 1):
            done = Done()
            actions = await world.attempt(HOME, fired_in, attempt)
            await perform(actions, story.ops, places, done)
        await world.settle()
        for reason in done.refusals:
            event(f"refused: {reason}")

        for key in (NEIGHBOUR, STRANGER):
            assert await world.log(key) == before[key], f"{key} changed"
        assert set(world.ledger.written) <= {HOME}
        assert set(world.ledger.read) <= {HOME}
        run_id = (await world.reaction(HOME, fired_in)).run_id
        for key in (NEIGHBOUR, STRANGER):
            twin = await world.records(key, run_id)
            assert all(record.tenant_id == key.tenant_id for record in twin)

        home = await world.handle(HOME)
        log = await world.log(HOME)
        new = log[len(before[HOME]) :]
        assert all(envelope.workspace_id == HOME.workspace_id for envelope in new)
        posted = {e.event.message_id for e in log if e.event.type == "message_posted"}
        assert set(done.messages) <= posted
        assert set(done.threads) <= {thread.id for thread in await home.threads()}
        for artifact_id in done.made:
            await home.artifact(artifact_id)
        assert set(done.proposals) <= {p.id for p in await home.proposals(status=None)}
        mine = [e for e in new if e.actor.participant == RULE_AUTHOR]
        assert not any(isinstance(e.event, ProposalResolved) for e in mine)

        if world.allowlists.for_rule(RULE).threads == "chain":
            allowed = {fired_in, *done.threads}
            strays = [e for e in new if e.thread_id is not None and e.thread_id not in allowed]
            assert strays == [], [(e.thread_id, e.event.type, e.actor.participant) for e in strays]
        event(f"rule events written: {min(len(mine), 5)}{'+' if len(mine) >= 5 else ''}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stories)
def test_in_memory_a_rule_writes_only_in_its_workspace_and_chain(story: Story) -> None:
    asyncio.run(scenario("memory", None, story))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stories)
def test_on_sqlite_a_rule_writes_only_in_its_workspace_and_chain(
    template: Path, story: Story
) -> None:
    asyncio.run(scenario("sqlite", template, story))
