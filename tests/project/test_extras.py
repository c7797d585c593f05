"""The ``console`` extra: a worker installs relayr without it and loads none of it, and
``relayr console`` without it stops with exit code 2 naming it (ADR-0111).

The worker's import set is read from a real worker's own report: ``relayr demo`` runs its
worker subprocess with ``PYTHONPROFILEIMPORTTIME``, so the worker and every pool process print
each module they import, through the runs and agent turns the demo makes them execute. A
missing extra is an interpreter whose import system finds none of it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayr.cli.console import CONSOLE_EXTRA
from relayr.settings import child_environment
from tests.workers import REPO, relayr_output

EXTRA_MODULES = (*CONSOLE_EXTRA, "multipart", "tqdm")
"""Every top-level module the ``console`` extra installs."""

IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(?P<module>[\w.]+)\s*$", re.MULTILINE)
"""A line of ``-X importtime``: ``import time: self | cumulative | module`` (indented by depth)."""

DEMO_TIMEOUT_S = 600

ABSENT = """
import importlib.abc, json, sys

absent = set(json.loads(sys.argv[1]))


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
from relayr.cli import cli

cli(args=sys.argv[2:], prog_name="relayr")
"""
"""Runs ``relayr ARGS`` in an interpreter where the modules named in argv[1] are not installed."""


def without(modules: tuple[str, ...], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ABSENT, json.dumps(modules), *args],
        cwd=cwd,
        env=child_environment({"RELAYR_HOME": str(cwd / "home")}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.worker
@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_a_worker_that_executes_runs_loads_nothing_of_the_console_extra(tmp_path: Path) -> None:
    environment = {**child_environment(), "PYTHONPROFILEIMPORTTIME": "1"}
    done = relayr_output(
        environment,
        "demo",
        "--runs",
        "2",
        "--json",
        cwd=tmp_path,
        check=False,
        timeout_s=DEMO_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["runs_succeeded"] > 0, summary
    log = (Path(summary["home"]) / "worker.log").read_text()

    loaded = {match["module"].partition(".")[0] for match in IMPORTED.finditer(log)}

    # the probe reads what the worker and its pool processes ran: Celery, both libraries, the
    # executor and the example's agent (imported when a run or a turn needs them)
    assert {"celery", "artifactr", "reflexr", "pydantic_ai", "tasks", "rules"} <= loaded, loaded
    assert loaded.isdisjoint(EXTRA_MODULES), sorted(loaded & set(EXTRA_MODULES))


@pytest.mark.parametrize("missing", [EXTRA_MODULES, ("itsdangerous",)], ids=["all", "one"])
@pytest.mark.process
def test_console_without_the_extra_is_bad_input_naming_it(
    tmp_path: Path, missing: tuple[str, ...]
) -> None:
    done = without(missing, "console", "--port", "0", cwd=tmp_path)

    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("Error: relayr console needs the console extra ("), line
    assert line.endswith("not installed): pip install 'relayr-bridge[console]'"), line
    named = {CONSOLE_EXTRA.get(module, module) for module in missing if module in CONSOLE_EXTRA}
    assert all(distribution in line for distribution in named), line
    assert not (tmp_path / "home").exists()  # refused before the settings' storage is touched


@pytest.mark.process
def test_a_file_published_on_a_terminal_without_tqdm_shows_no_bar(tmp_path: Path) -> None:
    """On a terminal, ``relayr publish --data-file`` without the extra publishes every line."""
    import os
    import pty

    events = tmp_path / "events.jsonl"
    events.write_text(
        "".join(
            json.dumps({"service": "api", "status": "ok", "thread_id": f"thr_{n}"}) + "\n"
            for n in range(3)
        )
    )
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                ABSENT,
                json.dumps(["tqdm"]),
                "publish",
                "acme/ops",
                "deploy:finished",
                "--data-file",
                str(events),
                "--json",
            ],
            cwd=REPO,
            env=child_environment({"RELAYR_HOME": str(tmp_path / "home")}),
            stdout=subprocess.PIPE,
            stderr=terminal,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(terminal)
        os.close(controller)

    assert done.returncode == 0, done.stdout
    assert json.loads(done.stdout.strip().splitlines()[-1])["added"] == 3
