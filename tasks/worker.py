"""A worker process's one event loop, and the Celery signals that start and stop it (ADR-0010).

Each pool process owns ONE loop in a background thread, made after the fork
(``worker_process_init``) and holding the process's :class:`relayr.runtime.process.Runtime`. A
task hands its coroutine to it (:meth:`EventLoopThread.call`) and waits; a soft time limit
cancels the coroutine, and a turn a run started keeps running after the task returns. The
runtime starts in the background (the first task waits; a failed start is retried by the next)
and closes on ``worker_process_shutdown``. Each pool process configures its own tracing after the
fork (ADR-0080).
"""

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, Final

import structlog
from celery import signals
from celery.exceptions import Reject

from relayr.core.errors import InvalidTask
from relayr.observe import hooks
from relayr.observe.hooks import TurnsDrained
from relayr.observe.logging import configure_logging
from relayr.runtime.process import Runtime, freeze_start_up
from relayr.settings import Settings

logger = structlog.get_logger("relayr.worker")

CLOSE_MARGIN_S: Final = 10.0
"""Beyond the turns' grace, how long closing the runtime may take (the Runner's cancellations,
ledger close, engine disposal) before the process stops waiting and exits anyway."""

CANCEL_WAIT_S: Final = 5.0
"""How long a task interrupted by its soft time limit waits for its cancelled coroutine to
unwind (release the run's lease, roll back), so the next task does not meet its leftovers."""


