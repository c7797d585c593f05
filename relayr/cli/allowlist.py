"""``relayr allowlist check`` and ``relayr allowlist explain``: the operators' file.

Operators own the allowlist file: ``check`` validates it (every problem with its key and line,
exit code 1 if there is any: finding them is what the check is for) and warns about entries
that name no rule of the application; ``explain`` says what a rule may do and which entry gave
it. Settings or an application that cannot be loaded, and a file ``explain`` cannot read, are
bad input (exit code 2). The application's rules come from its rules part (ADR-0050).
"""

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from relayr.cli.helpers import EXIT_PROBLEMS, echo_json, fail, load_settings, run_async

if TYPE_CHECKING:
    from relayr.settings import Settings


@click.group("allowlist")
def allowlist() -> None:
    """Check the operators' allowlist file and explain a rule's permissions."""


@allowlist.command("check")
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def allowlist_check(file: Path | None, as_json: bool) -> None:
    """Validate FILE (default: RELAYR_ALLOWLIST): exit 1 if it has a problem, 0 otherwise.

    Also warns about entries that name no rule the application has, and about rules that get
    turns through a namespace or the default rather than their own entry.
    """
    from relayr.core.allowlist import warnings
    from relayr.core.errors import InvalidAllowlist
    from relayr.runtime.allowlist_file import load_allowlist

    settings = load_settings()
    path = file or settings.allowlist
    try:
        allowlists = load_allowlist(path)
    except InvalidAllowlist as invalid:
        if as_json:
            echo_json({"ok": False, "file": str(path), "problems": _problems(invalid.problems)})
        else:
            for problem in invalid.problems:
                click.echo(f"{path}: {problem}", err=True)
            click.echo(f"{path}: {len(invalid.problems)} problem(s); nothing of it is used")
        sys.exit(EXIT_PROBLEMS)
    found = warnings(allowlists, rule_names(settings))
    summary = (
        f"{path}: ok, {len(allowlists.rules)} rule entr(ies), "
        f"{len(allowlists.namespaces)} namespace entr(ies), {len(allowlists.limits)} limit(s), "
        f"default {'set' if allowlists.default else 'not set'}; {len(found)} warning(s)"
    )
    if as_json:
        echo_json({"ok": True, "file": str(path), "warnings": _problems(found)})
        return
    for problem in found:
        click.echo(f"{path}: warning: {problem}", err=True)
    click.echo(summary)


@allowlist.command("explain")
@click.argument("rule")
@click.option("--file", type=click.Path(path_type=Path), help="Default: RELAYR_ALLOWLIST.")
@click.option("--json", "as_json", is_flag=True, help="Print the grant as one JSON object.")
def allowlist_explain(rule: str, file: Path | None, as_json: bool) -> None:
    """Say what RULE may do, which entry gave each permission, and which limits bind it."""
    from relayr.core.errors import InvalidAllowlist
    from relayr.runtime.allowlist_file import load_allowlist

    path = file or load_settings().allowlist
    try:
        grant = load_allowlist(path).explain(rule)
    except InvalidAllowlist as invalid:
        fail(invalid.message)
    data = grant.to_json()
    if as_json:
        echo_json(data)
        return
    click.echo(f"rule {rule} ({path}):")
    for name, value in data["allowlist"].items():
        source = data["fields"][name]
        given = source["kind"] if source["key"] is None else f"{source['kind']} {source['key']}"
        click.echo(f"  {name:15} = {json.dumps(value):20} from {given}")
    if not grant.limits:
        click.echo("  limits: none")
    for limit in grant.limits:
        line = "" if limit.line is None else f" (line {limit.line})"
        where = ", ".join(limit.workspaces)
        bounds = ", ".join(f"{kind} = {value}" for kind, value in limit.bounds())
        click.echo(f"  limit {limit.key}{line} in {where}: {bounds}")


def rule_names(settings: "Settings") -> list[str]:
    """The names of the application's code rules (from its rules part).

    Raises:
        BadInput: If the application cannot be loaded.
    """

    async def names() -> list[str]:
        from relayr.runtime.application_parts import opened_rules

        async with opened_rules(settings) as rules:
            return sorted(rules.rules)

    return run_async(names())


def _problems(problems: Sequence[Any]) -> list[dict[str, Any]]:
    return [
        {"key": problem.key, "line": problem.line, "message": problem.message}
        for problem in problems
    ]
