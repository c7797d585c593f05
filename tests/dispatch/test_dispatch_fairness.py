"""The dispatcher's fair hand-out on real reflexr storage (memory, SQLite, PostgreSQL): a flood
in one workspace does not hold another workspace's new run behind it.

Asserted on positions in the hand-out (the order of the messages the dispatcher sent), never on
time: the quiet workspace's run goes out behind at most ``fair_messages`` messages of the
flood, and the flood still gets a new message each time a worker takes one. The harness is
:mod:`tests.dispatch.dispatch_harness`; a worker taking a message is its runs executed.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from reflexr import SourceActor

from relayr.core.run_messages import RunMessage
from relayr.dispatch.changes import Changes
from relayr.dispatch.dispatcher import LONE_BATCH_ENVELOPES
from relayr.dispatch.evaluation import BATCH_ENVELOPES
from relayr.execution.executor import execute_runs
from relayr.settings import Settings
from tests.dispatch.dispatch_harness import (
    FAIR_BATCH,
    REQUEUE_AFTER_S,
    RULES,
    Harness,
    Ping,
    caught_up,
    opened,
)

FAIR_MESSAGES = 2
FLOOD = ("acme", "flood")
QUIET = ("acme", "quiet")
OTHER_TENANT = ("zeta", "ops")


class Sent:
    """The broker, as the list of messages sent, in order."""

    def __init__(self) -> None:
        self.messages: list[RunMessage] = []

    async def enqueue(self, batch: RunMessage) -> None:
        self.messages.append(batch)

    def of(self, workspace: tuple[str, str]) -> list[RunMessage]:
        return [m for m in self.messages if (m.tenant_id, m.workspace_id) == workspace]

    def position(self, workspace: tuple[str, str]) -> int:
        """Where the workspace's first message is in the hand-out."""
        return next(
            index
            for index, message in enumerate(self.messages)
            if (message.tenant_id, message.workspace_id) == workspace
        )


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    settings = Settings(
        home=tmp_path,
        database_url=database_url,
        requeue_after_s=REQUEUE_AFTER_S,
        turn_grace_s=0,
        fair_messages=FAIR_MESSAGES,
    )
    async with opened(settings, RULES[:1]) as harness:
        yield harness


async def publish(harness: Harness, workspace: tuple[str, str], count: int) -> None:
    source = await harness.rules.open(*workspace, actor=SourceActor(name="test"))
    for _ in range(count):
        await source.publish(Ping())


async def test_a_flood_does_not_hold_another_workspaces_run_behind_it(harness: Harness) -> None:
    sent = Sent()
    dispatcher = harness.dispatcher
    await publish(harness, FLOOD, 200)
    flooded = await caught_up(dispatcher, sent.enqueue)
    await publish(harness, QUIET, 1)
    await publish(harness, OTHER_TENANT, 1)
    quiet = await dispatcher.pass_once(sent.enqueue, Changes(rules={QUIET, OTHER_TENANT}))

    held_back = 200 - FAIR_MESSAGES * FAIR_BATCH
    assert (flooded.firings, flooded.messages, flooded.withheld) == (200, FAIR_MESSAGES, held_back)
    assert len(sent.of(FLOOD)) == FAIR_MESSAGES
    assert (quiet.firings, quiet.messages) == (2, 2)
    assert sent.position(QUIET) <= FAIR_MESSAGES
    assert sent.position(OTHER_TENANT) <= FAIR_MESSAGES + 1
    # and the broker delivers them before the flood's, which go behind
    assert all(message.behind for message in sent.of(FLOOD))
    assert not any(message.behind for message in sent.of(QUIET) + sent.of(OTHER_TENANT))


async def test_a_backlog_is_evaluated_a_transaction_a_pass_after_what_changed_since(
    harness: Harness,
) -> None:
    """A workspace's new event waits for at most one transaction of another's backlog
    (BATCH_ENVELOPES envelopes), not for the whole backlog to be evaluated; the backlog is
    evaluated to its end, every event once."""
    sent = Sent()
    dispatcher = harness.dispatcher
    flood = 3 * BATCH_ENVELOPES + 1
    await publish(harness, FLOOD, flood)
    first = await dispatcher.pass_once(sent.enqueue, Changes(rules={FLOOD}))
    await publish(harness, QUIET, 1)
    second = await dispatcher.pass_once(sent.enqueue, Changes(rules={QUIET}))
    assert (first.firings, second.firings) == (BATCH_ENVELOPES, 1 + BATCH_ENVELOPES)
    assert len(sent.of(QUIET)) == 1
    assert dispatcher.behind
    while dispatcher.behind:
        await dispatcher.pass_once(sent.enqueue, Changes())

    source = await harness.rules.open(*FLOOD, actor=SourceActor(name="test"))
    assert len(await source.runs(limit=1000)) == flood