class EventLoopThread:
    """An asyncio loop running forever in a daemon thread, fed from other threads."""

    def __init__(self, name: str = "relayr-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit[T](self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coroutine`` on the loop; the returned future is safe to wait on here."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call[T](self, coroutine: Coroutine[Any, Any, T], *, timeout_s: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for its result in this thread.

        If the wait is interrupted (a soft time limit raised in this thread, a timeout), the
        coroutine is cancelled on the loop and given :data:`CANCEL_WAIT_S` to unwind; then the
        interruption is raised.
        """
        future = self.submit(coroutine)
        try:
            return future.result(timeout_s)
        except BaseException:
            if future.cancel():
                concurrent.futures.wait([future], timeout=CANCEL_WAIT_S)
            raise

    def stop(self, timeout_s: float = CANCEL_WAIT_S) -> None:
        """Cancel what still runs on the loop, let it unwind, stop the loop and close it."""
        if not self.running:
            return
        done = self.submit(_cancel_all())
        try:
            done.result(timeout_s)
        except (TimeoutError, concurrent.futures.CancelledError):
            logger.warning("loop tasks did not unwind in time", timeout_s=timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


async def _started(settings: Settings) -> Runtime:
    """This process's runtime, started, with what starting made frozen (ADR-0129)."""
    runtime = await Runtime.start(settings, role="worker")
    freeze_start_up("worker")
    return runtime


async def _cancel_all() -> None:
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


class PoolProcess:
    """This process's loop and runtime; started once per process, after any fork."""

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self._pid: int | None = None
        self._loop: EventLoopThread | None = None
        self._runtime: concurrent.futures.Future[Runtime] | None = None
        self._lock = threading.Lock()

    def configure(self, settings: Settings) -> None:
        """Set the settings this process's runtime will start with (before it starts)."""
        self.settings = settings

    def start(self) -> None:
        """Start the loop and, on it, the runtime, without waiting for the runtime.

        A process forked from one that had started keeps none of its parent's loop: that loop's
        thread does not exist in the child, and its connections belong to the parent.
        """
        with self._lock:
            if self._pid == os.getpid() and self._loop is not None:
                return
            if self.settings is None:
                raise RuntimeError("the worker process was started before it was configured")
            self._pid = os.getpid()
            self._loop = EventLoopThread()
            self._loop.start()
            self._runtime = self._loop.submit(_started(self.settings))
            logger.info("worker process started", pid=self._pid)

    def runtime(self, *, timeout_s: float | None = None) -> Runtime:
        """This process's runtime, waiting for its start; a failed start is tried again."""
        self.start()
        with self._lock:
            assert self._loop is not None
            assert self._runtime is not None
            starting = self._runtime
            if starting.done() and starting.exception() is not None:
                assert self.settings is not None
                starting = self._runtime = self._loop.submit(_started(self.settings))
        return starting.result(timeout_s)

    def call[T](self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on this process's loop and return its result (see EventLoopThread)."""
        self.start()
        assert self._loop is not None
        return self._loop.call(coroutine)

    def stop(self) -> None:
        """Close the runtime on its loop (turns get their grace), then stop the loop."""
        with self._lock:
            loop, starting = self._loop, self._runtime
            if loop is None or self._pid != os.getpid():
                return
            self._loop = self._runtime = None
        grace_s = self.settings.turn_grace_s if self.settings is not None else 0.0
        if starting is not None:
            try:
                runtime = starting.result(grace_s + CLOSE_MARGIN_S)
            except Exception as error:  # a runtime that never started has nothing to close
                logger.warning("worker runtime never started", error=str(error))
            else:
                turns = runtime.bridge.turns.running()
                if turns:
                    logger.info(
                        "letting running turns finish", turns=len(turns), turn_grace_s=grace_s
                    )
                try:
                    loop.call(runtime.aclose(), timeout_s=grace_s + CLOSE_MARGIN_S)
                except Exception:
                    logger.exception("closing the worker runtime failed")
                # the loop is idle now: reading the turns' tasks from this thread is safe
                hooks.emit(TurnsDrained(sum(not turn.task.cancelled() for turn in turns)))
        loop.stop()
        logger.info("worker process stopped", pid=os.getpid())


process: Final = PoolProcess()
"""The one PoolProcess of this process; :func:`tasks.app.create_celery` configures it."""


class _RefusedTaskFilter(logging.Filter):
    """Drops Celery's warning (with a traceback) about a task rejected as malformed: the task
    has logged the one line that names the problem (:class:`relayr.core.errors.InvalidTask`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, Reject) and isinstance(error.reason, InvalidTask))


def _setup_logging(loglevel: int | str | None = None, **_: object) -> None:
    """Take over Celery's logging setup, so the worker logs through structlog."""
    settings = process.settings
    log_format = settings.log_format if settings is not None else "console"
    traced = settings is not None and settings.tracing
    configure_logging(log_format, level=loglevel or "INFO", traced=traced)
    logging.getLogger("celery.app.trace").addFilter(_RefusedTaskFilter())


def _traced(*, lazy: bool) -> None:
    """Configure this process's OpenTelemetry providers, when the settings turn tracing on."""
    settings = process.settings
    if settings is not None and settings.tracing:
        from relayr.observe.otel import configure  # the SDK: only when tracing is on

        configure(settings, "worker", lazy=lazy)


def _flush() -> None:
    settings = process.settings
    if settings is not None and settings.tracing:
        from relayr.observe.otel import flush

        flush()


def _worker_init(**_: object) -> None:
    # the main process: lazily, so a pool process forked from it inherits no exporter
    _traced(lazy=True)


def _after_setup(**_: object) -> None:
    # the main process, its logging set up, before the pool forks: the pool's processes share
    # these pages and never walk these objects
    freeze_start_up("worker main")


def _process_init(**_: object) -> None:
    _traced(lazy=False)
    process.start()


def _process_shutdown(**_: object) -> None:
    process.stop()
    _flush()


def _worker_shutdown(**_: object) -> None:
    # the solo and threads pools run tasks in the main process: its loop stops here
    process.stop()
    _flush()


signals.setup_logging.connect(_setup_logging, weak=False)
signals.worker_init.connect(_worker_init, weak=False)
signals.celeryd_after_setup.connect(_after_setup, weak=False)
signals.worker_process_init.connect(_process_init, weak=False)
signals.worker_process_shutdown.connect(_process_shutdown, weak=False)
signals.worker_shutdown.connect(_worker_shutdown, weak=False)
