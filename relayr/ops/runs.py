"""What ops do to runs: retry, cancel or skip them safely.

Every change goes through reflexr's own operator operations (ADR-0001). A retry is reflexr's
retry (due now, attempts from zero) then an enqueue, so ops need not wait for the dispatcher; if
the enqueue fails (:class:`relayr.core.errors.BrokerUnavailable`), the run stays retried for the
dispatcher and the remaining runs skip the broker (ADR-0034). Retrying is always safe: the run's
writes have derived ids (ADR-0026). :func:`find_runs` is how the command line and the console
find the runs they are named, so both refuse alike.
"""

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final

import structlog
from reflexr import UserActor
from reflexr.core import InvalidState, NotFound, Rejection
from reflexr.workspace import WorkspaceRef, Workspaces

from relayr.core.errors import BrokerUnavailable
from relayr.ledger.port import WorkspaceKey
from relayr.ops.rows import AmbiguousRun, RunRow, find_run

if TYPE_CHECKING:
    pass

logger = structlog.get_logger("relayr.ops")

OPERATOR: Final = UserActor(id="relayr-ops", name="relayr ops")
"""Who retries, cancels and skips runs from the CLI, as reflexr's facts record it."""

MAX_OPERATOR_CHARS: Final = 100
"""The longest operator name recorded."""


def operator(name: str, *, via: str) -> UserActor:
    """The actor reflexr records for a person named ``name`` acting through ``via`` (the
    console): the facts of what they did carry it, so a run's page says who acted.

    Raises:
        ValueError: When the name is empty, too long or holds a control character.
    """
    cleaned = name.strip()
    if not cleaned or len(cleaned) > MAX_OPERATOR_CHARS:
        raise ValueError(f"operator name must be 1 to {MAX_OPERATOR_CHARS} characters")
    if any(ord(character) < 0x20 or ord(character) == 0x7F for character in cleaned):
        raise ValueError("operator name holds a control character")
    return UserActor(id=f"{via}:{cleaned}", name=cleaned)


ENQUEUE_FAILED: Final = "enqueue_failed"
""":attr:`OperatorResult.enqueue_error` of a retried run whose enqueue failed otherwise than with
the broker unavailable (:attr:`relayr.core.errors.BrokerUnavailable.code`): a message the broker
refused, credentials it refused, a folder that cannot be written."""

type EnqueueRun = Callable[[str, str, str], Awaitable[None]]
"""Hands one retried run to the queue: ``await enqueue(tenant_id, workspace_id, run_id)``
(a message of one run; :data:`relayr.dispatch.dispatcher.Enqueue` hands a whole batch)."""


@dataclass(frozen=True)
class OperatorResult:
    """What an operation did to one run: changed it, or refused, and why.

    ``enqueued`` is a retry's: whether the run was handed to the broker at once (False: the
    enqueue failed, and the dispatcher will enqueue it); None for other operations.
    ``enqueue_error`` says why it was not: ``broker_unavailable`` or :data:`ENQUEUE_FAILED` (the
    detail names the error).
    """

    run_id: str
    workspace: str
    ok: bool
    detail: str
    status: str | None = None
    enqueued: bool | None = None
    enqueue_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def find_runs(
    rules: Workspaces, named: Iterable[tuple[WorkspaceKey | None, str]]
) -> tuple[list[RunRow], list[OperatorResult]]:
    """The runs named (each in its workspace, or the one workspace that has it), and a refusal
    that names each one that does not exist (``no run fir_... in acme/ops``) or that several
    workspaces hold (:class:`AmbiguousRun`)."""
    found: list[RunRow] = []
    missing: list[OperatorResult] = []
    for workspace, run_id in named:
        try:
            row = await find_run(rules, run_id, workspace)
        except AmbiguousRun as error:
            missing.append(OperatorResult(run_id, "*", False, str(error)))
            continue
        if row is not None:
            found.append(row)
            continue
        where = "" if workspace is None else f" in {workspace}"
        missing.append(
            OperatorResult(run_id, str(workspace or "*"), False, f"no run {run_id}{where}")
        )
    return found, missing


