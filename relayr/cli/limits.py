"""``relayr limits``: each operator's limit, its use now, and how many runs wait for it.

The limits are the allowlist file's (``RELAYR_ALLOWLIST``, or ``--file``); their use is what the
workers count, in the application's database (:mod:`relayr.ops.limits`). A file that cannot be
read is bad input (exit code 2). It builds the application's rules part only (ADR-0050).
"""

from pathlib import Path

import click

from relayr.cli.helpers import echo_json, fail, load_settings, run_async


@click.command("limits")
@click.option("--file", type=click.Path(path_type=Path), help="Default: RELAYR_ALLOWLIST.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def limits(file: Path | None, as_json: bool) -> None:
    """Each limit of the allowlist file: its bounds, what each uses now, and the runs waiting."""
    from relayr.core.errors import InvalidAllowlist
    from relayr.ledger.limits import LimitUse, limit_uses
    from relayr.runtime.allowlist_file import load_allowlist
    from relayr.runtime.application_parts import opened_limits

    settings = load_settings()
    path = file or settings.allowlist
    try:
        allowlists = load_allowlist(path)
    except InvalidAllowlist as invalid:
        fail(invalid.message)

    async def work() -> list[LimitUse]:
        async with opened_limits(settings) as (rules, store):
            return await limit_uses(allowlists.limits, store, now=rules.clock())

    uses = run_async(work())
    if as_json:
        echo_json([use.to_json() for use in uses])
        return
    shown: str | None = None
    for use in uses:
        if use.limit.key != shown:
            shown = use.limit.key
            line = "" if use.limit.line is None else f" (line {use.limit.line})"
            click.echo(
                f"{use.limit.key}{line}: rules {', '.join(use.limit.rules)} "
                f"in {', '.join(use.limit.workspaces)}"
            )
        click.echo(f"  {use.describe()}")
    click.echo(f"{len(allowlists.limits)} limit(s) in {path}")
