"""turn_cause: a turn belongs to the run that posted the newest of its messages (ADR-0026)."""

from relayr.ledger import Cause, InMemoryLedger, WorkspaceKey
from relayr.ledger.turns import turn_cause

WORKSPACE = WorkspaceKey("tenant-1", "ws-1")
EARLIER = Cause(correlation_id="cor-1", firing_id="fir-1", run_id="fir-1", depth=0)
LATER = Cause(correlation_id="cor-2", firing_id="fir-2", run_id="fir-2", depth=1)


async def test_the_newest_message_a_run_posted_names_the_cause() -> None:
    ledger = InMemoryLedger()
    await ledger.record_cause(WORKSPACE, "message", "msg-1", EARLIER)
    await ledger.record_cause(WORKSPACE, "message", "msg-2", LATER)

    assert await turn_cause(ledger, WORKSPACE, ["msg-1", "msg-2"]) == LATER
    assert await turn_cause(ledger, WORKSPACE, ["msg-2", "msg-1"]) == EARLIER


async def test_messages_no_run_posted_are_skipped() -> None:
    ledger = InMemoryLedger()
    await ledger.record_cause(WORKSPACE, "message", "msg-1", EARLIER)

    assert await turn_cause(ledger, WORKSPACE, ["msg-0", "msg-1", "by-a-person"]) == EARLIER


async def test_a_turn_no_run_asked_for_has_no_cause() -> None:
    ledger = InMemoryLedger()
    await ledger.record_cause(WORKSPACE, "thread", "msg-1", EARLIER)
    await ledger.record_cause(WorkspaceKey("tenant-1", "ws-2"), "message", "msg-1", EARLIER)

    assert await turn_cause(ledger, WORKSPACE, ["msg-1", "by-a-person"]) is None
    assert await turn_cause(ledger, WORKSPACE, []) is None
