"""Evaluating a workspace's rules: every rule, one read of the log, one transaction (ADR-0028).

What reflexr's ``Reactor.evaluate`` does, with its public pure core: every enabled rule over one
read of the log up to the head the pass found, saved as the reactor saves it. No evaluation
lease: the transaction's row lock makes two dispatchers take turns, and neither evaluates an
envelope twice. With tracing on, an evaluation is a ``relayr.evaluate`` span (ADR-0080).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from reflexr.core import (
    Envelope,
    Rule,
    RuleProgress,
    Run,
    begin,
    create_run,
    evaluate,
    needs,
    new_event_id,
    reset,
)
from reflexr.workspace import REACTOR, Entry, Transaction, WorkspaceRef, Workspaces

from relayr.observe import telemetry

BATCH_ENVELOPES: Final = 20
"""How many envelopes one transaction reads. The transaction holds the workspace's lock, which
workers wait for, and a dispatcher evaluates one such transaction of a backlog before it turns
to another workspace's new event (:func:`evaluate_each`): an envelope that fires costs 3 to 4
ms of its time on PostgreSQL, a transaction about 25 ms more (ADR-0114)."""


@dataclass(frozen=True)
class Evaluated:
    """What evaluating a workspace did: the runs its firings made, the last seq it was to read,
    and whether it read that far."""

    runs: tuple[Run, ...]
    up_to: int
    caught_up: bool


async def evaluate_workspace(
    rules: Workspaces,
    ref: WorkspaceRef,
    *,
    up_to: int | None = None,
    batch: int = BATCH_ENVELOPES,
) -> Evaluated:
    """Evaluate every enabled rule of ``ref`` over up to ``batch`` new envelopes, in one
    transaction; ``up_to`` bounds the seqs read (the head a pass began with)."""
    async with rules.storage.transaction(ref) as transaction:
        found = await rules.rules_in(transaction)
        head = await transaction.head_seq()
        last = head if up_to is None else min(head, up_to)
        enabled = [entry.rule for entry in found.values() if entry.rule.enabled]
        cursors = {rule.name: await _progress(transaction, rule, head) for rule in enabled}
        low = min((progress.cursor for progress in cursors.values()), default=last)
        if low >= last:
            return Evaluated((), last, True)
        envelopes = [
            envelope
            for envelope in await transaction.read(after_seq=low, limit=batch)
            if envelope.seq <= last
        ]
        made: list[Run] = []
        with telemetry.evaluating(ref.tenant_id, ref.workspace_id, envelopes) as traced:
            for rule in enabled:
                made += await _evaluate(
                    rules, transaction, rule, cursors[rule.name], envelopes, traced.traceparent
                )
            traced.fired(made)
        read_to = envelopes[-1].seq if envelopes else last
    return Evaluated(tuple(made), last, read_to >= last)


async def _progress(transaction: Transaction, rule: Rule, head: int) -> RuleProgress:
    """A rule's progress: begun if it has none, reset at the head if its definition changed."""
    progress = await transaction.progress(rule.name)
    if progress is None:
        progress = begin(rule, head_seq=head)
        await transaction.save_progress(rule.name, progress)
    elif progress.definition != rule.definition():
        # a changed rule starts afresh at the head; replaying is how to reprocess
        progress, event = reset(rule, progress, from_seq=head)
        await transaction.clear_states(rule.name)
        await transaction.save_progress(rule.name, progress)
        await transaction.append([Entry(id=new_event_id(), actor=REACTOR, event=event)])
    return progress


async def _evaluate(
    rules: Workspaces,
    transaction: Transaction,
    rule: Rule,
    progress: RuleProgress,
    envelopes: list[Envelope],
    traceparent: str | None = None,
) -> list[Run]:
    """Fold the envelopes after the rule's cursor into its state; save what it decided, and
    return the runs its firings made."""
    new = [envelope for envelope in envelopes if envelope.seq > progress.cursor]
    if not new:
        return []
    keys = needs(rule, progress, new, predicates=rules.predicates)
    states = await transaction.states(rule.name, keys)
    evaluation = evaluate(
        rule, progress, states, new, predicates=rules.predicates, max_depth=rules.max_depth
    )
    await transaction.save_states(rule.name, evaluation.states)
    await transaction.save_progress(rule.name, evaluation.progress)
    if evaluation.errors:
        await transaction.dead_letter(evaluation.errors)
    runs = [create_run(firing, now=rules.clock()) for firing in evaluation.firings]
    await transaction.save_runs(runs)
    await transaction.append(
        [
            Entry(
                id=new_event_id(),
                actor=REACTOR,
                event=fact.event,
                causation=fact.causation,
                correlation_id=fact.correlation_id,
                traceparent=traceparent,
            )
            for fact in evaluation.facts
        ]
    )
    return runs


@dataclass(frozen=True)
class Evaluations:
    """What evaluating several workspaces did: the runs the firings made, with their
    workspaces, and the workspaces left with envelopes past what was read (``whole=False``)."""

    runs: list[tuple[WorkspaceRef, Run]]
    behind: list[WorkspaceRef]


async def evaluate_all(
    rules: Workspaces, *, evaluated_to: dict[WorkspaceRef, int] | None = None
) -> list[tuple[WorkspaceRef, Run]]:
    """Evaluate every workspace with a log (:func:`evaluate_each` over reflexr's list of
    workspaces); return the runs the firings made, with their workspaces."""
    refs = await rules.storage.workspaces()
    return (await evaluate_each(rules, refs, evaluated_to=evaluated_to)).runs


async def evaluate_each(
    rules: Workspaces,
    refs: Iterable[WorkspaceRef],
    *,
    evaluated_to: dict[WorkspaceRef, int] | None = None,
    whole: bool = True,
    batch: int = BATCH_ENVELOPES,
) -> Evaluations:
    """Evaluate each workspace of ``refs``: each up to the head it had when its turn came, or,
    unless ``whole``, over one transaction of ``batch`` envelopes, the rest left for the caller
    (``behind``), so that a backlog takes its turn with the others.

    ``evaluated_to`` remembers, across calls, the head each workspace was evaluated up to: a
    workspace whose head has not moved since is skipped after one read of its head, without the
    evaluation's transaction and its lock (which on SQLite is the file's write lock). Only for
    applications whose rules are all in code: a stored rule can change without the log moving.
    """
    made: list[tuple[WorkspaceRef, Run]] = []
    behind: list[WorkspaceRef] = []
    known = evaluated_to if rules.stored_rules is None else None
    for ref in refs:
        if known is not None and known.get(ref) == await rules.storage.head_seq(ref):
            continue
        evaluated = await evaluate_workspace(rules, ref, batch=batch)
        made += [(ref, run) for run in evaluated.runs]
        while whole and not evaluated.caught_up:
            evaluated = await evaluate_workspace(rules, ref, up_to=evaluated.up_to, batch=batch)
            made += [(ref, run) for run in evaluated.runs]
        if not evaluated.caught_up:
            behind.append(ref)
        elif known is not None:
            # what this evaluation appended (its firings' facts) moved the head past it, so
            # the next pass evaluates those
            known[ref] = evaluated.up_to
    return Evaluations(made, behind)
