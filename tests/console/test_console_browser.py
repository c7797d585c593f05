"""The console in a browser, on real processes: what an on-call engineer does from an alert
works end to end, and nothing on a page can act for anyone but a logged-in operator.

Debian's Chromium, driven by Playwright, talks to ``relayr console`` started as a subprocess,
while a real ``celery worker`` and ``relayr dispatch`` run the rules of
:mod:`tests.console.console_app`; the test publishes events with ``relayr publish`` and checks the
console against what ``relayr runs`` and ``relayr thread show`` say:

- a run that failed for good is in the dead list with its reason; retried from its page with
  the token, it succeeds and its notice is posted once;
- the bulk retry's preview lists exactly the dead runs of the filter (``runs retry --dead
  --dry-run``'s list) and changes none, a confirmation with a field it cannot read retries
  none, and the confirmation retries those listed;
- without the token no button is shown, and a forged POST is refused (403) with the run left
  as it was;
- markup in a message, an error, a reason and a thread's title is shown as text, and nothing
  of it runs.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.console.console_app import HOSTILE_REASON
from tests.console.consoles import Console, chromium, dispatching, running_console, until
from tests.ops.ops_app import FIXED
from tests.workers import relayr_environment, relayr_here, relayr_json, running_worker

pytestmark = [pytest.mark.worker, pytest.mark.slow]

TOKEN = "console-browser-token-0123456789"
WHERE = "acme/ops"
ELSEWHERE = "acme/billing"
BACKUP = "ops:backup-check"
NOTICE = "checking the nightly backup"
HOSTILE = (
    '<script>window.__pwned = "script"</script>'
    '<img src="x" onerror="window.__pwned = \'img\'"><b>bold</b> & done'
)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest) -> dict[str, object]:
    if request.param == "postgres":
        return {"database_url": request.getfixturevalue("postgres_url")}
    return {}


def environment_of(home: Path, **settings: object) -> dict[str, str]:
    return relayr_environment(
        home,
        app="tests.console.console_app:create_console_app",
        max_redeliveries=1,
        lease_ttl_s=2.0,
        **settings,
    )


def runs(environment: dict[str, str], *filters: str) -> list[dict[str, Any]]:
    """``relayr runs list``, in this process: tests poll it."""
    found: list[dict[str, Any]] = relayr_here(environment, "runs", "list", *filters)
    return found


def wait_for(
    environment: dict[str, str], status: str, count: int, *filters: str
) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        found = runs(environment, "--status", status, *filters)
        return found if len(found) >= count else None

    return until(probe, f"{count} {status} run(s) of {filters}")


def dead_ids(environment: dict[str, str]) -> set[str]:
    """Every dead run, across every workspace, as ``TENANT/WORKSPACE/RUN`` (a run's id is its
    workspace's: two workspaces' runs may share one)."""
    return {
        f"{run['tenant_id']}/{run['workspace_id']}/{run['id']}"
        for run in runs(environment, "--status", "dead")
    }


def publish(environment: dict[str, str], where: str, event: str, **data: str) -> None:
    relayr_here(environment, "publish", where, event, "--data", json.dumps(data))


def run_link(console: Console, run: dict[str, Any]) -> str:
    return console.at(f"/run?id={run['id']}&workspace={run['tenant_id']}/{run['workspace_id']}")


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as found:
        yield found


def test_a_dead_run_is_listed_with_its_reason_and_a_retry_posts_its_notice_once(
    tmp_path: Path, database: dict[str, object], browser: Any
) -> None:
    environment = environment_of(tmp_path, console_token=TOKEN, **database)
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", "backups")["id"]
    with (
        running_worker(environment, tmp_path),
        dispatching(environment, tmp_path),
        running_console(environment, tmp_path) as console,
    ):
        publish(environment, WHERE, "opsw:backup", thread_id=thread)
        [dead] = wait_for(environment, "dead", 1, "--rule", BACKUP)
        page = browser.new_page()

        page.goto(console.at("/runs?status=dead"))
        row = page.locator(f'#runs tr[data-run="{dead["id"]}"]')
        cells = row.locator("td").all_inner_texts()
        assert cells[1:5] == ["dead", BACKUP, WHERE, "2"]
        assert cells[5].startswith("backup_down")
        assert "the backup host is down" in cells[5]

        # a visitor reads, and is offered no action; a forged POST changes nothing
        page.goto(run_link(console, dead))
        assert page.locator("#status").inner_text() == "dead"
        assert page.locator("#actions").count() == 0
        assert page.locator("form[method=post]").count() == 0
        forged = page.request.post(
            console.at("/run/retry"), form={"id": dead["id"], "workspace": WHERE, "csrf": "x"}
        )
        assert forged.status == 403
        assert relayr_here(environment, "runs", "show", dead["id"])["run"]["status"] == "dead"

        # logged in with the token, the run's page has its buttons
        page.click("#access a")
        page.fill("input[name=token]", TOKEN)
        page.click("form.login button[type=submit]")
        page.wait_for_url(re.compile(r"/run\?id="))
        assert "Logged in" in page.locator("#access").inner_text()
        (tmp_path / FIXED).touch()
        page.click("form[action='/run/retry'] button")
        page.wait_for_url(re.compile(r"/done\?key="))
        result = page.locator(f'#results tr[data-run="{dead["id"]}"]').inner_text()
        assert "retried and enqueued" in result, result

        wait_for(environment, "succeeded", 1, "--rule", BACKUP)
        page.reload()  # the result page follows the run to its end, and retries nothing
        now = page.locator(f'#results tr[data-run="{dead["id"]}"] td.now').inner_text()
        assert now == "succeeded"
        page.goto(run_link(console, dead))
        assert page.locator("#status").inner_text() == "succeeded"
        outcomes = page.locator("#attempts tbody tr td:nth-child(5)").all_inner_texts()
        assert outcomes == ["failed", "dead", "succeeded"]
        numbers = page.locator("#attempts tbody tr td:nth-child(1)").all_inner_texts()
        assert numbers == ["1", "2", "3"]
        report = relayr_here(environment, "runs", "show", dead["id"])
        assert [action["action"] for action in report["actions"]] == ["retry"]

        page.goto(console.at(f"/thread?workspace={WHERE}&id={thread}"))
        entries = page.locator("#transcript article.entry").all_inner_texts()
        by_rule = [entry for entry in entries if f"external_agent:reflexr:{BACKUP}" in entry]
        assert len(by_rule) == 1, entries
        assert "[notice]" in by_rule[0]
        assert NOTICE in by_rule[0]

    transcript = relayr_here(environment, "thread", "show", WHERE, thread)
    notices = [e for e in transcript if e["author"] == f"external_agent:reflexr:{BACKUP}"]
    assert [(n["kind"], n["content"]) for n in notices] == [("notice", NOTICE)]


def test_the_bulk_retry_previews_exactly_the_dead_runs_of_its_filter(
    tmp_path: Path, browser: Any
) -> None:
    environment = environment_of(tmp_path, console_token=TOKEN)
    here = relayr_here(environment, "thread", "create", WHERE, "--title", "backups")["id"]
    there = relayr_here(environment, "thread", "create", ELSEWHERE, "--title", "backups")["id"]
    with (
        running_worker(environment, tmp_path),
        dispatching(environment, tmp_path),
        running_console(environment, tmp_path) as console,
    ):
        for _ in range(3):
            publish(environment, WHERE, "opsw:backup", thread_id=here)
        publish(environment, ELSEWHERE, "opsw:backup", thread_id=there)
        publish(environment, WHERE, "consolew:hostile", thread_id=here, payload="not a backup")
        wait_for(environment, "dead", 5)
        dead_before = dead_ids(environment)
        assert len(dead_before) == 5
        selected = ["--rule", BACKUP, "--workspace", WHERE]
        expected = {run["id"] for run in runs(environment, "--status", "dead", *selected)}
        assert len(expected) == 3
        dry_run = relayr_json(environment, "runs", "retry", "--dead", *selected, "--dry-run")
        assert {result["run_id"] for result in dry_run} == expected

        page = browser.new_page()
        page.goto(console.at("/login?next=/runs"))
        page.fill("input[name=token]", TOKEN)
        page.click("form.login button[type=submit]")
        page.wait_for_url("**/runs")
        page.goto(console.at(f"/runs?status=dead&rule={BACKUP}&workspace={WHERE}"))
        page.click("#retry-dead")
        page.wait_for_url(re.compile(r"/retry-dead\?"))
        listed = page.locator("#preview tbody tr").evaluate_all(
            "rows => rows.map(row => row.dataset.run)"
        )
        assert sorted(listed) == sorted(expected)
        confirmed = page.locator("#confirm input[name=run]").evaluate_all(
            "inputs => inputs.map(input => input.value)"
        )
        assert sorted(confirmed) == sorted(f"{WHERE}/{run_id}" for run_id in expected)
        assert dead_ids(environment) == dead_before  # a preview changes nothing

        # a confirmation whose filter cannot be read is refused before any run is retried
        csrf = page.locator("#confirm input[name=csrf]").get_attribute("value")
        assert csrf
        unreadable = page.request.post(
            console.at("/retry-dead"),
            form={"csrf": csrf, "run": confirmed[0], "rule": BACKUP, "since": "2x"},
        )
        assert unreadable.status == 400, unreadable.text()
        assert "since &#39;2x&#39; is not a duration" in unreadable.text()
        assert dead_ids(environment) == dead_before

        (tmp_path / FIXED).touch()
        page.click("#confirm button[type=submit]")
        page.wait_for_url(re.compile(r"/done\?key="))
        done = page.locator("#results tbody tr").evaluate_all(
            "rows => rows.map(row => row.dataset.run)"
        )
        assert sorted(done) == sorted(expected)
        assert "3 done, 0 refused" in page.locator("#summary").inner_text()
        succeeded = wait_for(environment, "succeeded", 3, *selected)
        assert {run["id"] for run in succeeded} == expected

        # what the filter left out is still dead
        left = {(run["rule"], run["workspace_id"]) for run in runs(environment, "--status", "dead")}
        assert left == {(BACKUP, "billing"), ("console:hostile", "ops")}


def test_without_the_token_nothing_acts_and_stored_markup_is_text(
    tmp_path: Path, browser: Any
) -> None:
    environment = environment_of(tmp_path)
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", HOSTILE)["id"]
    with (
        running_worker(environment, tmp_path),
        dispatching(environment, tmp_path),
        running_console(environment, tmp_path) as console,
    ):
        publish(environment, WHERE, "consolew:hostile", thread_id=thread, payload=HOSTILE)
        [dead] = wait_for(environment, "dead", 1, "--rule", "console:hostile")
        assert (dead["reason"], dead["error"]) == (HOSTILE_REASON, HOSTILE)
        page = browser.new_page()
        pwned: list[str] = []
        page.on("dialog", lambda dialog: pwned.append(dialog.message))

        for path in ("/runs?status=dead", run_link(console, dead)):
            page.goto(console.at(path) if path.startswith("/") else path)
            assert "RELAYR_CONSOLE_TOKEN is not set" in page.locator("#access").inner_text()
            assert page.locator("form[method=post]").count() == 0
            assert page.locator("button", has_text="Retry").count() == 0
        assert page.locator("#error").inner_text() == HOSTILE
        assert page.locator("#reason").inner_text() == HOSTILE_REASON
        assert page.locator("#reason b, #error b, #error img").count() == 0
        [posted] = page.locator("#emissions pre.content").all_inner_texts()
        assert posted == HOSTILE
        fired_by = page.locator("article.event pre").first.inner_text()
        assert json.dumps(HOSTILE, ensure_ascii=False) in fired_by

        page.goto(console.at(f"/thread?workspace={WHERE}&id={thread}"))
        assert page.locator("#thread-title").inner_text() == HOSTILE
        contents = page.locator("#transcript pre.content").all_inner_texts()
        assert contents == [HOSTILE]
        assert page.locator("main script, main img, main b").count() == 0
        assert page.evaluate("() => window.__pwned") is None
        assert pwned == []

        for action in ("/run/retry", "/run/cancel", "/run/skip"):
            forged = page.request.post(
                console.at(action),
                form={"id": dead["id"], "workspace": WHERE, "csrf": "x", "reason": "forged"},
            )
            assert forged.status == 403, action
            assert "read-only" in forged.text()
        report = relayr_here(environment, "runs", "show", dead["id"])
        assert report["run"]["status"] == "dead"
        assert [attempt["outcome"] for attempt in report["attempts"]] == ["dead"]


def test_a_retry_with_the_broker_down_says_so_and_the_dispatcher_runs_it(
    tmp_path: Path, browser: Any
) -> None:
    """The console reaches no broker (nothing listens on its port), the worker and the
    dispatcher reach theirs: the retry is done in reflexr, the page says the broker is down and
    that the dispatcher will enqueue the run (ADR-0034), and the dispatcher does."""
    environment = environment_of(tmp_path, console_token=TOKEN)
    unreachable = {**environment, "RELAYR_BROKER_URL": "redis://127.0.0.1:1/0"}
    thread = relayr_here(environment, "thread", "create", WHERE, "--title", "backups")["id"]
    with (
        running_worker(environment, tmp_path),
        dispatching(environment, tmp_path),
        running_console(unreachable, tmp_path) as console,
    ):
        publish(environment, WHERE, "opsw:backup", thread_id=thread)
        [dead] = wait_for(environment, "dead", 1, "--rule", BACKUP)
        page = browser.new_page()
        back = "/" + run_link(console, dead).split("/", 3)[3]
        page.goto(console.at("/login?" + urlencode({"next": back})))
        page.fill("input[name=token]", TOKEN)
        page.click("form.login button[type=submit]")
        page.wait_for_url(re.compile(r"/run\?id="))
        (tmp_path / FIXED).touch()
        page.click("form[action='/run/retry'] button")
        page.wait_for_url(re.compile(r"/done\?key="))
        problem = page.locator("#problem").inner_text()
        assert problem.startswith("broker redis://127.0.0.1:1/0 is unavailable: retried in")
        assert f"{dead['id']} ({WHERE}); the dispatcher will enqueue it" in problem
        result = page.locator(f'#results tr[data-run="{dead["id"]}"]').inner_text()
        assert "retried, not enqueued" in result
        wait_for(environment, "succeeded", 1, "--rule", BACKUP)