async def test_a_backlog_no_workspace_waits_behind_is_evaluated_in_longer_transactions(
    harness: Harness,
) -> None:
    """Alone, a backlog is evaluated LONE_BATCH_ENVELOPES envelopes a transaction; once
    another workspace moves, BATCH_ENVELOPES again, after that workspace."""
    sent = Sent()
    dispatcher = harness.dispatcher
    flood = BATCH_ENVELOPES + LONE_BATCH_ENVELOPES + BATCH_ENVELOPES + 5
    await publish(harness, FLOOD, flood)
    new = await dispatcher.pass_once(sent.enqueue, Changes(rules={FLOOD}))
    alone = await dispatcher.pass_once(sent.enqueue, Changes())
    await publish(harness, QUIET, 1)
    beside = await dispatcher.pass_once(sent.enqueue, Changes(rules={QUIET}))
    last = await dispatcher.pass_once(sent.enqueue, Changes())

    assert [done.firings for done in (new, alone, beside, last)] == [
        BATCH_ENVELOPES,
        LONE_BATCH_ENVELOPES,
        1 + BATCH_ENVELOPES,
        5,
    ]
    assert len(sent.of(QUIET)) == 1


async def test_a_message_that_went_ahead_does_not_make_a_backlog_look_lost(
    harness: Harness,
) -> None:
    """The broker delivers messages not ``behind`` first, so a worker taking the quiet
    workspace's message, sent after the flood's, says nothing of the flood's: they are not
    sent again while the broker holds them, however long the workers take."""
    sent = Sent()
    dispatcher = harness.dispatcher
    await publish(harness, FLOOD, 3 * FAIR_BATCH)
    await dispatcher.pass_once(sent.enqueue)
    await publish(harness, QUIET, 1)
    await dispatcher.pass_once(sent.enqueue, Changes(rules={QUIET}))
    (quiet,) = sent.of(QUIET)
    await execute_runs(harness.runtime, *QUIET, list(quiet.run_ids))
    harness.depth = FAIR_MESSAGES  # the flood's messages wait in the broker
    await dispatcher.pass_once(sent.enqueue, Changes(rules={QUIET}))
    for _ in range(3):
        harness.clock.now += REQUEUE_AFTER_S
        done = await dispatcher.pass_once(sent.enqueue)
        assert done.again == 0

    assert len(sent.of(FLOOD)) == FAIR_MESSAGES


async def test_the_flood_gets_a_message_each_time_a_worker_takes_one(harness: Harness) -> None:
    """Work-conserving: the flood's runs keep flowing, FAIR_MESSAGES waiting at a time, and
    every run is handed out once."""
    sent = Sent()
    dispatcher = harness.dispatcher
    await publish(harness, FLOOD, 60)
    await dispatcher.pass_once(sent.enqueue)
    taken = 0
    while taken < len(sent.messages):
        message = sent.messages[taken]
        await execute_runs(harness.runtime, *FLOOD, list(message.run_ids))
        taken += 1
        done = await dispatcher.pass_once(sent.enqueue, Changes(rules={FLOOD}))
        assert len(sent.messages) - taken <= FAIR_MESSAGES
        assert done.again == 0

    handed = [run_id for message in sent.messages for run_id in message.run_ids]
    source = await harness.rules.open(*FLOOD, actor=SourceActor(name="test"))
    runs = await source.runs(limit=1000)
    assert sorted(handed) == sorted(run.id for run in runs)
    assert {run.status for run in runs} == {"succeeded"}


async def test_lost_messages_do_not_hold_their_workspaces_place(harness: Harness) -> None:
    """Every message of a workspace lost (the broker says its queue is empty, no worker took
    any): each is sent again in turn, and the run withheld behind them goes out too; a lost
    message never keeps its place among those waiting in the broker."""
    sent = Sent()
    dispatcher = harness.dispatcher
    harness.depth = 0
    await publish(harness, FLOOD, 3)
    first = await dispatcher.pass_once(sent.enqueue)
    for _ in range(10):
        harness.clock.now += REQUEUE_AFTER_S
        await dispatcher.pass_once(sent.enqueue)

    source = await harness.rules.open(*FLOOD, actor=SourceActor(name="test"))
    runs = {run.id for run in await source.runs()}
    handed = [run_id for message in sent.messages for run_id in message.run_ids]
    assert (first.messages, first.withheld) == (FAIR_MESSAGES, 1)
    assert set(handed) == runs
    assert all(handed.count(run_id) >= 2 for run_id in handed[:FAIR_MESSAGES])
