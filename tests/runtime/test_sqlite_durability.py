"""The embedded database in write-ahead-log mode keeps every commit of a process that is killed.

A subprocess commits notices through relayr's own engine (as a worker does), says how many, and
SIGKILLs itself before it could close anything; a fresh process then finds every one of them,
and the file in WAL mode (ADR-0025).
"""

import asyncio
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import MessagePosted
from artifactr.sql import SqlStorage

from relayr.runtime.application import create_engine

pytestmark = pytest.mark.process

NOTICES = 50

WRITER = """
import asyncio, os, signal, sys
from artifactr import UserActor, Workspaces
from artifactr.sql import SqlStorage, migrate
from relayr.runtime.application import create_engine

async def main(path, count):
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    await migrate(engine)
    workspace = await Workspaces(SqlStorage(engine)).open("t", "w", actor=UserActor(id="u"))
    thread = (await workspace.create_thread("crash")).id
    for index in range(count):
        await workspace.post_message(thread, f"notice {index}", kind="notice")
    print(thread, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_commits_survive_a_killed_process(tmp_path: Path) -> None:
    path = tmp_path / "relayr.db"
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(path), str(NOTICES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    thread = done.stdout.strip()

    with sqlite3.connect(path) as database:
        assert database.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert asyncio.run(_notices(path, thread)) == [f"notice {index}" for index in range(NOTICES)]


async def _notices(path: Path, thread: str) -> list[str]:
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        workspace = await ArtifactWorkspaces(SqlStorage(engine)).open(
            "t", "w", actor=UserActor(id="u")
        )
        return [
            e.event.content
            for e in await workspace.read(threads={thread})
            if isinstance(e.event, MessagePosted)
        ]
    finally:
        await engine.dispose()
