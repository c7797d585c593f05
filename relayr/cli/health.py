"""``relayr health``: the probe's command over :mod:`relayr.observe.health`'s checks (ADR-0031).

Exit 0 when healthy, 1 when a check failed (:data:`relayr.cli.helpers.EXIT_UNHEALTHY`), 2 for
bad input. The checks (a Redis client, SQLAlchemy) are imported only when the command runs.
"""

from typing import Any, Literal

import click

from relayr.cli.helpers import EXIT_UNHEALTHY, echo_json, load_settings


@click.command("health")
@click.option(
    "--worker",
    "role",
    flag_value="worker",
    help="Also check the worker's heartbeat (its main loop is turning).",
)
@click.option(
    "--dispatcher",
    "role",
    flag_value="dispatcher",
    help="Also check the dispatcher's heartbeat (its passes are running).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Seconds the broker and the database each get to answer.  [default: 5]",
)
@click.option(
    "--max-age",
    "max_age_s",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds a heartbeat may be old.  [default: 60]",
)
@click.option(
    "--liveness",
    is_flag=True,
    help="Check only the heartbeat, not the broker and database (for liveness probes).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def health(
    role: Literal["worker", "dispatcher"] | None,
    timeout_s: float | None,
    max_age_s: float | None,
    liveness: bool,
    as_json: bool,
) -> None:
    """Exit 0 if alive and the broker and database answer; else print why and exit 1.

    Cheap enough for a probe every 10 s, and answers while the worker is busy: it reads the
    heartbeat file's mtime, PINGs Redis and runs SELECT 1, without asking the worker anything.
    """
    if liveness and role is None:
        raise click.UsageError("--liveness checks a heartbeat: give --worker or --dispatcher")
    settings = load_settings(log_level=None, role=None)  # a probe: never traced
    from relayr.observe.health import check_health

    given: dict[str, Any] = {"timeout_s": timeout_s, "max_age_s": max_age_s}
    report = check_health(
        settings,
        role,
        dependencies=not liveness,
        **{name: value for name, value in given.items() if value is not None},
    )
    if as_json:
        echo_json(report.as_dict())
    else:
        click.echo(report.summary(), err=not report.ok)
    if not report.ok:
        raise SystemExit(EXIT_UNHEALTHY)
