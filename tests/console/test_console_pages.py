"""The console's pages over HTTP, on a real ``relayr console`` process: what they show of what
is stored, and how they answer a bad request.

Stored markup comes back escaped; a bad parameter is one line naming it (400); a run or thread
that does not exist is 404; a run id that two workspaces hold, named without its workspace, is
a page that links to both runs. The consoles are :mod:`tests.console.console_http`'s; the runs
are fired by the CLI and reflexr's Reactor.
"""

import asyncio
import html
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from reflexr import SourceActor
from reflexr.workspace import Reactor, WorkspaceRef

from relayr.execution.limiting import checks_for
from relayr.ledger.limits import RunKey
from relayr.runtime.allowlist_file import load_allowlist
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.console.console_http import SCRIPT, WHERE, environment_of
from tests.console.consoles import Client, Console, chromium, running_console
from tests.console.test_console_phone import DESK, PHONE, WIDE, shots
from tests.workers import relayr_here

pytestmark = pytest.mark.process


def test_stored_markup_comes_back_as_text(read_only: tuple[Console, str]) -> None:
    console, thread = read_only
    client = Client()
    pages: dict[str, Any] = {
        "thread": client.get(console.at(f"/thread?workspace={WHERE}&id={thread}")),
        "allowlist": client.get(console.at("/allowlist")),
        "rule filter": client.get(console.at("/runs?rule=" + SCRIPT)),
    }
    for name, (status, page, _) in pages.items():
        assert status == 200, name
        assert "<script" not in page, name
        assert "&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;" in page, name


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/runs?since=yesterday", "since 'yesterday' is not a duration"),
        ("/runs?workspace=acme/ops/x", "workspace 'acme/ops/x' is malformed"),
        ("/runs?workspace=a%20b", "workspace 'a b' is malformed: expected TENANT or TENANT/"),
        ("/runs?status=lost", "status 'lost' is not one of dead, retrying, running, pending"),
        ("/runs?sort=size", "sort 'size' is not one of created, changed"),
        ("/runs?from=yesterday", "from 'yesterday' is not a time"),
        ("/runs?after=x", "after 'x' is not a page's cursor"),
        ("/event?workspace=acme/ops&seq=0", "seq '0' is not a position in the log"),
        ("/run?id=a%20b", "id 'a b' is malformed"),
        ("/thread?workspace=acme/ops", "id '' is malformed"),
        ("/retry-dead?since=2x", "since '2x' is not a duration"),
        ("/runs/act?action=delete&run=acme/ops/fir_1", "action 'delete' is not one of retry"),
        ("/runs/act?action=skip", "no run selected: tick the runs to act on"),
        ("/runs/act?action=skip&run=fir_1", "run 'fir_1' is malformed: expected TENANT/"),
        (
            "/runs/act?action=skip&" + "&".join(f"run=acme/ops/fir_{n}" for n in range(101)),
            "101 runs selected: at most 100 at once",
        ),
    ],
)
def test_a_bad_parameter_is_one_line_naming_it(
    token_console: Console, path: str, message: str
) -> None:
    status, page, _ = Client().get(token_console.at(path))
    assert status == 400
    assert message in html.unescape(page)


def test_a_run_or_thread_that_does_not_exist_is_404(token_console: Console) -> None:
    client = Client()
    status, page, _ = client.get(token_console.at("/run?id=fir_0000000000000000"))
    assert (status, "no run fir_0000000000000000" in page) == (404, True)
    status, page, _ = client.get(token_console.at(f"/thread?workspace={WHERE}&id=thr_0"))
    assert (status, "thread thr_0 does not exist in acme/ops" in page) == (404, True)


