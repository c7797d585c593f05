"""The ``relayr`` command: run the worker and the dispatcher, and try rules by hand.

Every command reads the settings once from ``RELAYR_*`` (:class:`relayr.settings.Settings`), and
commands that print data take ``--json``. Bad input (a malformed ``TENANT/WORKSPACE``, data that
is not a JSON object, an unknown event type, invalid settings, allowlist or application) stops
the command before it writes anything, with one line naming what is wrong and exit code 2.

- ``relayr worker``: a Celery worker for relayr's run tasks (prefork: one event loop per pool
  process, see :mod:`tasks.worker`).
- ``relayr dispatch``: the dispatcher: evaluates rules and queues each due run once per attempt.
- ``relayr run``: both on one machine: the dispatcher here and a worker in a subprocess, started
  again when it exits (:mod:`relayr.supervisor`).
- ``relayr publish``, ``relayr thread create``, ``relayr thread show``: publish an event, open a
  thread, read what the rules and the agent wrote in it.
- ``relayr demo``: the example application end to end, with a summary that checks the counts.
- ``relayr allowlist``, ``relayr runs`` (:mod:`relayr.ops_cli`), ``relayr health``
  (:mod:`relayr.health`): the operators' commands.

Commands import what they need when they run: ``relayr health`` runs as a probe every few
seconds and must not pay for loading both libraries and the application (ADR-0031).
"""

import asyncio
import importlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, Literal, NoReturn

import click

from relayr.errors import RelayrError
from relayr.logging import configure_logging
from relayr.settings import Settings
from relayr.supervisor import (
    RESTART_DELAY_MAX_S,
    RESTART_DELAY_S,
    RestartPolicy,
    WorkerSupervisor,
    status_path,
)

if TYPE_CHECKING:
    from artifactr import UserActor as ArtifactUserActor
    from artifactr import Workspace as ArtifactWorkspace
    from reflexr import SourceActor

    from relayr.runtime import Role, Runtime

EXIT_BAD_INPUT: Final = 2

ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
"""What a tenant, workspace, thread or event id typed on the command line may look like: it
keeps shell accidents (spaces, slashes, empty parts) out of the store."""

METRICS_ADDRESS: Final = "0.0.0.0"
"""Where ``--metrics-port`` listens: every IPv4 interface, so Prometheus can scrape a pod."""

OPERATOR_COMMANDS: Final = {
    "allowlist": "relayr.ops_cli:allowlist_group",
    "runs": "relayr.ops_cli:runs_group",
    "health": "relayr.health:health_command",
}
"""Commands defined in other modules, loaded when they are called (or listed by --help)."""

WORKER_STOP_MARGIN_S: Final = 15.0
"""Beyond the turns' grace, how long a stopping worker subprocess may take before it is
killed (its pool processes close their runtimes one after the other)."""


