"""The console as an on-call operator uses it, over HTTP, on a real ``relayr console`` process
and real storage (SQLite): runs made dead, left pending or missing their thread by relayr's own
executor in this process (:mod:`tests.console.console_world`).

Each test reproduces one of the console's former defects, and fails on the console before its
fix: a wrong token keeps the login form and where it led; attempts are numbered across retries,
with their end and duration; a finished run has no next attempt; cancel and skip ask for a
reason on a page of their own, and who acted and why is shown on the run and in the audit page;
every action is answered with a redirect, so a reload repeats nothing; ``pending`` is a status
filter; the rule filter takes any part of a name in any case, and the workspace filter a
tenant; every run is reachable by a cursor; runs sort by their last change; the bulk preview
sets apart the runs that will fail again and filters by reason, and its result page shows each
run as it is now; a run's page links its event's thread and the transcript links each message
to its run; the overview's counts are the store's; ``/favicon.ico`` is an icon.
"""

import html
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest

from tests.console.console_world import World, execute, home_of, make_world
from tests.console.consoles import Client, Console, running_console
from tests.ops.ops_app import FIXED
from tests.workers import relayr_environment, relayr_here

pytestmark = pytest.mark.process

TOKEN = "console-operations-token-0123456789"
BACKUP = "ops:backup-check"
ROW_LINK = r'<td data-label="Run"><a href="/run\?id=([^&]+)&amp;workspace=([^"]+)"'
"""A runs page's link to each of its runs: the run's id and its workspace, quoted."""


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, page
    return found[1]


