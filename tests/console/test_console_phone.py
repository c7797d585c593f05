"""The console in Chromium as an on-call operator uses it from a phone (375 px wide) and a
desk, on a real ``relayr console`` process over runs made by relayr's executor
(:mod:`tests.console.console_world`), while the worker is frozen: its ``relayr run`` says it
is up, its heartbeat is 70 s old.

What only a browser shows: nothing on the runs list scrolls sideways at 375 px; a wrong token
keeps the login form and where it led; every page says the worker is frozen; cancel asks for a
reason on its own page, and a reload of the result page after an action (a browser's reload
re-sends nothing) changes nothing more; the overview's chart is drawn. The screenshots are kept
in the test's directory (``RELAYR_CONSOLE_SHOTS`` names another) for people to look at.
"""

import os
import re
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest

from relayr.observe.health import SupervisorStatus, heartbeat_path, status_path, write_status
from tests.console.console_world import World, make_world
from tests.console.consoles import chromium, running_console
from tests.workers import relayr_environment, relayr_here

pytestmark = [pytest.mark.process, pytest.mark.slow]

TOKEN = "console-phone-token-0123456789abcd"
PHONE = {"width": 375, "height": 812}
DESK = {"width": 1280, "height": 900}
WIDE = """() => [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > window.innerWidth)
    .slice(0, 5).map(e => e.tagName + '.' + e.className + '#' + e.id)"""
"""What sticks out of the viewport, to name it when a page scrolls sideways."""


def freeze_worker(home: Path) -> None:
    """What a frozen worker leaves: ``relayr run``'s status says it runs, its heartbeat is old."""
    beat = heartbeat_path(home, "worker")
    beat.parent.mkdir(parents=True, exist_ok=True)
    beat.touch()
    stale = time.time() - 70
    os.utime(beat, (stale, stale))
    since = "2026-01-01T00:00:00.123456+00:00"
    write_status(
        status_path(home),
        SupervisorStatus(supervisor_pid=os.getpid(), state="running", worker_pid=4242, since=since),
    )


def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("RELAYR_CONSOLE_SHOTS", tmp_path / "shots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_an_operator_on_a_phone_finds_a_frozen_worker_and_acts_once(tmp_path: Path) -> None:
    environment = relayr_environment(
        tmp_path, app="tests.console.console_app:create_console_app", console_token=TOKEN
    )
    world: World = make_world(environment, dead=2, dead_elsewhere=1, pending=1)
    freeze_worker(tmp_path)
    folder = shots(tmp_path)
    [pending] = world.pending
    with running_console(environment, tmp_path) as console, chromium() as browser:
        page = browser.new_page(viewport=PHONE)
        going = "/runs?status=dead"
        page.goto(console.at("/login?" + urlencode({"next": going})))
        page.fill("input[name=token]", "wrong-token-0123456789")
        page.click("form.login button[type=submit]")
        assert "not the console's token" in page.locator("#message").inner_text()
        assert page.locator("input[name=next]").get_attribute("value") == going
        page.fill("input[name=token]", TOKEN)
        page.click("form.login button[type=submit]")
        page.wait_for_url(re.compile(r"/runs\?status=dead$"))

        banner = page.locator("#health-banner").inner_text()
        assert "worker frozen" in banner
        assert "worker pid 4242 is up since 2026-01-01 00:00:00 UTC" in banner
        assert page.locator("#runs tbody tr").count() == 5
        page.screenshot(path=str(folder / "runs-375.png"), full_page=True)
        width = page.evaluate("() => document.documentElement.scrollWidth")
        wide = page.evaluate(WIDE)
        assert width <= PHONE["width"], f"/runs is {width} px wide at 375 px: {wide}"
        status = page.locator("#runs tbody tr").first.locator("td[data-label=Status]")
        assert status.is_visible()
        box = status.bounding_box()
        assert box is not None
        assert box["x"] + box["width"] <= PHONE["width"]
        page.screenshot(path=str(folder / "runs-375.png"), full_page=True)

        # cancel asks for a reason on its own page; a reload of the result repeats nothing
        where = pending.where
        page.goto(console.at("/run?" + urlencode({"id": pending.id, "workspace": where})))
        page.screenshot(path=str(folder / "run-375.png"), full_page=True)
        page.click("#cancel")
        page.fill("#confirm input[name=reason]", "duplicate of an older alert")
        page.click("#confirm button[type=submit]")
        page.wait_for_url(re.compile(r"/done\?key="))
        for _ in range(2):
            page.reload()
            assert "cancelled" in page.locator("#results").inner_text()
        report = relayr_here(environment, "runs", "show", pending.id, "--workspace", where)
        assert [(a["action"], a["who"], a["reason"]) for a in report["actions"]] == [
            ("cancel", "console", "duplicate of an older alert")
        ]
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"]

        page.goto(console.at("/health"))
        state = page.locator('#heartbeats tr[data-role="worker"] td.state').inner_text()
        assert state == "frozen"
        assert "T00:00:00.123456" not in page.locator("#heartbeats").inner_text()
        page.screenshot(path=str(folder / "health-375.png"), full_page=True)

        desk = browser.new_page(viewport=DESK)
        desk.goto(console.at("/"))
        assert desk.locator("#chart rect.bar.dead").count() >= 1
        assert desk.locator('#figures [data-status="dead"] a').inner_text() == str(
            len(relayr_here(environment, "runs", "list", "--status", "dead"))
        )
        desk.screenshot(path=str(folder / "overview-1280.png"), full_page=True)
        desk.goto(console.at("/runs"))
        desk.screenshot(path=str(folder / "runs-1280.png"), full_page=True)
        page.goto(console.at("/"))
        page.screenshot(path=str(folder / "overview-375.png"), full_page=True)
        width = page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"]
