"""The operators' and ops' commands: ``relayr allowlist ...`` and ``relayr runs ...``.

Operators own the allowlist file: ``check`` validates it (every problem with its key and line)
and ``explain`` says what a rule may do and which entry gave it. Ops own failed runs: ``list``
finds them across every workspace, ``show`` tells one whole (attempts, emissions, the turns its
messages started), and ``retry``, ``cancel`` and ``skip`` change them through reflexr's own
operator operations. A retry also enqueues the run, so it runs without waiting for the
dispatcher. Every command that prints data has ``--json``.

Exit codes: 0 when every run was changed (and, for a retry, enqueued); 1 when some were refused,
or when the broker stayed unavailable through the enqueue's bounded retries (those runs are
retried in reflexr and stay due: the dispatcher enqueues them; ADR-0034); 2 for bad input
(arguments, settings, application).
"""

import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import click
from kombu.exceptions import OperationalError as KombuOperationalError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from relayr.allowlist import load_allowlist, warnings
from relayr.application import load_application
from relayr.errors import BrokerUnavailable, InvalidAllowlist, RelayrError
from relayr.health import redact
from relayr.ledger.port import WorkspaceKey
from relayr.logging import configure_logging
from relayr.ops import (
    Done,
    RunFilter,
    RunRow,
    cancel,
    find_run,
    list_runs,
    retry,
    show_run,
    skip,
)
from relayr.runtime import Runtime
from relayr.settings import Settings

STATUSES: Final = ("pending", "running", "retrying", "succeeded", "dead", "cancelled", "skipped")
_DURATION = re.compile(r"(\d+)([smhd])")
_UNITS: Final = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}

BROKER_TRIES: Final = 3
"""How often ``runs retry`` hands a run to the broker before it says the broker is unavailable.
Each try is Celery's publish with its own quick retries (about 0.6 s against a refused
connection); three tries and the waits between them end within about 4 s, so ops wait seconds,
not minutes, and a broker that restarts meanwhile is ridden out."""

BROKER_BACKOFF_S: Final = (0.5, 2.0)
"""The first and the longest wait between tries of the broker (tenacity's exponential wait)."""

EXIT_NOT_ALL_DONE: Final = 1
"""Some runs were refused, or retried but not enqueued: done, but not fully."""

EXIT_BAD_INPUT: Final = 2
"""As every ``relayr`` command: arguments, settings or application that cannot be used."""

type Enqueue = Callable[[str, str, str], Awaitable[None]]


class BadInput(click.ClickException):
    """Raised when the settings or the application cannot be used: one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


def is_transient_broker_fault(error: BaseException) -> bool:
    """Whether a failed publish may pass if tried again: the broker's connection was refused,
    dropped or timed out (kombu reports those as its ``OperationalError``), nothing else."""
    return isinstance(error, KombuOperationalError | ConnectionError | TimeoutError)


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``7d``, or a sum such as ``1h30m``.

    Raises:
        click.BadParameter: Naming the text, when it is not a duration.
    """
    parts = _DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise click.BadParameter(f"{text!r} is not a duration such as 90s, 15m, 2h or 7d")
    total = timedelta()
    for number, unit in parts:
        total += timedelta(**{_UNITS[unit]: int(number)})
    return total


def parse_workspace(text: str) -> WorkspaceKey:
    """``TENANT/WORKSPACE``.

    Raises:
        click.BadParameter: Naming the text, when it is not of that form.
    """
    tenant, slash, workspace = text.partition("/")
    if not slash or not tenant or not workspace or "/" in workspace:
        raise click.BadParameter(f"{text!r} is not TENANT/WORKSPACE")
    return WorkspaceKey(tenant, workspace)


def _workspace_option(value: str | None) -> WorkspaceKey | None:
    return None if value is None else parse_workspace(value)


def _settings() -> Settings:
    """The environment's settings; logs go to stderr, warnings and worse, so stdout is data."""
    try:
        settings = Settings.from_env()
    except RelayrError as error:
        raise BadInput(error.message) from None
    configure_logging(settings.log_format, level="WARNING")
    return settings


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, default=str))


def _run[T](work: Callable[[Runtime], Awaitable[T]]) -> T:
    """Run ``work`` with a runtime of this process, opened and closed on one loop."""
    settings = _settings()

    async def main() -> T:
        runtime = await Runtime.start(settings, role="cli")
        try:
            return await work(runtime)
        finally:
            await runtime.aclose()

    try:
        return asyncio.run(main())
    except RelayrError as error:
        raise BadInput(error.message) from None


