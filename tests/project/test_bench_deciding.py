"""The deciding side's benchmarks run, at a tiny size, and print the JSON the targets read.

``bench.latency``, ``bench.fairness`` and ``bench.idle`` run as ``python -m bench.<name>``, as a
person runs them, on the embedded storage (no server needed), each with sizes far below their
targets' so their verdicts say they judge nothing. Only the shape and the sanity of the figures
are checked (every event noticed, percentiles in order, counts that add up), never a speed: on a
shared machine a timing assertion would fail for reasons that are not relayr's.
"""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.worker, pytest.mark.timeout(1500)]

COMMANDS: Final = {
    "latency": ("bench.latency", "--n", "3", "--interval-s", "0.5", "--storage", "sqlite"),
    "fairness": (
        "bench.fairness",
        *("--floods", "4", "8", "--quiet", "2", "--interval-s", "0.5", "--storage", "sqlite"),
        *("--publishing", "process"),
    ),
    "idle": (
        "bench.idle",
        *("--workspaces", "4", "--new", "2", "--window-s", "1", "--storage", "sqlite"),
    ),
}
"""Each benchmark at a tiny size. They run at once (each case has its own home, queue and
SQLite file), so the module takes about as long as the slowest one."""

TIMEOUT_S: Final = 1200
"""A bound on each benchmark, not a pace: far above what the slowest takes on a busy machine."""

NOT_JUDGED: Final = re.compile(r"(met|missed) \(small run: not judged\)")

PERCENTILES: Final = ("p50", "p90", "p99", "max")


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
        outputs[name] = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return outputs


def ordered(latency: dict[str, float]) -> None:
    """Percentiles present, positive and in order."""
    assert list(latency) == list(PERCENTILES)
    values = [latency[name] for name in PERCENTILES]
    assert values[0] > 0
    assert values == sorted(values)


def stages(split: dict[str, dict[str, float]], latency: dict[str, float]) -> None:
    """Each stage's percentiles in order, none longer than the whole way."""
    assert list(split) == ["decide", "queue", "act"]
    for stage in split.values():
        ordered(stage)
        assert stage["max"] <= latency["max"]


def verdicts(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verdict lines, which come last, each of the one shape, judging nothing."""
    found = [line for line in lines if line["bench"] == "verdict"]
    assert found
    assert lines[-len(found) :] == found
    for verdict in found:
        assert set(verdict) == {"bench", "target", "limit", "figure", "verdict"}
        assert isinstance(verdict["figure"], int | float)
        assert NOT_JUDGED.fullmatch(verdict["verdict"]), verdict
    return found


def test_latency_prints_the_percentiles_of_every_event_noticed(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    machine, figures, *rest = printed["latency"]
    assert machine["bench"] == "machine"
    assert figures["bench"] == "latency"
    assert (figures["storage"], figures["broker"], figures["database"]) == (
        "sqlite",
        "filesystem",
        "sqlite",
    )
    assert figures["publishing"] == "stream"
    assert figures["n"] == figures["notices"] == 3
    assert figures["complete"] is True
    assert figures["duplicates"] == 0
    ordered(figures["latency_ms"])
    stages(figures["stages_ms"], figures["latency_ms"])
    assert [line["target"] for line in verdicts(rest)] == [
        "sqlite: publish to notice p50, ms",
        "sqlite: publish to notice p99, ms",
    ]
    assert [line["figure"] for line in rest] == [
        figures["latency_ms"]["p50"],
        figures["latency_ms"]["p99"],
    ]


def test_fairness_prints_each_phase_then_its_verdicts(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    machine, *lines = printed["fairness"]
    assert machine["bench"] == "machine"
    phases = [line for line in lines if line["bench"] == "fairness"]
    assert [(line["phase"], line["flood"], line["quiet"]) for line in phases] == [
        ("quiet alone", 0, 2),
        ("flood alone", 4, 0),
        ("flood and quiet", 4, 2),
        ("flood alone", 8, 0),
        ("flood and quiet", 8, 2),
    ]
    for phase in phases:
        assert phase["publishing"] == "process"
        assert phase["complete"] is True
        assert phase["duplicates"] == 0
        if phase["quiet"]:
            assert phase["quiet_notices"] == 2
            ordered(phase["quiet_latency_ms"])
            stages(phase["quiet_stages_ms"], phase["quiet_latency_ms"])
        if phase["flood"]:
            assert phase["flood_notices"] == phase["flood"]
            assert phase["flood_runs_per_s"] > 0
            assert phase["flood_s"] > 0
        if phase["flood"] and phase["quiet"]:
            assert 0 <= phase["quiet_published_during_flood"] <= phase["quiet"]
    assert [line["target"] for line in verdicts(lines)] == [
        "sqlite: quiet workspace's p99 during a flood of 4 / alone",
        "sqlite: quiet workspace's p99 during a flood of 8 / alone",
        "sqlite: quiet workspace's p99, flood of 8 against 4",
        "sqlite: throughput of a flood of 4 beside the quiet workspace / alone",
        "sqlite: throughput of a flood of 8 beside the quiet workspace / alone",
    ]


def test_idle_prints_the_dispatcher_s_cpu_and_the_time_to_decide(
    printed: dict[str, list[dict[str, Any]]],
) -> None:
    machine, figures, *rest = printed["idle"]
    assert machine["bench"] == "machine"
    assert figures["bench"] == "idle"
    assert figures["workspaces"] == 4
    assert figures["settled"] is True
    assert figures["first_pass_s"] >= 0
    assert figures["caught_up_passes"] >= 1  # the first sweep, worked off in passes
    assert figures["caught_up_s"] >= 0
    assert figures["window_s"] >= 1
    assert figures["dispatcher_cpu_percent"] >= 0
    assert figures["database_cpu_percent"] is None  # SQLite: no server
    # every new event's run decided and enqueued, once: one message per workspace
    assert figures["new"] == figures["runs_decided"] == figures["messages_enqueued"] == 2
    assert figures["decided_from_first_publish_s"] >= figures["decided_s"]
    assert [line["target"] for line in verdicts(rest)] == [
        "sqlite: dispatcher's CPU, 4 workspaces with nothing new, % of a core",
        "sqlite: one new event in each of 2 workspaces, all enqueued, s",
    ]
