"""Which trace relayr's spans continue (ADR-0080), decided without processes or an SDK.

The rules of ``relayr.observe.telemetry``, on span contexts made here: work for several things joins
their trace when they share one and links to each otherwise; work for one thing continues its
trace, under the current span when that is in it, else linked to the current span; with
tracing off, nothing is parsed or started. The journey on real processes is
``tests/observe/test_traces.py``.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, TraceFlags
from reflexr.telemetry import attributes as reflexr_attributes

from relayr.observe import firing_traces, telemetry


def context(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))


def traceparent(found: SpanContext) -> str:
    return f"00-{found.trace_id:032x}-{found.span_id:016x}-01"


A1, A2, B1 = context(0xA, 1), context(0xA, 2), context(0xB, 3)


@dataclass
class Envelope:
    seq: int
    traceparent: str | None


@dataclass
class Run:
    id: str
    fired_seq: int
    attempts: int = 1
    epoch: int = 1


@pytest.fixture
def on() -> Iterator[None]:
    """relayr's spans on in this process, over whatever provider is global (none: no-ops)."""
    telemetry.enable()
    try:
        yield
    finally:
        telemetry.disable()


def parent_of(found: object) -> SpanContext:
    assert found is not None
    return trace.get_current_span(found).get_span_context()  # type: ignore[arg-type]


def test_nothing_to_join_leaves_the_current_span_the_parent() -> None:
    assert telemetry.joining([None, INVALID_SPAN.get_span_context()]) == (None, [])


def test_work_of_one_trace_is_a_child_of_it() -> None:
    parent, links = telemetry.joining([A2, None, A1])

    assert parent_of(parent) == A2
    assert links == []


def test_work_of_several_traces_starts_its_own_linked_to_each_once() -> None:
    parent, links = telemetry.joining([A1, B1, A2])

    assert parent_of(parent) == INVALID_SPAN.get_span_context()  # a root
    assert [link.context for link in links] == [A1, B1]


def test_links_are_bounded() -> None:
    many = [context(trace_id, 1) for trace_id in range(1, 100)]

    _, links = telemetry.joining(many)

    assert len(links) == telemetry.MAX_LINKS


def test_one_thing_s_work_continues_its_trace_linked_to_the_shared_work() -> None:
    with trace.use_span(NonRecordingSpan(B1)):
        parent, links = telemetry.continuing(A1)

    assert parent_of(parent) == A1
    assert [link.context for link in links] == [B1]


def test_one_thing_s_work_stays_under_the_current_span_in_its_trace() -> None:
    with trace.use_span(NonRecordingSpan(A2)):
        assert telemetry.continuing(A1) == (None, [])


def test_one_thing_s_work_with_nothing_current_continues_its_trace_unlinked() -> None:
    parent, links = telemetry.continuing(A1)

    assert parent_of(parent) == A1
    assert links == []


def test_tracing_off_parses_and_starts_nothing() -> None:
    assert not telemetry.tracing()
    assert telemetry.parse_traceparent(traceparent(A1)) is None
    assert telemetry.current_traceparent() is None
    assert telemetry.run_span("t", "w", Run("fir_1", 1), "ops:x", [Envelope(1, None)]) is None
    with telemetry.span("relayr.anything", {"a": 1}) as span:
        assert not span.is_recording()
    with telemetry.evaluating("t", "w", [Envelope(1, traceparent(A1))]) as evaluation:
        assert evaluation.traceparent is None
        evaluation.fired([Run("fir_1", 1)])
    assert firing_traces.firings.take("fir_1") is None


def test_an_envelope_s_traceparent_is_read_when_tracing(on: None) -> None:
    assert telemetry.parse_traceparent(traceparent(B1)) == B1
    assert telemetry.parse_traceparent("00-not-a-trace") is None


def test_an_evaluation_of_one_trace_hands_it_to_the_runs_it_fired(on: None) -> None:
    envelopes = [Envelope(1, traceparent(A1)), Envelope(2, traceparent(A2))]
    with telemetry.evaluating("t", "w", envelopes) as evaluation:
        # without an SDK, the evaluation's span is its parent's context: A1
        assert evaluation.traceparent == traceparent(A1)
        evaluation.fired([Run("fir_1", 1), Run("fir_2", 2)])

    assert (firing_traces.firings.take("fir_1"), firing_traces.firings.take("fir_2")) == (A1, A1)
    assert firing_traces.firings.take("fir_1") is None  # taken once, by the message's enqueue


def test_remembered_firings_are_bounded() -> None:
    firings = firing_traces.FiringTraces(limit=2)
    for run_id, found in (("r1", A1), ("r2", A2), ("r3", B1)):
        firings.fired(run_id, found)

    assert firings.take("r1") is None
    assert (firings.take("r2"), firings.take("r3")) == (A2, B1)


def test_log_lines_carry_the_current_span_s_ids() -> None:
    with trace.use_span(NonRecordingSpan(B1)):
        line = telemetry.add_trace_ids(None, "info", {"event": "x"})

    assert line == {"event": "x", "trace_id": f"{0xB:032x}", "span_id": f"{3:016x}"}
    assert telemetry.add_trace_ids(None, "info", {"event": "y"}) == {"event": "y"}


def test_reflexr_s_concepts_go_by_reflexr_s_attribute_names() -> None:
    assert telemetry.TENANT_ID == reflexr_attributes.TENANT_ID
    assert telemetry.WORKSPACE_ID == reflexr_attributes.WORKSPACE_ID
    assert telemetry.RULE == reflexr_attributes.RULE
    assert telemetry.RUN_ID == reflexr_attributes.RUN_ID
    assert telemetry.ATTEMPT == reflexr_attributes.ATTEMPT
    assert telemetry.EPOCH == reflexr_attributes.EPOCH
    assert telemetry.RUN_STATUS == reflexr_attributes.RUN_STATUS
    assert telemetry.EVENT_ID == reflexr_attributes.EVENT_ID
