"""Hostile task payloads on a real worker: refused or harmless, one line each, no write, no
retry loop.

A real ``celery worker`` on Redis and SQLite gets a table of bad messages (unknown ids, a real
run's id under another tenant or workspace, a finished run's id, wrong arity, non-strings,
10k-character strings, NUL, whitespace and case variants, a non-JSON body): afterwards no row
changed or was added in artifactr, reflexr or the ledger; the queue holds none of them, each
was logged by one last line and none twice, the run another tenant's ids pointed at is still
untouched, and the worker still executes good runs. How the ids are read, without a worker, is
in tests/execution/test_task_ids.py.
"""

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from reflexr.core import load_event

from relayr.broker.redis import dead_letter_list
from relayr.cli.demo import run_scenario
from relayr.core.run_messages import RunMessage
from relayr.demo import CLI_USER, DEMO_PUBLISHER, Plan
from relayr.dispatch.dispatcher import Dispatcher
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.app import create_celery
from tasks.runs import LEGACY_TASK_NAME, MAX_ID_LENGTH, RUN_OUTCOME_LINES, TASK_NAME
from tests.services import forgetting_redis_queue
from tests.stored_rows import database_file, table_rows
from tests.workers import RelayrProcess, log_records, relayr_environment, running_worker

WORKER_TIMEOUT_S = 60.0
"""How long the worker may take to log the outcome of every bad message; it needs seconds."""

SCENARIO_TIMEOUT_S = 120.0

VOLATILE_TABLES = frozenset({"reflexr_leases"})
"""Rows a declined claim may take and release again: compared separately (no lease may be
left for a workspace that does not exist)."""

FINAL_LINES = frozenset({"task refused", *(message for _, message in RUN_OUTCOME_LINES.values())})
"""The one line a task logs last: its refusal, or its outcome."""


@dataclass(frozen=True)
class Bad:
    """One bad message and what the worker must say about it."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    refused: str | None = None
    outcomes: frozenset[str] = frozenset()
    serializer: str | None = None
    task: str = LEGACY_TASK_NAME
    """The one-run task of earlier releases, whose three ids most rows break; the rest are
    the run task's, which names a list of runs."""

    def marker(self, task_id: str) -> str:
        """What its log line contains: its task id, or Celery's refusal of a non-JSON body."""
        return PICKLE_REFUSED if self.serializer == "pickle" else task_id


@dataclass(frozen=True)
class Known:
    """The real runs the table points at."""

    tenant: str
    workspace: str
    finished: str
    rival_tenant: str
    rival_workspace: str
    pending: str


PICKLE_REFUSED = "Refusing to deserialize untrusted content of type pickle"

NOTHING_TO_DO = frozenset({"missing"})
FINISHED = frozenset({"not_due", "contended"})