def _enqueuer(settings: Settings) -> Enqueue:
    """Hands a run to the workers, as the dispatcher does, trying a broker that is down again.

    A transient fault (:func:`is_transient_broker_fault`) is tried again, at most
    :data:`BROKER_TRIES` times; the last one raises :class:`BrokerUnavailable`. Anything else
    is raised as it is.
    """
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
                retry=retry_if_exception(is_transient_broker_fault),
                reraise=True,
            ):
                with attempt:
                    await asyncio.to_thread(send_run, app, settings.queue, ids)
        except Exception as error:
            if not is_transient_broker_fault(error):
                raise
            raise BrokerUnavailable(broker, error, tries=BROKER_TRIES) from error

    return enqueue


@click.group("allowlist")
def allowlist_group() -> None:
    """Check the operators' allowlist file and explain a rule's permissions."""


@allowlist_group.command("check")
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def allowlist_check(file: Path | None, as_json: bool) -> None:
    """Validate FILE (default: RELAYR_ALLOWLIST): exit 1 if it has a problem, 0 otherwise.

    Also warns about entries that name no rule the application has, and about rules that get
    turns through a namespace or the default rather than their own entry.
    """
    settings = _settings()
    path = file or settings.allowlist
    try:
        allowlists = load_allowlist(path)
    except InvalidAllowlist as invalid:
        if as_json:
            _echo_json({"ok": False, "file": str(path), "problems": _problems(invalid.problems)})
        else:
            for problem in invalid.problems:
                click.echo(f"{path}: {problem}", err=True)
            click.echo(f"{path}: {len(invalid.problems)} problem(s); nothing of it is used")
        sys.exit(1)
    rules = _rule_names(settings)
    found = warnings(allowlists, rules)
    summary = (
        f"{path}: ok, {len(allowlists.rules)} rule entr(ies), "
        f"{len(allowlists.namespaces)} namespace entr(ies), "
        f"default {'set' if allowlists.default else 'not set'}; {len(found)} warning(s)"
    )
    if as_json:
        _echo_json({"ok": True, "file": str(path), "warnings": _problems(found)})
        return
    for problem in found:
        click.echo(f"{path}: warning: {problem}", err=True)
    click.echo(summary)


@allowlist_group.command("explain")
@click.argument("rule")
@click.option("--file", type=click.Path(path_type=Path), help="Default: RELAYR_ALLOWLIST.")
@click.option("--json", "as_json", is_flag=True, help="Print the grant as one JSON object.")
def allowlist_explain(rule: str, file: Path | None, as_json: bool) -> None:
    """Say what RULE may do, and which entry gave each permission."""
    path = file or _settings().allowlist
    try:
        grant = load_allowlist(path).explain(rule)
    except InvalidAllowlist as invalid:
        raise click.ClickException(invalid.message) from None
    data = grant.to_json()
    if as_json:
        _echo_json(data)
        return
    click.echo(f"rule {rule} ({path}):")
    for name, value in data["allowlist"].items():
        source = data["fields"][name]
        given = source["kind"] if source["key"] is None else f"{source['kind']} {source['key']}"
        click.echo(f"  {name:15} = {json.dumps(value):20} from {given}")


@click.group("runs")
def runs_group() -> None:
    """List, show, retry, cancel and skip rule runs, across every workspace."""


@runs_group.command("list")
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
    """Runs, newest first: id, rule, status, attempts, last reason and error, next attempt."""
    query = _filter(status, rule, workspace, since, limit)

    async def work(runtime: Runtime) -> list[RunRow]:
        query.since = _since(runtime, since)
        return await list_runs(runtime.application.rules, query)

    rows = _run(work)
    if as_json:
        _echo_json([row.to_json() for row in rows])
        return
    for row in rows:
        click.echo(
            f"{row.id}  {row.rule:24} {row.status:9} attempts={row.attempts} "
            f"reason={row.reason or '-'} next={row.next_attempt_at:%Y-%m-%dT%H:%M:%S} "
            f"{row.tenant_id}/{row.workspace_id}"
            + (f"\n    error: {row.error}" if row.error else "")
        )
    click.echo(f"{len(rows)} run(s)")


@runs_group.command("show")
@click.argument("run_id", metavar="RUN")
@click.option("--workspace", help="TENANT/WORKSPACE of the run (default: search all).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def runs_show(run_id: str, workspace: str | None, as_json: bool) -> None:
    """A run's attempts, what it posted (emission records) and the turns its messages started."""
    key = _workspace_option(workspace)

    async def work(runtime: Runtime) -> dict[str, Any] | None:
        row = await find_run(runtime.application.rules, run_id, key)
        if row is None:
            return None
        report = await show_run(
            runtime.application.rules, runtime.application.artifacts, runtime.bridge.ledger, row
        )
        return report.to_json()

    report = _run(work)
    if report is None:
        raise click.ClickException(f"no run {run_id}" + (f" in {key}" if key else ""))
    if as_json:
        _echo_json(report)
        return
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
            + (f" ({turn['reason']})" if turn["reason"] else "")
        )


