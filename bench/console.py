"""How long the console's pages take to answer with many runs in the store.

``python -m bench.console`` fills a storage of the case's own (SQLite, then PostgreSQL) with
``--runs`` N runs (100,000) across :data:`WORKSPACES` (three tenants), of the example's five
rules, in a mix of statuses (:data:`STATUS_MIX`: mostly succeeded; dead for four reasons;
pending, retrying, cancelled and skipped), created over the last two days. Each run is written
through reflexr's storage API, in transactions of :data:`FILL_BATCH` runs: the
``deploy:finished`` event that fired it is appended to the workspace's log and the run saved with
``save_runs``, as an evaluation saves the runs it creates. Its status, attempts, error and times
are set as its last attempt left them: evaluating and executing 100,000 runs would take hours,
and the console reads runs, not how they got there. So the log holds none of these runs'
facts (``reflexr:rule_fired``, ``reflexr:run_*``), by which a running console's index sees runs
change (ADR-0109): the console is started after the fill, and reads them all as it starts.

``--idle-workspaces`` K adds K workspaces of a tenant of their own, each with one event in its
log and no run: what a page's refresh costs for workspaces with nothing new.

It then starts ``relayr console --port 0`` (a process of its own, on the case's settings, as
an operator does), and times each page of :func:`pages` over HTTP from this process: one
request first (a warm-up, timed apart as ``first_ms``), then ``--requests`` more, one at a
time; a page's figures are their p50, p95 and max in milliseconds, and its status (a search for
an id answers 303, a redirect to what it found), and the console's memory after them (``VmRSS``
and its peak, KiB). One JSON line per storage, then one verdict line per page and storage
(:mod:`bench.verdicts`): its p95 at most :data:`PAGE_MS` with 100,000 runs (a smaller
``--runs`` prints them marked not judged).
"""

import argparse
import asyncio
import http.client
import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from urllib.parse import urlencode, urlsplit

from reflexr.core import Run, firing_id, new_event_id
from reflexr.workspace import Entry, WorkspaceRef

from bench.common import (
    STORAGES,
    available_storages,
    emit,
    machine,
    memory_kib,
    note,
    percentile,
    quiet_logging,
)
from bench.deployed import Deployment, deployment
from bench.stamps import READER, Stores
from bench.verdicts import Target
from bench.workers import REPO
from relayr.cli.processes import RelayrProcess, relayr_command
from rules.example.events import DeployFinished

PAGE_MS: Final = 300.0
"""Every page, at its p95, with 100,000 runs in the store."""

JUDGED_RUNS: Final = 100_000

WORKSPACES: Final = (
    ("acme", "ops"),
    ("acme", "billing"),
    ("acme", "search"),
    ("acme", "web"),
    ("zeta", "ops"),
    ("zeta", "data"),
    ("zeta", "mail"),
    ("umbra", "ops"),
)
"""Where the runs are, the first workspaces holding more than the last (:func:`share`)."""

RULES: Final = (
    "ops:deploy-notice",
    "ops:incident-triage",
    "ops:agent-replied",
    "ops:page-on-call",
    "ops:incident-scribe",
)
"""The example's rules: the console's rule filter resolves its names against them."""

DEAD_REASONS: Final = (
    ("no_thread", "artifactr refused: thread thr_gone does not exist"),
    ("not_allowed", "rule ops:incident-triage may not start turns; post a notice"),
    ("rejected", "artifactr rejected the message: content too long"),
    ("timeout", "the action did not finish within 300 s"),
)

STATUS_MIX: Final = (
    ("succeeded", 86),
    ("dead", 6),
    ("pending", 3),
    ("retrying", 3),
    ("cancelled", 1),
    ("skipped", 1),
)
"""Out of every hundred runs, how many end in each status."""

SPREAD: Final = timedelta(hours=48)
"""Runs are created evenly over this long before the fill, so the overview's last 24 hours
hold about half of them."""

FILL_BATCH: Final = 1000
"""Runs (and their events) written per transaction."""

REQUEST_TIMEOUT_S: Final = 600.0
"""A bound on one page's answer: a slow page is a figure, not a failure."""


def share(index: int) -> int:
    """The weight of the ``index``-th workspace: the first holds eight times the last."""
    return len(WORKSPACES) - index


def statuses(count: int) -> list[str]:
    """``count`` statuses in :data:`STATUS_MIX`'s proportions, interleaved."""
    cycle = [status for status, weight in STATUS_MIX for _ in range(weight)]
    stride = 37  # coprime with 100: consecutive runs take statuses far apart in the cycle
    return [cycle[(index * stride) % len(cycle)] for index in range(count)]


