"""A thread's transcript: every message in order, each with its kind, for people to read.

``relayr thread show`` and the console's thread page read a thread the same way, so a notice is
told apart from a message in both: by artifactr's ``kind``, marked ``[notice]`` or
``[message]`` (:func:`marker`). Rules post notices by default and only messages start agent
turns, so the mark is what an operator reads first.

This module imports artifactr only inside :func:`read_thread`, so the command line's module that
names it still loads nothing heavy for ``--help`` (ADR-0050).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from artifactr import Workspace as ArtifactWorkspace


@dataclass(frozen=True)
class ThreadEntry:
    """One message of a thread, as ``relayr thread show`` and the console show it."""

    id: str
    kind: str
    author: str
    content: str
    seq: int


def marker(kind: str) -> str:
    """How a message of ``kind`` is marked for people: ``[notice]`` or ``[message]``."""
    return "[notice]" if kind == "notice" else "[message]"


async def read_thread(workspace: "ArtifactWorkspace", thread_id: str) -> list[ThreadEntry]:
    """Every message of a thread, in order: people's, the rules' and the agent's."""
    from artifactr.core import MessagePosted

    entries = []
    for envelope in await workspace.read(threads={thread_id}):
        event = envelope.event
        if isinstance(event, MessagePosted) and event.thread_id == thread_id:
            entries.append(
                ThreadEntry(
                    id=event.message_id,
                    kind=event.kind,
                    author=envelope.actor.participant,
                    content=event.content,
                    seq=envelope.seq,
                )
            )
    return entries
