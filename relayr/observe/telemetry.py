"""Traces across the queue: relayr's spans, and the trace each continues (ADR-0080).

Work for one event or one run continues that event's trace (:func:`continuing`); work for
several runs (an evaluation, a message, a group commit) continues their trace when they share
one and otherwise starts its own, linked to each (:func:`joining`). With tracing off every
helper returns at once. This module uses OpenTelemetry's API only (the SDK is
:mod:`relayr.observe.otel`'s). Attributes carry ids, names, counts and outcomes, never content.
"""

import contextlib
from collections.abc import Coroutine, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Final, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Tracer,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from relayr.observe.firing_traces import Evaluation, TracedRun, firings

SCOPE: Final = "relayr"
"""The instrumentation scope of relayr's spans."""

# ─── attribute names: reflexr's where the concept is reflexr's, artifactr's where artifactr's ──

TENANT_ID: Final = "reflexr.tenant.id"
WORKSPACE_ID: Final = "reflexr.workspace.id"
RULE: Final = "reflexr.rule"
RUN_ID: Final = "reflexr.run.id"
ATTEMPT: Final = "reflexr.attempt"
EPOCH: Final = "reflexr.run.epoch"
RUN_STATUS: Final = "reflexr.run.status"
RUN_REASON: Final = "reflexr.run.reason"
EVENT_ID: Final = "reflexr.event.id"
EVENT_SEQ: Final = "reflexr.event.seq"
EVENT_TYPE: Final = "reflexr.event.type"
THREAD_ID: Final = "artifactr.thread.id"
TURN_ID: Final = "artifactr.run.id"
"""The agent turn: artifactr's run id."""
OUTCOME: Final = "relayr.outcome"
"""What executing a run did (``succeeded``, ``contended``, ...), or how a write or turn ended."""
MESSAGE_ID: Final = "relayr.message.id"
"""The id of the artifactr message a run posted (a notice) or sent (a message)."""
EMISSION_KIND: Final = "relayr.emission.kind"
POLICY: Final = "relayr.emission.policy"
RUNS: Final = "relayr.runs"
"""How many runs a message, claim or group commit carries."""
RUN_IDS: Final = "relayr.run.ids"
TASK_ID: Final = "relayr.task.id"
"""The Celery task id, which is the broker message's id."""
FIRINGS: Final = "relayr.firings"
ENVELOPES: Final = "relayr.envelopes"
DEPTH: Final = "relayr.chain.depth"
ARTIFACTR_SEQ: Final = "relayr.artifactr.seq"
"""The seq of an artifactr envelope a follower bridges."""

MAX_LINKS: Final = 32
"""How many traces a span joining several links to at most: a burst evaluated at once may hold
hundreds of events, each its own trace; the first ones show the shape, and each run's own span
still continues its event's trace."""

_W3C: Final = TraceContextTextMapPropagator()

_OFF: Final = contextlib.nullcontext(INVALID_SPAN)
"""What a span helper returns while tracing is off: a context manager that yields a span whose
methods do nothing."""


class _State:
    tracer: Tracer | None = None


_state = _State()


def enable(provider: trace.TracerProvider | None = None) -> None:
    """Turn relayr's spans on in this process, once its providers are configured
    (:func:`relayr.observe.otel.configure` calls it), on the global provider or ``provider`` (a
    test's
    own, which the global one cannot be: OpenTelemetry sets that once per process)."""
    _state.tracer = trace.get_tracer(SCOPE, tracer_provider=provider)


def disable() -> None:
    """Turn relayr's spans off again (tests that enabled them in their own process)."""
    _state.tracer = None


def tracing() -> bool:
    """Whether relayr's spans are on in this process."""
    return _state.tracer is not None


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
) -> contextlib.AbstractContextManager[Span]:
    """A span of relayr's, current in the block, a child of the current span; while tracing
    is off, nothing (a span whose methods do nothing)."""
    tracer = _state.tracer
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name, attributes=attributes, kind=kind)


def joined_span(
    name: str,
    contexts: Iterable[SpanContext | None],
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
) -> contextlib.AbstractContextManager[Span]:
    """A span, current in the block, for work on behalf of what ``contexts`` name: a child of
    their trace when they share one, else the root of a trace of its own linked to each
    (:func:`joining`); with no context, a child of the current span."""
    tracer = _state.tracer
    if tracer is None:
        return _OFF
    parent, links = joining(contexts)
    return tracer.start_as_current_span(
        name, context=parent, kind=kind, attributes=attributes, links=links
    )


