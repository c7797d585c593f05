"""``relayr follow``: the followers alone, where they stand, and what they could not bridge.

``relayr follow`` runs a pass every ``RELAYR_DISPATCH_INTERVAL_S`` (``--once``: one) beside a
dispatcher started with ``--no-follow``; any number may run. ``status`` shows each workspace's
cursor, lag, lease and dead letters; ``dead-letters list`` and ``dead-letters replay`` show and
publish again what could not be bridged (exit 1 if some are still not bridged). ADR-0065.
"""

import sys
from typing import TYPE_CHECKING, Any

import click

from relayr.cli.helpers import (
    EXIT_NOT_ALL_DONE,
    echo_json,
    in_runtime,
    load_settings,
    parse_id,
    parse_optional_workspace,
    parse_workspace,
)

if TYPE_CHECKING:
    from relayr.follow.follower import Followers
    from relayr.runtime.process import Runtime


def followers_of(runtime: "Runtime") -> "Followers":
    """The followers of the runtime's application (:func:`relayr.follow.follower.followers_of`,
    which the
    console's health page reads too), imported when a command runs (ADR-0050)."""
    from relayr.follow.follower import followers_of as of_runtime

    return of_runtime(runtime)


@click.group(invoke_without_command=True)
@click.option("--once", is_flag=True, help="Follow every workspace once, print what it did.")
@click.option("--json", "as_json", is_flag=True, help="With --once: print one JSON object.")
@click.pass_context
def follow(ctx: click.Context, once: bool, as_json: bool) -> None:
    """Bridge artifactr's events into reflexr as artifactr:* events (until Ctrl-C)."""
    if ctx.invoked_subcommand is not None:
        if once or as_json:
            raise click.UsageError("--once and --json go with relayr follow itself")
        return
    if as_json and not once:
        raise click.UsageError("--json goes with --once")
    settings = load_settings(log_level="WARNING" if once else "INFO", role="dispatcher")

    async def work(runtime: "Runtime") -> dict[str, int] | None:
        import asyncio

        followers = followers_of(runtime)
        if once:
            try:
                return vars(await followers.follow_all())
            finally:
                await followers.release()
        from relayr.cli.serve import stop_on_signals

        stop = asyncio.Event()
        stop_on_signals(stop)
        await followers.serve(runtime.settings.dispatch_interval_s, stop)
        return None

    done = in_runtime(settings, work, role="dispatcher")
    if done is None:
        return
    if as_json:
        echo_json(done)
        return
    click.echo(
        f"{done['workspaces']} workspace(s) followed ({done['elsewhere']} held elsewhere, "
        f"{done['failed']} failed): {done['read']} envelope(s) read, {done['bridged']} "
        f"bridged, {done['duplicates']} already bridged, {done['skipped']} not bridged, "
        f"{done['dead']} dead-lettered"
    )


@follow.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def follow_status(as_json: bool) -> None:
    """Each workspace: its cursor, artifactr's head, the lag, its lease and dead letters."""
    settings = load_settings()

    async def work(runtime: "Runtime") -> list[dict[str, Any]]:
        return [
            {
                "workspace": str(found.workspace),
                "cursor": found.cursor,
                "head": found.head,
                "lag": found.lag,
                "holder": found.holder,
                "held_until": found.held_until,
                "dead_letters": found.dead_letters,
            }
            for found in await followers_of(runtime).status()
        ]

    rows = in_runtime(settings, work)
    if as_json:
        echo_json(rows)
        return
    for row in rows:
        held = (
            f"held by {row['holder']} until {row['held_until']:%H:%M:%S}" if row["holder"] else ""
        )
        click.echo(
            f"{row['workspace']}: cursor {row['cursor']} of {row['head']} (lag {row['lag']}), "
            f"{row['dead_letters']} dead letter(s) {held}".rstrip()
        )
    click.echo(f"{len(rows)} workspace(s)")


@follow.group("dead-letters")
def dead_letters() -> None:
    """The envelopes no follower could bridge: list them, replay them."""


