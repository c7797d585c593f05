"""What the console's buttons do: the command line's own operations on runs, nothing else.

Each action is the call ``relayr runs`` makes (:mod:`relayr.ops.runs`) with the same enqueue, so
a retry from the browser is ``relayr runs retry`` (ADR-0034). Retrying a filter's dead runs is a
preview (``--dead --dry-run``) then a confirmation that retries only the runs the preview named
and still dead.
"""

import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from artifactr.core import NotFound as ArtifactNotFound
from artifactr.core import Rejection as ArtifactRejection
from reflexr import UserActor
from reflexr.workspace import WorkspaceRef

from relayr.core import reasons
from relayr.ledger.port import WorkspaceKey
from relayr.ops.index import RunIndex
from relayr.ops.rows import RunRow
from relayr.ops.runs import (
    EnqueueRun,
    OperatorResult,
    cancel,
    find_runs,
    retry,
    skip,
    would_retry,
)
from relayr.runtime.process import Runtime

from .queries import RunQuery
from .reads import READER, firing_events, rule_names

BULK_RETRY_MAX: Final = 500
"""The most runs one confirmation retries: the preview lists them all in one page, and the
confirmation's form carries each id. More wait for the next preview."""

KEPT_RESULTS: Final = 200
"""How many actions' results a console keeps for their result pages (the newest)."""


@dataclass(frozen=True)
class RunRef:
    """A run named by its workspace and id, as the confirmation form carries it."""

    workspace: WorkspaceKey
    run_id: str

    def __str__(self) -> str:
        return f"{self.workspace}/{self.run_id}"


@dataclass(frozen=True)
class Verdict:
    """What the preview says of retrying one dead run: it would be retried (``ok``), and whether
    it will certainly fail again, and why."""

    done: OperatorResult
    row: RunRow | None
    fails_again: str | None = None


@dataclass(frozen=True)
class Preview:
    """What retrying the dead runs of a filter would do (``runs retry --dead --dry-run``), with
    the runs that will certainly fail again set apart, and the reasons the dead runs have."""

    query: RunQuery
    verdicts: list[Verdict]
    more: int
    """Dead runs of the filter past :data:`BULK_RETRY_MAX`, left for the next preview."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Every dead run of the filter but its reason's, by reason: to filter the preview by."""

    @property
    def results(self) -> list[OperatorResult]:
        return [verdict.done for verdict in self.verdicts]

    @property
    def retried(self) -> list[OperatorResult]:
        """The runs a confirmation would retry: those that may succeed."""
        return [v.done for v in self.verdicts if v.done.ok and v.fails_again is None]

    @property
    def doomed(self) -> list[Verdict]:
        """The runs that would be retried but will certainly fail again."""
        return [v for v in self.verdicts if v.done.ok and v.fails_again is not None]


@dataclass(frozen=True)
class Outcome:
    """One action's results, kept for its result page (post/redirect/get): the page reads each
    run's state again when it is shown, so it follows the runs to their end."""

    action: str
    who: str
    results: list[OperatorResult]
    problem: str | None
    back: str


class Outcomes:
    """The newest :data:`KEPT_RESULTS` actions' results of this console process, by a random
    key the action redirects to: reloading the result page shows them again and acts never."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Outcome] = OrderedDict()

    def keep(self, outcome: Outcome) -> str:
        key = secrets.token_urlsafe(16)
        self._kept[key] = outcome
        while len(self._kept) > KEPT_RESULTS:
            self._kept.popitem(last=False)
        return key

    def get(self, key: str) -> Outcome | None:
        return self._kept.get(key)


async def retry_one(
    runtime: Runtime,
    enqueue: EnqueueRun,
    run_id: str,
    workspace: WorkspaceKey | None,
    *,
    actor: UserActor,
) -> list[OperatorResult]:
    """``relayr runs retry RUN``: reflexr's operator retry, then an enqueue."""
    rules = runtime.application.rules
    found, missing = await _find(runtime, [(workspace, run_id)])
    return [*missing, *await retry(rules, found, enqueue, actor=actor)]