def run_of(
    index: int, status: str, seq: int, correlation_id: str, created: datetime, now: datetime
) -> Run:
    """A run of the ``index``-th firing, as its last attempt (or none) left it."""
    rule = RULES[index % len(RULES) if index % 3 else 0]
    updated = min(created + timedelta(seconds=5 + index % 600), now)
    dead = DEAD_REASONS[index % len(DEAD_REASONS)]
    failed = status in ("dead", "retrying")
    return Run(
        id=firing_id(rule, 0, "", seq),
        rule=rule,
        scope_key="",
        scope={},
        fired_seq=seq,
        matched=(seq,),
        correlation_id=correlation_id,
        status=status,  # type: ignore[arg-type]
        attempts={"pending": 0, "succeeded": 1, "dead": 3, "retrying": 1}.get(status, 1),
        next_attempt_at=updated + timedelta(minutes=5) if status == "retrying" else created,
        created_at=created,
        updated_at=created if status == "pending" else updated,
        error=dead[1] if failed else None,
        reason=dead[0] if failed else None,
    )


async def fill(stores: Stores, runs: int) -> dict[str, int]:
    """Write ``runs`` runs across :data:`WORKSPACES`; how many each holds."""
    weights = [share(index) for index in range(len(WORKSPACES))]
    counts = [runs * weight // sum(weights) for weight in weights]
    counts[0] += runs - sum(counts)
    storage = stores.rules.storage
    now = datetime.now(UTC)
    written = 0
    for (tenant, workspace), count in zip(WORKSPACES, counts, strict=True):
        ref = WorkspaceRef(tenant, workspace)
        kinds = statuses(count)
        for start in range(0, count, FILL_BATCH):
            chunk = range(start, min(start + FILL_BATCH, count))
            entries = [
                Entry(
                    id=new_event_id(),
                    actor=READER,
                    event=DeployFinished(
                        service=f"svc-{index % 40}", status="succeeded", thread_id="thr_bench"
                    ),
                )
                for index in chunk
            ]
            async with storage.transaction(ref) as transaction:
                envelopes = await transaction.append(entries)
                await transaction.save_runs(
                    [
                        run_of(
                            written + index,
                            kinds[index],
                            envelope.seq,
                            envelope.correlation_id,
                            now - SPREAD + SPREAD * (index + 0.5) / count,
                            now,
                        )
                        for index, envelope in zip(chunk, envelopes, strict=True)
                    ]
                )
        written += count
        note(f"{written} of {runs} runs written")
    return {
        f"{tenant}/{workspace}": count
        for (tenant, workspace), count in zip(WORKSPACES, counts, strict=True)
    }


IDLE_TENANT: Final = "idle"


async def idle(stores: Stores, count: int) -> None:
    """Append one event to each of ``count`` workspaces of :data:`IDLE_TENANT`."""
    storage = stores.rules.storage
    for number in range(count):
        event = DeployFinished(service="svc-idle", status="succeeded", thread_id="thr_bench")
        async with storage.transaction(WorkspaceRef(IDLE_TENANT, f"idle-{number:05}")) as begun:
            await begun.append([Entry(id=new_event_id(), actor=READER, event=event)])
        if (number + 1) % 1000 == 0:
            note(f"{number + 1} of {count} idle workspaces written")


async def samples(stores: Stores) -> dict[str, str]:
    """Ids the pages name: a dead run of the first workspace, and the seq of its event."""
    storage = stores.rules.storage
    ref = WorkspaceRef(*WORKSPACES[0])
    [dead] = await storage.runs(ref, status="dead", limit=1)
    return {"run": dead.id, "workspace": "/".join(WORKSPACES[0]), "seq": str(dead.fired_seq)}


def pages(found: dict[str, str]) -> list[str]:
    """The pages an operator opens, with the filters and sorts of the runs list."""
    run = {"id": found["run"], "workspace": found["workspace"]}
    return [
        "/",
        "/runs",
        "/runs?sort=changed",
        "/runs?status=dead",
        "/runs?status=dead&sort=changed",
        "/runs?status=pending",
        "/runs?status=retrying&sort=changed",
        "/runs?rule=triage",
        "/runs?workspace=zeta",
        "/runs?workspace=acme/ops&sort=changed",
        "/runs?reason=no_thread",
        "/runs?since=1h",
        "/runs?since=6h&sort=changed",
        "NEXT /runs?sort=changed",
        "/run?" + urlencode(run),
        "/run?" + urlencode({"id": found["run"]}),
        "/search?" + urlencode({"q": found["run"]}),
        "/search?" + urlencode({"q": "does not exist"}),
        "/retry-dead",
        "/retry-dead?reason=timeout",
        "/event?" + urlencode({"workspace": found["workspace"], "seq": found["seq"]}),
        "/health",
        "/limits",
        "/allowlist",
        "/audit",
    ]


NEXT_LINK: Final = re.compile(r'href="(/runs\?[^"]*after=[^"]*)"')


class Browser:
    """One HTTP connection to the console, as a browser keeps one open."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.connection = http.client.HTTPConnection(
            parts.hostname or "127.0.0.1", parts.port, timeout=REQUEST_TIMEOUT_S
        )

    def get(self, path: str) -> tuple[int, str, float]:
        """The page's status, body, and milliseconds from sending to the last byte."""
        started = time.perf_counter()
        self.connection.request("GET", path)
        answer = self.connection.getresponse()
        body = answer.read().decode(errors="replace")
        return answer.status, body, (time.perf_counter() - started) * 1000.0

    def path_of(self, page: str) -> str:
        """A page's path; ``NEXT /runs...`` is the second page of that list, by its link."""
        if not page.startswith("NEXT "):
            return page
        status, body, _ = self.get(page.removeprefix("NEXT "))
        found = NEXT_LINK.search(body)
        if status != 200 or found is None:
            raise SystemExit(f"{page}: no next page ({status})")
        return found[1].replace("&amp;", "&")


def time_page(browser: Browser, page: str, requests: int) -> dict[str, Any]:
    path = browser.path_of(page)
    status, _, first_ms = browser.get(path)
    times = []
    for _ in range(requests):
        status, _, elapsed = browser.get(path)
        times.append(elapsed)
    return {
        "page": page,
        "status": status,
        "first_ms": round(first_ms, 1),
        "p50_ms": round(percentile(times, 50) or 0.0, 1),
        "p95_ms": round(percentile(times, 95) or 0.0, 1),
        "max_ms": round(max(times), 1),
    }


def start_console(deployed: Deployment) -> tuple[RelayrProcess, str]:
    """``relayr console --port 0`` on the case's settings; it and its address, once it
    answers."""
    process = RelayrProcess.start(
        relayr_command("console", "--port", "0"),
        name="console",
        environment={**deployed.environment, "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
        log_path=deployed.home / "console.log",
    )
    deployed.processes.append(process)
    process.ready("relayr console on ")
    found = re.search(r"relayr console on (http://\S+/) ", process.log())
    if found is None:
        raise SystemExit(f"the console did not say where it listens:\n{process.log()}")
    return process, found[1]


async def filled(
    deployed: Deployment, runs: int, idle_workspaces: int
) -> tuple[dict[str, int], dict[str, str]]:
    async with Stores.opened(deployed.settings) as stores:
        counts = await fill(stores, runs)
        await idle(stores, idle_workspaces)
        return counts, await samples(stores)


def measure(deployed: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    kind = deployed.storage.kind
    note(f"{kind}: writing {args.runs} runs")
    started = time.monotonic()
    counts, found = asyncio.run(filled(deployed, args.runs, args.idle_workspaces))
    filled_s = time.monotonic() - started
    console, base = start_console(deployed)
    browser = Browser(base)
    load_before = machine()["load_avg"]
    timed = []
    for page in pages(found):
        note(f"{kind}: {page}")
        timed.append(time_page(browser, page, args.requests))
    return {
        "bench": "console",
        **deployed.described,
        "runs": args.runs,
        "workspaces": counts,
        "idle_workspaces": args.idle_workspaces,
        "filled_s": round(filled_s, 1),
        "requests": args.requests,
        "pages": timed,
        "console_memory_kib": memory_kib(console.pid),
        "load_avg": {"before": load_before, "after": machine()["load_avg"]},
    }


def verdicts(figures: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    size = "full" if args.runs >= JUDGED_RUNS else "small"
    kind = figures["storage"]
    return [
        Target(
            f"{kind}: GET {page['page']} with {args.runs} runs, p95 ms", PAGE_MS, page["p95_ms"]
        ).line(size)
        for page in figures["pages"]
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.console",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=JUDGED_RUNS, help="runs in the store")
    parser.add_argument("--requests", type=int, default=10, help="per page, after one warm-up")
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument(
        "--idle-workspaces", type=int, default=0, help="workspaces with one event and no run"
    )
    parser.add_argument("--keep", action="store_true", help="keep each case's home")
    args = parser.parse_args(argv)
    if args.runs < len(WORKSPACES) * 10 or args.requests < 1 or args.idle_workspaces < 0:
        parser.error(
            f"--runs must be at least {len(WORKSPACES) * 10}, --requests at least 1, "
            "--idle-workspaces at least 0"
        )
    quiet_logging()
    emit({"bench": "machine", **machine()})
    lines: list[dict[str, Any]] = []
    for kind in available_storages("console", args.storage):
        with deployment(kind, f"console-{kind}", keep=args.keep) as deployed:
            figures = measure(deployed, args)
        emit(figures)
        lines += verdicts(figures, args)
    for line in lines:
        emit(line)


if __name__ == "__main__":
    main()