@dead_letters.command("list")
@click.option("--workspace", help="TENANT/WORKSPACE (default: every workspace).")
@click.option("--all", "everything", is_flag=True, help="Also those a replay bridged.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def dead_letters_list(workspace: str | None, everything: bool, as_json: bool) -> None:
    """Dead letters, oldest first: workspace, envelope id and seq, type, reason, error."""
    where = parse_optional_workspace(workspace)
    settings = load_settings()

    async def work(runtime: "Runtime") -> list[dict[str, Any]]:
        from relayr.ledger.port import WorkspaceKey

        key = None if where is None else WorkspaceKey(where.tenant_id, where.workspace_id)
        letters = await followers_of(runtime).store.dead_letters(key, replayed=everything)
        return [{"workspace": str(letter.workspace), **letter.details()} for letter in letters]

    rows = in_runtime(settings, work)
    if as_json:
        echo_json(rows)
        return
    for row in rows:
        replayed = (
            f" (replayed {row['replayed_at']:%Y-%m-%dT%H:%M:%S})" if row["replayed_at"] else ""
        )
        click.echo(
            f"{row['workspace']} #{row['seq']} {row['envelope_id']} {row['event_type']}: "
            f"{row['reason']}, {row['tries']} tr{'y' if row['tries'] == 1 else 'ies'}{replayed}"
            f"\n    {row['error']}"
        )
    click.echo(f"{len(rows)} dead letter(s)")


@dead_letters.command("replay")
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.argument("envelope_ids", nargs=-1, metavar="[ID]...")
@click.option("--all", "everything", is_flag=True, help="Every dead letter of the workspace.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def dead_letters_replay(
    where: str, envelope_ids: tuple[str, ...], everything: bool, as_json: bool
) -> None:
    """Project dead letters again and publish them, each once, under its envelope's id.

    Exit codes: 0 every one bridged; 1 some failed again (their new reason is listed), are
    not waiting dead letters of the workspace, or were left waiting (skipped, not found);
    2 bad input.
    """
    if bool(envelope_ids) == everything:
        raise click.UsageError("name envelope IDs or --all, not both and not neither")
    workspace = parse_workspace(where)
    ids = [parse_id("ID", envelope_id) for envelope_id in envelope_ids]
    settings = load_settings()

    async def work(runtime: "Runtime") -> dict[str, Any]:
        from relayr.ledger.port import WorkspaceKey

        key = WorkspaceKey(workspace.tenant_id, workspace.workspace_id)
        replayed = await followers_of(runtime).replay(key, None if everything else ids)
        return {
            "bridged": list(replayed.bridged),
            "failed": [
                {"envelope_id": letter.envelope_id, "reason": letter.reason, "error": letter.error}
                for letter in replayed.failed
            ],
            "unknown": list(replayed.unknown),
            "skipped": list(replayed.skipped),
            "not_found": list(replayed.not_found),
        }

    done = in_runtime(settings, work)
    if as_json:
        echo_json(done)
    else:
        for envelope_id in done["bridged"]:
            click.echo(f"bridged {envelope_id}")
        for letter in done["failed"]:
            click.echo(f"failed  {letter['envelope_id']}: {letter['reason']}: {letter['error']}")
        for envelope_id in done["unknown"]:
            click.echo(f"unknown {envelope_id}: not a dead letter waiting in {workspace}")
        for envelope_id in done["skipped"]:
            click.echo(f"skipped {envelope_id}: no projection bridges it now; it stays waiting")
        for envelope_id in done["not_found"]:
            click.echo(
                f"missing {envelope_id}: not in artifactr's log at its seq; it stays waiting"
            )
        click.echo(
            f"{len(done['bridged'])} bridged, {len(done['failed'])} failed again, "
            f"{len(done['unknown'])} unknown, {len(done['skipped'])} skipped, "
            f"{len(done['not_found'])} not found"
        )
    if done["failed"] or done["unknown"] or done["skipped"] or done["not_found"]:
        sys.exit(EXIT_NOT_ALL_DONE)
