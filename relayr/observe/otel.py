"""OpenTelemetry's SDK in a relayr process: providers, OTLP export, Celery's instrumentation and
the ``relayr.turn`` span that follows an agent turn to its end (ADR-0080).

The one module that imports the SDK (an import-linter contract), imported only when the settings
turn tracing on. :func:`configure` builds the providers of the process it runs in (the CLI, the
dispatcher, each pool process in ``worker_process_init``); a worker's main process configures
lazily, so its forked children inherit nothing. :func:`instrument_celery` carries the trace
context in each message's headers; :func:`turn_context` opens the turn's span; :func:`flush`
exports what is left when a process ends.
"""

import asyncio
import atexit
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, Final

import structlog
from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import Meter, MeterProvider, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, SpanContext, Tracer, TracerProvider
from opentelemetry.util.types import Attributes

from relayr.ledger.port import Ledger, WorkspaceKey
from relayr.ledger.turns import turn_cause
from relayr.observe import telemetry
from relayr.settings import Settings

if TYPE_CHECKING:  # artifactr is the worker's: a traced `relayr publish` loads none (ADR-0050)
    from artifactr.agent import Session

type Role = str
"""What a process is: ``worker``, ``dispatcher`` or ``cli`` (the runtime's roles)."""

SERVICE_NAMES: Final = {
    "worker": "relayr-worker",
    "dispatcher": "relayr-dispatcher",
    "cli": "relayr-cli",
    "demo": "relayr-demo",
}
"""The resource's ``service.name`` by role, unless ``OTEL_SERVICE_NAME`` names one."""

EXPORT_TIMEOUT_S: Final = 5.0
"""How long one export may take, retries included, in a long-running process (its exports run
in the background); the SDK's default is 10 s."""

FLUSH_TIMEOUT_S: Final = 5.0
"""How long a pool process that stops waits for its last spans to be exported."""

EXIT_FLUSH_S: Final = 2.0
"""How long a process that exits waits, spans first, then metrics, for its last exports; also
how long a command's one export may take, retries included. So a command run in a loop while
the collector is down stays quick: with the SDK's own exit hook and timeouts, `relayr publish`
took 8 s more, measured."""

METRIC_INTERVAL_S: Final = 15.0
"""How often metrics are exported: often enough that a short process (a demo, a test) is seen,
rarely enough to cost nothing (the SDK's default is 60 s)."""

logger = structlog.get_logger("relayr.otel")


class _Process:
    """This process's SDK providers and what it configured them with."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: Settings | None = None
        self.role: Role = "cli"
        self.pid: int | None = None
        self.tracer_provider: SdkTracerProvider | None = None
        self.meter_provider: SdkMeterProvider | None = None
        self.installed = False

    def providers(self) -> tuple[SdkTracerProvider, SdkMeterProvider]:
        """The SDK providers of the process calling, built now if this process has none."""
        pid = os.getpid()
        if self.pid != pid or self.tracer_provider is None or self.meter_provider is None:
            with self.lock:
                if self.pid != pid or self.tracer_provider is None:
                    self._build(pid)
        assert self.tracer_provider is not None
        assert self.meter_provider is not None
        return self.tracer_provider, self.meter_provider

    def _build(self, pid: int) -> None:
        settings = self.settings
        assert settings is not None, "relayr.observe.otel.configure comes first"
        name = settings.otel_service_name or SERVICE_NAMES.get(self.role, "relayr")
        resource = Resource(
            {
                "service.name": name,
                "service.version": version("relayr-bridge"),
                "process.pid": pid,
            }
        )
        endpoint = settings.otlp_endpoint
        timeout_s = EXIT_FLUSH_S if self.role == "cli" else EXPORT_TIMEOUT_S
        tracer_provider = SdkTracerProvider(resource=resource, shutdown_on_exit=False)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=timeout_s)
            )
        )
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics", timeout=timeout_s),
            export_interval_millis=METRIC_INTERVAL_S * 1000,
            export_timeout_millis=timeout_s * 1000,
        )
        meter_provider = SdkMeterProvider(
            resource=resource, metric_readers=[reader], shutdown_on_exit=False
        )
        self.tracer_provider, self.meter_provider, self.pid = tracer_provider, meter_provider, pid
        atexit.register(flush, EXIT_FLUSH_S)


_process = _Process()


class ProcessTracerProvider(TracerProvider):
    """The global tracer provider relayr sets: each process's spans go to the SDK provider
    built in that process, whoever asked for the tracer and wherever (a tracer obtained
    before a fork, such as Celery's instrumentation's, included)."""

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> Tracer:
        return _ProcessTracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )


class _ProcessTracer(Tracer):
    """A tracer that starts each span with this process's SDK tracer."""

    def __init__(
        self, name: str, release: str | None, schema_url: str | None, attributes: Attributes
    ) -> None:
        self._scope = (name, release, schema_url, attributes)
        self._pid: int | None = None
        self._tracer: Tracer | None = None

    def _here(self) -> Tracer:
        if self._pid != os.getpid() or self._tracer is None:
            provider, _ = _process.providers()
            self._tracer, self._pid = provider.get_tracer(*self._scope), os.getpid()
        return self._tracer

    def start_span(self, *args: Any, **kwargs: Any) -> Span:
        return self._here().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._here().start_as_current_span(*args, **kwargs)


