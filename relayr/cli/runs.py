"""``relayr runs list|show|retry|cancel|skip``: find failed runs across workspaces, act on them.

Changes go through reflexr's operator operations (:mod:`relayr.ops.runs`); a retry also enqueues
the run. Every id is checked and every run found before the first change, so a typo changes
nothing. Exit 0 when every run was changed (and enqueued), 1 when some were refused or the
enqueue failed (those runs stay due for the dispatcher, ADR-0034), 2 for bad input.
"""

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

import click

from relayr.cli.helpers import (
    EXIT_NOT_ALL_DONE,
    Where,
    echo_json,
    fail,
    in_runtime,
    load_settings,
    parse_id,
    parse_optional_workspace,
    run_async,
)
from relayr.core import parsing

if TYPE_CHECKING:
    from reflexr.workspace import Workspaces

    from relayr.ops.rows import RunFilter, RunRow
    from relayr.ops.runs import EnqueueRun, OperatorResult
    from relayr.runtime.process import Runtime
    from relayr.settings import Settings

WORKSPACE_OF_RUNS: Final = (
    "TENANT/WORKSPACE of the runs (default: all; a RUN id that several workspaces hold is "
    "refused without it)."
)

STATUSES: Final = ("pending", "running", "retrying", "succeeded", "dead", "cancelled", "skipped")

BROKER_TRIES: Final = 3
"""How often ``runs retry`` hands a run to the broker before it says the broker is unavailable.
Each try is Celery's publish with its own quick retries (about 0.6 s against a refused
connection); three tries and the waits between them end within about 4 s, so ops wait seconds,
not minutes, and a broker that restarts meanwhile is ridden out."""

BROKER_BACKOFF_S: Final = (0.5, 1.0)
"""The first and the longest wait between tries of the broker: tenacity's exponential wait
doubles from the first, so with :data:`BROKER_TRIES` tries the waits are 0.5 s, then 1 s."""


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``7d``, or a sum such as ``1h30m``.

    Raises:
        BadInput: Naming the text, when it is not a duration.
    """
    try:
        return parsing.parse_duration("--since", text)
    except parsing.Unreadable as unreadable:
        fail(unreadable.message)


def enqueuer(settings: "Settings") -> "EnqueueRun":
    """Hands a run to the workers, as the dispatcher does, trying a broker that is down again.

    A transient fault (:func:`relayr.runtime.transient.is_transient`) is tried again, at most
    :data:`BROKER_TRIES` times; the last one raises :class:`relayr.core.errors.BrokerUnavailable`.
    Anything else is raised as it is.
    """
    import asyncio

    from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

    from relayr.core.errors import BrokerUnavailable
    from relayr.runtime.transient import is_transient
    from relayr.settings import redact
    from tasks.app import create_celery
    from tasks.runs import RunIds, send_run

    app = create_celery(settings)
    broker = redact(settings.broker_url)

    async def enqueue(tenant_id: str, workspace_id: str, run_id: str) -> None:
        ids = RunIds(tenant_id, workspace_id, run_id)
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(BROKER_TRIES),
                wait=wait_exponential(multiplier=BROKER_BACKOFF_S[0], max=BROKER_BACKOFF_S[1]),
                retry=retry_if_exception(is_transient),
                reraise=True,
            ):
                with attempt:
                    await asyncio.to_thread(send_run, app, settings.queue, ids)
        except Exception as error:
            if not is_transient(error):
                raise
            raise BrokerUnavailable(broker, error, tries=BROKER_TRIES) from error

    return enqueue


def on_rules[T](settings: "Settings", work: Callable[["Workspaces"], Awaitable[T]]) -> T:
    """Run ``work`` on the application's reflexr workspaces (its rules part), then close them."""

    async def main() -> T:
        from relayr.runtime.application_parts import opened_rules

        async with opened_rules(settings) as rules:
            return await work(rules)

    return run_async(main())


@click.group("runs")
def runs() -> None:
    """List, show, retry, cancel and skip rule runs, across every workspace."""


