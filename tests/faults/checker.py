"""The invariant checker: every promise relayr makes about a workspace's runs, read in the stores.

It reads the truth, not the logs: reflexr's runs, artifactr's log and relayr's ledger, and names
every broken promise:

- every run ended: succeeded, or dead with a reason the scenario allows;
- exactly one notice per notice run, exactly one message per send run, each taken by a turn
  (named by a ``run_started``, which names the messages a turn took at its start, or at or
  below the thread's *taken* cursor, up to which artifactr's Runner consumed the thread's
  messages: a message delivered to a turn already running is not named);
- no message id twice, no rule text twice in one thread;
- the ledger holds the cause of every rule's write, naming the run that made it, and an
  emission record for every run that wrote; every turn that took a rule's message is traced
  back to it (``turn_cause``).

Turns that started and never ended are counted (``turns.unended``), not refused: a turn runs
on the event loop of the pool process whose task sent its message, so a fault that kills that
process kills the turn, and artifactr leaves it ``running`` with its message taken (it is
failed ``abandoned`` only when the thread is next claimed, and the message is not redone).
Scenarios in which no process dies assert there are none.
"""

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from artifactr.core import MessagePosted, RunEnded, RunStarted

from relayr.demo import CLI_USER, DEMO_PUBLISHER
from relayr.ledger.port import WorkspaceKey
from relayr.ledger.turns import turn_cause
from relayr.runtime.process import Runtime
from rules.example import DEPLOY_NOTICE, INCIDENT_TRIAGE
from tests.faults.constants import RULE_AUTHOR_PREFIX, TAKEN_CURSOR, TENANT, WORKSPACE


@dataclass(frozen=True)
class Report:
    """A scenario's outcome: its figures and every broken promise the checker found."""

    figures: dict[str, Any]
    problems: list[str]

    def line(self) -> str:
        return json.dumps({**self.figures, "problems": self.problems[:20]}, default=str)