def bad_messages(known: Known) -> list[Bad]:
    """A few dozen messages no worker may act on."""
    t, w, done = known.tenant, known.workspace, known.finished
    rt, rw, pending = known.rival_tenant, known.rival_workspace, known.pending
    huge = "x" * 10_000
    return [
        Bad("unknown run", (t, w, "fir_0000000000000000"), outcomes=NOTHING_TO_DO),
        Bad("garbage run id", (t, w, "no such run"), outcomes=NOTHING_TO_DO),
        Bad("finished run", (t, w, done), outcomes=FINISHED),
        Bad("finished run by name", kwargs={"tenant_id": t, "workspace_id": w, "run_id": done},
            outcomes=FINISHED),
        Bad("finished run, rival tenant", (rt, rw, done), outcomes=NOTHING_TO_DO),
        Bad("finished run, other workspace", (t, "elsewhere", done), outcomes=NOTHING_TO_DO),
        Bad("pending run, our tenant", (t, rw, pending), outcomes=NOTHING_TO_DO),
        Bad("pending run, another workspace", (rt, "elsewhere", pending),
            outcomes=NOTHING_TO_DO),
        Bad("pending run, swapped ids", (rw, rt, pending), outcomes=NOTHING_TO_DO),
        Bad("pending run, ids rotated", (pending, rt, rw), outcomes=NOTHING_TO_DO),
        Bad("pending run, tenant with a space", (rt + " ", rw, pending), outcomes=NOTHING_TO_DO),
        Bad("pending run, tenant upper case", (rt.upper(), rw, pending), outcomes=NOTHING_TO_DO),
        Bad("pending run, id upper case", (rt, rw, pending.upper()), outcomes=NOTHING_TO_DO),
        Bad("pending run, id with a newline", (rt, rw, pending + "\n"), outcomes=NOTHING_TO_DO),
        Bad("sql in the id", (t, w, "' OR 1=1 --"), outcomes=NOTHING_TO_DO),
        Bad("a path as tenant", ("../../etc", w, done), outcomes=NOTHING_TO_DO),
        Bad("unicode ids", ("démo", "שלום", "🚀"), outcomes=NOTHING_TO_DO),
        Bad("longest id accepted", (t, w, "x" * MAX_ID_LENGTH), outcomes=NOTHING_TO_DO),
        Bad("no arguments", refused="task argument tenant_id is missing"),
        Bad("one argument", (t,), refused="task argument workspace_id is missing"),
        Bad("two arguments", (t, w), refused="task argument run_id is missing"),
        Bad("four arguments", (t, w, done, "again"), refused="expected 3 task arguments, got 4"),
        Bad("extra keyword", (t, w, done), {"payload": "x"}, refused="unexpected task arguments"),
        Bad("missing keyword", kwargs={"tenant_id": t, "workspace_id": w},
            refused="task argument run_id is missing"),
        Bad("ints", (1, 2, 3), refused="task argument tenant_id must be a string, not int"),
        Bad("int run id", (t, w, 123), refused="run_id must be a string, not int"),
        Bad("nones", (None, None, None), refused="tenant_id must be a string, not NoneType"),
        Bad("none run id", (t, w, None), refused="run_id must be a string, not NoneType"),
        Bad("bool", (t, True, done), refused="workspace_id must be a string, not bool"),
        Bad("float", (t, w, 1.5), refused="run_id must be a string, not float"),
        Bad("list", ([t], w, done), refused="tenant_id must be a string, not list"),
        Bad("dict", (t, w, {"id": done}), refused="run_id must be a string, not dict"),
        Bad("empty run id", (t, w, ""), refused="run_id is empty"),
        Bad("blank workspace", (t, " \t", done), refused="workspace_id is empty"),
        Bad("10k run id", (t, w, huge), refused="run_id is longer than 256"),
        Bad("10k tenant", (huge, w, done), refused="tenant_id is longer than 256"),
        Bad("10k keyword", (t, w, done), {huge: 1}, refused="unexpected task arguments"),
        Bad("nul in run id", (t, w, done + "\x00"), refused="run_id contains a NUL"),
        Bad("nul tenant", ("\x00", w, done), refused="tenant_id contains a NUL"),
        Bad("nul workspace", (t, "o\x00ps", done), refused="workspace_id contains a NUL"),
        Bad("pickled body", (t, w, done), serializer="pickle"),
        Bad("surrogate run id", (t, w, "fir_\ud800"), refused="run_id is not text that"),
        Bad("surrogate tenant", ("\udfff", w, done), refused="tenant_id is not text"),
        Bad("batch of the finished run", (t, w, [done]), outcomes=FINISHED, task=TASK_NAME),
        Bad("batch naming the pending run of another tenant", (t, w, [pending]),
            outcomes=NOTHING_TO_DO, task=TASK_NAME),
        Bad("batch, one id not a list", (t, w, done), refused="run_ids must be a list of ids",
            task=TASK_NAME),
        Bad("batch of none", (t, w, []), refused="run_ids names no run", task=TASK_NAME),
        Bad("batch with an int", (t, w, [done, 7]), refused="run_ids[1] must be a string, not int",
            task=TASK_NAME),
        Bad("batch with a nul", (t, w, [done + "\x00"]), refused="run_ids[0] contains a NUL",
            task=TASK_NAME),
        Bad("batch with a blank id", (t, w, [done, " "]), refused="run_ids[1] is empty",
            task=TASK_NAME),
        Bad("batch naming no workspace", (t, None, [done]),
            refused="workspace_id must be a string, not NoneType", task=TASK_NAME),
        Bad("batch too long", (t, w, [done] * 21), refused="run_ids names more than 20 runs",
            task=TASK_NAME),
    ]  # fmt: skip


def lines_mentioning(worker: RelayrProcess, task_id: str) -> list[str]:
    return [line for line in worker.log().splitlines() if task_id in line]


def final_lines(worker: RelayrProcess, task_id: str) -> list[dict[str, Any]]:
    return [
        line
        for line in log_records(worker.log())
        if line.get("task_id") == task_id and line.get("event") in FINAL_LINES
    ]


