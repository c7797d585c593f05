"""relayr's Prometheus metrics: what runs, emissions, refusals and turns did, for every process.

The metrics and their labels are listed in docs/operations.md. A worker calls
:func:`enable_multiprocess` before it imports prometheus_client and forks its pool, so every
pool process writes to the shared directory the ``/metrics`` server merges (ADR-0030); a process
that never enables it keeps its values in memory (:func:`registry`). Recording never fails a
run: a metric that cannot be written is logged and dropped.
"""

import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import structlog

from relayr.settings import export_metrics_directory

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = structlog.get_logger("relayr.metrics")

type MetricsRole = Literal["worker", "dispatcher", "cli"]

UNKNOWN_RULE: Final = "unknown"
"""The ``rule`` label of a run that could not be read (``missing``)."""

ATTEMPT_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Attempts range from a notice (tens of milliseconds) to the soft time limit (300 s)."""

LAG_BUCKETS_S: Final = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600)
"""A handed-on run starts in milliseconds, a polled one within the dispatch interval (1 s); a
lost message is found again after ``requeue_after_s`` (60 s); beyond that is a backlog."""


class _Instruments:
    """The metrics themselves, built once the process knows where values are kept."""

    def __init__(self, registry: "CollectorRegistry | None") -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.runs = Counter(
            "relayr_runs_executed",
            "Runs the executor handled, by rule and outcome.",
            ["rule", "outcome"],
            registry=registry,
        )
        self.attempt_duration = Histogram(
            "relayr_attempt_duration_seconds",
            "How long an attempt that ran its rule's action took.",
            ["rule"],
            buckets=ATTEMPT_BUCKETS_S,
            registry=registry,
        )
        self.dispatch_lag = Histogram(
            "relayr_dispatch_lag_seconds",
            "How long a run waited from becoming due to its attempt starting.",
            buckets=LAG_BUCKETS_S,
            registry=registry,
        )
        self.emissions = Counter(
            "relayr_emissions",
            "Emission records written, by kind and outcome.",
            ["kind", "outcome"],
            registry=registry,
        )
        self.refusals = Counter(
            "relayr_refusals",
            "Writes of rules refused for good, by reason.",
            ["reason"],
            registry=registry,
        )
        self.redelivered = Counter(
            "relayr_runs_redelivered",
            "Task messages for runs delivered again.",
            registry=registry,
        )
        self.enqueued = Counter(
            "relayr_runs_enqueued",
            "Runs enqueued (each run a task message names).",
            registry=registry,
        )
        self.turns_started = Counter(
            "relayr_turns_started",
            "Agent turns that runs started.",
            registry=registry,
        )
        self.runs_limited = Counter(
            "relayr_runs_limited",
            "Runs an operator's limit held back from starting, by rule and limit.",
            ["rule", "limit"],
            registry=registry,
        )
        # set by the dispatchers from the limit store every worker counts in: each dispatcher
        # reads the same counts, so the processes' values agree (the latest is kept)
        self.limit_used = Gauge(
            "relayr_limit_used",
            "What a bound of an operator's limit uses now (slots held, or the window's count).",
            ["limit", "kind"],
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.limit_waiting = Gauge(
            "relayr_limit_waiting",
            "Runs an operator's limit holds back now, by limit and kind.",
            ["limit", "kind"],
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.turns_drained = Counter(
            "relayr_turns_drained",
            "Turns that ended within a stopping worker's grace period.",
            registry=registry,
        )


@dataclass
class _State:
    instruments: _Instruments | None = None
    local: "CollectorRegistry | None" = None
    directory: Path | None = None


_state = _State()
_lock = threading.Lock()


def _instruments() -> _Instruments:
    if _state.instruments is None:
        with _lock:
            if _state.instruments is None:
                from prometheus_client import CollectorRegistry

                _state.local = CollectorRegistry()
                _state.instruments = _Instruments(_state.local)
    return _state.instruments


def _safely(record: Callable[[_Instruments], None]) -> None:
    try:
        record(_instruments())
    except OSError as error:  # a full or vanished metrics directory must not fail a run
        logger.warning("metric not recorded", error=str(error))


def record_run(rule: str | None, outcome: str, duration_s: float | None = None) -> None:
    """Count one executor outcome; ``duration_s`` when the attempt ran the rule's action."""
    label = rule or UNKNOWN_RULE

    def record(metrics: _Instruments) -> None:
        metrics.runs.labels(rule=label, outcome=outcome).inc()
        if duration_s is not None:
            metrics.attempt_duration.labels(rule=label).observe(max(duration_s, 0.0))

    _safely(record)


def record_limited(rule: str, limit: str) -> None:
    """Count one run that a limit (``limits.NAME``'s kind, ``triage/turns_per``) held back."""
    _safely(lambda metrics: metrics.runs_limited.labels(rule=rule, limit=limit).inc())