def start_span(
    name: str,
    continued: SpanContext | None,
    attributes: Mapping[str, Any] | None = None,
) -> Span | None:
    """Start (and leave to the caller to end) a span for one event's or one run's work: a
    child of the current span when that is in ``continued``'s trace, else a child of
    ``continued`` linked to the current span (:func:`continuing`). None while tracing is off."""
    tracer = _state.tracer
    if tracer is None:
        return None
    parent, links = continuing(continued)
    return tracer.start_span(name, context=parent, attributes=attributes, links=links)


def joining(
    contexts: Iterable[SpanContext | None],
) -> tuple[otel_context.Context | None, list[Link]]:
    """Where a span for several pieces of work begins: ``(parent, links)``.

    With no valid context, nothing is decided (None: the current context is the parent). When
    every context is in one trace, the first is the parent. Otherwise the span starts a trace
    of its own (an empty context), linked to the first :data:`MAX_LINKS` traces.
    """
    valid = [found for found in contexts if found is not None and found.is_valid]
    if not valid:
        return None, []
    if all(found.trace_id == valid[0].trace_id for found in valid):
        return _parent(valid[0]), []
    seen: dict[int, SpanContext] = {}
    for found in valid:
        seen.setdefault(found.trace_id, found)
    return otel_context.Context(), [Link(found) for found in list(seen.values())[:MAX_LINKS]]


def continuing(continued: SpanContext | None) -> tuple[otel_context.Context | None, list[Link]]:
    """Where a span for one event's or one run's work begins: ``(parent, links)``.

    The current span when it is in ``continued``'s trace (or nothing is continued); else
    ``continued`` itself, with a link to the current span (the shared work it was done in).
    """
    current = trace.get_current_span().get_span_context()
    if continued is None or not continued.is_valid:
        return None, []
    if current.is_valid and current.trace_id == continued.trace_id:
        return None, []
    return _parent(continued), [Link(current)] if current.is_valid else []


def _parent(found: SpanContext) -> otel_context.Context:
    return trace.set_span_in_context(NonRecordingSpan(found), otel_context.Context())


@contextlib.contextmanager
def using(span: Span | None) -> Iterator[None]:
    """Make ``span`` current in the block (without ending it); nothing for None."""
    if span is None:
        yield
        return
    with trace.use_span(span, end_on_exit=False):
        yield


