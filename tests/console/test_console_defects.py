"""Each of the console's former defects, in Chromium, on one real ``relayr console`` process over
runs made by relayr's executor (:mod:`tests.console.console_world`): each test checks in the
browser the behaviour its fix brought, and that a reload after an action repeats nothing. Also
the overview's counts against the store's, the login, a refused run's and a traced run's links,
and a replay of dead letters (on a console of its own, the example application's).
"""

import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from reflexr import SourceActor
from reflexr.workspace import Reactor

from relayr.console.queries import STATUS_FILTERS
from relayr.console.security import LOGGED_IN_AT, SESSION_COOKIE, SESSION_MAX_AGE_S
from relayr.execution.executor import execute_run
from relayr.observe import telemetry
from relayr.ops.runs import operator
from relayr.runtime.process import Runtime
from tests.console.console_app import HostileDue
from tests.console.console_world import (
    Fired,
    World,
    execute,
    fire,
    in_runtime,
    make_world,
    run_to_end,
    thread_in,
)
from tests.console.consoles import Client, Console, chromium, running_console, signed_session
from tests.console.test_console_health import ghost_notice
from tests.console.test_console_operations import run_url
from tests.ops.ops_app import FIXED, BackupDue, DiskFull
from tests.workers import relayr_environment, relayr_here

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = [pytest.mark.process, pytest.mark.slow]

TOKEN = "console-defects-token-0123456789ab"

RETRY = "acme/retry"
"""The bulk retry's own workspace: its dead runs are retried by no other test."""

MOMENT = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
"""A moment as the console shows it."""

PICKED = "acme/picked"
"""The workspace of the runs the selected-runs test acts on: no other test reads them."""

BULK = "acme/bulk"
PAGED = 55
"""Runs of :data:`BULK`: a page of 50 and some, for the keyset paging."""

TRACE_URL = "http://jaeger.example/trace/{trace_id}"
"""The console's ``RELAYR_TRACE_URL``."""

NO_TURNS = '[default]\nthreads = "chain"\n'
"""The world's allowlist: no rule may send, so ``ops:send-then-die`` is refused before it kills
the process that executes it (this one)."""


@dataclass
class Defects:
    """The world of :func:`make_world`, with the runs it does not make."""

    world: World
    retrying: Fired
    succeeded: Fired
    cancelled: Fired
    doomed: list[Fired]
    """Dead runs of :data:`RETRY` that a retry may save (their thread exists)."""
    gone: Fired
    """A dead run of :data:`RETRY` whose thread does not exist."""
    paged: list[str]
    refused: Fired
    """Dead ``not_allowed``: its send was refused by the allowlist."""
    traced: Fired
    trace_id: str
    """The trace of :attr:`traced`'s one attempt, as its span was exported."""
    picked: list[Fired]
    """Three pending runs of :data:`PICKED`."""


@pytest.fixture(scope="module")
def browser() -> Iterator["Browser"]:
    with chromium() as found:
        yield found


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, browser: "Browser"
) -> Iterator[tuple[Defects, Console]]:
    home = tmp_path_factory.mktemp("defects")
    allowlist = home / "allowlist.toml"
    allowlist.write_text(NO_TURNS)
    environment = relayr_environment(
        home,
        app="tests.console.console_app:create_console_app",
        console_token=TOKEN,
        allowlist=allowlist,
        trace_url=TRACE_URL,
    )
    made = make_world(environment, dead=3, dead_elsewhere=1, hostile=2, pending=2)
    defects: Defects = in_runtime(environment, lambda runtime: more_runs(runtime, made, home))
    with running_console(environment, home) as console:
        yield defects, console


