"""relayr's metrics in this process: names, labels, and what each recording function counts.

The metrics stay in memory here: nothing in this module enables the file mode, which would
change prometheus_client for every later test (tests/observe/test_metrics_processes.py enables it in
subprocesses). One test serves them over HTTP from a server on a free port.
"""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relayr.observe import metrics, observers
from relayr.observe.hooks import RunLimited
from tests.observe.metrics_probes import sample, scrape

EXPECTED = {
    # family name (samples add _total to counters): (type, label names)
    "relayr_runs_executed": ("counter", ("rule", "outcome")),
    "relayr_emissions": ("counter", ("kind", "outcome")),
    "relayr_refusals": ("counter", ("reason",)),
    "relayr_attempt_duration_seconds": ("histogram", ("rule",)),
    "relayr_dispatch_lag_seconds": ("histogram", ()),
    "relayr_runs_redelivered": ("counter", ()),
    "relayr_runs_enqueued": ("counter", ()),
    "relayr_turns_started": ("counter", ()),
    "relayr_turns_drained": ("counter", ()),
    "relayr_runs_limited": ("counter", ("rule", "limit")),
    "relayr_limit_used": ("gauge", ("limit", "kind")),
    "relayr_limit_waiting": ("gauge", ("limit", "kind")),
}


def value(name: str, **labels: str) -> float:
    """The current value of one sample of this process's metrics (0 when absent)."""
    found = metrics.registry().get_sample_value(name, labels)
    return float(found or 0.0)


def test_every_metric_is_declared_with_conventional_names_and_labels() -> None:
    metrics.record_run("ops:a", "succeeded", 0.1)
    families = {family.name: family for family in metrics.registry().collect()}
    declared = {name: family.type for name, family in families.items()}
    assert declared == {name: kind for name, (kind, _) in EXPECTED.items()}
    for name, family in families.items():
        assert name.startswith("relayr_")
        assert family.documentation
        if family.type == "histogram":
            assert name.endswith("_seconds")
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name.endswith("_created"):  # in memory only: when each series began
            continue
        _, labels = EXPECTED[family.name]
        for found in family.samples:
            assert set(found.labels) - {"le"} == set(labels), found
            suffixes = {""} if family.type == "gauge" else {"_total", "_bucket", "_sum", "_count"}
            assert found.name.removeprefix(family.name) in suffixes


def test_record_run_counts_the_outcome_and_times_the_attempt() -> None:
    before = value("relayr_runs_executed_total", rule="ops:r1", outcome="succeeded")
    observed = value("relayr_attempt_duration_seconds_count", rule="ops:r1")
    total = value("relayr_attempt_duration_seconds_sum", rule="ops:r1")
    metrics.record_run("ops:r1", "succeeded", 0.25)
    metrics.record_run("ops:r1", "succeeded", 0.5)
    assert value("relayr_runs_executed_total", rule="ops:r1", outcome="succeeded") == before + 2
    assert value("relayr_attempt_duration_seconds_count", rule="ops:r1") == observed + 2
    assert value("relayr_attempt_duration_seconds_sum", rule="ops:r1") == pytest.approx(
        total + 0.75
    )


def test_a_run_that_did_not_run_is_counted_without_a_duration() -> None:
    observed = value("relayr_attempt_duration_seconds_count", rule="ops:r2")
    metrics.record_run("ops:r2", "not_due")
    metrics.record_run(None, "missing")
    assert value("relayr_runs_executed_total", rule="ops:r2", outcome="not_due") >= 1
    assert value("relayr_runs_executed_total", rule="unknown", outcome="missing") >= 1
    assert value("relayr_attempt_duration_seconds_count", rule="ops:r2") == observed


def test_a_negative_duration_or_lag_counts_as_zero() -> None:
    zero_bucket = value("relayr_dispatch_lag_seconds_bucket", le="0.05")
    total = value("relayr_dispatch_lag_seconds_sum")
    metrics.record_dispatch_lag(-3.0)
    assert value("relayr_dispatch_lag_seconds_bucket", le="0.05") == zero_bucket + 1
    assert value("relayr_dispatch_lag_seconds_sum") == total
    metrics.record_run("ops:r3", "succeeded", -1.0)
    assert value("relayr_attempt_duration_seconds_sum", rule="ops:r3") == 0.0


def test_dispatch_lag_lands_in_its_bucket() -> None:
    within_2s = value("relayr_dispatch_lag_seconds_bucket", le="2.0")
    within_1s = value("relayr_dispatch_lag_seconds_bucket", le="1.0")
    metrics.record_dispatch_lag(1.5)
    assert value("relayr_dispatch_lag_seconds_bucket", le="2.0") == within_2s + 1
    assert value("relayr_dispatch_lag_seconds_bucket", le="1.0") == within_1s


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [("notice", "posted"), ("notice", "already_posted"), ("message", "asked")],
)
def test_record_emission_counts_by_kind_and_outcome(kind: str, outcome: str) -> None:
    before = value("relayr_emissions_total", kind=kind, outcome=outcome)
    metrics.record_emission(kind, outcome)
    assert value("relayr_emissions_total", kind=kind, outcome=outcome) == before + 1


def test_refusals_redeliveries_enqueues_and_turns_are_counted() -> None:
    counters: dict[str, Callable[[], None]] = {
        "relayr_refusals_total": lambda: metrics.record_refusal("not_allowed"),
        "relayr_runs_redelivered_total": metrics.record_redelivery,
        "relayr_runs_enqueued_total": lambda: metrics.record_enqueued(3),
        "relayr_turns_started_total": metrics.record_turn_started,
        "relayr_turns_drained_total": lambda: metrics.record_turns_drained(2),
    }
    steps = {
        "relayr_refusals_total": 1,
        "relayr_runs_redelivered_total": 1,
        "relayr_runs_enqueued_total": 3,
        "relayr_turns_started_total": 1,
        "relayr_turns_drained_total": 2,
    }
    for name, record in counters.items():
        labels = {"reason": "not_allowed"} if name == "relayr_refusals_total" else {}
        before = value(name, **labels)
        record()
        assert value(name, **labels) == before + steps[name], name


def test_a_run_a_limit_holds_back_is_counted_by_rule_and_limit() -> None:
    labels = {"rule": "ops:r1", "limit": "triage/turns_per"}
    before = value("relayr_runs_limited_total", **labels)
    observers.count(RunLimited("ops:r1", "triage/turns_per"))  # what the runtime subscribes
    assert value("relayr_runs_limited_total", **labels) == before + 1


def test_no_turns_drained_adds_nothing() -> None:
    before = value("relayr_turns_drained_total")
    metrics.record_turns_drained(0)
    assert value("relayr_turns_drained_total") == before


def test_each_serving_process_has_a_directory_of_its_own(tmp_path: Path) -> None:
    worker = metrics.metrics_directory(tmp_path, "worker", pid=41)
    assert worker == tmp_path.absolute() / "metrics" / "worker-41"
    assert metrics.metrics_directory(tmp_path, "dispatcher").name == f"dispatcher-{os.getpid()}"


def test_a_server_in_memory_mode_serves_this_process(tmp_path: Path) -> None:
    server = metrics.start_metrics_server(0, None, addr="127.0.0.1")
    try:
        metrics.record_refusal("served_here")
        assert sample(scrape(server.port), "relayr_refusals_total", reason="served_here") >= 1
    finally:
        server.close()
