"""Which run is behind an agent turn (ADR-0026: turns are traced by their messages).

A turn carries out the messages its ``run_started`` names, oldest first. Its chain is that of the
newest of them that a run posted, as the ledger recorded before posting it, so the follower and
the turn context tag a turn exactly without reading the thread back. A turn none of whose
messages a run posted (one logged before artifactr named its messages, say) continues no chain.

:func:`turn_cause` asks the ledger, in one read; :func:`newest_cause` makes the same choice among
causes already read, for the follower, which reads the causes of a whole batch at once.
"""

from collections.abc import Mapping, Sequence

from relayr.ledger.port import Cause, Ledger, WorkspaceKey


async def turn_cause(
    ledger: Ledger, workspace: WorkspaceKey, message_ids: Sequence[str]
) -> Cause | None:
    """Return the cause of the newest of ``message_ids`` that a run posted, or None (ADR-0026).

    ``message_ids`` is ordered oldest first, as ``RunStarted.message_ids`` orders them; ids the
    ledger does not know (messages people posted) are skipped.
    """
    found = await ledger.causes(workspace, {("message", message_id) for message_id in message_ids})
    return newest_cause(message_ids, {key: cause for (_, key), cause in found.items()})


def newest_cause(message_ids: Sequence[str], causes: Mapping[str, Cause]) -> Cause | None:
    """:func:`turn_cause`'s choice among ``causes``, the messages' causes by message id."""
    for message_id in reversed(message_ids):
        cause = causes.get(message_id)
        if cause is not None:
            return cause
    return None
