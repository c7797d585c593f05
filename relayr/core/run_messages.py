"""What a run message carries: ids only, of runs in one tenant's workspace.

A message names runs; reflexr's store decides what happens to them (a task re-reads each run),
so a message never carries data a run could be made from, and a malformed one is refused before
anything is read. The model checks what storage can hold: ids of at most
:data:`MAX_ID_LENGTH` characters, not blank, without NUL characters or lone surrogates.
"""

from typing import Annotated, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

MAX_ID_LENGTH: Final = 256
"""The longest tenant, workspace or run id a message may carry. reflexr's run ids are 20
characters; the bound keeps a garbage message from reaching storage."""

MAX_BATCH_RUNS: Final = 20
"""The most runs one message names. Enough that a burst costs the queue and the claim
transaction a twentieth of a message per run; few enough that a burst still splits into many
messages that several worker processes share, and that a process killed mid-batch abandons
few attempts."""


def _storable(value: str) -> str:
    if not value.strip():
        raise ValueError("is empty")
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not text that storage can hold (a lone surrogate)") from None
    return value


Id = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=MAX_ID_LENGTH),
    AfterValidator(_storable),
]
"""An id storage can hold."""


class RunMessage(BaseModel):
    """Runs of one workspace to execute: the payload of a run message."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant_id: Id
    workspace_id: Id
    run_ids: Annotated[tuple[Id, ...], Field(min_length=1, max_length=MAX_BATCH_RUNS)]
    behind: bool = False
    """Part of a workspace's backlog: the broker delivers it after the messages of workspaces
    that have nothing else waiting (the message's priority; not one of the task's arguments)."""
