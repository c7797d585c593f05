"""Which run is behind an agent turn (ADR-0026: turns are traced by their messages).

A turn carries out the messages its ``run_started`` names, oldest first. Its chain is that of the
newest of them that a run posted, as the ledger recorded before posting it, so the follower and
the turn context tag a turn exactly without reading the thread back. A turn none of whose
messages a run posted (one logged before artifactr named its messages, say) continues no chain.
"""

from collections.abc import Sequence

from relayr.ledger.port import Cause, Ledger, WorkspaceKey


async def turn_cause(
    ledger: Ledger, workspace: WorkspaceKey, message_ids: Sequence[str]
) -> Cause | None:
    """Return the cause of the newest of ``message_ids`` that a run posted, or None (ADR-0026).

    ``message_ids`` is ordered oldest first, as ``RunStarted.message_ids`` orders them; ids the
    ledger does not know (messages people posted) are skipped.
    """
    for message_id in reversed(message_ids):
        cause = await ledger.cause(workspace, "message", message_id)
        if cause is not None:
            return cause
    return None
