"""Observation is hooked: the path emits facts, and metrics and traces subscribe to them.

The facts of a real run on real reflexr storage (the executor's harness), what each observer
makes of a fact, and an observer that raises failing nothing.
"""

from collections.abc import Iterator

import pytest

from relayr.observe import hooks, metrics, observers
from relayr.observe.hooks import (
    EmissionMade,
    Fact,
    RunClaimed,
    RunEnded,
    RunsEnqueued,
    WriteRefused,
)
from tests.execution.executor_harness import Asked, Harness
from tests.execution.executor_harness import database_url as database_url  # the storage, a fixture
from tests.execution.executor_harness import harness as harness  # the fixture, on every storage
from tests.observe.metrics_probes import sample as sample_of
from tests.observe.metrics_probes import scrape_text


def sample(name: str, **labels: str) -> float:
    return sample_of(scrape_text(metrics.exposition().decode()), name, **labels)


@pytest.fixture
def seen() -> Iterator[list[Fact]]:
    facts: list[Fact] = []
    unsubscribe = hooks.subscribe(facts.append)
    yield facts
    unsubscribe()


async def test_a_run_emits_its_claim_and_its_end(harness: Harness, seen: list[Fact]) -> None:
    run_id = await harness.fire(Asked(mode="ok"))

    executed = await harness.execute(run_id)

    assert executed.outcome == "succeeded"
    claimed = [fact for fact in seen if isinstance(fact, RunClaimed)]
    ended = [fact for fact in seen if isinstance(fact, RunEnded)]
    assert len(claimed) == 1
    assert claimed[0].lag_s >= 0
    assert [(fact.rule, fact.outcome) for fact in ended] == [("exec:work", "succeeded")]
    assert ended[0].duration_s is not None


def test_an_observer_that_raises_fails_nothing_and_the_others_still_see(
    seen: list[Fact],
) -> None:
    def broken(fact: Fact) -> None:
        raise RuntimeError("observer down")

    unsubscribe = hooks.subscribe(broken)
    try:
        hooks.emit(WriteRefused("not_allowed"))
    finally:
        unsubscribe()

    assert seen == [WriteRefused("not_allowed")]


def test_counting_observer_records_each_fact_in_its_metric() -> None:
    refusals = sample("relayr_refusals_total", reason="hooked_reason")
    enqueued = sample("relayr_runs_enqueued_total")
    emissions = sample("relayr_emissions_total", kind="notice", outcome="posted")

    observers.count(WriteRefused("hooked_reason"))
    observers.count(RunsEnqueued(4))
    observers.count(EmissionMade("notice", "posted", "notice"))

    assert sample("relayr_refusals_total", reason="hooked_reason") == refusals + 1
    assert sample("relayr_runs_enqueued_total") == enqueued + 4
    assert sample("relayr_emissions_total", kind="notice", outcome="posted") == emissions + 1


def test_install_subscribes_once() -> None:
    observers.install()
    observers.install()
    before = sample("relayr_refusals_total", reason="installed_once")

    hooks.emit(WriteRefused("installed_once"))

    assert sample("relayr_refusals_total", reason="installed_once") == before + 1
    assert metrics.registry() is not None
