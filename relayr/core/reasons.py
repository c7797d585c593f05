"""Every reason a run's attempt can fail with, or its write be refused with: the one list.

A reason is the stable code machines match on (the run's ``reason``, ``relayr_refusals_total``,
the logs); its message is for people. relayr writes no other reason, besides the artifactr codes
:func:`relayr.core.refusals.classify` passes through (listed here too) and an application's own
``RunFailure``s. Whether a reason is permanent is decided where the failure is made (ADR-0060).
The lost-attempt count travels in an abandoned attempt's error: :func:`abandoned_error` writes
it, :func:`lost_in_a_row` reads it (ADR-0022, ADR-0061).
"""

import re
from typing import Final

# -- a rule's write, refused before anything is written (relayr.core.routing) ----------------

NOT_ALLOWED: Final = "not_allowed"
"""The allowlist does not grant the write (turns, a thread outside the chain, a new thread)."""

NO_THREAD: Final = "no_thread"
"""The run has no thread to post in: its events carry no ``thread_id`` and it created none."""

MISSING_RUN_CONTEXT: Final = "missing_run_context"
"""An action asked to act for a run relayr does not execute (its reaction's ``deps`` is not
relayr's bridge): there is no rule, run or workspace to act as."""

EMPTY_CONTENT: Final = "empty_content"
"""The content to post is empty or whitespace only."""

INVALID_CONTENT: Final = "invalid_content"
"""The content holds what no storage keeps: a NUL character or a lone surrogate."""

INVALID_ID: Final = "invalid_id"
"""A thread or artifact id the rule named is empty or holds what no storage keeps."""

INVALID_PATH: Final = "invalid_path"
"""An edit's path is not a JSON pointer."""

# -- a rule's write, refused by artifactr (relayr.core.refusals.classify) ----------------------

THREAD_NOT_FOUND: Final = "thread_not_found"
"""The thread does not exist in the run's workspace. Permanent: a thread appears only when it
is created, by a person or by the rule itself before it writes there (ADR-0060)."""

NOT_FOUND: Final = "not_found"
"""An artifact (or its kind) does not exist. Retried: an artifact a rule proposed appears when
a person accepts the proposal."""

ARTIFACT_ARCHIVED: Final = "artifact_archived"
"""The artifact to edit or propose a change to is archived: nothing can change it."""

THREAD_BUSY: Final = "thread_busy"
"""Another holder owns the thread's claim (a turn elsewhere). Retried."""

VERSION_CONFLICT: Final = "version_conflict"
"""The artifact kept changing under the write, past the bounded re-reads. Retried."""

VALIDATION_FAILED: Final = "validation_failed"
"""artifactr found the data invalid for the artifact's kind. Retried (the data's source may be
fixed)."""

PATCH_FAILED: Final = "patch_failed"
"""artifactr could not apply the edit (an anchor missing, a no-op). Retried."""

FORBIDDEN: Final = "forbidden"
"""The libraries' ``authorize`` refused the rule (artifactr's or reflexr's). Permanent."""

INVALID_STATE: Final = "invalid_state"
"""artifactr refused the write for its state in a way relayr does not take for "already made".
Permanent."""

STORAGE_UNAVAILABLE: Final = "storage_unavailable"
"""The storage kept failing past relayr's own bounded retries (:mod:`relayr.runtime.transient`): the
database is down, locked or unreachable. Retried by the rule's policy."""

REJECTED: Final = "rejected"
"""artifactr refused the write with a code relayr names no reason for (its base ``rejected``,
a protocol it does not support, or one a later release adds); the message keeps artifactr's
code. Permanent."""

INVALID_EMISSION: Final = "invalid_emission"
"""The emission record of a post does not validate (its named code in the message), checked
before anything is written. Permanent."""

IO_ERROR: Final = "io_error"
"""The emission record of a write artifactr holds could not be written to the ledger past
relayr's own bounded retries. Retried: the retry finds the write and records it."""

# -- an attempt, as the executor ends it -----------------------------------------------------

TIMEOUT: Final = "timeout"
"""The action ran past its rule's timeout."""

UNKNOWN_ACTION: Final = "unknown_action"
"""The rule runs an action the application no longer has (a deploy removed it). Permanent."""

INVALID_PARAMS: Final = "invalid_params"
"""The rule's params do not validate as its action's params model. Permanent."""

ABANDONED: Final = "abandoned"
"""The attempt's executor stopped before it ended (its lease lapsed); recorded by the next
claim. Retried."""

WORKER_LOST: Final = "worker_lost"
"""The run's attempts kept losing their worker, past ``max_redeliveries``. Permanent."""

RULE_GONE: Final = "rule_gone"
"""The run's rule is gone from its workspace: the run is cancelled with this reason."""

SOFT_TIME_LIMIT: Final = "soft_time_limit"
"""Celery's soft time limit interrupted the task running the attempt (logged; the attempt is
recorded ``abandoned`` by the next claim)."""

WRITE_REFUSALS: Final = frozenset(
    {
        NOT_ALLOWED,
        NO_THREAD,
        MISSING_RUN_CONTEXT,
        EMPTY_CONTENT,
        INVALID_CONTENT,
        INVALID_ID,
        INVALID_PATH,
        THREAD_NOT_FOUND,
        NOT_FOUND,
        ARTIFACT_ARCHIVED,
        THREAD_BUSY,
        VERSION_CONFLICT,
        VALIDATION_FAILED,
        PATCH_FAILED,
        FORBIDDEN,
        INVALID_STATE,
        STORAGE_UNAVAILABLE,
        REJECTED,
        INVALID_EMISSION,
        IO_ERROR,
    }
)
"""Every reason a rule's write can be refused with."""

ATTEMPT_FAILURES: Final = frozenset(
    {TIMEOUT, UNKNOWN_ACTION, INVALID_PARAMS, FORBIDDEN, ABANDONED, WORKER_LOST, RULE_GONE}
)
"""Every reason the executor itself ends an attempt (or its run) with."""

ALL: Final = WRITE_REFUSALS | ATTEMPT_FAILURES | {SOFT_TIME_LIMIT}
"""Every reason relayr writes or logs."""

ABANDONED_ERROR: Final = "the attempt was abandoned: its executor stopped"
"""The error recorded for an attempt whose executor stopped before it ended, before its
count (:func:`abandoned_error`)."""

_LOST = re.compile(r"\((\d+) attempts? lost in a row\)$")


def abandoned_error(lost: int) -> str:
    """The error of an abandoned attempt that is the ``lost``-th lost in a row (1 or more).

    ``"the attempt was abandoned: its executor stopped (2 attempts lost in a row)"``: read by
    people in ``relayr runs show``, and back by :func:`lost_in_a_row`.
    """
    if lost < 1:
        raise ValueError(f"a lost-attempt count starts at 1, not {lost}")
    return f"{ABANDONED_ERROR} ({lost} {'attempt' if lost == 1 else 'attempts'} lost in a row)"


def lost_in_a_row(reason: str | None, error: str | None) -> int:
    """How many attempts in a row were lost, from the last failure's ``reason`` and ``error``.

    0 unless the last failure was ``abandoned``; an abandoned attempt whose error carries no
    count (one written before the count existed) counts as 1.
    """
    if reason != ABANDONED or error is None:
        return 0
    found = _LOST.search(error)
    return int(found.group(1)) if found else 1
