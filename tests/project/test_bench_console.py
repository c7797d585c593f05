"""``python -m bench.console`` runs, at a tiny size, and prints the figures the target reads.

On the embedded storage (no server needed), with far fewer runs than the target's, so its
verdicts judge nothing. Only the shape and the sanity of the figures are checked (every page
answered, the runs written add up, percentiles in order), never a speed.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUNS: Final = 200


@pytest.mark.process
def test_bench_console_times_every_page() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.console", "--runs", str(RUNS)),
            *("--requests", "2", "--storage", "sqlite", "--idle-workspaces", "3"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert lines[0]["bench"] == "machine"
    [figures] = [line for line in lines if line["bench"] == "console"]
    assert figures["storage"] == "sqlite"
    assert sum(figures["workspaces"].values()) == RUNS
    assert figures["idle_workspaces"] == 3
    pages = figures["pages"]
    assert {page["page"] for page in pages} >= {"/", "/runs?sort=changed", "/health"}
    for page in pages:
        expected = 303 if page["page"].startswith("/search?q=fir_") else 200
        assert page["status"] == expected, page
        assert 0 < page["p50_ms"] <= page["p95_ms"] <= page["max_ms"], page
    assert figures["console_memory_kib"]["VmRSS"] > 0
    verdicts = [line for line in lines if line["bench"] == "verdict"]
    assert len(verdicts) == len(pages)
    assert all(line["verdict"].endswith("(small run: not judged)") for line in verdicts)