async def more_runs(runtime: Runtime, made: World, home: Path) -> Defects:
    """A retrying run, a succeeded one and a cancelled one; dead runs of :data:`RETRY`;
    :data:`PAGED` pending runs of ``acme/bulk``; a run refused by the allowlist and a traced
    one; three pending runs of :data:`PICKED`."""
    thread = made.threads["acme/ops"]
    retrying = await fire(runtime, "acme/ops", BackupDue(thread_id=thread))
    await execute_run(runtime, "acme", "ops", retrying.id)  # the first of its two attempts
    (home / FIXED).touch()
    succeeded = await fire(runtime, "acme/ops", BackupDue(thread_id=thread))
    assert await run_to_end(runtime, succeeded) == "succeeded"
    (home / FIXED).unlink()
    event = HostileDue(thread_id=made.threads["zeta/ops"], payload="not needed")
    cancelled = await fire(runtime, "zeta/ops", event)
    rules = runtime.application.rules
    log = await rules.open("zeta", "ops", actor=operator("ops", via="cli"))
    await log.cancel_run(cancelled.id, reason="not needed")
    here = await thread_in(runtime, RETRY, "backups")
    doomed = [await fire(runtime, RETRY, BackupDue(thread_id=here)) for _ in range(2)]
    gone = await fire(runtime, RETRY, BackupDue(thread_id="thr_gone"))
    for fired in (*doomed, gone):
        assert await run_to_end(runtime, fired) == "dead"
    bulk = await rules.open(*BULK.split("/"), actor=SourceActor(name="test"))
    await bulk.publish_many(
        [HostileDue(thread_id="thr_bulk", payload=str(n)) for n in range(PAGED)]
    )
    await Reactor(rules, actions=runtime.application.actions).evaluate()
    paged = [run.id for run in await bulk.runs()]
    assert len(paged) == PAGED
    refused = await fire(runtime, "acme/ops", DiskFull(thread_id=thread))
    assert await run_to_end(runtime, refused) == "dead"
    traced = await fire(runtime, "acme/ops", HostileDue(thread_id=thread, payload="traced"))
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry.enable(provider)  # relayr's spans, as a worker with RELAYR_OTEL=1 makes them
    try:
        assert await run_to_end(runtime, traced) == "dead"
    finally:
        telemetry.disable()
        provider.shutdown()
    [attempt] = [s for s in spans.get_finished_spans() if s.name == "relayr.run console:hostile"]
    assert attempt.context is not None
    trace_id = f"{attempt.context.trace_id:032x}"
    picked = [
        await fire(runtime, PICKED, HostileDue(thread_id=thread, payload=str(n))) for n in range(3)
    ]
    return Defects(
        made, retrying, succeeded, cancelled, doomed, gone, paged, refused, traced, trace_id, picked
    )


def log_in(browser: "Browser", console: Console, going: str = "/runs") -> "Page":
    """A page of a new browser context, logged in with the token, at ``going``."""
    page = browser.new_context().new_page()
    page.goto(console.at("/login?" + urlencode({"next": going})))
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button[type=submit]")
    page.wait_for_url(console.at(going))
    return page


def local(url: str) -> str:
    """A console's URL as its own links name it: path and query."""
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}" if parts.query else parts.path


def listed(page: "Page") -> list[tuple[str, str]]:
    """Every run the runs list shows, from this page through its next pages: workspace, id."""
    found: list[tuple[str, str]] = []
    while True:
        where = page.locator("#runs tbody tr[data-run] td[data-label=Workspace]")
        found += zip(where.all_inner_texts(), row_ids(page), strict=True)
        following = page.locator("#next-page")
        if following.count() == 0:
            return sorted(found)
        following.click()
        page.wait_for_url(re.compile(r"after="))


def reloaded(page: "Page") -> None:
    """Reload the page, which must be read again with a GET (a POST's answer was redirected)."""
    answer = page.reload()
    assert answer is not None
    assert answer.request.method == "GET"


def confirmed(page: "Page", reason: str) -> None:
    """Give the confirmation its required reason, confirm, and wait for the result page."""
    field = page.locator("#confirm input[name=reason]")
    assert field.get_attribute("required") is not None
    field.fill(reason)
    page.click("#confirm button[type=submit]")
    page.wait_for_url(re.compile(r"/done\?key="))


def visitor(browser: "Browser") -> "Page":
    return browser.new_context().new_page()


def row_ids(page: "Page", table: str = "#runs") -> list[str]:
    ids: list[str] = page.locator(f"{table} tbody tr[data-run]").evaluate_all(
        "rows => rows.map(row => row.dataset.run)"
    )
    return ids


