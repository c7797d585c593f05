"""relayr deployed for a benchmark: its own processes on a case's storage, fed by its command line.

:func:`deployment` makes a case's storage and home (:func:`bench.common.case_storage`), and
:class:`Deployment` starts relayr's commands in it (``relayr run``, ``relayr dispatch``), each a
process of its own logging to the home, and publishes events as a person's tools would, with
``relayr publish`` in a process of its own per call. Nothing here imports the dispatcher: the
benchmarks that use this module measure whichever dispatcher ``relayr`` runs, through the
command line and the stores (:mod:`bench.stamps`) alone.
"""

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bench.common import STORAGES, CaseStorage, StorageKind, case_storage, fresh_home, note
from bench.stamps import DEPLOY_FINISHED, TENANT
from bench.workers import REPO, relayr_environment
from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.settings import Settings

RUNTIME_STARTED: Final = '"runtime started"'
"""What a relayr process's JSON log says once its runtime runs (relayr.runtime.process)."""

PUBLISH_TIMEOUT_S: Final = 600.0
"""A bound on one ``relayr publish``, a file of thousands of events included, on a busy host."""


@dataclass
class Deployment:
    """One case's storage, home and settings, and the relayr processes started in it."""

    storage: CaseStorage
    home: Path
    environment: dict[str, str]
    settings: Settings
    processes: list[RelayrProcess] = field(default_factory=list)

    @property
    def described(self) -> dict[str, Any]:
        broker, database = STORAGES[self.storage.kind]
        return {"storage": self.storage.kind, "broker": broker, "database": database}

    def start(self, *args: str, name: str) -> RelayrProcess:
        """``relayr ARGS`` in this deployment, logging to ``<home>/<name>.log``; returned once
        its runtime runs (its log says so)."""
        process = RelayrProcess.start(
            relayr_command(*args),
            name=name,
            environment=self.environment,
            cwd=REPO,
            log_path=self.home / f"{name}.log",
        )
        self.processes.append(process)
        return process.ready(RUNTIME_STARTED)

    def publish(
        self, workspace: str, data: Mapping[str, Any], *, id: str
    ) -> "subprocess.Popen[str]":
        """Start ``relayr publish bench/WORKSPACE deploy:finished --data ... --id ID``; the
        process, to :func:`finished` with the others."""
        command = relayr_command(
            "publish", f"{TENANT}/{workspace}", DEPLOY_FINISHED, "--data", json.dumps(data)
        )
        return subprocess.Popen(
            [*command, "--id", id],
            cwd=REPO,
            env=self.environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    async def publish_paced(
        self,
        workspace: str,
        events: Sequence[tuple[str, Mapping[str, Any]]],
        interval_s: float,
    ) -> None:
        """Publish ``(id, data)`` events one every ``interval_s``, each by a ``relayr publish``
        of its own started on time (a slow one does not hold the next back); return when every
        one has ended, each having succeeded."""
        started = time.monotonic()
        running = []
        for index, (event_id, data) in enumerate(events):
            await asyncio.sleep(max(0.0, started + index * interval_s - time.monotonic()))
            running.append(self.publish(workspace, data, id=event_id))
        await asyncio.to_thread(finished, running)

    def publish_file(
        self, workspace: str, rows: Sequence[Mapping[str, Any]], *, id_prefix: str
    ) -> float:
        """``relayr publish --data-file`` of ``rows`` (one process, a transaction per 500); its
        wall time in seconds."""
        path = self.home / f"{id_prefix}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        command = relayr_command(
            "publish",
            f"{TENANT}/{workspace}",
            DEPLOY_FINISHED,
            "--data-file",
            str(path),
            "--id-prefix",
            id_prefix,
        )
        started = time.monotonic()
        done = subprocess.run(
            command,
            cwd=REPO,
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=PUBLISH_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"relayr publish --data-file failed:\n{done.stderr[-2000:]}")
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop every process started here (a warm shutdown, then SIGKILL)."""
        while self.processes:
            self.processes.pop().stop()


def finished(running: Sequence["subprocess.Popen[str]"]) -> None:
    """Wait for each ``relayr publish``; any that failed stops the benchmark, with its error."""
    for process in running:
        _, stderr = process.communicate(timeout=PUBLISH_TIMEOUT_S)
        if process.returncode != 0:
            raise SystemExit(f"relayr publish failed ({process.returncode}):\n{stderr[-2000:]}")


@contextlib.contextmanager
def deployment(
    kind: StorageKind, label: str, *, keep: bool = False, **settings: object
) -> Iterator[Deployment]:
    """A storage and home of their own for one case, with ``settings`` (``Settings`` field
    names) over the benchmarks' defaults; every process started in it is stopped after the
    block, and the home removed unless ``keep``."""
    home = fresh_home(label)
    note(f"{label}: home {home}")
    try:
        with case_storage(kind) as storage:
            environment = relayr_environment(home, **storage.overrides, **settings)
            deployed = Deployment(storage, home, environment, Settings.from_env(environment))
            try:
                yield deployed
            finally:
                deployed.stop()
    finally:
        if not keep:
            shutil.rmtree(home, ignore_errors=True)