class ProcessMeterProvider(MeterProvider):
    """The global meter provider relayr sets: a meter comes from the SDK provider of the
    process that asks for it (the libraries ask when an application is built, in the process
    that runs it)."""

    def get_meter(
        self,
        name: str,
        version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> Meter:
        _, provider = _process.providers()
        return provider.get_meter(name, version, schema_url, attributes)


def configure(settings: Settings, role: Role, *, lazy: bool = False) -> None:
    """Configure this process's providers for ``role``, once per process (ADR-0080).

    Sets relayr's global providers (once: the first process of a tree sets them, children
    inherit them) and builds this process's SDK providers now, or, with ``lazy``, when the
    process first records (a worker's main process, whose pool processes are forked from it).
    Then relayr's own spans are on (:func:`relayr.observe.telemetry.enable`).
    """
    with _process.lock:
        _process.settings, _process.role = settings, role
        if not _process.installed:
            trace.set_tracer_provider(ProcessTracerProvider())
            metrics.set_meter_provider(ProcessMeterProvider())
            _process.installed = True
    if not isinstance(trace.get_tracer_provider(), ProcessTracerProvider):
        logger.warning("a tracer provider was set before relayr's: relayr's spans go to it")
    if not lazy:
        _process.providers()
    telemetry.enable()


def instrument_celery() -> None:
    """Carry the trace context in Celery's messages (producer and consumer spans), once per
    process tree: a pool process inherits its parent's instrumentation, whose spans go to the
    pool process's own providers (:class:`ProcessTracerProvider`)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(meter_provider=NoOpMeterProvider())


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Export what this process's providers hold, spans first, within ``timeout_s`` in all (at
    exit; and a pool process that stops, which billiard ends without the exit hooks). What
    cannot be exported in time is dropped, and the SDK logs it."""
    if _process.pid != os.getpid():
        return  # a hook inherited across a fork: the parent's providers are not this process's
    deadline = time.monotonic() + timeout_s
    if _process.tracer_provider is not None:
        _process.tracer_provider.force_flush(int(timeout_s * 1000))
    left_ms = int(max(deadline - time.monotonic(), 0) * 1000)
    if _process.meter_provider is not None and left_ms > 0:
        try:
            _process.meter_provider.force_flush(left_ms)
        except Exception:  # the SDK raises what its readers could not export in time
            logger.warning("metrics could not be exported before the process ended")


type TurnContext = Callable[["Session[Any]"], AbstractAsyncContextManager[None]]


def turn_context(ledger: Ledger) -> TurnContext:
    """artifactr's ``turn_context``: a ``relayr.turn`` span in the trace of the run that sent
    the turn's message, from the turn's start to its end.

    The run is the ledger's cause of the newest message the turn carries out that a run posted
    (:func:`relayr.ledger.turns.turn_cause`, ADR-0026); a turn no run caused gets no span. Its
    parent is what artifactr linked the turn to: the span that sent the message (a send's), or where
    the message was committed (a turn started by recovery or a hand-over), both in the run's trace.
    The span links to the turn's own trace, whose spans stay artifactr's.
    """

    @asynccontextmanager
    async def traced(session: "Session[Any]") -> AsyncIterator[None]:
        span = await _turn_span(ledger, session)
        if span is None:
            yield
            return
        outcome = "failed"
        try:
            yield
            outcome = "completed"
        except BaseException as error:
            outcome = "stopped" if _cancelled(error) else "failed"
            raise
        finally:
            telemetry.end(span, {telemetry.OUTCOME: outcome})

    return traced


async def _turn_span(ledger: Ledger, session: "Session[Any]") -> Span | None:
    turn = trace.get_current_span()
    handle = session.workspace
    key = WorkspaceKey(handle.tenant_id, handle.workspace_id)
    try:
        cause = await turn_cause(ledger, key, session.message_ids)
    except Exception:  # the turn goes on untraced by relayr: its own trace is artifactr's
        logger.warning("the cause of a turn could not be read", turn_id=session.run_id)
        return None
    links = turn.links if isinstance(turn, ReadableSpan) else ()
    sender = next((link.context for link in links if link.context.is_valid), None)
    if cause is None or sender is None:
        return None
    attributes: dict[str, Any] = {
        telemetry.TENANT_ID: key.tenant_id,
        telemetry.WORKSPACE_ID: key.workspace_id,
        telemetry.THREAD_ID: session.thread_id,
        telemetry.TURN_ID: session.run_id,
        telemetry.RUN_ID: cause.run_id,
        telemetry.DEPTH: cause.depth,
    }
    return _started("relayr.turn", sender, turn.get_span_context(), attributes)


def _started(
    name: str, parent: SpanContext, linked: SpanContext, attributes: dict[str, Any]
) -> Span:
    tracer = trace.get_tracer(telemetry.SCOPE)
    links = [Link(linked)] if linked.is_valid else []
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    return tracer.start_span(name, context=context, attributes=attributes, links=links)


def _cancelled(error: BaseException) -> bool:
    return isinstance(error, asyncio.CancelledError)
