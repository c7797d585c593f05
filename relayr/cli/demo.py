"""``relayr demo``: the example application end to end, on embedded defaults, with a real worker.

In a fresh home of its own it starts a worker subprocess, runs the :mod:`relayr.demo` scenario
with the dispatcher in this process, prints each thread's transcript and a summary, and exits 1
if any count is off. :func:`run_scenario` is the scenario on Celery, for the demo and the tests.
"""

import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import click

from relayr.cli.helpers import (
    EXIT_OK,
    WORKER_STOP_MARGIN_S,
    concurrency_option,
    configure_tracing,
    echo_json,
    run_async,
)

if TYPE_CHECKING:
    import asyncio

    from relayr.demo import Plan
    from relayr.runtime.process import Runtime
    from relayr.settings import Settings

EXIT_COUNTS_OFF: Final = 1
"""``relayr demo``: a count is off (a run did not succeed, a notice is missing or twice...)."""

type Serve = Callable[["Runtime", "asyncio.Event"], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class DemoResult:
    """What :func:`run_scenario` saw: the summary, and each thread's transcript."""

    summary: dict[str, Any]
    transcripts: Mapping[str, Sequence[Any]]


async def run_scenario(
    settings: "Settings",
    plan: "Plan",
    *,
    timeout_s: float,
    serve: Serve | None = None,
    tenant_id: str | None = None,
    workspace_id: str | None = None,
) -> DemoResult:
    """Publish ``plan`` and dispatch in this process until every run and turn ended.

    Workers must be running elsewhere (on the same broker and database). ``serve`` is the
    dispatcher loop, :func:`relayr.cli.serve.serve_dispatcher` by default; tests pass one that
    enqueues every run twice.
    """
    import asyncio

    from relayr import demo
    from relayr.cli.serve import serve_dispatcher
    from relayr.ops.transcript import read_thread
    from relayr.runtime.process import Runtime

    tenant_id = tenant_id or demo.TENANT
    workspace_id = workspace_id or demo.WORKSPACE
    runtime = await Runtime.start(settings, role="dispatcher")
    async with runtime:
        stop = asyncio.Event()
        dispatcher = asyncio.create_task((serve or serve_dispatcher)(runtime, stop))
        try:
            scenario = await demo.publish_scenario(runtime, tenant_id, workspace_id, plan)
            rules = await runtime.application.rules.open(
                tenant_id, workspace_id, actor=demo.DEMO_PUBLISHER
            )
            artifacts = await runtime.application.artifacts.open(
                tenant_id, workspace_id, actor=demo.CLI_USER
            )
            progress, runs_done_s = await demo.wait_until_done(
                rules, artifacts, plan, timeout_s=timeout_s
            )
        finally:
            stop.set()
            await dispatcher
        summary = demo.summarize(plan, progress, runs_done_s)
        transcripts = {
            thread_id: await read_thread(artifacts, thread_id) for thread_id in scenario.threads
        }
    return DemoResult(summary, transcripts)


def print_transcripts(transcripts: Mapping[str, Sequence[Any]]) -> None:
    from relayr.cli.threads import format_entry

    for thread_id, entries in transcripts.items():
        click.echo(f"== thread {thread_id}")
        for entry in entries:
            click.echo(format_entry(entry))
        click.echo("")


def print_summary(summary: dict[str, Any]) -> None:
    click.echo("== summary")
    for name in (
        "runs",
        "runs_succeeded",
        "notices",
        "messages",
        "turns",
        "replies",
        "bridged_events",
        "follow_ups",
        "tool_calls",
    ):
        click.echo(f"{name:>15}: {summary[name]}")
    click.echo(f"{'duplicates':>15}: {summary['duplicates']}")
    click.echo(f"{'runs/s':>15}: {summary['runs_per_s']} ({summary['elapsed_s']} s end to end)")
    if summary["ok"]:
        click.echo("every count is as expected")
    else:
        for problem in summary["problems"]:
            click.echo(f"OFF: {problem}")


def run_demo(*, runs: int, concurrency: int, timeout_s: float, as_json: bool) -> int:
    """``relayr demo``: returns the exit code (0 when every count is as expected)."""
    from relayr import demo
    from relayr.cli.processes import RelayrProcess, relayr_command
    from relayr.observe.logging import configure_logging
    from relayr.settings import Settings, child_environment

    home = demo.demo_home()
    home.mkdir(parents=True, exist_ok=True)
    environment = demo.demo_environment(home)
    # the worker's environment: the demo's settings, and the caller's tracing (OTEL_*), so a
    # traced demo exports its publish, evaluation and enqueue as well as the worker's runs
    settings = Settings.from_env(child_environment(environment))
    if settings.tracing:
        configure_tracing(settings, "demo")
    configure_logging(settings.log_format, level="WARNING")
    plan = demo.Plan.of(runs)
    log_path = home / "worker.log"
    if not as_json:
        click.echo(
            f"demo: {plan.deploys} deploy:finished + {plan.incidents} incident:opened events, "
            f"a worker of {concurrency} processes; home {home} (worker log: {log_path})"
        )
    worker = RelayrProcess.start(
        relayr_command("worker", "--concurrency", str(concurrency)),
        name="the demo's worker",
        environment=child_environment(environment),
        log_path=log_path,
    )
    try:
        result = run_async(run_scenario(settings, plan, timeout_s=timeout_s))
    finally:
        worker.stop(settings.turn_grace_s + WORKER_STOP_MARGIN_S)
    summary = {**result.summary, "home": str(home)}
    if as_json:
        echo_json(summary)
    else:
        print_transcripts(result.transcripts)
        print_summary(summary)
    return EXIT_OK if summary["ok"] else EXIT_COUNTS_OFF


@click.command()
@click.option(
    "--runs",
    "runs",
    type=click.IntRange(min=2),
    default=12,
    show_default=True,
    help="How many events to publish (a quarter are incidents, the rest deploys).",
)
@concurrency_option("The worker's pool processes.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=180.0,
    show_default=True,
    help="Seconds to wait for every run and turn to end.",
)
@click.option("--json", "as_json", is_flag=True, help="Print only the summary, as one JSON line.")
def demo(runs: int, concurrency: int, timeout_s: float, as_json: bool) -> None:
    """Run the example application end to end with a real worker, then check the counts."""
    sys.exit(run_demo(runs=runs, concurrency=concurrency, timeout_s=timeout_s, as_json=as_json))
