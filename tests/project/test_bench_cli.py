"""``python -m bench.cli`` runs, at one run per command, and prints the figures
docs/performance.md reads ("Command line"): only their shape is checked, never a speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.process
def test_the_command_line_benchmark_prints_each_command_and_its_reference() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.cli", "--runs", "1", "--events", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert lines[0]["bench"] == "machine"
    assert len(lines[0]["load_avg"]) == 3
    by_command = {line["command"]: line for line in lines[1:]}
    assert by_command["import click"]["reference"] is True
    for command in ("relayr --help", "relayr publish --help", "relayr publish"):
        line = by_command[command]
        assert line["median_s"] > 0
        assert line["ratio"] > 0
        assert isinstance(line["met"], bool)
    assert by_command["relayr publish"]["reference"] == "import reflexr.workspace, reflexr.sql"
    assert by_command["relayr thread create"]["median_s"] > 0
    published = by_command["relayr publish --data-file"]
    assert published["events"] == 10
    assert published["events_per_s"] > 0