def audit_rows(page: "Page", console: Console, fired: Fired) -> list[list[str]]:
    """The audit page's rows of one run: who, what, why."""
    page.goto(console.at("/audit"))
    rows = page.locator(f'#audit tbody tr[data-run="{fired.id}"]')
    found = []
    for index in range(rows.count()):
        cells = rows.nth(index).locator("td").all_inner_texts()
        if cells[5] == fired.where:
            found.append([cells[1], cells[2], cells[6]])
    return found


def test_next_attempt_is_shown_for_pending_and_retrying_runs_only_3(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    made = defects.world
    page = visitor(browser)
    for fired, status in ((made.pending[1], "pending"), (defects.retrying, "retrying")):
        page.goto(run_url(console, fired.id, fired.where))
        assert page.locator("#status").inner_text() == status
        assert page.locator("#next-attempt").is_visible(), status
        assert re.match(MOMENT, page.locator("#next-attempt").inner_text()), status
    for fired, status in (
        (made.dead[0], "dead"),
        (defects.succeeded, "succeeded"),
        (defects.cancelled, "cancelled"),
    ):
        page.goto(run_url(console, fired.id, fired.where))
        assert page.locator("#status").inner_text() == status
        assert page.locator("#next-attempt").count() == 0, status
        assert "Next attempt" not in page.locator("#summary").inner_text(), status


def test_attempts_are_numbered_across_two_retries_with_their_end_and_duration_2(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    made = defects.world
    run = made.hostile[0]  # dead at its first attempt: permanent
    page = log_in(browser, console, local(run_url(console, run.id, run.where)))
    for retried in (1, 2):
        page.click("form[action='/run/retry'] button")
        page.wait_for_url(re.compile(r"/done\?key="))
        assert execute(made.environment, [run]) == ["dead"]
        page.reload()  # the result page: it shows the run as it is now, and retries nothing
        now = page.locator(f'#results tr[data-run="{run.id}"] td.now').inner_text()
        assert now.startswith("dead"), now
        page.goto(run_url(console, run.id, run.where))
        whats = page.locator("#operator-actions tbody tr td[data-label=What]").all_inner_texts()
        assert whats == ["retry"] * retried
    assert page.locator("#attempt-count").inner_text() == "3 (1 since the last retry)"
    rows = page.locator("#attempts tbody tr")
    assert rows.locator("td[data-label='#']").all_inner_texts() == ["1", "2", "3"]
    for ended in rows.locator("td[data-label=Ended]").all_inner_texts():
        assert re.fullmatch(MOMENT, ended), ended
    for took in rows.locator("td[data-label=Took]").all_inner_texts():
        assert re.fullmatch(r"\d+(\.\d)? s|\d+ min( \d+ s)?", took), took
    assert rows.locator("td[data-label=Outcome]").all_inner_texts() == ["dead"] * 3


def test_skip_asks_a_reason_records_who_and_why_and_a_reload_repeats_nothing_4_5(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    run = defects.world.pending[0]
    page = log_in(browser, console, local(run_url(console, run.id, run.where)))
    assert page.locator("#status").inner_text() == "pending"
    assert page.locator("form[action='/run/retry']").count() == 0  # no retry of a pending run
    assert page.locator("form[action='/run/skip']").count() == 0  # a link to a confirmation
    page.click("#skip")
    page.wait_for_url(re.compile(r"/run/skip\?id="))
    confirm = page.url
    reason = page.locator("#confirm input[name=reason]")
    assert reason.get_attribute("required") is not None
    page.click("#confirm button[type=submit]")  # empty: the browser does not send it
    assert reason.evaluate("input => input.validity.valueMissing") is True
    assert page.url == confirm
    reason.fill("   ")  # blanks only: sent, and refused by the console
    page.click("#confirm button[type=submit]")
    page.wait_for_load_state()
    assert "reason is required" in page.locator("#message").inner_text()
    page.goto(run_url(console, run.id, run.where))
    assert page.locator("#status").inner_text() == "pending"

    page.goto(confirm)
    page.fill("#confirm input[name=reason]", "duplicate alert")
    page.click("#confirm button[type=submit]")
    page.wait_for_url(re.compile(r"/done\?key="))
    for _ in range(2):
        page.reload()
        assert "skipped" in page.locator(f'#results tr[data-run="{run.id}"]').inner_text()
    page.goto(run_url(console, run.id, run.where))
    assert page.locator("#status").inner_text() == "skipped"
    assert page.locator("#status-why").inner_text() == "by console: duplicate alert"
    acted = page.locator("#operator-actions tbody tr td").all_inner_texts()
    assert acted[1:] == ["console", "skip", "duplicate alert"]
    assert audit_rows(page, console, run) == [["console", "skip", "duplicate alert"]]
    report = relayr_here(
        defects.world.environment, "runs", "show", run.id, "--workspace", run.where
    )
    assert [(a["action"], a["who"], a["reason"]) for a in report["actions"]] == [
        ("skip", "console", "duplicate alert")
    ]


def test_the_status_filter_offers_pending_and_lists_pending_runs_7(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    page = visitor(browser)
    page.goto(console.at("/runs"))
    offered = page.locator("select[name=status] option").evaluate_all(
        "options => options.map(option => option.value)"
    )
    assert "pending" in offered
    assert "due" not in offered
    page.select_option("select[name=status]", "pending")
    page.fill("input[name=workspace]", "zeta/ops")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"status=pending"))
    statuses = page.locator("#runs tbody td[data-label=Status]").all_inner_texts()
    assert set(statuses) == {"pending"}
    listed = set(row_ids(page))
    assert defects.world.pending[1].id in listed  # [0] may be skipped by now
    assert listed <= {run.id for run in defects.world.pending}
    page.goto(console.at("/runs?status=pending"))
    statuses = page.locator("#runs tbody td[data-label=Status]").all_inner_texts()
    assert len(statuses) == 50
    assert set(statuses) == {"pending"}


def test_the_rule_filter_takes_a_part_in_any_case_and_the_workspace_a_tenant_8(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    made = defects.world
    page = visitor(browser)
    page.goto(console.at("/runs"))
    page.fill("input[name=rule]", "BACKUP-CH")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"rule=BACKUP-CH"))
    assert "ops:backup-check" in page.locator("#rules-matched").inner_text()
    rules = page.locator("#runs tbody td[data-label=Rule]").all_inner_texts()
    backups = len(made.dead) + len(made.missing_thread) + 2 + len(defects.doomed) + 1
    assert rules == ["ops:backup-check"] * backups

    page.fill("input[name=rule]", "")
    page.fill("input[name=workspace]", "zeta")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"workspace=zeta(&|$)"))
    where = page.locator("#runs tbody td[data-label=Workspace]").all_inner_texts()
    assert set(where) == {"zeta/ops"}
    assert set(row_ids(page)) == {run.id for run in made.pending} | {defects.cancelled.id}


