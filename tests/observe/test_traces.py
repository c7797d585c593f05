"""One trace from a publish to the end of the agent turn it caused, across real processes.

Real processes, each configured by the environment alone, as an operator would run them:
``relayr publish`` (``relayr-cli``), ``relayr dispatch`` (``relayr-dispatcher``) and a
``celery worker`` (``relayr-worker``: its pool process) on Redis and SQLite, all exporting to an
OTLP/HTTP receiver this test starts (:mod:`tests.otlp`). One ``incident:opened`` event makes the
example's ``ops:incident-triage`` send a message, which starts the agent's turn.

The trace of the publish holds the dispatcher's evaluation and enqueue, Celery's producer and
consumer spans, the executor's claim, run, send and completion, artifactr's commit of the sent
message inside the run's span, and ``relayr.turn``, which ends when the turn has recorded its
end, linked to the turn's own trace (ADR-0080). No span anywhere carries what was written: the
incident's title, the message, the agent's reply. The worker's log lines carry the trace's id.

Every wait is bounded (:data:`WAIT_S`) and none stands for an event: the test polls for what it
needs (the ``relayr.turn`` span, then the spans of every process) until it is there.
"""

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rules.example.agent import REPLY
from tests.otlp import ReceivedSpan, Receiver, receiving
from tests.services import forgetting_redis_queue
from tests.workers import (
    log_records,
    relayr_environment,
    relayr_json,
    relayr_output,
    running_dispatcher,
    running_worker,
    until,
)

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600)]

WAIT_S = 240.0
"""How long any one wait may take: far above what it needs on a quiet machine (seconds)."""

TENANT_WORKSPACE = "acme/ops"


def ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> Iterator[ReceivedSpan]:
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        yield span


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.name == name]


