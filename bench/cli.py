"""How fast the command line answers: each command's wall time beside two references.

A person runs ``relayr`` by hand and scripts run it in loops, so a command's start is most of
its cost. This benchmark runs each command as a process of its own, several times, and prints
one JSON object per line on stdout: the machine first, then per measurement the median, least
and most wall time, and for the commands with a target (ADR-0050) the ratio to their reference
(``relayr --help`` and every command's ``--help``: at most 3x ``python -c "import click"``;
``relayr publish``: at most 1.3x ``python -c "import reflexr.workspace, reflexr.sql"``).

The runs take turns (one of each, then again), so a change of the machine's load weighs on all
alike, and every command runs once first, unmeasured, so that a database's migration happens
before the figures. Commands run on a fresh embedded home (SQLite, the broker in folders) with
the example application. Last, ``publish --data-file`` of ``--events`` events, in one process,
against publishing them one command each (measured on a tenth of them, and scaled).

    python -m bench.cli [--runs 7] [--events 300]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from bench.common import BENCH_HOME, REPO, emit, machine, note
from bench.workers import relayr_environment

REFERENCES: Final = {
    "import click": [sys.executable, "-c", "import click"],
    "import reflexr.workspace, reflexr.sql": [
        sys.executable,
        "-c",
        "import reflexr.workspace, reflexr.sql",
    ],
}
"""What a command is compared with: the least a command line in Python costs (click), and the
least a command that writes a reflexr event costs (the library itself)."""

TARGETS: Final = {
    "help": ("import click", 3.0),
    "publish": ("import reflexr.workspace, reflexr.sql", 1.3),
}
"""Each target: the reference and the ratio it must stay under (ADR-0050)."""

WHERE: Final = "bench/cli"


def relayr() -> list[str]:
    """The ``relayr`` console script next to this interpreter, else ``python -m relayr.cli``."""
    script = Path(sys.executable).with_name("relayr")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "relayr.cli"]


def deploy(thread_id: str, index: int) -> dict[str, str]:
    return {"service": f"svc-{index}", "status": "succeeded", "thread_id": thread_id}


def commands(thread_id: str) -> dict[str, tuple[list[str], str | None]]:
    """Each measured command, and the target it has (None: measured only)."""
    base = relayr()
    data = json.dumps(deploy(thread_id, 0))
    return {
        "relayr --help": ([*base, "--help"], "help"),
        "relayr publish --help": ([*base, "publish", "--help"], "help"),
        "relayr runs --help": ([*base, "runs", "--help"], "help"),
        "relayr --version": ([*base, "--version"], "help"),
        "relayr publish": (
            [*base, "publish", WHERE, "deploy:finished", "--data", data],
            "publish",
        ),
        "relayr thread create": ([*base, "thread", "create", WHERE, "--title", "bench"], None),
        "relayr runs list": ([*base, "runs", "list", "--limit", "5"], None),
        "relayr allowlist check": ([*base, "allowlist", "check"], None),
    }


def timed(command: Sequence[str], environment: Mapping[str, str]) -> float:
    """Wall time of one run of ``command``, which must succeed."""
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=REPO, env=dict(environment), capture_output=True, text=True, check=False
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return elapsed


def measure(
    measured: Mapping[str, Sequence[str]], environment: Mapping[str, str], runs: int
) -> dict[str, list[float]]:
    """Each command's wall times: once unmeasured, then ``runs`` rounds of one run of each."""
    for command in measured.values():
        timed(command, environment)
    times: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(runs):
        for name, command in measured.items():
            times[name].append(timed(command, environment))
    return times


def figures(name: str, seconds: Sequence[float]) -> dict[str, Any]:
    return {
        "bench": "cli",
        "command": name,
        "median_s": round(statistics.median(seconds), 4),
        "min_s": round(min(seconds), 4),
        "max_s": round(max(seconds), 4),
        "runs": len(seconds),
    }


def publish_file(environment: Mapping[str, str], thread_id: str, events: int) -> dict[str, Any]:
    """``publish --data-file`` of ``events`` events, against one ``relayr publish`` each."""
    home = Path(environment["RELAYR_HOME"])
    path = home / "events.jsonl"
    tag = uuid.uuid4().hex[:8]
    path.write_text("".join(json.dumps(deploy(thread_id, index)) + "\n" for index in range(events)))
    command = [
        *relayr(),
        "publish",
        WHERE,
        "deploy:finished",
        "--data-file",
        str(path),
        "--id-prefix",
        f"bench-{tag}",
    ]
    file_s = timed(command, environment)
    sample = max(1, events // 10)
    one_each_s = sum(
        timed(
            [*relayr(), "publish", WHERE, "deploy:finished", "--data", json.dumps(data)],
            environment,
        )
        for data in (deploy(thread_id, index) for index in range(sample))
    )
    loop_s = one_each_s / sample * events
    return {
        "bench": "cli",
        "command": "relayr publish --data-file",
        "events": events,
        "wall_s": round(file_s, 3),
        "events_per_s": round(events / file_s, 1),
        "one_command_each_s": round(loop_s, 2),
        "one_command_each_measured_on": sample,
        "speedup": round(loop_s / file_s, 1),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=7, help="measured runs of each command")
    parser.add_argument("--events", type=int, default=300, help="events of --data-file")
    parser.add_argument("--keep", action="store_true", help="keep the home")
    args = parser.parse_args(argv)
    home = BENCH_HOME / f"cli-{uuid.uuid4().hex[:8]}"
    home.mkdir(parents=True)
    environment = relayr_environment(home, queue=f"relayr.bench.{uuid.uuid4().hex[:12]}")
    emit({"bench": "machine", **machine()})
    try:
        created = subprocess.run(
            [*relayr(), "thread", "create", WHERE, "--title", "bench"],
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            check=True,
        )
        thread_id = created.stdout.strip()
        measured = commands(thread_id)
        note(f"{len(measured)} commands and 2 references, {args.runs} runs each")
        times = measure(
            {**REFERENCES, **{name: command for name, (command, _) in measured.items()}},
            environment,
            args.runs,
        )
        medians = {name: statistics.median(seconds) for name, seconds in times.items()}
        for name in REFERENCES:
            emit({**figures(name, times[name]), "reference": True})
        for name, (_, target) in measured.items():
            line = figures(name, times[name])
            if target is not None:
                reference, ratio = TARGETS[target]
                line["reference"] = reference
                line["ratio"] = round(medians[name] / medians[reference], 2)
                line["target_ratio"] = ratio
                line["met"] = line["ratio"] <= ratio
            emit(line)
        note(f"publish --data-file of {args.events} events")
        emit(publish_file(environment, thread_id, args.events))
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
