"""The observers every relayr process subscribes to the path's facts: metrics and traces.

:func:`install` subscribes them once per process (the runtime calls it when it is made);
installing again changes nothing, so a process that builds several runtimes counts each fact
once.
"""

from relayr.observe import hooks, metrics, telemetry
from relayr.observe.hooks import (
    EmissionMade,
    Fact,
    LimitsUsed,
    MessageRedelivered,
    RunClaimed,
    RunEnded,
    RunLimited,
    RunsEnqueued,
    TurnsDrained,
    TurnStarted,
    WriteRefused,
)

_installed: list[bool] = []


def install() -> None:
    """Subscribe :func:`count` and :func:`trace` to the path's facts, once per process."""
    if not _installed:
        hooks.subscribe(count)
        hooks.subscribe(trace)
        _installed.append(True)


def count(fact: Fact) -> None:
    """Prometheus: each fact to its counter or histogram (:mod:`relayr.observe.metrics`)."""
    match fact:
        case RunClaimed(lag_s=lag_s):
            metrics.record_dispatch_lag(lag_s)
        case RunEnded(rule=rule, outcome=outcome, duration_s=duration_s):
            metrics.record_run(rule, outcome, duration_s)
        case WriteRefused(reason=reason):
            metrics.record_refusal(reason)
        case EmissionMade(kind=kind, outcome=outcome):
            metrics.record_emission(kind, outcome)
        case TurnStarted():
            metrics.record_turn_started()
        case TurnsDrained(count=drained):
            metrics.record_turns_drained(drained)
        case RunsEnqueued(count=enqueued):
            metrics.record_enqueued(enqueued)
        case RunLimited(rule=rule, limit=limit):
            metrics.record_limited(rule, limit)
        case MessageRedelivered():
            metrics.record_redelivery()
        case LimitsUsed(uses=uses):
            metrics.record_limits_used(uses)


def trace(fact: Fact) -> None:
    """OpenTelemetry: what an emission did, on the current span (the write's)."""
    if isinstance(fact, EmissionMade):
        telemetry.annotate(
            {
                telemetry.OUTCOME: fact.outcome,
                telemetry.EMISSION_KIND: fact.kind,
                telemetry.POLICY: fact.policy,
                telemetry.TURN_ID: fact.turn_id,
            }
        )
