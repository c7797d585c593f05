"""The benchmarks run, at a tiny N, and print the JSON figures docs/performance.md reads.

Only the shape is checked, never a speed: on a shared machine a timing assertion would fail
for reasons that are not relayr's. Each benchmark runs as ``python -m bench.<name>``, as a
person runs it, on the embedded storage (no server needed): ``bench.targets`` (what
``make bench`` runs first) with ``--tiny``, whose verdicts say they judge nothing.
``bench.cli`` has a test of its own (tests/project/test_bench_cli.py).
"""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.worker]


COMMANDS = {
    "end_to_end": ("bench.end_to_end", "--n", "6", "--workers", "1", "--storage", "sqlite"),
    "floor": ("bench.floor", "--n", "5", "--storage", "sqlite"),
    "transactions": (
        "bench.transactions",
        "--n",
        "4",
        "--storage",
        "sqlite",
        "--limit",
        "none",
        "runs_in_flight",
    ),
    "memory": ("bench.memory", "--first", "2", "--total", "5", "--storage", "sqlite"),
    "broker": ("bench.broker", "--n", "20", "--rounds", "1"),
    "targets": ("bench.targets", "--tiny", "--storage", "sqlite"),
}
"""Each benchmark at a tiny N. They run at once (each case has its own home, queue and
SQLite file), so the module takes about as long as the slowest one, ``bench.targets`` (its
four cases one after the other)."""

TIMEOUT_S = 600
"""A bound on each benchmark, not a pace: far above what the slowest takes on a busy machine."""

TARGET_CASES = ("sqlite-none", "sqlite-scope", "sqlite-n6", "sqlite-n12")
"""``bench.targets --tiny --storage sqlite``'s cases: both orderings, then the two bursts."""


@pytest.fixture(scope="module")
def printed() -> dict[str, list[dict[str, Any]]]:
    """What each benchmark printed on stdout, one JSON object per line."""
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", *arguments],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, arguments in COMMANDS.items()
    }
    outputs: dict[str, list[dict[str, Any]]] = {}
    for name, process in running.items():
        try:
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        assert process.returncode == 0, f"{name}: {stderr[-4000:]}"
        # every line of stdout is one JSON object
        outputs[name] = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return outputs


def test_end_to_end_prints_runs_per_second_latency_and_transactions(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    kinds = [figures["bench"] for figures in printed["end_to_end"]]
    assert kinds == ["machine", "floor", "end_to_end"]
    machine, floor, figures = printed["end_to_end"]
    assert machine["cores"] >= 1
    assert len(machine["load_avg"]) == 3
    assert floor["transactions_per_commit"] == 1.0
    assert figures["notices"] == 6
    assert figures["complete"] is True
    assert figures["runs_succeeded_total"] == 6
    assert figures["duplicates_total"] == 0
    assert figures["runs_per_s"] > 0
    assert figures["ms_per_run"] > 0
    assert set(figures["latency_ms"]) == {"p50", "p95", "p99", "max"}
    assert figures["ratio_to_floor"] > 0
    assert figures["transactions"]["publish_per_run"] == 1.0
    assert figures["transactions"]["worker_per_run"] > 0
    assert figures["outcomes"]["succeeded"] == 6
    (rss,) = figures["rss_kib"].values()
    assert rss["VmHWM"] >= rss["VmRSS"] > 0


def test_floor_prints_milliseconds_per_commit(printed: dict[str, list[dict[str, Any]]]) -> None:
    (figures,) = printed["floor"]
    assert figures["bench"] == "floor"
    assert figures["ms_per_commit"] > 0
    assert figures["transactions_per_commit"] == 1.0


def test_transactions_prints_counts_per_notice_run_and_per_pass(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    figures, limited = printed["transactions"]
    assert (figures["limit"], limited["limit"]) == ("none", "runs_in_flight")
    assert limited["outcomes"]["succeeded"] == figures["outcomes"]["succeeded"] == 4
    assert "limited" not in limited["outcomes"]  # the limit binds every run and refuses none
    assert figures["bench"] == "transactions"
    assert figures["publish_per_run"] == 1.0
    assert figures["per_notice_run"] == figures["worker_per_run"] + 1.0
    assert figures["per_dispatch_pass"] > 0
    assert figures["all_counted"] == pytest.approx(
        figures["per_notice_run"] + figures["dispatch_per_run"], abs=0.01
    )
    assert figures["all_counted_target"] == 4.0
    assert isinstance(figures["met"], bool)


def test_memory_prints_peak_rss_after_each_round(printed: dict[str, list[dict[str, Any]]]) -> None:
    (figures,) = printed["memory"]
    assert figures["bench"] == "memory"
    assert figures["after_2"]["VmHWM"] > 0
    assert figures["after_5"]["VmHWM"] >= figures["after_2"]["VmHWM"]
    assert figures["runs_succeeded"] == 5


def test_broker_prints_messages_per_second_for_each_transport(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    lines = printed["broker"]
    assert [figures["transport"] for figures in lines] == [
        "kombu-filesystem",
        "relayr-filesystem",
        "relayr-filesystem-fsync",
    ]
    for figures in lines:
        assert figures["consumed"] == figures["n"] == 20
        assert figures["publish_per_s"] > 0
        assert figures["consume_per_s"] > 0
        assert len(figures["machine"]["load_avg"]) == 3


def test_targets_prints_each_case_then_one_verdict_per_target(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    lines = printed["targets"]
    assert [line["bench"] for line in lines[:2]] == ["machine", "floor"]
    cases = [line for line in lines if line["bench"] == "end_to_end"]
    assert [case["case"] for case in cases] == list(TARGET_CASES)
    for case in cases:
        assert case["storage"] == "sqlite"
        assert case["notices"] == case["n"]
        assert case["complete"] is True
    verdicts = [line for line in lines if line["bench"] == "verdict"]
    assert lines[-len(verdicts) :] == verdicts
    assert [verdict["target"] for verdict in verdicts] == [
        "sqlite none: ms per run / floor",
        "sqlite none: SQL transactions per notice run, all counted",
        "sqlite scope: ms per run / floor",
        "sqlite scope: SQL transactions per notice run, all counted",
        "sqlite: scope / none per run",
        "sqlite: duplicate deliveries in a burst of 12",
        "sqlite: per run, N=12 / N=6",
        "sqlite: pool peak RSS, N=12 / N=6",
    ]
    for verdict in verdicts:
        assert set(verdict) == {"bench", "target", "limit", "figure", "verdict"}
        assert isinstance(verdict["limit"], int | float)
        assert isinstance(verdict["figure"], int | float)
        # a tiny run judges nothing, whatever its figures
        assert re.fullmatch(r"(met|missed) \(tiny run: not judged\)", verdict["verdict"])