async def check_invariants(
    runtime: Runtime,
    expected: Mapping[str, int],
    *,
    dead_allowed: Mapping[str, frozenset[str]],
    tenant_id: str = TENANT,
    workspace_id: str = WORKSPACE,
) -> Report:
    """Every promise relayr makes about one workspace's runs, checked in the stores.

    Args:
        expected: How many runs each rule should have.
        dead_allowed: For a rule, the reasons its runs may end ``dead`` with; any other run
            must have succeeded.
    """
    problems: list[str] = []
    application = runtime.application
    ledger = runtime.bridge.ledger
    key = WorkspaceKey(tenant_id, workspace_id)
    rules = await application.rules.open(tenant_id, workspace_id, actor=DEMO_PUBLISHER)
    artifacts = await application.artifacts.open(tenant_id, workspace_id, actor=CLI_USER)
    runs = {run.id: run for run in await rules.runs()}

    by_rule: Counter[str] = Counter(run.rule for run in runs.values())
    for rule, count in expected.items():
        if by_rule[rule] != count:
            problems.append(f"rule {rule} has {by_rule[rule]} runs, expected {count}")
    for rule in set(by_rule) - set(expected):
        problems.append(f"rule {rule} has {by_rule[rule]} runs, expected none")
    statuses: Counter[str] = Counter()
    dead_reasons: Counter[str] = Counter()
    for run in runs.values():
        statuses[run.status] += 1
        if run.status == "succeeded":
            continue
        allowed = dead_allowed.get(run.rule, frozenset())
        if run.status == "dead":
            dead_reasons[f"{run.rule}:{run.reason}"] += 1
            if run.reason in allowed:
                continue
        problems.append(
            f"run {run.id} of {run.rule} ended {run.status} (reason {run.reason}, "
            f"attempts {run.attempts}): {run.error}"
        )

    envelopes = list(await artifacts.read())
    ids: Counter[str] = Counter()
    texts: Counter[tuple[str, str, str]] = Counter()
    posted: dict[str, list[tuple[int, MessagePosted]]] = {}
    seq_of: dict[str, int] = {}
    thread_of: dict[str, str] = {}
    started: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    turns: Counter[str] = Counter()
    ended_turns: set[str] = set()
    for envelope in envelopes:
        event = envelope.event
        if isinstance(event, MessagePosted):
            ids[event.message_id] += 1
            seq_of[event.message_id] = envelope.seq
            thread_of[event.message_id] = event.thread_id
            author = envelope.actor.participant
            if not author.startswith(RULE_AUTHOR_PREFIX):
                continue
            rule = author.removeprefix(RULE_AUTHOR_PREFIX)
            texts[(event.thread_id, rule, event.content)] += 1
            cause = await ledger.cause(key, "message", event.message_id)
            if cause is None:
                problems.append(f"message {event.message_id} of {rule}: no cause in the ledger")
                continue
            writer = runs.get(cause.run_id)
            if writer is None or writer.rule != rule:
                problems.append(
                    f"message {event.message_id} of {rule}: the ledger names run "
                    f"{cause.run_id}, not one of that rule"
                )
                continue
            posted.setdefault(writer.id, []).append((envelope.seq, event))
        elif isinstance(event, RunStarted):
            started.setdefault(event.thread_id, []).append((event.run_id, event.message_ids))
        elif isinstance(event, RunEnded):
            turns[event.status] += 1
            ended_turns.add(event.run_id)
    turns["started"] = sum(len(s) for s in started.values())
    unended = [
        (thread, turn)
        for thread, starts in started.items()
        for turn, _ in starts
        if turn not in ended_turns
    ]
    turns["unended"] = len(unended)

    for message_id, count in ids.items():
        if count > 1:
            problems.append(f"message id {message_id} posted {count} times")
    for (thread, rule, content), count in texts.items():
        if count > 1:
            problems.append(f"{rule} posted {content!r} {count} times in thread {thread}")

    kinds = {DEPLOY_NOTICE.name: "notice", INCIDENT_TRIAGE.name: "message"}
    untaken = 0
    for run in runs.values():
        kind = kinds.get(run.rule)
        if kind is None or run.status != "succeeded":
            continue
        messages = posted.get(run.id, [])
        if len(messages) != 1:
            problems.append(f"run {run.id} of {run.rule} posted {len(messages)} messages")
            continue
        seq, message = messages[0]
        if message.kind != kind:
            problems.append(f"run {run.id} of {run.rule} posted a {message.kind}, not a {kind}")
        output = run.output if isinstance(run.output, dict) else {}
        if output.get("message_id") != message.message_id:
            problems.append(
                f"run {run.id} returned {output.get('message_id')}, but posted {message.message_id}"
            )
        if not await ledger.emissions(key, run.id):
            problems.append(f"run {run.id} of {run.rule} left no emission record")
        if kind != "message":
            continue
        thread = message.thread_id
        named = [turn for turn, taken in started.get(thread, []) if message.message_id in taken]
        cursor = await artifacts.cursor(TAKEN_CURSOR.format(thread_id=thread))
        if not named and seq > cursor:
            untaken += 1
            problems.append(
                f"message {message.message_id} of run {run.id} was taken by no turn "
                f"(thread {thread}, seq {seq}, taken cursor {cursor})"
            )
    for thread, starts in started.items():
        for turn, message_ids in starts:
            if not message_ids:
                continue
            cause = await turn_cause(ledger, key, message_ids)
            if cause is None or cause.run_id not in runs:
                problems.append(f"turn {turn} in {thread} is traced to no run ({message_ids})")

    figures = {
        "runs_by_status": dict(sorted(statuses.items())),
        "dead_reasons": dict(sorted(dead_reasons.items())),
        "attempts": sum(run.attempts for run in runs.values()),
        "messages_by_rules": sum(len(p) for p in posted.values()),
        "turns": dict(sorted(turns.items())),
        "turns_unended": [f"{turn} in {thread}" for thread, turn in unended[:10]],
        "sends_untaken": untaken,
    }
    return Report(figures, problems)
