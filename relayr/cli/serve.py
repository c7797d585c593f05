"""The long-running commands: ``relayr worker``, ``relayr dispatch`` and ``relayr run``.

``relayr worker`` is a Celery worker for the run tasks; it exits with code 2 when its allowlist
or application cannot load, which ``relayr run`` reads as "cannot start" (ADR-0033). ``relayr
dispatch`` follows (unless ``--no-follow``), evaluates and enqueues. ``relayr run`` runs the
dispatcher here and a supervised worker subprocess. Heavy imports wait until a command runs.
"""

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import click

from relayr.cli.helpers import (
    EXIT_BAD_INPUT,
    WORKER_STOP_MARGIN_S,
    BadInput,
    concurrency_option,
    in_runtime,
    load_settings,
    reserve_for,
    reserve_option,
)

if TYPE_CHECKING:
    import asyncio

    from relayr.core.run_messages import RunMessage
    from relayr.dispatch.dispatcher import Enqueue
    from relayr.runtime.process import Runtime
    from relayr.settings import Settings

METRICS_ADDRESS: Final = "0.0.0.0"
"""Where ``--metrics-port`` listens: every IPv4 interface, so Prometheus can scrape a pod."""


def metrics_port_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--metrics-port``: where a worker or the dispatcher serves Prometheus metrics
    (:data:`METRICS_ADDRESS`), none by default."""
    return click.option(
        "--metrics-port", type=click.IntRange(min=0, max=65535), default=None, help=help
    )


@click.command()
@concurrency_option("Pool processes: runs executed at once.")
@reserve_option
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
@metrics_port_option("Serve Prometheus metrics of every pool process on this port.")
def worker(
    concurrency: int,
    reserve: int | None,
    loglevel: str,
    hostname: str,
    pool: str,
    metrics_port: int | None,
) -> None:
    """Run a Celery worker for relayr's run tasks (the queue is RELAYR_QUEUE)."""
    settings = load_settings(log_level=None, role=None)  # Celery's signals configure tracing
    check_worker_inputs(settings)
    from relayr.broker.reserve import BEHIND_AT_MOST
    from tasks.app import create_celery

    app = create_celery(settings)
    reserve = reserve_for(settings, reserve) if pool == "prefork" else 0  # solo: one process
    if reserve:
        options = app.conf.broker_transport_options
        app.conf.broker_transport_options = {**options, BEHIND_AT_MOST: concurrency}
    # before the pool forks, so every pool process writes where this process serves from
    server = serve_metrics(metrics_port, settings.home, "worker", per_process=True)
    try:
        app.worker_main(
            [
                "worker",
                f"--queues={settings.queue}",
                f"--concurrency={concurrency + reserve}",
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


def check_worker_inputs(settings: "Settings") -> None:
    """Refuse to start a worker whose allowlist or application cannot be loaded.

    Pool processes load both when they start; without this check a worker would start, and
    every run would fail in its pool processes instead.
    """
    problem = worker_input_problem(settings)
    if problem is not None:
        raise BadInput(problem)


def worker_input_problem(settings: "Settings") -> str | None:
    """What keeps a worker from starting (its allowlist, its application, or tracing on
    without the ``otel`` extra), or None."""
    from relayr.core.errors import RelayrError
    from relayr.runtime.allowlist_file import load_allowlist
    from relayr.runtime.application import load_factory

    try:
        load_allowlist(settings.allowlist)
        load_factory(settings.app)
    except RelayrError as error:
        return error.message
    if settings.tracing:
        try:
            import relayr.observe.otel  # noqa: F401  (the SDK: ADR-0080)
        except ImportError as missing:
            return (
                f"tracing is on (RELAYR_OTEL or OTEL_EXPORTER_OTLP_ENDPOINT) but "
                f"{missing.name} is not installed: pip install 'relayr-bridge[otel]'"
            )
    return None


def serve_metrics(
    port: int | None, home: Path, role: Literal["worker", "dispatcher"], *, per_process: bool
) -> Any:  # a relayr.observe.metrics.MetricsServer, or None without a port
    """Start ``/metrics`` on ``port`` (ADR-0030); ``per_process`` for a worker and its pool."""
    if port is None:
        return None
    from relayr.observe.metrics import metrics_directory, start_metrics_server

    directory = metrics_directory(home, role) if per_process else None
    # every IPv4 interface, as a scrape target must be reachable ("" fails on some hosts)
    return start_metrics_server(port, directory, addr=METRICS_ADDRESS)


async def serve_dispatcher(
    runtime: "Runtime", stop: "asyncio.Event", *, follow: bool = True
) -> None:
    """Run the dispatcher on ``runtime`` until ``stop`` is set, queueing runs on Celery.

    The dispatcher refreshes its heartbeat after each pass that ended, for
    ``relayr health --dispatcher``: a pass stuck on storage stops the beat (ADR-0031). With
    ``follow``, each pass first follows artifactr's logs (ADR-0065).
    """
    from relayr.dispatch.changes import Changes
    from relayr.dispatch.dispatcher import Dispatcher, DispatchPass, Enqueue
    from relayr.observe.health import heartbeat_path, touch_heartbeat

    heartbeat = heartbeat_path(runtime.settings.home, "dispatcher")

    class BeatingDispatcher(Dispatcher):
        async def pass_once(self, enqueue: Enqueue, changes: Changes | None = None) -> DispatchPass:
            done = await super().pass_once(enqueue, changes)
            touch_heartbeat(heartbeat)
            return done

    enqueue = batch_enqueuer(runtime.settings)
    runtime.requeue = enqueue  # runs a turn's end lets go (its limits) are queued at once
    try:
        await BeatingDispatcher(runtime, follow=follow).serve(enqueue, stop)
    finally:
        heartbeat.unlink(missing_ok=True)


def batch_enqueuer(settings: "Settings") -> "Enqueue":
    """Hands a batch of runs to the workers: the dispatcher's enqueue, on Celery.

    Celery's publish blocks its thread: against a broker that is down it retries
    (``task_publish_retry_policy``), and a connection that does not answer holds it until the
    socket's timeout. So it runs in a thread of its own (``asyncio.to_thread``, as ``relayr runs
    retry``'s :func:`relayr.cli.runs.enqueuer` does), and the loop keeps serving what else runs
    on it meanwhile: the followers and their leases, the heartbeat, ``relayr run``'s
    supervisor. The dispatcher awaits each batch before it sends the next, so one thread
    publishes at a time in a pass's order, and one more for what it decides beside a pass
    (ADR-0127); Celery takes its connection and producer
    from kombu's pools (thread-safe queues, which ``relayr runs retry`` already uses from a
    thread), and the thread gets the caller's context (the enqueue's trace, ADR-0080).
    """
    import asyncio

    from tasks.app import create_celery
    from tasks.runs import send_runs

    app = create_celery(settings)
    queue = settings.queue

    async def enqueue(batch: "RunMessage") -> None:
        await asyncio.to_thread(send_runs, app, queue, batch)

    return enqueue


def stop_on_signals(stop: "asyncio.Event") -> None:
    """Set ``stop`` on Ctrl-C or SIGTERM."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)


follow_option = click.option(
    "--follow/--no-follow",
    default=True,
    show_default=True,
    help="Follow artifactr's logs into reflexr at the start of each pass (--no-follow where "
    "relayr follow runs the followers apart).",
)


@click.command()
@metrics_port_option("Serve Prometheus metrics on this port.")
@follow_option
def dispatch(metrics_port: int | None, follow: bool) -> None:
    """Run the dispatcher: evaluate rules, queue due runs for the workers (until Ctrl-C)."""
    settings = load_settings(log_level="INFO", role="dispatcher")

    async def work(runtime: "Runtime") -> None:
        import asyncio

        from relayr.runtime.process import freeze_start_up

        freeze_start_up("dispatcher")
        stop = asyncio.Event()
        stop_on_signals(stop)
        await serve_dispatcher(runtime, stop, follow=follow)

    server = serve_metrics(metrics_port, settings.home, "dispatcher", per_process=False)
    try:
        in_runtime(settings, work, role="dispatcher")
    finally:
        if server is not None:
            server.close()


@click.command()
@concurrency_option("The worker's pool processes.")
@reserve_option
@click.option(
    "--restart-delay",
    "restart_delay_s",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Seconds before a worker that exited is started again; doubles with each exit in a "
    "row.  [default: 1]",
)
@click.option(
    "--restart-delay-max",
    "restart_delay_max_s",
    type=click.FloatRange(min=0.1),
    default=None,
    help="The longest wait between starts of a worker that keeps exiting.  [default: 30]",
)
@follow_option
def run(
    concurrency: int,
    reserve: int | None,
    restart_delay_s: float | None,
    restart_delay_max_s: float | None,
    follow: bool,
) -> None:
    """Run the main job on one machine: the dispatcher here, a worker in a subprocess.

    A worker that exits is started again after a back-off (--restart-delay, doubling up to
    --restart-delay-max, back to the first after a minute up); each exit and start is logged,
    and `relayr health --worker` is unhealthy while it is down. A worker whose settings,
    allowlist or application cannot be loaded is not started again: relayr run stops with one
    line and exit code 2. Ctrl-C or SIGTERM stops the dispatcher, then the worker (warm
    shutdown), and exits 0.
    """
    # the defaults are the supervisor's, imported here: relayr.runtime.supervisor loads asyncio and
    # structlog, which --help must not (the test of this module's help checks the two agree)
    from relayr.runtime.supervisor import RESTART_DELAY_MAX_S, RESTART_DELAY_S

    restart_delay_s = RESTART_DELAY_S if restart_delay_s is None else restart_delay_s
    if restart_delay_max_s is None:
        restart_delay_max_s = RESTART_DELAY_MAX_S
    if restart_delay_max_s < restart_delay_s:
        raise BadInput(
            f"--restart-delay-max {restart_delay_max_s:g} is below --restart-delay "
            f"{restart_delay_s:g}"
        )
    settings = load_settings(log_level="INFO", role="dispatcher")
    check_worker_inputs(settings)
    from relayr.cli.processes import RelayrProcess, relayr_command
    from relayr.observe.health import status_path
    from relayr.runtime.supervisor import RestartPolicy, WorkerSupervisor

    worker_command = relayr_command(
        "worker",
        "--concurrency",
        str(concurrency),
        "--reserve",
        str(reserve_for(settings, reserve)),
    )
    supervisor = WorkerSupervisor(
        lambda: RelayrProcess.start(worker_command, name="relayr worker"),
        status_path(settings.home),
        policy=RestartPolicy(first_s=restart_delay_s, max_s=restart_delay_max_s),
        stop_timeout_s=settings.turn_grace_s + WORKER_STOP_MARGIN_S,
    )
    supervisor.start()
    try:

        async def work(runtime: "Runtime") -> str:
            import asyncio

            from relayr.runtime.process import freeze_start_up

            freeze_start_up("dispatcher")
            stop = asyncio.Event()
            stop_on_signals(stop)
            dispatcher = asyncio.create_task(serve_dispatcher(runtime, stop, follow=follow))
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
