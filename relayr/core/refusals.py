"""What a refused write means for its run: a stable reason, and whether a retry may help.

A rule's write can be refused by relayr before it is made (:mod:`relayr.core.routing`) or by
artifactr when it is made. Either way the run's attempt fails with a :class:`Refusal`: a reason
from :mod:`relayr.core.reasons`, a lower-case message naming the ids, and ``permanent`` when no
retry can make the write, so the rule's retry policy is skipped and the run is dead at once.

:func:`classify` decides for artifactr's refusals, from their code (and, for ``not_found``, the
kind of thing not found): pure, so the table is tested without artifactr (ADR-0060).
"""

from dataclasses import dataclass
from typing import Final

from relayr.core import reasons


@dataclass(frozen=True)
class Refusal:
    """Why a write is not made: ``reason`` for machines, ``message`` for people."""

    reason: str
    message: str
    permanent: bool = True


RETRIED: Final = frozenset(
    {
        reasons.VALIDATION_FAILED,
        reasons.PATCH_FAILED,
        reasons.NOT_FOUND,
        reasons.THREAD_BUSY,
        reasons.VERSION_CONFLICT,
        reasons.STORAGE_UNAVAILABLE,
        reasons.IO_ERROR,
    }
)
"""The refusals a later attempt may not meet: the data or its source may be fixed, an artifact
a rule proposed may be accepted meanwhile, a busy thread frees up, a database comes back. Any
other refusal is permanent."""


def classify(code: str, message: str, *, doing: str, entity: str | None = None) -> Refusal:
    """The refusal of a write artifactr refused with ``code`` while ``doing`` it: always one of
    :data:`relayr.core.reasons.WRITE_REFUSALS` (a code relayr names no reason for is
    ``rejected``, with the code in the message).

    Args:
        code: artifactr's ``Rejection.code`` (``thread_busy`` for its ``ThreadBusy``, which
            carries ``invalid_state``).
        message: artifactr's message, kept after what relayr was doing.
        doing: What the write was, naming its ids: ``posting notice msg_...``.
        entity: For ``not_found``, what was not found (artifactr's ``NotFound.entity``).
    """
    reason = code
    if code == reasons.NOT_FOUND and entity == "thread":
        reason = reasons.THREAD_NOT_FOUND
    if reason not in reasons.WRITE_REFUSALS:
        reason, message = reasons.REJECTED, f"{message} (artifactr's code {code})"
    return Refusal(reason, f"{doing}: {message}", permanent=reason not in RETRIED)


def storage_failure(error: BaseException, *, doing: str) -> Refusal:
    """The refusal of a write whose storage kept failing past relayr's own retries: retried
    by the rule's policy, with the error's class and text for people."""
    detail = str(error).splitlines()[0] if str(error) else ""
    return Refusal(
        reasons.STORAGE_UNAVAILABLE,
        f"{doing}: the storage failed ({type(error).__name__}: {detail})".replace(": )", ")"),
        permanent=False,
    )


def record_failure(error: BaseException, *, doing: str) -> Refusal:
    """The refusal of an attempt whose emission record could not be written (``io_error``),
    past relayr's own retries, for a write artifactr holds: retried, so that the retry finds
    the write and records it."""
    detail = str(error).splitlines()[0] if str(error) else ""
    why = f"{type(error).__name__}: {detail}".removesuffix(": ")
    return Refusal(
        reasons.IO_ERROR,
        f"{doing}: the emission record could not be written ({why})",
        permanent=False,
    )
