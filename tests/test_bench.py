"""The benchmarks run, at a tiny N, and print the JSON figures docs/performance.md reads.

Only the shape is checked, never a speed: on a shared machine a timing assertion would fail
for reasons that are not relayr's. Each benchmark runs as ``python -m bench.<name>``, as a
person runs it, on the embedded storage (no server needed).
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.worker]


def run_bench(*arguments: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line of stdout is one JSON object


def test_end_to_end_prints_runs_per_second_latency_and_transactions() -> None:
    printed = run_bench("bench.end_to_end", "--n", "6", "--workers", "1", "--storage", "sqlite")
    kinds = [figures["bench"] for figures in printed]
    assert kinds == ["machine", "floor", "end_to_end"]
    machine, floor, figures = printed
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


def test_floor_prints_milliseconds_per_commit() -> None:
    (figures,) = run_bench("bench.floor", "--n", "5", "--storage", "sqlite")
    assert figures["bench"] == "floor"
    assert figures["ms_per_commit"] > 0
    assert figures["transactions_per_commit"] == 1.0


def test_transactions_prints_counts_per_notice_run_and_per_pass() -> None:
    (figures,) = run_bench("bench.transactions", "--n", "4", "--storage", "sqlite")
    assert figures["bench"] == "transactions"
    assert figures["publish_per_run"] == 1.0
    assert figures["per_notice_run"] == figures["worker_per_run"] + 1.0
    assert figures["per_dispatch_pass"] > 0
    assert isinstance(figures["met"], bool)


def test_memory_prints_peak_rss_after_each_round() -> None:
    (figures,) = run_bench("bench.memory", "--first", "2", "--total", "5", "--storage", "sqlite")
    assert figures["bench"] == "memory"
    assert figures["after_2"]["VmHWM"] > 0
    assert figures["after_5"]["VmHWM"] >= figures["after_2"]["VmHWM"]
    assert figures["runs_succeeded"] == 5