def test_a_run_id_two_workspaces_hold_is_shown_with_its_workspace_only(tmp_path: Path) -> None:
    """The same rule firing at the same seq in two workspaces makes the same run id: a page
    that names the id alone, and a search for it, link to both runs."""
    environment = environment_of(tmp_path)
    data = json.dumps({"thread_id": "thr_1", "payload": "same"})
    for where in ("acme/ops", "acme/billing"):
        relayr_here(environment, "publish", where, "consolew:hostile", "--data", data)

    async def fired() -> set[str]:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            rules = runtime.application.rules
            await Reactor(rules, actions=runtime.application.actions).evaluate()
            ids = set()
            for workspace in ("ops", "billing"):
                log = await rules.open("acme", workspace, actor=SourceActor(name="test"))
                ids |= {run.id for run in await log.runs()}
            return ids

    [run_id] = asyncio.run(fired())  # the premise: one id, in both workspaces
    with running_console(environment, tmp_path) as console:
        client = Client()
        for path in (f"/run?id={run_id}", f"/search?q={run_id}"):
            status, page, _ = client.get(console.at(path))
            assert status == 200, path
            links = set(re.findall(r'href="(/run\?[^"]+)"', html.unescape(page)))
            assert links == {
                f"/run?id={run_id}&workspace=acme%2Fbilling",
                f"/run?id={run_id}&workspace=acme%2Fops",
            }, path
        assert "is in 2 workspaces" in page_of(client, console.at(f"/run?id={run_id}"))
        status, page, _ = client.get(console.at(f"/run?id={run_id}&workspace=acme/billing"))
        assert status == 200
        assert "acme/billing" in page


def page_of(client: Client, url: str) -> str:
    return html.unescape(client.get(url)[1])


def test_the_limits_page_and_the_runs_a_limit_holds_back(tmp_path: Path) -> None:
    """Two runs of a rule bound to one run in flight: the first holds the slot (admitted, as a
    worker's claim admits it, in the limit store every worker counts in), the second waits. The
    limits page shows the use and the wait, the runs page says why the run waits, and the
    overview counts it."""
    allowlist = tmp_path / "allowlist.toml"
    allowlist.write_text('[limits.gate]\nrules = ["console:hostile"]\nruns_in_flight = 1\n')
    environment = environment_of(tmp_path, allowlist=allowlist)
    for payload in ("first", "second"):
        data = json.dumps({"thread_id": "thr_1", "payload": payload})
        relayr_here(environment, "publish", WHERE, "consolew:hostile", "--data", data)

    async def one_waits() -> str:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            rules = runtime.application.rules
            await Reactor(rules, actions=runtime.application.actions).evaluate()
            log = await rules.open("acme", "ops", actor=SourceActor(name="test"))
            first, second = sorted(await log.runs(), key=lambda run: run.fired_seq)
            ref, store, now = WorkspaceRef("acme", "ops"), runtime.bridge.limits, rules.clock()
            allowlists = load_allowlist(allowlist)
            refusals = [
                await store.admit(
                    RunKey("acme", "ops", run.id),
                    checks_for(allowlists, ref, run),
                    now=now,
                    lease_until=now + timedelta(hours=1),
                )
                for run in (first, second)
            ]
            assert refusals[0] is None
            assert refusals[1] is not None
            return second.id

    waiting = asyncio.run(one_waits())
    with running_console(environment, tmp_path) as console:
        client = Client()
        status, page, _ = client.get(console.at("/limits"))
        assert status == 200, page
        row = re.search(
            r'<tr data-limit="limits.gate" data-kind="runs_in_flight".*?</tr>', page, re.S
        )
        assert row is not None, page
        assert re.search(r'class="used">1<', row[0])
        assert re.search(r'class="waiting"><a [^>]*>1</a>', row[0])
        runs = page_of(client, console.at("/runs?status=pending"))
        line = re.search(rf'data-run="{waiting}">.*?</tr>', runs, re.S)
        assert line is not None, runs
        assert "waiting: runs_in_flight 1 of limits.gate" in line[0]
        overview = page_of(client, console.at("/"))
        waits = re.search(r'<table id="limit-waits">.*?</table>', overview, re.S)
        assert waits is not None
        assert "limits.gate" in waits[0]
        assert ">1</a>" in waits[0]
        with chromium() as browser:
            folder = shots(tmp_path)
            for size, viewport in (("375", PHONE), ("1280", DESK)):
                page = browser.new_page(viewport=viewport)
                for path, name in (("/limits", "limits"), ("/runs?status=pending", "waiting")):
                    page.goto(console.at(path))
                    page.screenshot(path=str(folder / f"{name}-{size}.png"), full_page=True)
                    width = page.evaluate("() => document.documentElement.scrollWidth")
                    assert width <= viewport["width"], (path, width, page.evaluate(WIDE))
                page.close()
