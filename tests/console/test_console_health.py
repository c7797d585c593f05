"""The console's health over HTTP, on a real ``relayr console`` process and real storage, with
the example application: what is unhealthy is said once, coherently, on every page.

A frozen worker (``relayr run`` says it is up, its heartbeat is 70 s old) is ``frozen`` on
``/health``, with times for people, and named in the banner of every page; the queue's depth
has a table of its own; a follower's lag is a time; a follower's dead letters are listed with
their reason, and replayed from the page (a POST answered with a redirect).
"""

import asyncio
import html
import os
import re
import time
from pathlib import Path

import pytest
from artifactr import ExternalAgentActor, UserActor
from reflexr import SourceActor

from relayr.observe.health import SupervisorStatus, heartbeat_path, status_path, write_status
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import DeployFinished
from tests.console.consoles import Client, running_console
from tests.workers import relayr_environment, relayr_here

pytestmark = pytest.mark.process

TOKEN = "console-health-token-0123456789ab"


def ghost_notice(environment: dict[str, str]) -> None:
    """A rule's notice no run wrote (its follower cannot find its cause), and an event that
    makes reflexr know the tenant."""

    async def work() -> None:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            artifacts = await runtime.application.artifacts.open(
                "acme", "ops", actor=UserActor(id="alice")
            )
            thread = (await artifacts.create_thread("incident")).id
            rule = ExternalAgentActor(client_id="reflexr:ops:ghost", name="ops:ghost")
            await artifacts.as_actor(rule).post_message(thread, "boo", kind="notice")
            rules = await runtime.application.rules.open(
                "acme", "ops", actor=SourceActor(name="test")
            )
            await rules.publish(DeployFinished(service="api", status="ok", thread_id=thread))

    asyncio.run(work())


def freeze_worker(home: Path) -> None:
    beat = heartbeat_path(home, "worker")
    beat.parent.mkdir(parents=True, exist_ok=True)
    beat.touch()
    stale = time.time() - 70
    os.utime(beat, (stale, stale))
    write_status(
        status_path(home),
        SupervisorStatus(
            supervisor_pid=os.getpid(),
            state="running",
            worker_pid=4242,
            since="2026-01-01T00:00:00.123456+00:00",
        ),
    )


def text_of(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def test_a_frozen_worker_lag_in_time_and_dead_letters_replayed(tmp_path: Path) -> None:
    environment = relayr_environment(tmp_path, console_token=TOKEN)
    ghost_notice(environment)
    freeze_worker(tmp_path)
    with running_console(environment, tmp_path) as console:
        client = Client()
        _, page, _ = client.get(console.at("/health"))
        worker = re.search(r'<tr class="bad" data-role="worker">.*?</tr>', page, re.S)
        assert worker is not None, page
        row = text_of(worker[0])
        assert "frozen" in row
        assert "worker pid 4242 is up since 2026-01-01 00:00:00 UTC" in row
        assert "does not beat" in row
        assert "ok" not in row.split()
        assert ".123456" not in page
        assert re.search(r'<table id="queue".*?class="depth">\d+<', page, re.S)
        lag = re.search(r'data-workspace="acme/ops">.*?class="lag">([^<]+)<', page, re.S)
        assert lag is not None
        assert re.fullmatch(r"\d+(\.\d)? (s|min)( \d+ s)? \(\d+ envelope\(s\)\)", lag[1]), lag[1]
        for path in ("/", "/runs", "/allowlist", "/audit"):
            _, page, _ = client.get(console.at(path))
            assert "worker frozen: worker pid 4242 is up" in text_of(page), path

        relayr_here(environment, "follow", "--once")
        [letter] = relayr_here(environment, "follow", "dead-letters", "list")
        _, page, _ = client.get(console.at("/health"))
        assert f'data-envelope="{letter["envelope_id"]}"' in page
        assert "cause_missing" in page
        assert "1 follower dead letter(s) wait" in text_of(page)
        assert "up to date" in text_of(page)  # the lag, once followed

        _, page, _ = client.get(console.at("/login"))
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf is not None
        client.post(console.at("/login"), {"csrf": csrf[1], "token": TOKEN})
        _, page, _ = client.get(console.at("/health"))
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf is not None
        assert 'action="/dead-letters/replay"' in page
        status, _, headers = client.post(
            console.at("/dead-letters/replay"), {"csrf": csrf[1], "workspace": "acme/ops"}
        )
        assert (status, headers["location"]) == (303, "/health#dead-letters")
        _, page, _ = client.get(console.at("/health"))
        assert "Replayed: acme/ops: 0 bridged, 1 failed again" in text_of(page)
        _, page, _ = client.get(console.at("/health"))
        assert "Replayed:" not in page  # said once
    [again] = relayr_here(environment, "follow", "dead-letters", "list")
    assert again["tries"] == 2