def test_the_search_box_finds_a_run_two_workspaces_hold_and_an_event_9(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    made = defects.world
    run = made.dead[0]
    every = relayr_here(made.environment, "runs", "list", "--limit", "10000")
    holders = {f"{r['tenant_id']}/{r['workspace_id']}" for r in every if r["id"] == run.id}
    assert len(holders) >= 2  # the premise: one rule firing at one seq in two workspaces
    page = visitor(browser)
    page.goto(console.at("/runs"))
    with page.expect_navigation() as navigation:
        page.fill("header input[name=q]", run.id)
        page.press("header input[name=q]", "Enter")
    answer = navigation.value
    assert answer is not None
    assert answer.status == 200  # not 400: the id alone names two runs
    links = page.locator('#hits tr[data-kind="run"] a').evaluate_all(
        "links => links.map(link => link.getAttribute('href'))"
    )
    assert sorted(links) == sorted(
        "/run?" + urlencode({"id": run.id, "workspace": where}) for where in holders
    )

    page.fill("header input[name=q]", run.event_id)
    page.press("header input[name=q]", "Enter")
    page.wait_for_url(re.compile(r"/event\?"))
    assert page.locator("h1").inner_text() == f"Event {run.event_id}"
    assert parse_qs(urlsplit(page.url).query)["workspace"] == [run.where]


def test_acknowledging_a_dead_run_once_and_sorting_by_change_puts_it_first_10(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    run = defects.world.dead[1]
    page = log_in(browser, console, local(run_url(console, run.id, run.where)))
    page.click("#acknowledge")
    page.wait_for_url(re.compile(r"/run/skip\?.*acknowledge=1"))
    assert "Acknowledging it skips it" in page.locator("main").inner_text()
    confirmed(page, "host retired")
    for _ in range(2):
        reloaded(page)
        assert "skipped" in page.locator(f'#results tr[data-run="{run.id}"]').inner_text()
    assert audit_rows(page, console, run) == [["console", "skip", "host retired"]]
    report = relayr_here(
        defects.world.environment, "runs", "show", run.id, "--workspace", run.where
    )
    assert [(a["action"], a["reason"]) for a in report["actions"]] == [("skip", "host retired")]
    page.goto(run_url(console, run.id, run.where))
    assert page.locator("#status-why").inner_text() == "by console: host retired"
    page.goto(console.at("/runs?workspace=acme/ops"))
    assert row_ids(page)[0] != run.id  # created long before the others
    page.click("#runs thead a:has-text('Changed')")
    page.wait_for_url(re.compile(r"sort=changed"))
    assert row_ids(page)[0] == run.id
    first = page.locator("#runs tbody tr").first.locator("td[data-label=Status]")
    assert first.inner_text() == "skipped"


def test_a_runs_event_links_its_thread_and_the_thread_links_back_to_the_run_12(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    run = defects.world.dead[2]
    page = visitor(browser)
    page.goto(run_url(console, run.id, run.where))
    assert page.locator("#status").inner_text() == "dead"
    page.click(f"article.event a.thread-link:has-text('{run.thread}')")
    page.wait_for_url(re.compile(r"/thread\?"))
    assert parse_qs(urlsplit(page.url).query) == {"workspace": [run.where], "id": [run.thread]}
    back = page.locator(f"#transcript a.run-link:has-text('posted by run {run.id}')")
    assert back.count() >= 1
    back.first.click()
    page.wait_for_url(re.compile(r"/run\?"))
    assert parse_qs(urlsplit(page.url).query) == {"id": [run.id], "workspace": [run.where]}
    assert page.locator("#status").inner_text() == "dead"
    # the rule's allowlist entry
    page.click("#summary a:has-text('allowlist')")
    page.wait_for_url(re.compile(r"/allowlist#rule-ops:backup-check$"))


def test_the_bulk_preview_sets_apart_a_run_that_fails_again_and_retries_once_13(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    page = log_in(browser, console, "/runs?" + urlencode({"status": "dead", "workspace": RETRY}))
    page.click("#retry-dead")
    page.wait_for_url(re.compile(r"/retry-dead\?"))
    gone = page.locator(f'#preview tr[data-run="{defects.gone.id}"]')
    assert gone.get_attribute("data-verdict") == "fails-again"
    assert "will fail again: thread thr_gone does not exist in acme/retry" in gone.inner_text()
    assert "1 run(s) will certainly fail again" in page.locator("#doomed").inner_text()
    confirmed = page.locator("#confirm input[name=run]").evaluate_all(
        "inputs => inputs.map(input => input.value)"
    )
    assert f"{RETRY}/{defects.gone.id}" not in confirmed

    page.click("#reasons a:has-text('backup_down')")
    page.wait_for_url(re.compile(r"reason=backup_down"))
    doomed = sorted(run.id for run in defects.doomed)
    assert sorted(row_ids(page, "#preview")) == doomed
    page.click("#reasons a:has-text('thread_not_found')")
    page.wait_for_url(re.compile(r"reason=thread_not_found"))
    assert row_ids(page, "#preview") == [defects.gone.id]
    page.click("#reasons a:has-text('backup_down')")
    page.wait_for_url(re.compile(r"reason=backup_down"))

    page.click("#confirm button[type=submit]")
    page.wait_for_url(re.compile(r"/done\?key="))
    assert "2 done, 0 refused" in page.locator("#summary").inner_text()
    # dead again (the backup is still down): a second retry would now be taken, and is not made
    assert execute(defects.world.environment, defects.doomed) == ["dead", "dead"]
    for _ in range(2):
        page.reload()
        assert sorted(row_ids(page, "#results")) == doomed
        now = page.locator("#results td.now").all_inner_texts()
        assert now == ["dead (backup_down)"] * 2, now
    for run in defects.doomed:
        assert audit_rows(page, console, run) == [["console", "retry", "-"]]
        page.goto(run_url(console, run.id, run.where))
        assert page.locator("#status").inner_text() == "dead"
        assert page.locator("#attempts tbody tr").count() == 4
    page.goto(run_url(console, defects.gone.id, RETRY))
    assert page.locator("#status").inner_text() == "dead"


def test_next_page_links_reach_the_oldest_run_and_the_favicon_is_an_icon_15(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    page = visitor(browser)
    page.goto(console.at(f"/runs?workspace={BULK}"))
    seen: list[str] = []
    pages = 0
    while True:
        pages += 1
        seen += row_ids(page)
        following = page.locator("#next-page")
        if following.count() == 0:
            break
        following.click()
        page.wait_for_url(re.compile(r"after="))
    assert pages == 2
    assert sorted(seen) == sorted(defects.paged)
    every = relayr_here(defects.world.environment, "runs", "list", "--limit", "10000")
    newest_first = [r["id"] for r in every if f"{r['tenant_id']}/{r['workspace_id']}" == BULK]
    assert seen == newest_first  # in order, and the last is the oldest
    icon = page.goto(console.at("/favicon.ico"))
    assert icon is not None
    assert icon.status == 200
    assert icon.headers["content-type"].startswith("image/")
    assert icon.body()[:4] == b"\x00\x00\x01\x00"


def test_a_refused_post_sends_the_login_back_to_the_page_not_the_action(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    """A login that expired while a confirmation was open: the refusal's login link leads back
    to the confirmation, not to ``/run/cancel`` (which a GET cannot do without its run)."""
    defects, console = world
    run = defects.world.pending[1]
    confirm = "/run/cancel?" + urlencode({"id": run.id, "workspace": run.where})
    page = log_in(browser, console, confirm)
    csrf = page.locator("#confirm input[name=csrf]").get_attribute("value")
    assert csrf
    expired = {
        "ops": True,
        "csrf": csrf,
        LOGGED_IN_AT: int(time.time()) - SESSION_MAX_AGE_S - 60,
        "operator": "console",
    }
    page.context.add_cookies(
        [{"name": SESSION_COOKIE, "value": signed_session(TOKEN, expired), "url": console.url}]
    )
    page.fill("#confirm input[name=reason]", "too late")
    with page.expect_navigation() as navigation:
        page.click("#confirm button[type=submit]")
    refused = navigation.value
    assert refused is not None
    assert refused.status == 403
    assert "log in with the console's token to act" in page.locator("#message").inner_text()
    login = page.locator("#access a").get_attribute("href")
    assert login == "/login?" + urlencode({"next": confirm}), login
    page.click("#access a")
    page.fill("input[name=token]", TOKEN)
    page.click("form.login button[type=submit]")
    page.wait_for_url(console.at(confirm))
    assert page.locator("#confirm input[name=reason]").is_visible()
    assert page.locator("span.status").first.inner_text() == "pending"  # nothing was done

    # a POST from no page of the console (a script): back to the overview
    cookie = {"Cookie": f"{SESSION_COOKIE}={signed_session(TOKEN, expired)}"}
    form = {"csrf": csrf, "id": run.id, "workspace": run.where, "reason": "too late"}
    status, answer, _ = Client().post(console.at("/run/cancel"), form, cookie)
    assert status == 403
    assert f'href="/login?next={quote("/", safe="")}"' in answer
    assert "next=%2Frun%2Fcancel" not in answer


def test_the_overviews_counts_are_the_stores_and_each_links_to_its_runs(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    every = relayr_here(defects.world.environment, "runs", "list", "--limit", "10000")
    runs = [(f"{r['tenant_id']}/{r['workspace_id']}", r["id"], r) for r in every]
    page = visitor(browser)
    page.goto(console.at("/"))
    assert page.locator("#total").inner_text() == str(len(every))
    statuses = Counter(r["status"] for r in every)
    for status in STATUS_FILTERS:
        shown = page.locator(f'#figures [data-status="{status}"] a.number').inner_text()
        assert shown == str(statuses[status]), status
    for table, key in (("#by-rule", "rule"), ("#by-workspace", "where")):
        rows = page.locator(f"{table} tbody tr")
        shown = {
            rows.nth(n).locator("td").first.inner_text(): rows.nth(n).locator("a").inner_text()
            for n in range(rows.count())
        }
        counts = Counter(r["rule"] if key == "rule" else where for where, _, r in runs)
        assert shown == {label: str(count) for label, count in counts.items()}, table

    page.click('#figures [data-status="dead"] a')
    page.wait_for_url(re.compile(r"/runs\?status=dead$"))
    assert listed(page) == sorted((w, i) for w, i, r in runs if r["status"] == "dead")
    for table, key in (("#by-rule", "rule"), ("#by-workspace", "where")):
        page.goto(console.at("/"))
        first = page.locator(f"{table} tbody tr").first
        label = first.locator("td").first.inner_text()
        count = int(first.locator("a").inner_text())
        first.locator("a").click()
        page.wait_for_url(re.compile(r"/runs\?"))
        chosen = sorted((w, i) for w, i, r in runs if (r["rule"] if key == "rule" else w) == label)
        assert listed(page) == chosen, label
        assert len(chosen) == count


def test_the_overview_refreshes_itself_until_paused_and_says_as_of_when(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    _, console = world
    page = visitor(browser)
    page.goto(console.at("/"))
    refresh = page.locator('meta[http-equiv="refresh"]')
    assert refresh.count() == 1
    assert re.fullmatch(r"\d+", refresh.get_attribute("content") or "")
    assert re.match(f"As of {MOMENT}\\. Refreshes every", page.locator("#live").inner_text())
    page.click("#pause")
    page.wait_for_url(re.compile(r"/\?live=0$"))
    assert page.locator('meta[http-equiv="refresh"]').count() == 0
    live = page.locator("#live").inner_text()
    assert re.match(f"As of {MOMENT}\\. Paused", live), live
    assert page.locator("#total").is_visible()
    page.click("#resume")
    page.wait_for_url(console.at("/"))
    assert page.locator('meta[http-equiv="refresh"]').count() == 1


def test_a_reload_after_logging_in_does_not_send_the_login_again(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    _, console = world
    logins = console.process.log().count('"console login"')
    going = "/runs?status=dead"
    page = log_in(browser, console, going)
    assert "/login" not in page.url
    answer = page.reload()
    assert answer is not None
    assert (answer.request.method, answer.status) == ("GET", 200)
    assert page.url == console.at(going)
    assert page.locator("#operator").is_visible()
    assert console.process.log().count('"console login"') == logins + 1


def test_a_run_the_allowlist_refused_links_to_its_rules_entry(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    defects, console = world
    run = defects.refused
    page = visitor(browser)
    page.goto(run_url(console, run.id, run.where))
    assert page.locator("#status").inner_text() == "dead"
    page.click("#reason a:has-text('not_allowed')")
    page.wait_for_url(re.compile(r"/allowlist#rule-ops:send-then-die$"))
    entry = page.locator('[id="rule-ops:send-then-die"]')
    assert entry.is_visible()
    assert entry.locator("td").nth(2).inner_text().startswith("false")  # turns


def test_a_traced_run_links_its_trace_by_the_settings_template(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    """The attempt's trace, as exported, linked by ``RELAYR_TRACE_URL`` on the run's page."""
    defects, console = world
    page = visitor(browser)
    page.goto(run_url(console, defects.refused.id, defects.refused.where))
    assert page.locator("#traces").inner_text() == "-"  # executed untraced
    page.goto(run_url(console, defects.traced.id, defects.traced.where))
    link = page.locator("#traces a")
    shown = page.locator("#traces").inner_text()
    assert shown == defects.trace_id, "the run records no trace id of its traced attempt"
    assert link.get_attribute("href") == TRACE_URL.replace("{trace_id}", defects.trace_id)


def test_a_dead_letters_replay_from_the_health_page_is_not_repeated_by_a_reload(
    tmp_path: Path, browser: "Browser"
) -> None:
    environment = relayr_environment(tmp_path, console_token=TOKEN)
    with ThreadPoolExecutor(max_workers=1) as thread:  # Playwright holds this thread's loop
        thread.submit(ghost_notice, environment).result()
    relayr_here(environment, "follow", "--once")
    with running_console(environment, tmp_path) as console:
        page = log_in(browser, console, "/health")
        # defect 11: the queue has a table of its own, a follower's lag is a time
        assert re.fullmatch(r"\d+", page.locator("#queue td.depth").inner_text())
        assert "waiting" not in page.locator("#heartbeats").inner_text()
        lag = page.locator('#followers tr[data-workspace="acme/ops"] td.lag').inner_text()
        assert re.fullmatch(r"up to date|[\d. a-z]+ \(\d+ envelope\(s\)\)", lag), lag
        row = page.locator("#letters tr[data-envelope]")
        assert row.count() == 1
        assert row.locator("td[data-label=Tries]").inner_text() == "1"
        page.click("form.replay button:has-text('acme/ops')")
        page.wait_for_url(console.at("/health#dead-letters"))
        replayed = page.locator("#replayed").inner_text()
        assert replayed == "Replayed: acme/ops: 0 bridged, 1 failed again, 0 left waiting."
        for _ in range(2):
            reloaded(page)
            assert page.locator("#replayed").count() == 0  # said once
            assert row.locator("td[data-label=Tries]").inner_text() == "2"
    [letter] = relayr_here(environment, "follow", "dead-letters", "list")
    assert letter["tries"] == 2


def test_runs_selected_on_the_list_are_acted_on_once_after_a_preview(
    world: tuple[Defects, Console], browser: "Browser"
) -> None:
    """Tick runs, choose an action, confirm after a preview that says what it would do to each;
    a run whose status the action does not take is refused, and a reload repeats nothing."""
    defects, console = world
    first, second, third = defects.picked
    going = "/runs?" + urlencode({"workspace": PICKED})
    page = log_in(browser, console, going)
    for run in (first, second):
        page.check(f'#runs input[type=checkbox][value="{PICKED}/{run.id}"]')
    page.select_option("#act-on-selected select[name=action]", "skip")
    page.click("#act-on-selected button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/act\?"))
    verdicts = page.locator("#selection tbody tr").evaluate_all(
        "rows => rows.map(row => [row.dataset.run, row.dataset.verdict])"
    )
    assert sorted(verdicts) == sorted([[first.id, "act"], [second.id, "act"]])
    confirmed(page, "duplicates of one alert")
    for _ in range(2):
        reloaded(page)
        now = page.locator("#results td.now").all_inner_texts()
        assert now == ["skipped", "skipped"]
    for run in (first, second):
        assert audit_rows(page, console, run) == [["console", "skip", "duplicates of one alert"]]
    page.go_back()  # the result page, then the way back to the list it was chosen on
    page.click("#summary a:has-text('Back')")
    page.wait_for_url(console.at(going))

    page.check(f'#runs input[type=checkbox][value="{PICKED}/{first.id}"]')
    page.check(f'#runs input[type=checkbox][value="{PICKED}/{third.id}"]')
    page.select_option("#act-on-selected select[name=action]", "retry")
    page.click("#act-on-selected button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/act\?"))
    refused = page.locator(f'#selection tr[data-run="{third.id}"]')
    assert refused.get_attribute("data-verdict") == "refused"
    assert refused.locator("td[data-label=Would]").inner_text().startswith("pending: retry takes")
    assert page.locator("#confirm input[name=reason]").count() == 0  # a retry takes none
    page.click("#confirm button[type=submit]")
    page.wait_for_url(re.compile(r"/done\?key="))
    page.reload()
    assert page.locator("#results tr.ok").evaluate_all("rows => rows.map(r => r.dataset.run)") == [
        first.id
    ]
    report = relayr_here(defects.world.environment, "runs", "show", first.id, "--workspace", PICKED)
    assert [action["action"] for action in report["actions"]] == ["skip", "retry"]
    report = relayr_here(defects.world.environment, "runs", "show", third.id, "--workspace", PICKED)
    assert (report["run"]["status"], report["actions"]) == ("pending", [])
