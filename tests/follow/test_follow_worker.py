"""The inbound side on real processes: a worker, and dispatchers started, killed and restarted.

On SQLite and PostgreSQL (the embedded broker), with :mod:`tests.follow.follow_app`:

1. a dispatcher that does not follow (``--no-follow``) and a worker run what the published
   events start: ``follow:ask`` sends a question, the agent answers it, ``loop:start`` posts
   its first echo; nothing is bridged;
2. a following dispatcher starts with the follower's gate armed: its first batch, which holds
   the agent's reply, is published, and the follower stops there before its cursor moves (it
   says so in a file); the test SIGKILLs the dispatcher then, on any machine's speed;
3. a dispatcher started again follows the same batch once its predecessor's lease lapsed,
   finds every event of it published already, and moves on.

Then the agent's reply reached ``follow:answered`` once, as ``artifactr:message_posted`` with
its kind; the turn continued ``follow:ask``'s chain one step deeper; and the loop of echoes
stopped at the depth limit.
"""

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from artifactr import UserActor
from artifactr.core import MessagePosted as ArtifactrMessagePosted
from reflexr import SourceActor

from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.follow.follow_app import (
    ALLOWLIST,
    FOLLOW_APP,
    GATE_ARMED,
    GATE_HELD,
    MAX_DEPTH,
    Asked,
    Looped,
)
from tests.workers import (
    RelayrProcess,
    log_records,
    relayr_environment,
    running_dispatcher,
    running_worker,
    until,
)

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.timeout(600)]

TENANT, WORKSPACE = "acme", "ops"
PERSON = UserActor(id="alice")
WAIT_S = 180.0
"""How long any one step may take: far above what it needs on a quiet machine."""

LEASE_TTL_S = 5.0
"""The lease of runs and of followers: a killed dispatcher's workspace is free this long after."""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def environment(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text(ALLOWLIST)
    settings: dict[str, object] = {
        "app": FOLLOW_APP,
        "allowlist": allowlist,
        "lease_ttl_s": LEASE_TTL_S,
        "turn_grace_s": 5,
    }
    if request.param == "postgres":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    return relayr_environment(tmp_path / "home", **settings)


def batches_of(process: RelayrProcess) -> list[dict[str, Any]]:
    """The batches a follower published, as its JSON log says, in order."""
    return [
        line for line in log_records(process.log()) if line.get("event") == "follow batch published"
    ]


def in_runtime[T](environment: dict[str, str], work: Callable[[Runtime], Any]) -> T:
    async def main() -> T:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            result: T = await work(runtime)
            return result

    return asyncio.run(main())


async def _start(runtime: Runtime) -> tuple[str, str]:
    artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    asked = (await artifacts.create_thread("asked")).id
    looped = (await artifacts.create_thread("looped")).id
    rules = await runtime.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="t"))
    await rules.publish_many(
        [Asked(thread_id=asked, text="is the api up?"), Looped(thread_id=looped)]
    )
    return asked, looped


async def _replied(runtime: Runtime) -> bool | None:
    artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    replies = [
        e
        for e in await artifacts.read()
        if isinstance(e.event, ArtifactrMessagePosted) and e.actor.kind == "agent"
    ]
    return True if replies else None


async def _state(runtime: Runtime) -> dict[str, Any]:
    artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
    rules = await runtime.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="t"))
    notices: dict[str, list[str]] = {}
    for envelope in await artifacts.read():
        event = envelope.event
        if isinstance(event, ArtifactrMessagePosted) and event.kind == "notice":
            rule = envelope.actor.participant.removeprefix("external_agent:reflexr:")
            notices.setdefault(rule, []).append(event.content)
    bridged = await rules.read(types=["artifactr:message_posted", "artifactr:turn_ended"])
    runs = await rules.runs()
    return {
        "notices": notices,
        "bridged": [
            {
                "id": e.id,
                "type": e.event_type,
                "data": e.data,
                "depth": e.depth,
                "correlation_id": e.correlation_id,
                "run": None if e.causation is None else e.causation.run_id,
            }
            for e in bridged
        ],
        "runs": [
            {
                "id": r.id,
                "rule": r.rule,
                "status": r.status,
                "depth": r.depth,
                "correlation_id": r.correlation_id,
            }
            for r in runs
        ],
        "dead": [letter.error for letter in await rules.dead_letters(rule="loop:echo")],
    }