RIVAL_DEPLOYS = 4
"""Deploys the rival tenant publishes, none dispatched. reflexr derives a run's id from its
rule and the seq of its event, not from its workspace, so the rival's first two runs have the
ids of the demo's two deploy runs; its last one has an id no demo run has."""


async def rival_pending_run(settings_: Settings, tenant: str, workspace: str) -> str:
    """Due runs in another tenant, made by a dispatcher pass that enqueues nothing; the last."""
    runtime = await Runtime.start(settings_, role="dispatcher")
    async with runtime:
        artifacts = await runtime.application.artifacts.open(tenant, workspace, actor=CLI_USER)
        thread = (await artifacts.create_thread("rival deploys")).id
        rules = await runtime.application.rules.open(tenant, workspace, actor=DEMO_PUBLISHER)
        for index in range(RIVAL_DEPLOYS):
            event = {"type": "deploy:finished", "service": f"rival-{index}", "status": "ok"}
            await rules.publish(load_event({**event, "thread_id": thread}), id=f"rival-{index}")

        async def hold(batch: RunMessage) -> None:
            return None

        await Dispatcher(runtime).pass_once(hold)
        runs = await rules.runs()
        assert [run.status for run in runs] == ["pending"] * RIVAL_DEPLOYS
        return max(runs, key=lambda run: max(run.matched)).id


async def runs_of(settings_: Settings, tenant: str, workspace: str) -> list[Any]:
    runtime = await Runtime.start(settings_, role="dispatcher")
    async with runtime:
        rules = await runtime.application.rules.open(tenant, workspace, actor=DEMO_PUBLISHER)
        return list(await rules.runs())


def queued_task_ids(client: "redis.Redis[bytes]", queue: str) -> set[str]:
    """Task ids of messages still in the queue (any priority) or delivered and unacknowledged;
    not those set aside as dead letters (a refused message is, on Redis: ADR-0013)."""
    bodies: list[bytes] = []
    for key in client.scan_iter(match=f"{queue}*"):
        if key.decode() == dead_letter_list(queue):
            continue
        if client.type(key) == b"list":
            bodies.extend(client.lrange(key, 0, -1))
    bodies.extend(client.hvals("unacked"))
    found: set[str] = set()
    for body in bodies:
        message = json.loads(body)
        if isinstance(message, list):  # an unacked entry is [message, exchange, routing key]
            message = message[0]
        task_id = message.get("headers", {}).get("id")
        if isinstance(task_id, str):
            found.add(task_id)
    return found


@pytest.mark.worker
@pytest.mark.redis
@pytest.mark.slow
def test_bad_messages_on_a_real_worker_write_nothing_and_are_logged_once(
    tmp_path: Path, redis_url: str
) -> None:
    environment = relayr_environment(tmp_path, broker_url=redis_url)
    settings_ = Settings.from_env(environment)
    app = create_celery(settings_)
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_url)
    started = time.monotonic()
    with (
        forgetting_redis_queue(settings_.queue, url=redis_url),
        running_worker(environment, settings_.home, concurrency=2) as worker,
    ):
        first = asyncio.run(
            run_scenario(settings_, Plan(deploys=2, incidents=1), timeout_s=SCENARIO_TIMEOUT_S)
        ).summary
        assert first["problems"] == [], first
        demo_runs = asyncio.run(runs_of(settings_, "demo", "ops"))
        [done] = [run.id for run in demo_runs if run.rule == "ops:incident-triage"]
        pending = asyncio.run(rival_pending_run(settings_, "rival", "ops"))
        rival_runs = asyncio.run(runs_of(settings_, "rival", "ops"))
        assert pending not in {run.id for run in demo_runs}
        assert done not in {run.id for run in rival_runs}
        table = bad_messages(Known("demo", "ops", done, "rival", "ops", pending))
        before = table_rows(database_file(settings_))

        sent: dict[str, Bad] = {}
        for bad in table:
            task_id = f"bad-{uuid.uuid4().hex[:12]}"
            app.send_task(
                bad.task,
                args=bad.args,
                kwargs=bad.kwargs or {},
                queue=settings_.queue,
                task_id=task_id,
                serializer=bad.serializer,
            )
            sent[task_id] = bad
        wait_until_logged(worker, sent)
        after = table_rows(database_file(settings_))
        assert worker.alive(), worker.log()
        wait_until_gone(client, settings_.queue, sent)
        check_lines(worker, sent)

        changed = sorted(
            name
            for name in before.keys() | after.keys()
            if name not in VOLATILE_TABLES and before.get(name) != after.get(name)
        )
        assert changed == [], changed
        lease_workspaces = {(row[0], row[1]) for row in after.get("reflexr_leases", [])}
        assert lease_workspaces <= {("demo", "ops"), ("rival", "ops")}
        rival_runs = asyncio.run(runs_of(settings_, "rival", "ops"))
        assert {(run.status, run.attempts) for run in rival_runs} == {("pending", 0)}

        later = asyncio.run(
            run_scenario(
                settings_,
                Plan(deploys=2, incidents=1),
                timeout_s=SCENARIO_TIMEOUT_S,
                workspace_id="after",
            )
        ).summary
        assert later["problems"] == [], later
        rival_runs = wait_for_status(settings_, "rival", "ops", "succeeded")
        assert {run.attempts for run in rival_runs} == {1}
        assert worker.alive()
        assert queued_task_ids(client, settings_.queue) & set(sent) == set()
        check_lines(worker, sent)  # nothing was delivered again meanwhile
        lines = {bad.name: len(lines_mentioning(worker, bad.marker(t))) for t, bad in sent.items()}
    print(
        json.dumps(
            {
                "bad_messages": len(sent),
                "refused": sum(bad.refused is not None for bad in table),
                "declined": sum(bool(bad.outcomes) for bad in table),
                "lines_per_message": dict(sorted(Counter(lines.values()).items())),
                "elapsed_s": round(time.monotonic() - started, 1),
            }
        )
    )