class BadInput(click.ClickException):
    """Raised when a command's input or settings cannot be used: one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True)
class ThreadEntry:
    """One message of a thread, as ``relayr thread show`` prints it."""

    id: str
    kind: str
    author: str
    content: str
    seq: int


def parse_where(value: str) -> tuple[str, str]:
    """Split ``TENANT/WORKSPACE``; raise :class:`BadInput` naming the problem."""
    tenant, slash, workspace = value.partition("/")
    if not slash or not ID_PATTERN.fullmatch(tenant) or not ID_PATTERN.fullmatch(workspace):
        raise BadInput(
            f"TENANT/WORKSPACE {value!r} is malformed: expected two ids joined by '/', "
            "such as acme/ops (letters, digits and . _ : @ -)"
        )
    return tenant, workspace


def parse_id(kind: str, value: str) -> str:
    if not ID_PATTERN.fullmatch(value):
        raise BadInput(f"{kind} {value!r} is malformed: letters, digits and . _ : @ - only")
    return value


def parse_data(value: str) -> dict[str, Any]:
    """Read ``--data`` as a JSON object; raise :class:`BadInput` naming the problem."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as error:
        raise BadInput(f"--data is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadInput(f"--data must be a JSON object, not {type(data).__name__}")
    if "type" in data:
        raise BadInput("--data must not contain 'type': the event type is the EVENT_TYPE argument")
    return data


def describe(errors: list[Any]) -> str:
    """Pydantic's validation errors as one line: ``status: Field required; ...``."""
    problems = []
    for error in errors:
        if isinstance(error, dict):
            where = ".".join(str(part) for part in error.get("loc", ())) or "event"
            problems.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(problems)


def publisher() -> "SourceActor":
    """Who publishes events from the command line, as reflexr records it."""
    from reflexr import SourceActor

    return SourceActor(name="relayr-cli")


def cli_user() -> "ArtifactUserActor":
    """Who creates threads and reads them from the command line, as artifactr records it."""
    from artifactr import UserActor

    return UserActor(id="relayr-cli", name="relayr CLI")


def load_settings() -> Settings:
    """Read the settings; invalid ones stop the command with exit code 2."""
    try:
        return Settings.from_env()
    except RelayrError as error:
        raise BadInput(error.message) from None


def in_runtime[T](
    settings: Settings, work: Callable[["Runtime"], Awaitable[T]], *, role: "Role" = "cli"
) -> T:
    """Run ``work`` on a runtime of this process, in this process's one loop, then close it."""
    from relayr.runtime import Runtime

    async def main() -> T:
        try:
            runtime = await Runtime.start(settings, role=role)
        except RelayrError as error:
            raise BadInput(error.message) from None
        async with runtime:
            return await work(runtime)

    return asyncio.run(main())


async def read_thread(workspace: "ArtifactWorkspace", thread_id: str) -> list[ThreadEntry]:
    """Every message of a thread, in order: people's, the rules' and the agent's."""
    from artifactr.core import MessagePosted

    entries = []
    for envelope in await workspace.read(threads={thread_id}):
        event = envelope.event
        if isinstance(event, MessagePosted) and event.thread_id == thread_id:
            entries.append(
                ThreadEntry(
                    id=event.message_id,
                    kind=event.kind,
                    author=envelope.actor.participant,
                    content=event.content,
                    seq=envelope.seq,
                )
            )
    return entries


def format_entry(entry: ThreadEntry) -> str:
    marker = "[notice]" if entry.kind == "notice" else "[message]"
    content = entry.content.replace("\n", "\n    ")
    return f"#{entry.seq} {marker} {entry.author} ({entry.id})\n    {content}"


def echo_json(value: object) -> None:
    click.echo(json.dumps(value, ensure_ascii=False))


class WorkerProcessHandle:
    """A ``relayr worker`` subprocess, in a session of its own so it can be stopped whole."""

    def __init__(
        self,
        *,
        concurrency: int,
        loglevel: str = "INFO",
        environment: Mapping[str, str] | None = None,
        output: IO[Any] | None = None,
    ) -> None:
        command = [
            sys.executable,
            "-m",
            "relayr.cli",
            "worker",
            "--concurrency",
            str(concurrency),
            "--loglevel",
            loglevel,
        ]
        self.process = subprocess.Popen(
            command,
            env=dict(environment) if environment is not None else None,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        return self.process.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def stop(self, timeout_s: float) -> int:
        """Warm shutdown (SIGTERM): running tasks finish, turns get their grace; then SIGKILL."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


def fail(message: str) -> NoReturn:
    raise BadInput(message)


class Commands(click.Group):
    """relayr's commands: its own, and :data:`OPERATOR_COMMANDS` loaded when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *OPERATOR_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        reference = OPERATOR_COMMANDS.get(cmd_name)
        if reference is None:
            return super().get_command(ctx, cmd_name)
        module, _, name = reference.partition(":")
        command = getattr(importlib.import_module(module), name)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """relayr: reflexr rules run on Celery workers and act in artifactr threads.

    Settings come from RELAYR_* environment variables; with none set, everything is embedded
    under .relayr/ (SQLite, and a broker in folders), and no server is needed.
    """


@cli.command()
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Pool processes: runs executed at once.",
)
@click.option(
    "--loglevel",
    "-l",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option(
    "--hostname",
    "-n",
    default="relayr@%h",
    show_default=True,
    help="The worker's node name (Celery's %h is this host).",
)
@click.option(
    "--pool",
    "-P",
    default="prefork",
    show_default=True,
    type=click.Choice(["prefork", "solo"]),
    help="prefork in production: time limits only work there.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="Serve Prometheus metrics of every pool process on this port.",
)
def worker(
    concurrency: int, loglevel: str, hostname: str, pool: str, metrics_port: int | None
) -> None:
    """Run a Celery worker for relayr's run tasks (the queue is RELAYR_QUEUE)."""
    settings = load_settings()
    check_worker_inputs(settings)
    from tasks.app import create_celery

    app = create_celery(settings)
    # before the pool forks, so every pool process writes where this process serves from
    server = serve_metrics(metrics_port, settings.home, "worker", per_process=True)
    try:
        app.worker_main(
            [
                "worker",
                f"--queues={settings.queue}",
                f"--concurrency={concurrency}",
                f"--loglevel={loglevel.upper()}",
                f"--hostname={hostname}",
                f"--pool={pool}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    finally:
        if server is not None:
            server.close()


def check_worker_inputs(settings: Settings) -> None:
    """Refuse to start a worker whose allowlist or application cannot be loaded.

    Pool processes load both when they start; without this check a worker would start, and
    every run would fail in its pool processes instead.
    """
    problem = worker_input_problem(settings)
    if problem is not None:
        raise BadInput(problem)


def worker_input_problem(settings: Settings) -> str | None:
    """What keeps a worker from starting (its allowlist or application), or None."""
    from relayr.allowlist import load_allowlist
    from relayr.application import load_factory

    try:
        load_allowlist(settings.allowlist)
        load_factory(settings.app)
    except RelayrError as error:
        return error.message
    return None


def serve_metrics(
    port: int | None, home: Path, role: Literal["worker", "dispatcher"], *, per_process: bool
) -> Any:  # a relayr.metrics.MetricsServer, or None without a port
    """Start ``/metrics`` on ``port`` (ADR-0030); ``per_process`` for a worker and its pool."""
    if port is None:
        return None
    from relayr.metrics import metrics_directory, start_metrics_server

    directory = metrics_directory(home, role) if per_process else None
    # every IPv4 interface, as a scrape target must be reachable ("" fails on some hosts)
    return start_metrics_server(port, directory, addr=METRICS_ADDRESS)


async def serve_dispatcher(runtime: "Runtime", stop: asyncio.Event) -> None:
    """Run the dispatcher on ``runtime`` until ``stop`` is set, queueing runs on Celery.

    The dispatcher refreshes its heartbeat after each pass that ended, for
    ``relayr health --dispatcher``: a pass stuck on storage stops the beat (ADR-0031).
    """
    from relayr.batch import RunBatch
    from relayr.dispatch import Dispatcher, DispatchPass, Enqueue
    from relayr.health import heartbeat_path, touch_heartbeat
    from tasks.app import create_celery
    from tasks.runs import send_runs

    heartbeat = heartbeat_path(runtime.settings.home, "dispatcher")

    class BeatingDispatcher(Dispatcher):
        async def pass_once(self, enqueue: Enqueue) -> DispatchPass:
            done = await super().pass_once(enqueue)
            touch_heartbeat(heartbeat)
            return done

    app = create_celery(runtime.settings)
    queue = runtime.settings.queue

    async def enqueue(batch: RunBatch) -> None:
        send_runs(app, queue, batch)

    try:
        await BeatingDispatcher(runtime).serve(enqueue, stop)
    finally:
        heartbeat.unlink(missing_ok=True)


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)


@cli.command()
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port.",
)
def dispatch(metrics_port: int | None) -> None:
    """Run the dispatcher: evaluate rules, queue due runs for the workers (until Ctrl-C)."""
    settings = load_settings()
    configure_logging(settings.log_format)

    async def work(runtime: "Runtime") -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        await serve_dispatcher(runtime, stop)

    server = serve_metrics(metrics_port, settings.home, "dispatcher", per_process=False)
    try:
        in_runtime(settings, work, role="dispatcher")
    finally:
        if server is not None:
            server.close()


@cli.command()
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="The worker's pool processes.",
)
@click.option(
    "--restart-delay",
    "restart_delay_s",
    type=click.FloatRange(min=0.1),
    default=RESTART_DELAY_S,
    show_default=True,
    help="Seconds before a worker that exited is started again; doubles with each exit in a row.",
)
@click.option(
    "--restart-delay-max",
    "restart_delay_max_s",
    type=click.FloatRange(min=0.1),
    default=RESTART_DELAY_MAX_S,
    show_default=True,
    help="The longest wait between starts of a worker that keeps exiting.",
)
def run(concurrency: int, restart_delay_s: float, restart_delay_max_s: float) -> None:
    """Run the main job on one machine: the dispatcher here, a worker in a subprocess.

    A worker that exits is started again after a back-off (--restart-delay, doubling up to
    --restart-delay-max, back to the first after a minute up); each exit and start is logged,
    and `relayr health --worker` is unhealthy while it is down. A worker whose settings,
    allowlist or application cannot be loaded is not started again: relayr run stops with one
    line and exit code 2. Ctrl-C or SIGTERM stops the dispatcher, then the worker (warm
    shutdown), and exits 0.
    """
    if restart_delay_max_s < restart_delay_s:
        raise BadInput(
            f"--restart-delay-max {restart_delay_max_s:g} is below --restart-delay "
            f"{restart_delay_s:g}"
        )
    settings = load_settings()
    check_worker_inputs(settings)
    configure_logging(settings.log_format)
    supervisor = WorkerSupervisor(
        lambda: WorkerProcessHandle(concurrency=concurrency),
        status_path(settings.home),
        policy=RestartPolicy(first_s=restart_delay_s, max_s=restart_delay_max_s),
        stop_timeout_s=settings.turn_grace_s + WORKER_STOP_MARGIN_S,
    )
    supervisor.start()
    try:

        async def work(runtime: "Runtime") -> str:
            stop = asyncio.Event()
            stop_on_signals(stop)
            dispatcher = asyncio.create_task(serve_dispatcher(runtime, stop))
            try:
                return await supervisor.supervise(stop, alongside=dispatcher)
            finally:
                stop.set()
                await dispatcher

        supervised = in_runtime(settings, work, role="dispatcher")
    finally:
        supervisor.stop()
    if supervised == "cannot_start":
        problem = worker_input_problem(settings) or (
            f"it exited with code {EXIT_BAD_INPUT}, bad input (its error is above)"
        )
        raise BadInput(f"the worker cannot start, so relayr run stops: {problem}")


@cli.command()
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.argument("event_type")
@click.option(
    "--data",
    "data_text",
    default="{}",
    show_default=True,
    help="The event's fields, as a JSON object.",
)
@click.option(
    "--id",
    "event_id",
    default=None,
    help="The event's id: publishing an id again adds nothing (idempotent).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def publish(
    where: str, event_type: str, data_text: str, event_id: str | None, as_json: bool
) -> None:
    """Publish an event into a workspace's log; the dispatcher evaluates the rules on it.

    Example: relayr publish acme/ops deploy:finished --data '{"service": "api",
    "status": "succeeded", "thread_id": "thr_..."}'
    """
    tenant, workspace = parse_where(where)
    data = parse_data(data_text)
    if event_id is not None:
        parse_id("--id", event_id)
    settings = load_settings()
    configure_logging(settings.log_format, level="WARNING")

    from reflexr.core import Forbidden, NotFound, UnknownEvent, ValidationFailed, load_event

    async def work(runtime: "Runtime") -> dict[str, Any]:
        try:
            event = load_event({"type": event_type, **data})
        except ValidationFailed as invalid:
            fail(f"invalid {event_type} event: {describe(invalid.errors) or invalid.message}")
        if isinstance(event, UnknownEvent):
            fail(f"unknown event type {event_type!r}")
        handle = await runtime.application.rules.open(tenant, workspace, actor=publisher())
        try:
            published = await handle.publish(event, id=event_id)
        except NotFound:
            fail(f"event type {event_type!r} is not one this application accepts")
        except Forbidden as refused:
            fail(f"event type {event_type!r} cannot be published: {refused.message}")
        envelope = published.envelope
        return {
            "id": envelope.id,
            "seq": envelope.seq,
            "type": event_type,
            "duplicate": published.duplicate,
        }

    result = in_runtime(settings, work)
    if as_json:
        echo_json(result)
    else:
        again = " (already published: nothing added)" if result["duplicate"] else ""
        click.echo(f"published {event_type} {result['id']} at seq {result['seq']}{again}")


@cli.group()
def thread() -> None:
    """Create artifactr threads and read them."""


@thread.command("create")
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.option("--title", required=True, help="The thread's title.")
@click.option("--json", "as_json", is_flag=True, help='Print {"id": ...}.')
def thread_create(where: str, title: str, as_json: bool) -> None:
    """Create a thread and print its id."""
    tenant, workspace = parse_where(where)
    settings = load_settings()
    configure_logging(settings.log_format, level="WARNING")

    async def work(runtime: "Runtime") -> str:
        handle = await runtime.application.artifacts.open(tenant, workspace, actor=cli_user())
        return (await handle.create_thread(title)).id

    thread_id = in_runtime(settings, work)
    if as_json:
        echo_json({"id": thread_id})
    else:
        click.echo(thread_id)


@thread.command("show")
@click.argument("where", metavar="TENANT/WORKSPACE")
@click.argument("thread_id", metavar="THREAD")
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list of {id, kind, author, content, seq}."
)
def thread_show(where: str, thread_id: str, as_json: bool) -> None:
    """Print every message of a thread: notices, messages and the agent's replies."""
    tenant, workspace = parse_where(where)
    parse_id("THREAD", thread_id)
    settings = load_settings()
    configure_logging(settings.log_format, level="WARNING")

    from artifactr.core import NotFound as ArtifactNotFound

    async def work(runtime: "Runtime") -> list[ThreadEntry]:
        handle = await runtime.application.artifacts.open(tenant, workspace, actor=cli_user())
        try:
            await handle.thread(thread_id)
        except ArtifactNotFound:
            fail(f"thread {thread_id} does not exist in {tenant}/{workspace}")
        return await read_thread(handle, thread_id)

    entries = in_runtime(settings, work)
    if as_json:
        echo_json([asdict(entry) for entry in entries])
    else:
        for entry in entries:
            click.echo(format_entry(entry))


@cli.command()
@click.option(
    "--runs",
    "runs",
    type=click.IntRange(min=2),
    default=12,
    show_default=True,
    help="How many events to publish (a quarter are incidents, the rest deploys).",
)
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="The worker's pool processes.",
)
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
    from relayr.demo import run_demo

    sys.exit(run_demo(runs=runs, concurrency=concurrency, timeout_s=timeout_s, as_json=as_json))


def main() -> None:
    """The console script ``relayr``."""
    cli(prog_name="relayr")


if __name__ == "__main__":
    main()
