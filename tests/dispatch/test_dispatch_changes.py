"""The change feed on real storage (memory, SQLite, PostgreSQL): a commit that moves a log names
its workspace, one that does not names none, and a dropped trigger is caught by the sweep's
heads. On SQLite, a commit is noted because the database's files were written, not because the
feed asked on a timer; without inotify, the feed polls.

Events are published through the libraries themselves, as any process writing their store
would: the feed reads what the database says (a trigger and ``NOTIFY``, or SQLite's changes
table), not what relayr's own code did.
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import pytest
import structlog
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import SourceActor
from reflexr.workspace import WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import text

from relayr.dispatch.changes import SQLITE_BUSY_S, ChangeFeed, Changes, SqliteFeed, feed_for
from relayr.runtime.application import SharedStorage, open_storage
from relayr.settings import Settings
from tests.dispatch.dispatch_harness import Ping
from tests.services import SQL_STORAGES, STORAGES, storage_url

WAIT_S = 30.0
"""A bound on a notification's arrival; it arrives in milliseconds, the bound only ends a
failing test."""


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@pytest.fixture
async def storage(database_url: str, tmp_path: Path) -> AsyncIterator[SharedStorage]:
    shared = await open_storage(Settings(home=tmp_path, database_url=database_url))
    try:
        yield shared
    finally:
        for engine in shared.engines:
            await engine.dispose()


@pytest.fixture
async def feed(storage: SharedStorage) -> AsyncIterator[ChangeFeed]:
    started = feed_for(storage.engines, storage.rules)
    await started.start()
    try:
        yield started
    finally:
        await started.aclose()


async def gathered(feed: ChangeFeed, until: Callable[[Changes], bool]) -> Changes:
    """What the feed gathers until ``until`` holds, or what it has after WAIT_S."""
    total = Changes()
    async with asyncio.timeout(WAIT_S):
        while not until(total):
            await feed.wait(1.0)
            taken = feed.take()
            total.rules |= taken.rules
            total.artifacts |= taken.artifacts
            total.everything |= taken.everything
    return total


async def test_a_published_event_names_its_workspace(
    storage: SharedStorage, feed: ChangeFeed
) -> None:
    source = await RuleWorkspaces(storage.rules, events=[Ping]).open(
        "acme", "quiet", actor=SourceActor(name="test")
    )
    await source.publish(Ping())
    changes = await gathered(feed, lambda c: ("acme", "quiet") in c.rules)

    assert changes.rules == {("acme", "quiet")}
    assert not changes.everything


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_a_thread_created_in_artifactr_names_its_workspace(
    storage: SharedStorage, feed: ChangeFeed
) -> None:
    """(In memory, artifactr's logs are not seen: the dispatcher follows them every pass.)"""
    handle = await ArtifactWorkspaces(storage.artifacts).open(
        "acme", "chat", actor=UserActor(id="al")
    )
    await handle.create_thread("hello")
    changes = await gathered(feed, lambda c: ("acme", "chat") in c.artifacts)

    assert changes.artifacts == {("acme", "chat")}
    assert changes.rules == set()


async def test_a_commit_that_appends_nothing_names_nothing(
    storage: SharedStorage, feed: ChangeFeed
) -> None:
    """A run's lease taken and released moves no log: the feed stays quiet (a marker event in
    another workspace shows the feed is live)."""
    ref = WorkspaceRef("acme", "quiet")
    await storage.rules.acquire_lease(ref, "run:x", "someone", timedelta(seconds=5))
    await storage.rules.release_lease(ref, "run:x", "someone")
    marker = await RuleWorkspaces(storage.rules, events=[Ping]).open(
        "acme", "marker", actor=SourceActor(name="test")
    )
    await marker.publish(Ping())
    changes = await gathered(feed, lambda c: ("acme", "marker") in c.rules)

    assert changes.rules == {("acme", "marker")}


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_heads_show_a_workspace_the_dropped_trigger_hid(
    storage: SharedStorage, feed: ChangeFeed
) -> None:
    """Notifications cut (the trigger dropped by hand): nothing is named, yet the heads the
    sweep compares show the new event."""
    (engine,) = storage.engines
    async with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            await connection.execute(text("DROP TRIGGER relayr_log_moved ON reflexr_workspaces"))
        else:
            await connection.execute(text("DROP TRIGGER relayr_reflexr_moved"))
            await connection.execute(text("DROP TRIGGER relayr_reflexr_created"))
    source = await RuleWorkspaces(storage.rules, events=[Ping]).open(
        "acme", "hidden", actor=SourceActor(name="test")
    )
    await source.publish(Ping())
    await source.publish(Ping())
    await feed.wait(1.0)

    assert ("acme", "hidden") not in feed.take().rules
    heads = await feed.heads()
    assert heads is not None
    assert heads.rules[("acme", "hidden")] == 2


async def publish_ping(storage: SharedStorage, workspace: str) -> None:
    source = await RuleWorkspaces(storage.rules, events=[Ping]).open(
        "acme", workspace, actor=SourceActor(name="test")
    )
    await source.publish(Ping())


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_sqlite_commits_are_noted_as_the_files_are_written_not_by_a_timer(
    storage: SharedStorage,
) -> None:
    """With the quiet poll an hour apart, each commit is still noted: inotify said the
    database's files were written. Each publish comes once the feed went quiet again."""
    (engine,) = storage.engines
    feed = SqliteFeed(engine, quiet_poll_s=3600.0)
    with structlog.testing.capture_logs() as logs:
        await feed.start()
    assert logs == []  # it watches the files (else it would poll, and say so)
    try:
        for workspace in ("one", "two", "three"):
            await asyncio.sleep(3 * SQLITE_BUSY_S)  # past the busy polls: it waits on the files
            await publish_ping(storage, workspace)
            changes = await gathered(feed, lambda c, w=workspace: ("acme", w) in c.rules)
            assert changes.rules == {("acme", workspace)}
    finally:
        await feed.aclose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_without_inotify_the_sqlite_feed_polls_and_says_so(
    storage: SharedStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    import inotify_simple

    def refused(*_args: object, **_kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(inotify_simple, "INotify", refused)
    (engine,) = storage.engines
    feed = SqliteFeed(engine, quiet_poll_s=3600.0)
    with structlog.testing.capture_logs() as logs:
        await feed.start()
    try:
        await publish_ping(storage, "polled")
        changes = await gathered(feed, lambda c: ("acme", "polled") in c.rules)
        assert changes.rules == {("acme", "polled")}
    finally:
        await feed.aclose()
    [warning] = [log for log in logs if log["log_level"] == "warning"]
    assert warning["event"] == "the SQLite change feed polls: inotify is unavailable"
    assert "Too many open files" in warning["error"]