def record_limits_used(uses: tuple[tuple[str, str, int | None, int], ...]) -> None:
    """Each bound's use now and its waiting runs (a chain's use, per chain, is not a gauge)."""

    def record(metrics: _Instruments) -> None:
        for limit, kind, used, waiting in uses:
            if used is not None:
                metrics.limit_used.labels(limit=limit, kind=kind).set(used)
            metrics.limit_waiting.labels(limit=limit, kind=kind).set(waiting)

    _safely(record)


def record_dispatch_lag(lag_s: float) -> None:
    """Observe how long a run waited from due to started (a negative lag counts as 0)."""
    _safely(lambda metrics: metrics.dispatch_lag.observe(max(lag_s, 0.0)))


def record_emission(kind: str, outcome: str) -> None:
    """Count one emission record by kind (``notice``, ``message``) and outcome."""
    _safely(lambda metrics: metrics.emissions.labels(kind=kind, outcome=outcome).inc())


def record_refusal(reason: str) -> None:
    """Count one refused write of a rule by its stable code (``not_allowed``, ...)."""
    _safely(lambda metrics: metrics.refusals.labels(reason=reason).inc())


def record_redelivery() -> None:
    """Count one task message delivered again."""
    _safely(lambda metrics: metrics.redelivered.inc())


def record_enqueued(count: int = 1) -> None:
    """Count ``count`` runs enqueued (the runs one task message names)."""
    _safely(lambda metrics: metrics.enqueued.inc(count))


def record_turn_started() -> None:
    """Count one agent turn a run started."""
    _safely(lambda metrics: metrics.turns_started.inc())


def record_turns_drained(count: int) -> None:
    """Count the turns that ended within a stopping worker's grace period."""
    if count > 0:
        _safely(lambda metrics: metrics.turns_drained.inc(count))


def metrics_directory(home: Path, role: MetricsRole, pid: int | None = None) -> Path:
    """Where a serving process and its children keep their values: one directory per process.

    Named by role and the serving process's id, so two processes sharing ``RELAYR_HOME`` on one
    host never merge or wipe each other's values.
    """
    return home.absolute() / "metrics" / f"{role}-{os.getpid() if pid is None else pid}"


def enable_multiprocess(directory: Path) -> None:
    """Keep this process's values, and those of processes it forks later, in ``directory``.

    Call it in the process that serves ``/metrics``, before it forks its pool. The directory is
    emptied first: values left by an earlier process of the same name are not this one's.

    Raises:
        RuntimeError: If the process already keeps its values in another directory.
    """
    directory = directory.absolute()
    with _lock:
        if _state.directory == directory:
            return
        if _state.directory is not None:
            raise RuntimeError(f"metrics are already kept in {_state.directory}")
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        export_metrics_directory(directory)
        if "prometheus_client.values" in sys.modules:
            # imported before the variable was set (this process recorded in memory first):
            # prometheus_client chooses its value class again, from the variable, as at import
            from prometheus_client import values

            choose: Any = values.get_value_class  # unannotated in prometheus_client
            values.ValueClass = choose()
        _state.directory = directory
        _state.local = None
        _state.instruments = _Instruments(None)


def registry() -> "CollectorRegistry":
    """What a scrape of this process returns: every process's values when they are in files."""
    _instruments()
    if _state.directory is not None:
        from prometheus_client import CollectorRegistry, multiprocess

        merged = CollectorRegistry()
        collector: Any = multiprocess.MultiProcessCollector  # unannotated in prometheus_client
        collector(merged, path=str(_state.directory))
        return merged
    assert _state.local is not None
    return _state.local


def exposition() -> bytes:
    """The text a scrape returns, in Prometheus's format."""
    from prometheus_client import generate_latest

    return generate_latest(registry())


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it and removes its directory."""

    port: int
    directory: Path | None
    _stop: Callable[[], None]

    def close(self) -> None:
        self._stop()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def start_metrics_server(port: int, directory: Path | None, *, addr: str = "") -> MetricsServer:
    """Serve ``/metrics`` on ``port`` (0: any free port) from a daemon thread of this process.

    Args:
        port: The TCP port; :attr:`MetricsServer.port` is the one bound.
        directory: Where this process and its future children keep values (see
            :func:`metrics_directory`); None keeps them in this process's memory, which is
            right only for a process that runs tasks itself.
        addr: The address to listen on; every interface by default.
    """
    if directory is not None:
        enable_multiprocess(directory)
    from prometheus_client import CollectorRegistry, start_http_server

    class Served(CollectorRegistry):
        """Answers each scrape with :func:`registry`, so values of processes forked later
        count."""

        def collect(self) -> Any:
            return registry().collect()

    server, thread = start_http_server(port, addr=addr, registry=Served())
    bound = int(server.server_address[1])
    logger.info("metrics served", port=bound, directory=str(directory) if directory else None)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return MetricsServer(port=bound, directory=directory, _stop=stop)