@runs.command("list")
@click.option("--status", type=click.Choice(STATUSES), help="Only runs in this status.")
@click.option("--rule", help="Only runs of this rule.")
@click.option("--workspace", help="Only runs of TENANT/WORKSPACE.")
@click.option("--since", help="Only runs changed within this duration (90s, 15m, 2h, 7d).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def runs_list(
    status: str | None,
    rule: str | None,
    workspace: str | None,
    since: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Runs, newest created first: id, rule, status, attempts, last reason and error, next
    attempt, and for a run an operator's limit holds back, the limit and when it expects to go.
    --since reads every run and keeps those that changed within it, so a run created long ago
    that died just now is found."""
    where = parse_optional_workspace(workspace)
    age = None if since is None else parse_duration(since)
    settings = load_settings()

    async def work() -> list["RunRow"]:
        from relayr.ops.limits import with_waits
        from relayr.ops.rows import list_runs
        from relayr.runtime.application_parts import opened_limits

        async with opened_limits(settings) as (rules, store):
            rows = await list_runs(rules, _filter(rules, status, rule, where, age, limit))
            return await with_waits(rows, store)

    rows = run_async(work())
    if as_json:
        echo_json([row.to_json() for row in rows])
        return
    for row in rows:
        click.echo(
            f"{row.id}  {row.rule:24} {row.status:9} attempts={row.attempts} "
            f"reason={row.reason or '-'} next={row.next_attempt_at:%Y-%m-%dT%H:%M:%S} "
            f"{row.tenant_id}/{row.workspace_id}"
            + (f"\n    error: {row.error}" if row.error else "")
            + (f"\n    {row.waiting}" if row.waiting else "")
        )
    click.echo(f"{len(rows)} run(s)")


@runs.command("show")
@click.argument("run_id", metavar="RUN")
@click.option(
    "--workspace", help="TENANT/WORKSPACE of the run (default: the one workspace that has it)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_show(run_id: str, workspace: str | None, as_json: bool) -> None:
    """A run's attempts, what it posted (emission records) and the turns its messages started."""
    parse_id("RUN", run_id)
    where = parse_optional_workspace(workspace)
    settings = load_settings()

    async def work(runtime: "Runtime") -> dict[str, Any] | None:
        from relayr.ops.report import show_run
        from relayr.ops.rows import AmbiguousRun, find_run

        rules = runtime.application.rules
        try:
            row = await find_run(rules, run_id, _key(where))
        except AmbiguousRun as error:
            fail(str(error))
        if row is None:
            return None
        artifacts, ledger = runtime.application.artifacts, runtime.bridge.ledger
        return (await show_run(rules, artifacts, ledger, row)).to_json()

    report = in_runtime(settings, work)
    if report is None:
        fail(f"no run {run_id}" + (f" in {where}" if where else ""))
    if as_json:
        echo_json(report)
        return
    from relayr.ops.report import TOOK

    run = report["run"]
    click.echo(
        f"run {run['id']} of {run['rule']} in {run['tenant_id']}/{run['workspace_id']}: "
        f"{run['status']}, {run['attempts']} attempt(s)"
    )
    for attempt in report["attempts"]:
        click.echo(
            f"  attempt {attempt['attempt']} at {attempt['started_at']}: {attempt['outcome']}"
            + (f" ({attempt['reason']})" if attempt["reason"] else "")
            + (f": {attempt['error']}" if attempt["error"] else "")
        )
    for record in report["emissions"]:
        click.echo(
            f"  emitted {record['kind']} {record['message_id']} in {record['thread_id']} "
            f"(attempt {record['attempt']}, {record['policy']}): {record['outcome']}"
        )
    for turn in report["turns"]:
        click.echo(
            f"  turn for {turn['message_id']}: {turn['turn_id'] or '-'} {turn['status']}"
            + (f", {TOOK[turn['took']]}" if turn["took"] else "")
            + (f" ({turn['reason']})" if turn["reason"] else "")
        )


@runs.command("retry")
@click.argument("run_ids", nargs=-1, metavar="[RUN]...")
@click.option("--dead", is_flag=True, help="Retry every dead run the filters select.")
@click.option("--rule", help="With --dead: only runs of this rule.")
@click.option("--workspace", help=WORKSPACE_OF_RUNS)
@click.option("--since", help="With --dead: only runs that died within this duration.")
@click.option("--dry-run", is_flag=True, help="Say what would be retried; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of results.")
def runs_retry(
    run_ids: tuple[str, ...],
    dead: bool,
    rule: str | None,
    workspace: str | None,
    since: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Retry runs (reflexr's operator retry), then enqueue each at once.

    A succeeded run cannot be retried. Retrying is safe: what an earlier attempt posted is not
    posted again, and a message whose turn was never asked gets its turn.

    The broker is tried a few times within a few seconds. If it stays unavailable, the runs are
    still retried in reflexr (pending, due now) and the dispatcher enqueues them once it
    reaches the broker; one line on stderr names the broker and the runs.

    Exit codes: 0 all retried and enqueued; 1 some refused, or not enqueued (the broker
    unavailable, or refusing); 2 bad input: a malformed RUN, or one that names no run (then
    nothing is retried).
    """
    if bool(run_ids) == dead:
        raise click.UsageError("name RUN ids or --dead, not both and not neither")
    if not dead and (rule or since):
        raise click.UsageError("--rule and --since select dead runs: use them with --dead")
    ids = _parse_ids(run_ids)
    where = parse_optional_workspace(workspace)
    age = None if since is None else parse_duration(since)
    settings = load_settings()
    enqueue = enqueuer(settings)

    async def work(rules: "Workspaces") -> list["OperatorResult"]:
        from relayr.ops.rows import list_runs
        from relayr.ops.runs import retry

        if dead:
            found = await list_runs(rules, _filter(rules, "dead", rule, where, age, None))
        else:
            found = await _targets(rules, ids, where)
        return await retry(rules, found, enqueue, dry_run=dry_run)

    results = on_rules(settings, work)
    from relayr.ops.runs import not_enqueued
    from relayr.settings import redact

    problem = not_enqueued(results, redact(settings.broker_url))
    _report(results, as_json, problem=None if problem is None else f"Error: {problem}")


@runs.command("cancel")
@click.argument("run_ids", nargs=-1, required=True, metavar="RUN...")
@click.option("--workspace", help=WORKSPACE_OF_RUNS)
@click.option("--reason", default="cancelled by ops", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of results.")
def runs_cancel(
    run_ids: tuple[str, ...], workspace: str | None, reason: str, as_json: bool
) -> None:
    """Cancel runs; a running attempt's result is dropped."""
    ids = _parse_ids(run_ids)
    where = parse_optional_workspace(workspace)
    settings = load_settings()

    async def work(rules: "Workspaces") -> list["OperatorResult"]:
        from relayr.ops.runs import cancel

        return await cancel(rules, await _targets(rules, ids, where), reason=reason)

    _report(on_rules(settings, work), as_json)


@runs.command("skip")
@click.argument("run_ids", nargs=-1, required=True, metavar="RUN...")
@click.option("--reason", required=True, help="Why the run will not run (recorded).")
@click.option("--workspace", help=WORKSPACE_OF_RUNS)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of results.")
def runs_skip(run_ids: tuple[str, ...], reason: str, workspace: str | None, as_json: bool) -> None:
    """Skip runs: they will not run, and their scope moves on."""
    ids = _parse_ids(run_ids)
    where = parse_optional_workspace(workspace)
    settings = load_settings()

    async def work(rules: "Workspaces") -> list["OperatorResult"]:
        from relayr.ops.runs import skip

        return await skip(rules, await _targets(rules, ids, where), reason=reason)

    _report(on_rules(settings, work), as_json)


def _key(where: Where | None) -> Any:
    """``where`` as the ledger's workspace key, which :mod:`relayr.ops.rows` and
    :mod:`relayr.ops.runs`
    take."""
    if where is None:
        return None
    from relayr.ledger.port import WorkspaceKey

    return WorkspaceKey(where.tenant_id, where.workspace_id)


def _filter(
    rules: "Workspaces",
    status: str | None,
    rule: str | None,
    where: Where | None,
    age: timedelta | None = None,
    limit: int | None = None,
) -> "RunFilter":
    from relayr.ops.rows import RunFilter

    since: datetime | None = None if age is None else rules.clock() - age
    return RunFilter(status=status, rule=rule, workspace=_key(where), since=since, limit=limit)


def _parse_ids(run_ids: Sequence[str]) -> list[str]:
    """The RUN ids, each checked, each once, in the order given.

    Raises:
        BadInput: Naming the first that is malformed.
    """
    return [parse_id("RUN", run_id) for run_id in dict.fromkeys(run_ids)]


async def _targets(
    rules: "Workspaces", run_ids: Sequence[str], where: Where | None
) -> list["RunRow"]:
    """The runs named, every one of them.

    Raises:
        BadInput: Naming each id that names no run (in ``where``): nothing has been changed.
    """
    from relayr.ops.runs import find_runs

    key = _key(where)
    found, missing = await find_runs(rules, [(key, run_id) for run_id in run_ids])
    if missing:
        fail("; ".join(refusal.detail for refusal in missing) + ": nothing was changed")
    return found


def _report(results: list["OperatorResult"], as_json: bool, *, problem: str | None = None) -> None:
    """Print what was done to each run, then ``problem`` on stderr; exit 1 if any was refused
    or there is a problem."""
    import sys

    if as_json:
        echo_json([result.to_json() for result in results])
    else:
        for result in results:
            mark = "ok     " if result.ok else "refused"
            click.echo(f"{mark} {result.run_id} ({result.workspace}): {result.detail}")
        done = sum(result.ok for result in results)
        click.echo(f"{done} done, {len(results) - done} refused")
    if problem is not None:
        click.echo(problem, err=True)
    if problem is not None or any(not result.ok for result in results):
        sys.exit(EXIT_NOT_ALL_DONE)
