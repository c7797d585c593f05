"""relayr deployed for a benchmark: its own processes on a case's storage, fed by its command line.

:func:`deployment` makes a case's storage and home (:func:`bench.common.case_storage`), and
:class:`Deployment` starts relayr's commands in it (``relayr run``, ``relayr dispatch``), each a
process of its own logging to the home, and publishes events as an application or a person's
tools would: a :class:`Publisher` feeds one ``relayr publish --stream`` process an event at a
time (``stream``, the default), or starts a ``relayr publish`` per event (``process``), and a
file goes through ``relayr publish --data-file``. Nothing here imports the dispatcher: the
benchmarks that use this module measure whichever dispatcher ``relayr`` runs, through the
command line and the stores (:mod:`bench.stamps`) alone.
"""

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from bench.common import STORAGES, CaseStorage, StorageKind, case_storage, fresh_home, note
from bench.stamps import DEPLOY_FINISHED, TENANT
from bench.workers import REPO, relayr_environment
from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.settings import Settings

RUNTIME_STARTED: Final = '"runtime started"'
"""What a relayr process's JSON log says once its runtime runs (relayr.runtime.process)."""

PUBLISH_TIMEOUT_S: Final = 600.0
"""A bound on one ``relayr publish``, a file of thousands of events included, on a busy host."""

Publishing = Literal["stream", "process"]
"""How paced events are published: ``stream``, each a line to one ``relayr publish --stream``
process (what an application publishing events does: no process starts during the measure);
``process``, each by a ``relayr publish`` of its own (a person's tool, or a cron job: each start
spends most of a second of CPU beside the processes measured)."""

PUBLISHINGS: Final[tuple[Publishing, ...]] = ("stream", "process")


@dataclass
class Deployment:
    """One case's storage, home and settings, and the relayr processes started in it."""

    storage: CaseStorage
    home: Path
    environment: dict[str, str]
    settings: Settings
    publishing: Publishing = "stream"
    processes: list[RelayrProcess] = field(default_factory=list)

    @property
    def described(self) -> dict[str, Any]:
        broker, database = STORAGES[self.storage.kind]
        return {
            "storage": self.storage.kind,
            "broker": broker,
            "database": database,
            "publishing": self.publishing,
        }

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

    @contextlib.asynccontextmanager
    async def publisher(self, workspace: str, id_prefix: str) -> AsyncIterator["Publisher"]:
        """A :class:`Publisher` into ``workspace`` (event N's id is ``ID_PREFIX-N``), started
        (its ``relayr publish --stream`` reading, under ``stream``) and ended after the block,
        every event it took having been published."""
        publisher = Publisher(self, workspace, id_prefix)
        try:
            yield await asyncio.to_thread(publisher.started)
            await asyncio.to_thread(publisher.close)
        finally:
            publisher.kill()

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


@dataclass
class Publisher:
    """Events into one workspace, an event at a time, by the deployment's :data:`Publishing`."""

    deployed: Deployment
    workspace: str
    id_prefix: str
    count: int = 0
    stream: "subprocess.Popen[str] | None" = None
    running: list["subprocess.Popen[str]"] = field(default_factory=list)
    reader: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))

    def started(self) -> "Publisher":
        """Under ``stream``, start the ``relayr publish --stream`` process and wait until it
        reads its input (its start is not in a measure)."""
        if self.deployed.publishing != "stream":
            return self
        command = relayr_command(
            "publish",
            f"{TENANT}/{self.workspace}",
            DEPLOY_FINISHED,
            "--data-file",
            "-",
            "--stream",
            "--id-prefix",
            self.id_prefix,
            "--json",
        )
        self.stream = subprocess.Popen(
            command,
            cwd=REPO,
            env=self.deployed.environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.stream.stderr is not None
        ready = self._answer(self.stream.stderr.readline)
        if "as it is read" not in ready:
            self._failed(ready)
        return self

    def publish(self, data: Mapping[str, Any]) -> None:
        """Publish one event: under ``stream``, return once it is in the log; under
        ``process``, once its ``relayr publish`` has started (:meth:`close` waits for it)."""
        self.count += 1
        if self.stream is None:
            event_id = f"{self.id_prefix}-{self.count}"
            self.running.append(self.deployed.publish(self.workspace, data, id=event_id))
            return
        assert self.stream.stdin is not None
        assert self.stream.stdout is not None
        self.stream.stdin.write(json.dumps(data) + "\n")
        self.stream.stdin.flush()
        answer = self._answer(self.stream.stdout.readline)
        if not answer.startswith("{"):
            self._failed(answer)

    async def paced(self, rows: Sequence[Mapping[str, Any]], interval_s: float) -> None:
        """Publish ``rows`` one every ``interval_s`` from now (a slow one delays the next)."""
        started = time.monotonic()
        for index, data in enumerate(rows):
            await asyncio.sleep(max(0.0, started + index * interval_s - time.monotonic()))
            await asyncio.to_thread(self.publish, data)

    def close(self) -> None:
        """Wait for every event taken to be published; stop the benchmark if one was not."""
        finished(self.running)
        self.running.clear()
        if self.stream is not None:
            _, stderr = self.stream.communicate(timeout=PUBLISH_TIMEOUT_S)
            if self.stream.returncode != 0:
                raise SystemExit(
                    f"relayr publish --stream failed ({self.stream.returncode}):\n{stderr[-2000:]}"
                )

    def kill(self) -> None:
        """End the publishing process, whatever state it is in, and the thread reading it."""
        for process in [*self.running, *([self.stream] if self.stream else [])]:
            process.kill()
            process.communicate()
        self.reader.shutdown()

    def _answer(self, readline: Any) -> str:
        """A line the stream printed, within :data:`PUBLISH_TIMEOUT_S`."""
        line: str = self.reader.submit(readline).result(PUBLISH_TIMEOUT_S)
        return line

    def _failed(self, line: str) -> None:
        assert self.stream is not None
        self.stream.kill()
        _, stderr = self.stream.communicate()
        raise SystemExit(f"relayr publish --stream failed: {line}{stderr[-2000:]}")


def finished(running: Sequence["subprocess.Popen[str]"]) -> None:
    """Wait for each ``relayr publish``; any that failed stops the benchmark, with its error."""
    for process in running:
        _, stderr = process.communicate(timeout=PUBLISH_TIMEOUT_S)
        if process.returncode != 0:
            raise SystemExit(f"relayr publish failed ({process.returncode}):\n{stderr[-2000:]}")


@contextlib.contextmanager
def deployment(
    kind: StorageKind,
    label: str,
    *,
    keep: bool = False,
    publishing: Publishing = "stream",
    **settings: object,
) -> Iterator[Deployment]:
    """A storage and home of their own for one case, with ``settings`` (``Settings`` field
    names) over the benchmarks' defaults, publishing paced events by ``publishing``; every
    process started in it is stopped after the block, and the home removed unless ``keep``."""
    home = fresh_home(label)
    note(f"{label}: home {home}")
    try:
        with case_storage(kind) as storage:
            environment = relayr_environment(home, **storage.overrides, **settings)
            deployed = Deployment(
                storage, home, environment, Settings.from_env(environment), publishing
            )
            try:
                yield deployed
            finally:
                deployed.stop()
    finally:
        if not keep:
            shutil.rmtree(home, ignore_errors=True)