def _settled(environment: dict[str, str]) -> dict[str, Any] | None:
    state: dict[str, Any] = in_runtime(environment, _state)
    notices = state["notices"]
    echoes = len(notices.get("loop:start", [])) + len(notices.get("loop:echo", []))
    finished = all(run["status"] == "succeeded" for run in state["runs"])
    answered = notices.get("follow:answered") and notices.get("follow:turn-ended")
    if answered and finished and echoes >= MAX_DEPTH and state["dead"]:
        return state
    return None


def test_a_reply_reaches_a_rule_once_across_a_dispatcher_killed_mid_follow(
    environment: dict[str, str],
) -> None:
    home = Path(environment["RELAYR_HOME"])
    with running_worker(environment, home) as worker:
        with running_dispatcher(environment, home, "--no-follow", name="dispatcher-1") as first:
            asked, looped = in_runtime(environment, _start)
            until(
                "the agent's reply",
                lambda: in_runtime(environment, _replied),
                worker,
                first,
                timeout_s=WAIT_S,
            )
        (home / GATE_ARMED).touch()
        with running_dispatcher(environment, home, name="dispatcher-2") as second:
            held = until(
                "the follower to stop after its publish",
                lambda: (home / GATE_HELD).read_text() if (home / GATE_HELD).exists() else None,
                worker,
                second,
                timeout_s=WAIT_S,
            )
            second.kill()
            killed_in = batches_of(second)
        pid, first_seq, last_seq = (int(part) for part in held.split())
        assert pid == second.pid
        with running_dispatcher(environment, home, name="dispatcher-3") as third:
            state = until(
                "the rules to settle",
                lambda: _settled(environment),
                worker,
                third,
                timeout_s=WAIT_S,
            )
            batches = batches_of(third)
        assert worker.alive(), worker.log()

    # dispatcher-2 published its first batch, which holds the reply, and was killed before its
    # cursor moved; dispatcher-3 read from the same cursor, found those events published and
    # appended only what the log gained meanwhile
    [published] = killed_in
    assert (published["first_seq"], published["last_seq"]) == (first_seq, last_seq)
    assert published["bridged"] > 0
    again = batches[0]
    assert again["first_seq"] == first_seq
    assert again["last_seq"] >= last_seq
    assert again["duplicates"] == published["bridged"]

    replies = [
        b
        for b in state["bridged"]
        if b["data"]["author_kind"] == "agent" and b["type"] == "artifactr:message_posted"
    ]
    assert [(r["data"]["kind"], r["data"]["content"]) for r in replies] == [
        ("message", "answer: is the api up?")
    ]
    assert len({b["id"] for b in state["bridged"]}) == len(state["bridged"])
    notices = state["notices"]
    assert notices["follow:answered"] == ["answered: answer: is the api up?"]

    runs = {run["rule"]: run for run in state["runs"] if not run["rule"].startswith("loop:")}
    ask = runs["follow:ask"]
    for rule in ("follow:answered", "follow:turn-ended"):
        assert (runs[rule]["correlation_id"], runs[rule]["depth"]) == (ask["correlation_id"], 1)
    [ended] = [b for b in state["bridged"] if b["type"] == "artifactr:turn_ended"]
    assert (ended["run"], ended["depth"]) == (ask["id"], 1)
    assert ended["data"]["outcome"] == "completed"

    echoes = notices["loop:start"] + notices["loop:echo"]
    assert sorted(echoes) == [f"echo at depth {depth}" for depth in range(MAX_DEPTH)]
    assert len(state["dead"]) == 1
    assert f"beyond the limit of {MAX_DEPTH}" in state["dead"][0]
    assert asked != looped
