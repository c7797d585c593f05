"""The floor: bare notice commits on the same storage, with nothing of relayr around them.

``python -m bench.floor --storage sqlite postgres --n 1000`` commits N
``PostMessage(kind="notice")`` as an external agent (``ExternalAgentActor``), one after the
other, in one process, into threads of :data:`relayr.demo.DEPLOYS_PER_THREAD` as the end-to-end
benchmark's notices are, on a fresh SQLite file or PostgreSQL database. It is what one notice
costs the storage alone: one artifactr transaction. The end-to-end benchmark divides its time
per run by it (``ratio_to_floor``).
"""

import argparse
import asyncio
import shutil
import time
from collections.abc import Sequence
from typing import Any

from artifactr import ExternalAgentActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import CreateThread, PostMessage

from bench.common import (
    STORAGES,
    EngineCounter,
    StorageKind,
    case_storage,
    emit,
    fresh_home,
    machine,
    note,
    percentile,
    quiet_logging,
    storage_available,
)
from relayr.demo import CLI_USER, DEPLOYS_PER_THREAD
from relayr.runtime.application import open_storage
from relayr.settings import Settings

AGENT = ExternalAgentActor(client_id="reflexr:bench:floor", name="bench:floor")


async def _commits(settings: Settings, n: int) -> dict[str, Any]:
    storage = await open_storage(settings)
    assert storage.engine is not None
    try:
        counter = EngineCounter(storage.engine)
        workspaces = ArtifactWorkspaces(storage.artifacts)
        people = await workspaces.open("bench", "floor", actor=CLI_USER)
        threads = []
        for index in range(-(-n // DEPLOYS_PER_THREAD)):
            command = CreateThread(title=f"deploys {index + 1}")
            await people.commit(command)
            threads.append(command.thread_id)
        agent = people.as_actor(AGENT)
        before = counter.snapshot()
        took: list[float] = []
        cpu_started = time.process_time()
        started = time.perf_counter()
        for index in range(n):
            begun = time.perf_counter()
            await agent.commit(
                PostMessage(
                    thread_id=threads[index // DEPLOYS_PER_THREAD],
                    content=f"deploy of svc-{index:05d} finished: succeeded",
                    kind="notice",
                )
            )
            took.append((time.perf_counter() - begun) * 1000)
        elapsed_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        after = counter.snapshot()
    finally:
        await storage.engine.dispose()
    return {
        "ms_per_commit": round(elapsed_s * 1000 / n, 3),
        "commits_per_s": round(n / elapsed_s, 1),
        "cpu_ms_per_commit": round(cpu_s * 1000 / n, 3),
        "commit_ms": {
            "p50": round(percentile(took, 50) or 0, 2),
            "p99": round(percentile(took, 99) or 0, 2),
        },
        "transactions_per_commit": round((after["begin"] - before["begin"]) / n, 2),
    }


def measure(storage: StorageKind, n: int) -> dict[str, Any]:
    """The floor on a fresh storage of ``storage``'s kind: one JSON-ready figures dict."""
    home = fresh_home(f"floor-{storage}-n{n}")
    note(f"floor {storage} n={n}")
    load_before = machine()["load_avg"]
    try:
        with case_storage(storage) as case:
            settings = Settings(home=home, **case.overrides)
            figures = asyncio.run(_commits(settings, n))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    broker, database = STORAGES[storage]
    return {
        "bench": "floor",
        "storage": storage,
        "broker": broker,
        "database": database,
        "n": n,
        **figures,
        "load_avg": {"before": load_before, "after": machine()["load_avg"]},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1000])
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    args = parser.parse_args(argv)
    quiet_logging()
    for storage in args.storage:
        if not storage_available(storage):
            emit({"bench": "floor", "storage": storage, "skipped": "PostgreSQL is down"})
            continue
        for n in args.n:
            emit(measure(storage, n))


if __name__ == "__main__":
    main()