async def cancel_one(
    runtime: Runtime,
    run_id: str,
    workspace: WorkspaceKey | None,
    *,
    reason: str,
    actor: UserActor,
) -> list[OperatorResult]:
    """``relayr runs cancel RUN --reason R``."""
    found, missing = await _find(runtime, [(workspace, run_id)])
    return [
        *missing,
        *await cancel(runtime.application.rules, found, reason=reason, actor=actor),
    ]


async def skip_one(
    runtime: Runtime,
    run_id: str,
    workspace: WorkspaceKey | None,
    *,
    reason: str,
    actor: UserActor,
) -> list[OperatorResult]:
    """``relayr runs skip RUN --reason R``."""
    found, missing = await _find(runtime, [(workspace, run_id)])
    return [*missing, *await skip(runtime.application.rules, found, reason=reason, actor=actor)]


async def preview_retry(runtime: Runtime, query: RunQuery, index: RunIndex) -> Preview:
    """``relayr runs retry --dead [filters] --dry-run`` (its runs from the console's run
    index): nothing changes. Each run that would be retried is checked for what makes it fail
    again for certain (:func:`fails_again`)."""
    rules = runtime.application.rules
    await index.refreshed()
    run_filter = query.run_filter(rules.clock(), limit=None, known=rule_names(runtime))
    dead = index.select(run_filter)
    unfiltered = dead
    if query.reason is not None:
        run_filter.reason = None
        unfiltered = index.select(run_filter)
    counts: dict[str, int] = {}
    for row in unfiltered:
        counts[row.reason or "-"] = counts.get(row.reason or "-", 0) + 1
    taken = dead[:BULK_RETRY_MAX]
    results = [would_retry(row, row.status) for row in taken]  # as the index read them just now
    verdicts = []
    for row, done in zip(taken, results, strict=True):
        why = await fails_again(runtime, row) if done.ok else None
        verdicts.append(Verdict(done, row, why))
    return Preview(
        query=query,
        verdicts=verdicts,
        more=len(dead) - len(taken),
        reasons=dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))),
    )


async def fails_again(runtime: Runtime, row: RunRow) -> str | None:
    """Why a dead run will certainly fail again if retried now, or None when it may succeed.

    A run whose events name no thread (``no_thread``) fails so again: its events do not change.
    One that died because a thread it acts in does not exist (``thread_not_found``) fails again
    while a thread its events name still does not exist.
    """
    if row.reason == reasons.NO_THREAD:
        return "its events name no thread to act in, and they will not change"
    if row.reason != reasons.THREAD_NOT_FOUND:
        return None
    rules = runtime.application.rules
    ref = WorkspaceRef(row.tenant_id, row.workspace_id)
    run = await rules.storage.run(ref, row.id)
    if run is None:
        return None
    handle = await runtime.application.artifacts.open(row.tenant_id, row.workspace_id, actor=READER)
    missing = []
    for event in await firing_events(rules, ref, run.matched):
        for thread_id in event.threads:
            try:
                await handle.thread(thread_id)
            except (ArtifactNotFound, ArtifactRejection):
                missing.append(thread_id)
    if not missing:
        return None
    return f"thread {', '.join(sorted(set(missing)))} does not exist in {row.workspace}"


async def confirm_retry(
    runtime: Runtime, enqueue: EnqueueRun, refs: Sequence[RunRef], *, actor: UserActor
) -> list[OperatorResult]:
    """Retry the runs a preview listed that are still dead, as ``relayr runs retry RUN...``."""
    found, missing = await _find(runtime, [(ref.workspace, ref.run_id) for ref in refs])
    dead = [row for row in found if row.status == "dead"]
    moved = [
        OperatorResult(
            row.id, str(row.workspace), False, f"no longer dead ({row.status}): not retried"
        )
        for row in found
        if row.status != "dead"
    ]
    return [
        *missing,
        *moved,
        *await retry(runtime.application.rules, dead, enqueue, actor=actor),
    ]