def text_of(page: str) -> str:
    """A page's text, tags dropped and entities read, spaces folded."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[World, Console]]:
    home = tmp_path_factory.mktemp("operations")
    environment = relayr_environment(
        home, app="tests.console.console_app:create_console_app", console_token=TOKEN
    )
    made = make_world(environment, dead=4, dead_elsewhere=1, pending=2, bulk=120)
    with running_console(environment, home) as console:
        yield made, console


def logged_in(console: Console, token: str = TOKEN) -> tuple[Client, str]:
    client = Client()
    _, page, _ = client.get(console.at("/login"))
    status, _, _ = client.post(console.at("/login"), {"csrf": csrf_of(page), "token": token})
    assert status == 303
    _, page, _ = client.get(console.at("/runs"))
    return client, csrf_of(page)


def show(world: World, run_id: str, where: str) -> dict[str, Any]:
    report: dict[str, Any] = relayr_here(
        world.environment, "runs", "show", run_id, "--workspace", where
    )
    return report


def run_url(console: Console, run_id: str, where: str) -> str:
    return console.at("/run?" + urlencode({"id": run_id, "workspace": where}))


def test_a_wrong_token_keeps_the_form_and_where_it_led(world: tuple[World, Console]) -> None:
    _, console = world
    client = Client()
    going = "/runs?status=dead&rule=backup"
    status, page, _ = client.get(console.at("/login?" + urlencode({"next": going})))
    assert status == 200
    assert "log in with the console's token" not in page  # no link to itself, no next=/login
    wrong, page, _ = client.post(
        console.at("/login"), {"csrf": csrf_of(page), "token": "not-it", "next": going}
    )
    assert wrong == 403
    assert "not the console's token" in html.unescape(page)
    assert 'name="token"' in page  # the form again
    assert f'name="next" value="{html.escape(going)}"' in page
    assert "next=%2Flogin" not in page
    status, _, headers = client.post(
        console.at("/login"), {"csrf": csrf_of(page), "token": TOKEN, "next": going}
    )
    assert (status, headers["location"]) == (303, going)


def test_a_retry_redirects_and_a_reload_repeats_nothing_and_attempts_count_on(
    world: tuple[World, Console],
) -> None:
    made, console = world
    run = made.dead[0]
    client, csrf = logged_in(console)
    before = show(made, run.id, run.where)
    assert [a["attempt"] for a in before["attempts"]] == [1, 2]

    status, page, headers = client.post(
        console.at("/run/retry"), {"csrf": csrf, "id": run.id, "workspace": run.where}
    )
    assert status == 303, page
    result = headers["location"]
    assert urlsplit(result).path == "/done"
    for _ in range(3):  # reloads of the result page: GETs, no action
        status, page, _ = client.get(console.at(result))
        assert status == 200
        assert "retried" in page
        assert "By <strong>console</strong>" in page
    assert show(made, run.id, run.where)["run"]["status"] == "pending"
    assert execute(made.environment, [run]) == ["dead"]

    report = show(made, run.id, run.where)
    attempts = report["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2, 3, 4]
    assert [a["of_budget"] for a in attempts] == [1, 2, 1, 2]
    assert all(a["ended_at"] and a["duration_s"] is not None for a in attempts)
    assert [(a["action"], a["who"]) for a in report["actions"]] == [("retry", "console")]

    _, page, _ = client.get(run_url(console, run.id, run.where))
    rows = re.findall(r'<td data-label="#">(\d+)</td>', page)
    assert rows == ["1", "2", "3", "4"]
    assert re.search(r'id="attempt-count">4 \(2 since the last retry\)', page)
    assert 'data-label="Took">-<' not in page  # every attempt ended, each with its duration
    assert "Next attempt" not in page  # a dead run has none
    assert 'action="/run/retry"' in page


def test_cancel_and_skip_ask_for_a_reason_and_record_who_and_why(
    world: tuple[World, Console],
) -> None:
    made, console = world
    pending, dead = made.pending[0], made.dead[1]
    client, csrf = logged_in(console)

    _, page, _ = client.get(run_url(console, pending.id, pending.where))
    assert 'action="/run/retry"' not in page  # no retry of a pending run
    assert "Next attempt" in page
    assert 'action="/run/cancel"' not in page  # a link to a confirmation, not a button
    confirm = console.at("/run/cancel?" + urlencode({"id": pending.id, "workspace": pending.where}))
    assert html.escape(urlsplit(confirm).path + "?" + urlsplit(confirm).query) in page
    _, page, _ = client.get(confirm)
    assert 'name="reason" required' in page
    status, page, _ = client.post(
        console.at("/run/cancel"), {"csrf": csrf, "id": pending.id, "workspace": pending.where}
    )
    assert status == 400
    assert "reason is required" in page
    assert show(made, pending.id, pending.where)["run"]["status"] == "pending"
    status, _, headers = client.post(
        console.at("/run/cancel"),
        {"csrf": csrf, "id": pending.id, "workspace": pending.where, "reason": "duplicate alert"},
    )
    assert status == 303
    client.get(console.at(headers["location"]))
    client.get(console.at(headers["location"]))
    report = show(made, pending.id, pending.where)
    assert report["run"]["status"] == "cancelled"
    assert [(a["action"], a["who"], a["reason"]) for a in report["actions"]] == [
        ("cancel", "console", "duplicate alert")
    ]

    status, _, _ = client.post(
        console.at("/run/skip"),
        {"csrf": csrf, "id": dead.id, "workspace": dead.where, "reason": "host retired"},
    )
    assert status == 303
    _, page, _ = client.get(run_url(console, dead.id, dead.where))
    assert "by console: host retired" in text_of(page)
    actions = re.search(r'<table id="operator-actions".*?</table>', page, re.S)
    assert actions is not None
    assert "host retired" in actions[0]
    assert "Next attempt" not in page
    _, page, _ = client.get(console.at("/audit"))
    audit = text_of(page)
    assert "console skip" in audit
    assert "host retired" in audit
    assert "console cancel" in audit
    assert "duplicate alert" in audit


def test_the_operator_is_named_by_the_proxys_header_when_told(tmp_path: Path) -> None:
    environment = relayr_environment(
        tmp_path, app="tests.console.console_app:create_console_app", console_token=TOKEN
    )
    made = make_world(environment, dead=1, dead_elsewhere=0, missing_thread=0, hostile=0, pending=0)
    [run] = made.dead
    with running_console(environment, tmp_path, "--operator-header", "X-Operator") as console:
        client, csrf = logged_in(console)
        form = {"csrf": csrf, "id": run.id, "workspace": run.where, "reason": "known outage"}
        status, page, _ = client.post(console.at("/run/skip"), form)
        assert status == 403
        assert "no x-operator header naming the operator" in html.unescape(page)
        status, _, _ = client.post(console.at("/run/skip"), form, {"X-Operator": "alice"})
        assert status == 303
    report = show(made, run.id, run.where)
    assert [(a["action"], a["who"], a["reason"]) for a in report["actions"]] == [
        ("skip", "alice", "known outage")
    ]


OPERATORS = {"alice": "alice-own-token-0123456789", "bob": "bob-own-token-9876543210"}


def test_each_operator_logs_in_with_a_token_of_their_own_and_acts_under_their_name(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "operators.toml"
    tokens.write_text("".join(f'{name} = "{token}"\n' for name, token in OPERATORS.items()))
    environment = relayr_environment(
        tmp_path,
        app="tests.console.console_app:create_console_app",
        console_token=TOKEN,
        console_tokens=tokens,
    )
    made = make_world(environment, dead=3, dead_elsewhere=0, missing_thread=0, hostile=0, pending=0)
    acted = dict(zip(("alice", "bob", "console"), made.dead, strict=True))
    with running_console(environment, tmp_path) as console:
        for name, run in acted.items():
            client, csrf = logged_in(console, OPERATORS.get(name, TOKEN))
            form = {"csrf": csrf, "id": run.id, "workspace": run.where, "reason": f"by {name}"}
            status, _, _ = client.post(console.at("/run/skip"), form)
            assert status == 303
        client = Client()
        _, page, _ = client.get(console.at("/login"))
        form = {"csrf": csrf_of(page), "token": OPERATORS["alice"].upper()}
        status, page, _ = client.post(console.at("/login"), form)
        assert status == 403
        assert "not the console's token" in html.unescape(page)
    for name, run in acted.items():
        report = show(made, run.id, run.where)
        assert [(a["action"], a["who"], a["reason"]) for a in report["actions"]] == [
            ("skip", name, f"by {name}")
        ]


def test_filters_take_pending_a_part_of_a_rule_a_tenant_and_sort_by_change(
    world: tuple[World, Console],
) -> None:
    made, console = world
    client = Client()

    def listed(query: str) -> list[str]:
        status, page, _ = client.get(console.at("/runs?" + query))
        assert status == 200, page
        return re.findall(r'<tr class="status-\w+" data-run="([^"]+)"', page)

    pending = {run.id for run in made.pending}
    assert set(listed("status=pending")) <= pending | set(made.bulk)
    assert listed("status=pending&workspace=zeta") == [made.pending[1].id]  # [0]: cancelled
    assert set(listed("status=due")) == set(listed("status=pending"))  # old links still work
    backups = listed("rule=BACKUP")
    assert backups
    assert set(backups) == set(listed("rule=ops:backup-check"))
    assert listed("rule=nothing-like-it") == []
    acme = set(listed("workspace=acme&rule=backup"))
    assert {run.id for run in made.dead} <= acme
    assert not pending & acme
    assert set(listed("workspace=zeta")) == pending
    by_reason = listed("reason=thread_not_found")
    assert by_reason == [run.id for run in made.missing_thread]
    every = relayr_here(made.environment, "runs", "list", "--limit", "10000")
    ops = [run for run in every if (run["tenant_id"], run["workspace_id"]) == ("acme", "ops")]
    # runs changed in one transaction share their moment: then by the event that fired them
    by_change = sorted(
        ops, key=lambda run: (run["updated_at"], run["fired_seq"], run["id"]), reverse=True
    )
    changed = listed("workspace=acme/ops&sort=changed")
    assert changed == [run["id"] for run in by_change]
    # the oldest dead run, retried (and dead again) since, is listed by its change
    oldest = made.dead[0].id
    assert changed.index(oldest) < listed("workspace=acme/ops").index(oldest)


def test_every_run_is_reachable_by_the_pages_cursor(world: tuple[World, Console]) -> None:
    made, console = world
    every = relayr_here(made.environment, "runs", "list", "--limit", "10000")
    client = Client()
    seen: list[tuple[str, str]] = []
    url = console.at("/runs?workspace=acme")
    pages = 0
    while url:
        status, page, _ = client.get(url)
        assert status == 200
        seen += re.findall(
            r'<td data-label="Run"><a href="/run\?id=([^&]+)&amp;workspace=([^"]+)"', page
        )
        found = re.search(r'id="next-page" href="([^"]+)"', page)
        url = console.at(html.unescape(found[1])) if found else ""
        pages += 1
        if found:
            assert "after" in parse_qs(urlsplit(url).query)
    expected = [
        (run["id"], f"{run['tenant_id']}%2F{run['workspace_id']}")
        for run in every
        if run["tenant_id"] == "acme"
    ]
    assert len(expected) > 2 * 50  # the premise: three pages
    assert pages == 3
    assert seen == expected


def test_search_finds_runs_events_threads_and_messages_by_id(
    world: tuple[World, Console],
) -> None:
    made, console = world
    run = made.dead[2]
    client = Client()
    for query, kind in (
        (run.event_id, "event"),
        (made.threads["acme/billing"], "thread"),
    ):
        status, _, headers = client.get(console.at("/search?" + urlencode({"q": query})))
        assert status == 303, kind  # one hit: straight to it
        status, page, _ = client.get(console.at(headers["location"]))
        assert status == 200, kind
    report = show(made, run.id, run.where)
    [notice] = {
        record["message_id"] for record in report["emissions"] if record["kind"] == "notice"
    }
    status, page, _ = client.get(console.at("/search?" + urlencode({"q": notice})))
    assert status == 200
    kinds = re.findall(r'<tr data-kind="([^"]+)"', html.unescape(page))
    assert kinds == ["message", "message's run"]
    assert f"/run?id={run.id}" in html.unescape(page)
    status, page, _ = client.get(console.at("/search?q=BACKUP+HOST+IS+DOWN"))
    assert status == 200
    assert run.id in page  # error text, any case
    assert len(re.findall(r'<tr data-kind="run"', page)) >= len(made.dead) - 1


def test_a_runs_page_links_its_thread_and_the_transcript_links_its_run(
    world: tuple[World, Console],
) -> None:
    made, console = world
    run = made.dead[3]
    client = Client()
    _, page, _ = client.get(run_url(console, run.id, run.where))
    thread_link = f'href="/thread?workspace=acme%2Fops&amp;id={run.thread}"'
    assert f'class="thread-link" {thread_link}' in page
    assert 'href="/allowlist#rule-ops:backup-check"' in page
    _, page, _ = client.get(console.at(f"/thread?workspace={run.where}&id={run.thread}"))
    assert f'href="/run?id={run.id}&amp;workspace=acme%2Fops">posted by run {run.id}' in page


def test_the_bulk_preview_sets_apart_runs_that_will_fail_again(
    world: tuple[World, Console],
) -> None:
    made, console = world
    client, csrf = logged_in(console)
    status, page, _ = client.get(console.at("/retry-dead?workspace=acme/ops"))
    assert status == 200
    verdicts = dict(re.findall(r'data-run="([^"]+)" data-verdict="([^"]+)"', page))
    [gone] = made.missing_thread
    assert verdicts[gone.id] == "fails-again"
    assert "thread thr_gone does not exist in acme/ops" in page
    confirmed = re.findall(r'name="run" value="([^"]+)"', page)
    assert f"acme/ops/{gone.id}" not in confirmed
    reasons = dict(re.findall(r"reason=(\w+)\"[^>]*>\w+ \((\d+)\)", html.unescape(page)))
    assert reasons["thread_not_found"] == "1"
    _, page, _ = client.get(console.at("/retry-dead?workspace=acme/ops&reason=backup_down"))
    only = set(re.findall(r'data-run="([^"]+)" data-verdict', page))
    dead_backups = {
        run["id"]
        for run in relayr_here(
            made.environment, "runs", "list", "--status", "dead", "--limit", "1000"
        )
        if run["workspace_id"] == "ops" and run["reason"] == "backup_down"
    }
    assert only == dead_backups

    (home_of(made.environment) / FIXED).touch()
    refs = re.findall(r'name="run" value="([^"]+)"', page)
    assert sorted(refs) == sorted(f"acme/ops/{run_id}" for run_id in dead_backups)
    status, _, headers = client.post(
        console.at("/retry-dead"), [("csrf", csrf), *(("run", ref) for ref in refs)]
    )
    assert status == 303
    result = console.at(headers["location"])
    _, page, _ = client.get(result)
    assert set(re.findall(r'class="status status-(\w+)"', page)) == {"pending"}
    assert '<meta http-equiv="refresh"' in page  # it follows them while they run
    retried = [run for run in made.dead if run.where == "acme/ops" and run.id in dead_backups]
    assert execute(made.environment, retried) == ["succeeded"] * len(retried)
    _, page, _ = client.get(result)
    assert set(re.findall(r'class="status status-(\w+)"', page)) == {"succeeded"}
    assert '<meta http-equiv="refresh"' not in page


def test_the_overview_counts_what_the_store_holds_and_links_to_it(
    world: tuple[World, Console],
) -> None:
    made, console = world
    every = relayr_here(made.environment, "runs", "list", "--limit", "10000")
    client = Client()
    status, page, _ = client.get(console.at("/"))
    assert status == 200
    for state in ("dead", "pending", "succeeded", "cancelled", "skipped"):
        found = re.search(
            rf'data-status="{state}"><span class="label">{state}</span><a class="number status" '
            rf'href="([^"]+)">(\d+)</a>',
            page,
        )
        assert found is not None, state
        assert int(found[2]) == sum(run["status"] == state for run in every), state
        _, listed, _ = client.get(console.at(html.unescape(found[1])))
        shown = len(re.findall(r'<tr class="status-', listed))
        assert shown == min(int(found[2]), 50), state
    assert re.search(rf'id="total">{len(every)}<', page)
    assert '<meta http-equiv="refresh"' in page
    assert "As of " in page
    paused = client.get(console.at("/?live=0"))[1]
    assert '<meta http-equiv="refresh"' not in paused
    bars = re.findall(r'<rect class="bar (\w+)"[^>]*data-count="(\d+)"', page)
    assert sum(int(count) for series, count in bars if series == "dead") == sum(
        run["status"] == "dead" for run in every
    )


def test_favicon_is_an_icon(world: tuple[World, Console]) -> None:
    _, console = world
    with urllib.request.urlopen(console.at("/favicon.ico"), timeout=30) as answer:
        assert answer.status == 200
        assert answer.headers["content-type"] == "image/x-icon"
        assert answer.read(4) == b"\x00\x00\x01\x00"  # an icon's header