def texts(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from texts(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from texts(item)


@pytest.fixture
def traced(tmp_path: Path, redis_url: str) -> Iterator[tuple[Receiver, dict[str, str]]]:
    environment = relayr_environment(tmp_path / "home", broker_url=redis_url, turn_grace_s=5)
    with (
        forgetting_redis_queue(environment["RELAYR_QUEUE"], url=redis_url),
        receiving() as receiver,
    ):
        environment["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        yield receiver, environment


def test_one_trace_from_the_publish_to_the_turn_s_end(
    traced: tuple[Receiver, dict[str, str]], tmp_path: Path
) -> None:
    receiver, environment = traced
    secret = f"checkout-{uuid.uuid4().hex}"
    created = relayr_json(environment, "thread", "create", TENANT_WORKSPACE, "--title", "incident")
    thread_id = created["id"]
    with (
        running_worker(environment, tmp_path, concurrency=1) as worker,
        running_dispatcher(environment, tmp_path) as dispatching,
    ):
        data = json.dumps({"title": secret, "thread_id": thread_id})
        published = relayr_json(
            environment, "publish", TENANT_WORKSPACE, "incident:opened", "--data", data
        )
        event_id = published["id"]

        def publish_span() -> ReceivedSpan | None:
            return next(
                (
                    span
                    for span in receiver.spans()
                    if span.name.startswith("reflexr.publish")
                    and span.attributes.get("reflexr.event.id") == event_id
                ),
                None,
            )

        publish = until("the publish's span", publish_span, worker, dispatching, timeout_s=WAIT_S)
        trace_id = publish.trace_id

        def in_trace() -> list[ReceivedSpan]:
            return [span for span in receiver.spans() if span.trace_id == trace_id]

        def turn_ended() -> ReceivedSpan | None:
            return next(iter(named(in_trace(), "relayr.turn")), None)

        turn = until(
            "relayr.turn in the publish's trace", turn_ended, worker, dispatching, timeout_s=WAIT_S
        )

        def everything() -> list[ReceivedSpan] | None:
            # each process exports on its own schedule: wait until each one's part is in
            spans = in_trace()
            wanted = {"relayr.evaluate", "relayr.enqueue", "relayr.complete", "relayr.send"}
            return spans if wanted <= {span.name for span in spans} else None

        spans = until("every process's spans", everything, worker, dispatching, timeout_s=WAIT_S)
        worker_log = worker.log()

    by_id = {span.span_id: span for span in spans}
    assert publish.service == "relayr-cli"
    assert publish.parent_id == ""

    # spans from at least three processes: the command, the dispatcher, the worker's pool
    processes = {span.process for span in spans}
    assert {service for service, _ in processes} >= {
        "relayr-cli",
        "relayr-dispatcher",
        "relayr-worker",
    }, processes
    assert len(processes) >= 3

    # the journey, each step inside the one before it
    [run] = named(spans, "relayr.run ops:incident-triage")
    chain = [span.name for span in ancestors(run, by_id)]
    assert chain[:2] == ["relayr.execute_runs", "run/relayr.execute_runs"], chain
    assert chain[2:5] == [
        "apply_async/relayr.execute_runs",
        "relayr.enqueue",
        "relayr.evaluate",
    ], chain
    assert chain[-1] == publish.name
    assert run.attributes["reflexr.rule"] == "ops:incident-triage"
    assert run.attributes["reflexr.attempt"] == 1
    assert run.attributes["reflexr.tenant.id"] == "acme"
    assert run.attributes["reflexr.workspace.id"] == "ops"
    assert run.attributes["relayr.outcome"] == "succeeded"
    assert {"relayr.claim", "relayr.complete"} <= {
        span.name for span in spans if span.parent_id == run.parent_id
    }

    # artifactr's commit of the sent message, inside the run's span
    [send] = named(spans, "relayr.send")
    assert run in ancestors(send, by_id)
    assert send.attributes["relayr.outcome"] == "posted"
    message_id = send.attributes["relayr.message.id"]
    commits = [
        span
        for span in named(spans, "artifactr.commit post_message")
        if send in ancestors(span, by_id)
    ]
    assert len(commits) == 1, [span.name for span in spans]
    [commit] = commits
    assert run.start_ns <= commit.start_ns <= commit.end_ns <= run.end_ns

    # the turn: in the run's trace, under its send, linked to the turn's own trace, and ended
    # once everything the turn did had ended
    assert turn.attributes["reflexr.run.id"] == run.attributes["reflexr.run.id"]
    assert send in ancestors(turn, by_id)
    everywhere = receiver.spans()
    [(turn_trace, turn_span_id)] = turn.links
    [own] = [span for span in everywhere if span.span_id == turn_span_id]
    assert own.name == "invoke_workflow turn"
    assert own.trace_id == turn_trace != trace_id
    assert turn.attributes["artifactr.run.id"] == own.attributes["artifactr.run.id"]
    assert turn.attributes["relayr.outcome"] == "completed"
    own_by_id = {span.span_id: span for span in everywhere if span.trace_id == turn_trace}
    # what the turn did, not what its reply caused once bridged (the follow-up rules' runs
    # continue the turn's trace under relayr.runtime.bridge, and may be exported by now or not)
    inside = [
        span
        for span in own_by_id.values()
        if own in (lineage := list(ancestors(span, own_by_id)))
        and not any(step.name == "relayr.bridge" for step in [span, *lineage])
    ]
    assert any(span.name == "artifactr.commit post_message" for span in inside)  # the reply
    assert all(span.end_ns <= turn.end_ns for span in inside)

    # no span anywhere carries what was written
    for span in everywhere:
        for text in [span.name, *texts(span.attributes)]:
            assert secret not in text, (span.name, span.attributes)
            assert REPLY[:40] not in text, (span.name, span.attributes)
            assert "Triage incident" not in text, (span.name, span.attributes)
    assert message_id.startswith("msg_")

    # log lines and traces join: the worker's lines of the run carry the trace's id
    started = [
        line
        for line in log_records(worker_log)
        if line.get("event") == "attempt started" and line.get("rule") == "ops:incident-triage"
    ]
    assert [line["trace_id"] for line in started] == [trace_id]
    assert started[0]["span_id"] == run.span_id


def test_a_traced_demo_exports_its_publish_and_enqueue_with_the_workers_runs(
    tmp_path: Path,
) -> None:
    """``relayr demo`` with an OTLP endpoint: its own process (``relayr-demo``) exports the
    publish, the evaluation and the enqueue, in the traces of the worker's runs."""
    with receiving() as receiver:
        environment = relayr_environment(tmp_path)
        environment["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        relayr_output(environment, "demo", "--runs", "4", "--json", cwd=tmp_path, timeout_s=WAIT_S)

        def both_ends() -> list[ReceivedSpan] | None:
            spans = receiver.spans()
            runs = {s.trace_id for s in spans if s.name.startswith("relayr.run ")}
            demo = {s.trace_id for s in spans if s.service == "relayr-demo"}
            return spans if runs & demo else None

        spans = until("the demo's and the worker's spans in one trace", both_ends, timeout_s=WAIT_S)
    demo = {span.name for span in spans if span.service == "relayr-demo"}
    assert {"relayr.evaluate", "relayr.enqueue"} <= demo, demo
    assert any(name.startswith("reflexr.publish") for name in demo), demo
    assert "relayr-worker" in {span.service for span in spans}