@runs_group.command("retry")
@click.argument("run_ids", nargs=-1, metavar="[RUN]...")
@click.option("--dead", is_flag=True, help="Retry every dead run the filters select.")
@click.option("--rule", help="With --dead: only runs of this rule.")
@click.option("--workspace", help="TENANT/WORKSPACE of the runs (default: all).")
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

    Exit codes: 0 all retried and enqueued; 1 some refused, or not enqueued (broker
    unavailable); 2 bad input.
    """
    if bool(run_ids) == dead:
        raise click.UsageError("name RUN ids or --dead, not both and not neither")
    if not dead and (rule or since):
        raise click.UsageError("--rule and --since select dead runs: use them with --dead")
    query = _filter("dead", rule, workspace, since, None)
    settings = _settings()
    enqueue = _enqueuer(settings)

    async def work(runtime: Runtime) -> list[Done]:
        query.since = _since(runtime, since)
        targets = await _targets(runtime, run_ids, query)
        return [
            *targets[1],
            *await retry(runtime.application.rules, targets[0], enqueue, dry_run=dry_run),
        ]

    results = _run(work)
    left = [result for result in results if result.enqueued is False]
    problem = None
    if left:
        runs = ", ".join(f"{result.run_id} ({result.workspace})" for result in left)
        them = "it" if len(left) == 1 else "them"
        problem = (
            f"Error: broker {redact(settings.broker_url)} is unavailable: retried in reflexr "
            f"but not enqueued: {runs}; the dispatcher will enqueue {them} once it reaches the "
            "broker"
        )
    _report(results, as_json, problem=problem)


@runs_group.command("cancel")
@click.argument("run_ids", nargs=-1, required=True, metavar="RUN...")
@click.option("--workspace", help="TENANT/WORKSPACE of the runs (default: all).")
@click.option("--reason", default="cancelled by ops", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of results.")
def runs_cancel(
    run_ids: tuple[str, ...], workspace: str | None, reason: str, as_json: bool
) -> None:
    """Cancel runs; a running attempt's result is dropped."""
    query = _filter(None, None, workspace, None, None)

    async def work(runtime: Runtime) -> list[Done]:
        found, missing = await _targets(runtime, run_ids, query)
        return [*missing, *await cancel(runtime.application.rules, found, reason=reason)]

    _report(_run(work), as_json)


@runs_group.command("skip")
@click.argument("run_ids", nargs=-1, required=True, metavar="RUN...")
@click.option("--reason", required=True, help="Why the run will not run (recorded).")
@click.option("--workspace", help="TENANT/WORKSPACE of the runs (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of results.")
def runs_skip(run_ids: tuple[str, ...], reason: str, workspace: str | None, as_json: bool) -> None:
    """Skip runs: they will not run, and their scope moves on."""
    query = _filter(None, None, workspace, None, None)

    async def work(runtime: Runtime) -> list[Done]:
        found, missing = await _targets(runtime, run_ids, query)
        return [*missing, *await skip(runtime.application.rules, found, reason=reason)]

    _report(_run(work), as_json)


def _filter(
    status: str | None,
    rule: str | None,
    workspace: str | None,
    since: str | None,
    limit: int | None,
) -> RunFilter:
    if since is not None:
        parse_duration(since)
    return RunFilter(status=status, rule=rule, workspace=_workspace_option(workspace), limit=limit)


def _since(runtime: Runtime, since: str | None) -> Any:
    if since is None:
        return None
    return runtime.application.rules.clock() - parse_duration(since)


async def _targets(
    runtime: Runtime, run_ids: Sequence[str], query: RunFilter
) -> tuple[list[RunRow], list[Done]]:
    rules = runtime.application.rules
    if not run_ids:
        return await list_runs(rules, query), []
    found: list[RunRow] = []
    missing: list[Done] = []
    for run_id in run_ids:
        row = await find_run(rules, run_id, query.workspace)
        if row is None:
            missing.append(Done(run_id, str(query.workspace or "*"), False, f"no run {run_id}"))
        else:
            found.append(row)
    return found, missing


def _report(results: list[Done], as_json: bool, *, problem: str | None = None) -> None:
    """Print what was done to each run, then ``problem`` on stderr; exit 1 if any was refused
    or there is a problem."""
    if as_json:
        _echo_json([result.to_json() for result in results])
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


def _rule_names(settings: Settings) -> list[str]:
    async def names() -> list[str]:
        application = await load_application(settings)
        try:
            return sorted(application.rules.rules)
        finally:
            await application.aclose()

    try:
        return asyncio.run(names())
    except RelayrError as error:
        click.echo(f"warning: cannot load the application to check rule names: {error}", err=True)
        return []


def _problems(problems: Sequence[Any]) -> list[dict[str, Any]]:
    return [
        {"key": problem.key, "line": problem.line, "message": problem.message}
        for problem in problems
    ]