async def retry(
    rules: Workspaces,
    targets: Sequence[RunRow],
    enqueue: EnqueueRun,
    *,
    dry_run: bool = False,
    actor: UserActor = OPERATOR,
) -> list[OperatorResult]:
    """reflexr's operator retry of each run, then an enqueue, so it runs at once.

    When ``enqueue`` fails, with :class:`BrokerUnavailable` or any other error (logged), that
    run and the rest are retried in reflexr but not enqueued (``enqueued=False``, the error in
    the detail): each stays due for the dispatcher, and every run gets its result. The enqueue
    is not tried again for the rest: a broker that failed one run in this call fails the next.
    """
    failed: tuple[str, str] | None = None  # once the enqueue failed: its code and message

    async def retry_one(row: RunRow) -> OperatorResult:
        nonlocal failed
        if dry_run:
            current = await rules.storage.run(_ref(row), row.id)
            return would_retry(row, None if current is None else current.status)
        handle = await rules.open(row.tenant_id, row.workspace_id, actor=actor)
        retried = await handle.retry_run(row.id)
        if failed is None:
            try:
                await enqueue(row.tenant_id, row.workspace_id, row.id)
            except BrokerUnavailable as unavailable:
                failed = (unavailable.code, unavailable.message)
            except Exception as error:  # the run changed: its result must still be reported
                failed = (ENQUEUE_FAILED, f"{type(error).__name__}: {error}")
                logger.error(
                    "a retried run was not enqueued; the dispatcher will enqueue it",
                    run_id=row.id,
                    workspace=str(row.workspace),
                    error=failed[1],
                )
            else:
                done = "retried and enqueued"
                return OperatorResult(row.id, str(row.workspace), True, done, retried.status, True)
        code, why = failed
        detail = f"retried, not enqueued ({why}); the dispatcher will enqueue it"
        return OperatorResult(row.id, str(row.workspace), True, detail, retried.status, False, code)

    return [await _guarded(row, retry_one) for row in targets]


def would_retry(row: RunRow, status: str | None) -> OperatorResult:
    """What a retry would do to ``row`` if it is now in ``status`` (None: it is gone), as
    ``runs retry --dry-run`` says it."""
    if status is None or status in ("succeeded", "running"):
        return OperatorResult(
            row.id, str(row.workspace), False, f"cannot retry a {status or 'gone'} run"
        )
    return OperatorResult(row.id, str(row.workspace), True, "would retry", status)


def not_enqueued(results: Sequence[OperatorResult], broker: str) -> str | None:
    """One line for ops when a retry reached reflexr but not the broker ``broker`` (already
    redacted), naming each run left for the dispatcher (ADR-0034); None when all went through."""
    left = [result for result in results if result.enqueued is False]
    if not left:
        return None
    listed = ", ".join(f"{result.run_id} ({result.workspace})" for result in left)
    them = "it" if len(left) == 1 else "them"
    if all(result.enqueue_error == BrokerUnavailable.code for result in left):
        return (
            f"broker {broker} is unavailable: retried in reflexr but not enqueued: {listed}; "
            f"the dispatcher will enqueue {them} once it reaches the broker"
        )
    return (
        f"the enqueue on broker {broker} failed (each run's detail says why): retried in "
        f"reflexr but not enqueued: {listed}; the dispatcher will enqueue {them}"
    )


async def cancel(
    rules: Workspaces, targets: Sequence[RunRow], *, reason: str, actor: UserActor = OPERATOR
) -> list[OperatorResult]:
    """reflexr's operator cancel of each run; a running attempt is fenced off."""

    async def cancel_one(row: RunRow) -> OperatorResult:
        handle = await rules.open(row.tenant_id, row.workspace_id, actor=actor)
        cancelled = await handle.cancel_run(row.id, reason=reason)
        return OperatorResult(row.id, str(row.workspace), True, "cancelled", cancelled.status)

    return [await _guarded(row, cancel_one) for row in targets]


async def skip(
    rules: Workspaces, targets: Sequence[RunRow], *, reason: str, actor: UserActor = OPERATOR
) -> list[OperatorResult]:
    """reflexr's operator skip of each run: it will not run, and its scope moves on."""

    async def skip_one(row: RunRow) -> OperatorResult:
        handle = await rules.open(row.tenant_id, row.workspace_id, actor=actor)
        skipped = await handle.skip_run(row.id, reason=reason)
        return OperatorResult(row.id, str(row.workspace), True, "skipped", skipped.status)

    return [await _guarded(row, skip_one) for row in targets]


async def _guarded(
    row: RunRow, operation: Callable[[RunRow], Awaitable[OperatorResult]]
) -> OperatorResult:
    try:
        return await operation(row)
    except (InvalidState, NotFound) as refused:
        return OperatorResult(row.id, str(row.workspace), False, refused.message)
    except Rejection as refused:
        return OperatorResult(
            row.id, str(row.workspace), False, f"{refused.code}: {refused.message}"
        )


def _ref(row: RunRow) -> WorkspaceRef:
    return WorkspaceRef(row.tenant_id, row.workspace_id)