SELECTED: Final = {
    "retry": ("dead", "retrying", "cancelled", "skipped"),
    "cancel": ("pending", "retrying", "running"),
    "skip": ("pending", "retrying", "dead"),
}
"""What an operator may do to the runs selected on the runs list, and the statuses each action
takes (those the run's own page offers it for)."""

SELECTED_MAX: Final = 100
"""The most runs one action on selected runs takes: two pages of the runs list."""

DONE: Final = {"retry": "retried", "cancel": "cancelled", "skip": "skipped"}


@dataclass(frozen=True)
class Selection:
    """What an action would do to each selected run, as they are now: ``ok`` those it takes."""

    action: str
    verdicts: list[OperatorResult]

    @property
    def taken(self) -> list[OperatorResult]:
        return [verdict for verdict in self.verdicts if verdict.ok]


async def preview_selected(runtime: Runtime, action: str, refs: Sequence[RunRef]) -> Selection:
    """What ``action`` would do to each run of ``refs`` now; nothing changes."""
    found, missing = await _find(runtime, [(ref.workspace, ref.run_id) for ref in refs])
    verdicts = [_fits(action, row) or _would_do(action, row) for row in found]
    return Selection(action, [*missing, *verdicts])


async def act_on_selected(
    runtime: Runtime,
    enqueue: EnqueueRun,
    action: str,
    refs: Sequence[RunRef],
    *,
    reason: str,
    actor: UserActor,
) -> list[OperatorResult]:
    """Do ``action`` to each run of ``refs`` whose status it takes now, as ``relayr runs
    retry|cancel|skip RUN...`` does; each other run gets a refusal that names its status.
    ``reason`` is a cancel's or a skip's (a retry takes none)."""
    rules = runtime.application.rules
    found, missing = await _find(runtime, [(ref.workspace, ref.run_id) for ref in refs])
    fit: list[RunRow] = []
    refused: list[OperatorResult] = []
    for row in found:
        refusal = _fits(action, row)
        if refusal is None:
            fit.append(row)
        else:
            refused.append(refusal)
    if action == "retry":
        done = await retry(rules, fit, enqueue, actor=actor)
    elif action == "cancel":
        done = await cancel(rules, fit, reason=reason, actor=actor)
    else:
        done = await skip(rules, fit, reason=reason, actor=actor)
    return [*missing, *refused, *done]


def _would_do(action: str, row: RunRow) -> OperatorResult:
    return OperatorResult(row.id, str(row.workspace), True, f"would {action}", row.status)


def _fits(action: str, row: RunRow) -> OperatorResult | None:
    """None when ``action`` takes ``row`` as it is, else the refusal that says why not."""
    if row.status in SELECTED[action]:
        return None
    detail = f"{row.status}: {action} takes {', '.join(SELECTED[action])} runs; not {DONE[action]}"
    return OperatorResult(row.id, str(row.workspace), False, detail, row.status)


async def current_states(runtime: Runtime, results: Sequence[OperatorResult]) -> dict[str, RunRow]:
    """Each run of an action's results as it is now, by ``workspace/id``."""
    named = [
        (WorkspaceKey(*result.workspace.split("/", 1)), result.run_id)
        for result in results
        if "/" in result.workspace
    ]
    found, _ = await _find(runtime, named)
    return {f"{row.workspace}/{row.id}": row for row in found}


async def _find(
    runtime: Runtime, named: Sequence[tuple[WorkspaceKey | None, str]]
) -> tuple[list[RunRow], list[OperatorResult]]:
    """The runs named, and a refusal for each that does not exist
    (:func:`relayr.ops.runs.find_runs`).

    A page shows each refusal next to the other runs' results; the command line refuses them
    all before acting instead, since it was typed (a typo), where a page's form names what a
    page showed (a run that may have gone since)."""
    return await find_runs(runtime.application.rules, named)
