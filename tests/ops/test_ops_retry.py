"""Ops retry, cancel and skip dead runs safely, on real storage (SQLite and PostgreSQL).

A dead run retried posts its notice once (a); a send whose worker died between its commit and
its ask gets exactly one turn (b); a dry run changes nothing, cancel and skip are reflexr's; an
enqueue that fails for good still reports every run retried. The runs are executed by relayr's
executor over reflexr and artifactr (:mod:`tests.ops.ops_harness`); the retry goes through
reflexr's operator retry, and what the retry enqueues is executed as a worker would.
"""

from kombu.exceptions import EncodeError
from structlog.testing import capture_logs

from relayr.ops.report import show_run
from relayr.ops.rows import RunFilter, find_run, list_runs
from relayr.ops.runs import ENQUEUE_FAILED, cancel, find_runs, not_enqueued, retry, skip
from tests.ops.ops_harness import KEY, WORLD, Crashed, Flaked, Ops, _ref


async def test_a_dead_run_is_listed_retried_and_posts_one_notice(ops: Ops) -> None:
    thread = await ops.thread()
    run_id = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(run_id) == "dead"

    [row] = await list_runs(ops.rules, RunFilter(status="dead"))
    assert (row.id, row.rule, row.reason, row.attempts) == (run_id, "ops:flaky", "backup_down", 2)
    assert "backup host is down" in (row.error or "")
    assert await list_runs(ops.rules, RunFilter(status="dead", rule="ops:other")) == []

    WORLD.fixed = True
    [done] = await retry(ops.rules, [row], ops.enqueue)
    assert (done.ok, done.status) == (True, "pending")
    assert ops.enqueued == [run_id]
    assert await ops.until_ended(run_id) == "succeeded"

    notices = [m for m, author in await ops.posted(thread) if author.endswith("ops:flaky")]
    assert [(m.kind, m.content) for m in notices] == [("notice", "checking the backup")]
    report = await show_run(
        ops.rules, ops.runtime.application.artifacts, ops.runtime.bridge.ledger, row
    )
    assert [(a.attempt, a.of_budget, a.outcome, a.reason) for a in report.attempts] == [
        (1, 1, "failed", "backup_down"),
        (2, 2, "dead", "backup_down"),
        (3, 1, "succeeded", None),
    ]
    assert all(a.ended_at is not None and a.duration_s is not None for a in report.attempts)
    assert [(a.action, a.who) for a in report.actions] == [("retry", "relayr ops")]
    assert [r.outcome for r in report.emissions] == ["posted", "already_posted", "already_posted"]

    [refused] = await retry(ops.rules, [row], ops.enqueue)
    assert not refused.ok
    assert "succeeded" in refused.detail


async def test_b_a_send_killed_between_commit_and_ask_gets_exactly_one_turn(ops: Ops) -> None:
    thread = await ops.thread()
    run_id = await ops.fire(Crashed(thread_id=thread))
    assert await ops.until_ended(run_id) == "dead"
    assert await ops.turns(thread) == []

    [row] = await list_runs(ops.rules, RunFilter(status="dead", rule="ops:crash"))
    [done] = await retry(ops.rules, [row], ops.enqueue)
    assert done.ok
    assert await ops.until_ended(run_id) == "succeeded"

    turns = await ops.turns(thread)
    mine = [m for m, author in await ops.posted(thread) if author.endswith("ops:crash")]
    assert len(mine) == 1
    assert len(turns) == 1
    assert mine[0].message_id in turns[0].message_ids
    report = await show_run(
        ops.rules, ops.runtime.application.artifacts, ops.runtime.bridge.ledger, row
    )
    [turn] = report.turns
    assert (turn.message_id, turn.status, turn.took) == (mine[0].message_id, "completed", "started")
    assert [r.outcome for r in report.emissions] == ["asked"]


async def test_dry_run_changes_nothing_and_cancel_and_skip_are_reflexrs(ops: Ops) -> None:
    thread = await ops.thread()
    first = await ops.fire(Flaked(thread_id=thread))
    assert await ops.until_ended(first) == "dead"
    row = await find_run(ops.rules, first)
    assert row is not None
    [would] = await retry(ops.rules, [row], ops.enqueue, dry_run=True)
    assert (would.ok, would.detail) == (True, "would retry")
    assert ops.enqueued == []
    assert (await ops.rules.storage.run(_ref(), first)).status == "dead"  # type: ignore[union-attr]

    [skipped] = await skip(ops.rules, [row], reason="backup retired")
    assert (skipped.ok, skipped.status) == (True, "skipped")
    [again] = await cancel(ops.rules, [row], reason="no")
    assert not again.ok
    assert "skipped" in again.detail
    assert await find_run(ops.rules, "fir_missing") is None


async def test_an_enqueue_that_fails_for_good_leaves_every_run_retried_and_reported(
    ops: Ops,
) -> None:
    """A message the broker cannot take (EncodeError), credentials it refuses, a folder that
    cannot be written: not transient, so the enqueue raises it as it is, after reflexr's retry
    changed the run. Every run still gets its result; the broker is not tried again."""
    thread = await ops.thread()
    run_ids = [await ops.fire(Flaked(thread_id=thread)) for _ in range(2)]
    for run_id in run_ids:
        assert await ops.until_ended(run_id) == "dead"
    rows, missing = await find_runs(ops.rules, [(KEY, run_id) for run_id in run_ids])
    assert missing == []
    tried: list[str] = []

    async def refusing(tenant_id: str, workspace_id: str, run_id: str) -> None:
        tried.append(run_id)
        raise EncodeError("Object of type bytes is not JSON serializable")

    with capture_logs() as logs:
        results = await retry(ops.rules, rows, refusing)
    assert tried == run_ids[:1]
    assert [(r.run_id, r.ok, r.status, r.enqueued) for r in results] == [
        (run_id, True, "pending", False) for run_id in run_ids
    ]
    assert {r.enqueue_error for r in results} == {ENQUEUE_FAILED}
    assert all("EncodeError: Object of type bytes" in r.detail for r in results)
    for run_id in run_ids:
        current = await ops.rules.storage.run(_ref(), run_id)
        assert current is not None
        assert current.status == "pending"
    [logged] = [line for line in logs if line["log_level"] == "error"]
    assert (logged["run_id"], logged["workspace"]) == (run_ids[0], str(KEY))
    problem = not_enqueued(results, "redis://broker:6379/0")
    assert problem is not None
    assert problem.startswith("the enqueue on broker redis://broker:6379/0 failed")
    assert problem.endswith(f"{run_ids[1]} ({KEY}); the dispatcher will enqueue them")