def wait_until_logged(worker: RelayrProcess, sent: dict[str, Bad]) -> None:
    """Until every message has its last line (a refusal, an outcome, Celery's error)."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while True:
        waiting = [
            bad.name
            for task_id, bad in sent.items()
            if not (
                final_lines(worker, task_id)
                if bad.serializer is None
                else lines_mentioning(worker, bad.marker(task_id))
            )
        ]
        if not waiting or time.monotonic() > deadline:
            assert waiting == [], f"never logged: {waiting}"
            return
        time.sleep(0.2)


def wait_until_gone(client: "redis.Redis[bytes]", queue: str, sent: dict[str, Bad]) -> None:
    """Until no message of ``sent`` is queued or unacknowledged. A worker logs its last line
    of a message before it acknowledges (or rejects) it, so one may still be unacknowledged
    just after its line; one put back in the queue would stay (and be logged twice)."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while left := queued_task_ids(client, queue) & set(sent):
        if time.monotonic() > deadline:
            assert [sent[task_id].name for task_id in left] == [], "still queued"
        time.sleep(0.2)


def check_lines(worker: RelayrProcess, sent: dict[str, Bad]) -> None:
    """One last line per message, the expected one; no line twice (no redelivery)."""
    problems: list[str] = []
    for task_id, bad in sent.items():
        mentioning = lines_mentioning(worker, bad.marker(task_id))
        if len(set(mentioning)) != len(mentioning):
            problems.append(f"{bad.name}: a line logged twice")
        if bad.serializer is not None:
            if len(mentioning) != 1:
                problems.append(f"{bad.name}: {len(mentioning)} lines, expected Celery's one")
            continue
        final = final_lines(worker, task_id)
        if len(final) != 1:
            problems.append(f"{bad.name}: {len(final)} last lines {final}")
            continue
        [line] = final
        if bad.refused is not None:
            if (line["event"], line.get("code")) != ("task refused", "invalid_task") or (
                bad.refused not in line["reason"]
            ):
                problems.append(f"{bad.name}: expected refusal {bad.refused!r}, got {line}")
            if len(mentioning) != 1:
                problems.append(f"{bad.name}: {len(mentioning)} lines, expected the refusal only")
        elif line.get("outcome") not in bad.outcomes:
            problems.append(f"{bad.name}: expected {sorted(bad.outcomes)}, got {line}")
        elif len(mentioning) > 2:  # the executor's "run not executed", then the task's outcome
            problems.append(f"{bad.name}: {len(mentioning)} lines for one declined message")
        if any("Traceback" in text for text in mentioning):
            problems.append(f"{bad.name}: a traceback was logged")
    assert problems == [], "\n".join(problems)


def wait_for_status(settings_: Settings, tenant: str, workspace: str, status: str) -> list[Any]:
    """The workspace's runs, once every one has ``status``."""
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    while True:
        runs = asyncio.run(runs_of(settings_, tenant, workspace))
        if {run.status for run in runs} == {status} or time.monotonic() > deadline:
            assert {run.status for run in runs} == {status}, runs
            return runs
        time.sleep(0.3)