async def within[T](span: Span | None, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work`` with ``span`` current (for a task started on its behalf)."""
    with using(span):
        return await work


def end(span: Span | None, attributes: dict[str, AttributeValue] | None = None) -> None:
    """Set ``attributes`` on ``span`` and end it; nothing for None."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    span.end()


def parse_traceparent(traceparent: str | None) -> SpanContext | None:
    """The span context a W3C ``traceparent`` names (an envelope's), or None; None while
    tracing is off, so the hot path parses nothing."""
    if traceparent is None or _state.tracer is None:
        return None
    found = trace.get_current_span(_W3C.extract({"traceparent": traceparent})).get_span_context()
    return found if found.is_valid else None


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, for an envelope relayr appends itself;
    None while tracing is off."""
    if _state.tracer is None:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent")


def current_context() -> SpanContext | None:
    """The current span's context, if tracing is on and there is a valid one."""
    if _state.tracer is None:
        return None
    found = trace.get_current_span().get_span_context()
    return found if found.is_valid else None


class _Envelope(Protocol):
    """What relayr reads of a reflexr or artifactr envelope to continue its trace."""

    @property
    def seq(self) -> int: ...

    @property
    def traceparent(self) -> str | None: ...


def _workspace(tenant_id: str, workspace_id: str) -> dict[str, AttributeValue]:
    return {TENANT_ID: tenant_id, WORKSPACE_ID: workspace_id}


_UNTRACED: Final = Evaluation()


@contextlib.contextmanager
def evaluating(
    tenant_id: str, workspace_id: str, envelopes: Sequence[_Envelope]
) -> Iterator[Evaluation]:
    """A ``relayr.evaluate`` span over the envelopes one evaluation reads: a child of their
    trace when they share one (one event published), else a trace of its own linked to theirs
    (:func:`joining`)."""
    if _state.tracer is None:
        yield _UNTRACED
        return
    events = {
        envelope.seq: found
        for envelope in envelopes
        if (found := parse_traceparent(envelope.traceparent)) is not None
    }
    attributes = {**_workspace(tenant_id, workspace_id), ENVELOPES: len(envelopes)}
    with joined_span("relayr.evaluate", events.values(), attributes) as span:
        evaluation = Evaluation(current_traceparent(), current_context(), events)
        yield evaluation
        span.set_attribute(FIRINGS, evaluation.count)


def enqueuing(
    tenant_id: str, workspace_id: str, run_ids: Sequence[str]
) -> contextlib.AbstractContextManager[Span]:
    """A ``relayr.enqueue`` span around sending one message: in its runs' trace when they
    share one, else a trace of its own linked to each (Celery's producer span is its child,
    and the message's headers carry it)."""
    if _state.tracer is None:
        return _OFF
    attributes = {
        **_workspace(tenant_id, workspace_id),
        RUNS: len(run_ids),
        RUN_IDS: list(run_ids),
    }
    contexts = [firings.take(run_id) for run_id in run_ids]
    return joined_span("relayr.enqueue", contexts, attributes, kind=SpanKind.PRODUCER)


def run_trace_id(run: TracedRun, events: Sequence[_Envelope]) -> str | None:
    """The id of the trace :func:`run_span` starts the run's span in, as hex, for reflexr to
    record on the attempt (``Run.trace_ids``); None while tracing is off, or when the span will
    begin a trace of its own (no traced event, no current span)."""
    if _state.tracer is None:
        return None
    continued = _fired_by(run, events)
    if continued is None or not continued.is_valid:
        continued = trace.get_current_span().get_span_context()
    return trace.format_trace_id(continued.trace_id) if continued.is_valid else None


def run_span(
    tenant_id: str, workspace_id: str, run: TracedRun, rule: str, events: Sequence[_Envelope]
) -> Span | None:
    """Start the span of one run's attempt, ``relayr.run <rule>``: a child of the message's
    span when the message is in the trace of the event that fired the run, else a child of
    that event's span (the envelope's ``traceparent``) linked to the message's (ADR-0080)."""
    if _state.tracer is None:
        return None
    attributes = {
        **_workspace(tenant_id, workspace_id),
        RULE: rule,
        RUN_ID: run.id,
        ATTEMPT: run.attempts,
        EPOCH: run.epoch,
    }
    return start_span(f"relayr.run {rule}", _fired_by(run, events), attributes)


def _fired_by(run: TracedRun, events: Sequence[_Envelope]) -> SpanContext | None:
    """The span of the event that fired ``run`` (its envelope's ``traceparent``), if any."""
    fired = next((e for e in events if e.seq == run.fired_seq), events[-1] if events else None)
    return None if fired is None else parse_traceparent(fired.traceparent)


class _Finished(Protocol):
    """What relayr reads of a run as its attempt ended."""

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str | None: ...


def run_ended(span: Span, outcome: str, run: _Finished | None) -> None:
    """End a run's span with what executing it did and the status it left the run in."""
    attributes: dict[str, AttributeValue] = {OUTCOME: outcome}
    if run is not None:
        attributes[RUN_STATUS] = run.status
        if run.reason is not None:
            attributes[RUN_REASON] = run.reason
    end(span, attributes)


class _Bridged(Protocol):
    """What relayr reads of an artifactr envelope it bridges."""

    @property
    def id(self) -> str: ...

    @property
    def seq(self) -> int: ...

    @property
    def traceparent(self) -> str | None: ...


def bridge_span(
    tenant_id: str, workspace_id: str, envelope: _Bridged, event_type: str
) -> Span | None:
    """Start the span of one artifactr envelope a follower bridges, ``relayr.runtime.bridge``: a
    child of the envelope's trace (artifactr stamps the commit's), so the rules it fires continue
    it. None while tracing is off."""
    if _state.tracer is None:
        return None
    attributes = {
        **_workspace(tenant_id, workspace_id),
        EVENT_ID: envelope.id,
        EVENT_TYPE: event_type,
        ARTIFACTR_SEQ: envelope.seq,
    }
    return start_span("relayr.bridge", parse_traceparent(envelope.traceparent), attributes)


def traceparent_of(span: Span | None) -> str | None:
    """The W3C ``traceparent`` naming ``span``, for the envelope appended on its behalf."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def traced[T](span: Span | None, work: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """``work`` to run with ``span`` current (a task started on its behalf); ``work`` itself
    for None, so an untraced task costs nothing more."""
    return work if span is None else within(span, work)


def annotate(attributes: dict[str, AttributeValue | None]) -> None:
    """Set ``attributes`` (those not None) on the current span, while tracing is on."""
    if _state.tracer is None:
        return
    trace.get_current_span().set_attributes(
        {name: value for name, value in attributes.items() if value is not None}
    )


def add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: the current span's ``trace_id`` and ``span_id``, so a log line
    and its trace join (in hex, as trace viewers show and search them)."""
    found = trace.get_current_span().get_span_context()
    if found.is_valid:
        event.setdefault("trace_id", format(found.trace_id, "032x"))
        event.setdefault("span_id", format(found.span_id, "016x"))
    return event
