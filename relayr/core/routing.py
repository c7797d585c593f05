"""Where a rule's write goes and whether it may be made: decided before anything is written.

A write is checked whole before any of it is made (ADR-0060): the thread it goes to, the
permission it needs, its ids and its content, so a refused write leaves nothing behind and its
refusal names what is wrong. :func:`route` answers for a post (a notice, a send, or a post the
allowlist routes), :func:`may_create_thread` for a new thread, :func:`is_direct` for an artifact
write; :func:`content_refusal` and :func:`id_refusal` check what storage can hold. Each returns
a decision or a :class:`~relayr.core.refusals.Refusal` with a reason from
:mod:`relayr.core.reasons`; :class:`relayr.execution.actions.RunActions` asks, then writes.

Pure: the allowlist in force, the run's chain of threads and the request in, a decision out.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from relayr.core import reasons
from relayr.core.allowlist import Allowlist
from relayr.core.refusals import Refusal

type PostOperation = Literal["notice", "send", "post"]
type Operation = Literal["notice", "send", "post", "create", "edit", "archive", "create_thread"]


@dataclass(frozen=True)
class Writer:
    """Who writes: the rule and its run, named in every refusal's message."""

    rule: str
    run_id: str


@dataclass(frozen=True)
class Route:
    """Where a post goes: its thread, and whether it is a message that starts a turn (a send)
    or a notice, which starts none."""

    thread_id: str
    turn: bool


def thread_for(
    allowlist: Allowlist,
    operation: Operation,
    thread_id: str | None,
    chain: Sequence[str],
    writer: Writer,
) -> str | Refusal:
    """The thread a write goes to: the one named, or the chain's first.

    Refused ``no_thread`` when none is named and the chain is empty, ``not_allowed`` for a
    thread outside the chain under ``threads = "chain"``, ``invalid_id`` for an id no storage
    holds.
    """
    if thread_id is None:
        if not chain:
            return Refusal(
                reasons.NO_THREAD,
                f"run {writer.run_id} of rule {writer.rule} has no thread to {operation} in: "
                "its events carry no thread_id and it created none",
            )
        return chain[0]
    if thread_id not in chain and allowlist.threads == "chain":
        return Refusal(
            reasons.NOT_ALLOWED,
            f"rule {writer.rule} may act only in its run's threads "
            f"({', '.join(chain) or 'none'}), not in {thread_id!r}",
        )
    refused = id_refusal("thread", thread_id, writer)
    return thread_id if refused is None else refused


def route(
    allowlist: Allowlist,
    operation: PostOperation,
    thread_id: str | None,
    chain: Sequence[str],
    writer: Writer,
    *,
    agent: bool = True,
) -> Route | Refusal:
    """Where a post goes, or why it may not be made.

    ``notice`` always posts a notice; ``send`` needs ``turns`` (else ``not_allowed``, nothing
    written); ``post`` sends when ``turns`` is granted and posts a notice otherwise, so
    operators grant or revoke turns without failing runs. A send needs an agent to start turns
    (``agent``): without one it is ``not_allowed`` too.
    """
    thread = thread_for(allowlist, operation, thread_id, chain, writer)
    if isinstance(thread, Refusal):
        return thread
    if operation == "notice":
        return Route(thread, turn=False)
    if operation == "send" and not allowlist.turns:
        return Refusal(
            reasons.NOT_ALLOWED, f"rule {writer.rule} may not start turns; post a notice"
        )
    turn = operation == "send" or allowlist.turns
    if turn and not agent:
        return Refusal(
            reasons.NOT_ALLOWED,
            f"rule {writer.rule} may start turns, but this application runs no agent",
        )
    return Route(thread, turn=turn)


def may_create_thread(allowlist: Allowlist, writer: Writer) -> Refusal | None:
    """None when the rule may create threads; else why not (``not_allowed``)."""
    if allowlist.create_threads:
        return None
    return Refusal(reasons.NOT_ALLOWED, f"rule {writer.rule} may not create threads")


def is_direct(
    allowlist: Allowlist, kind: str, write_policy: str, *, suggesting: bool = False
) -> bool:
    """Whether a write to an artifact of ``kind`` is made directly, else proposed.

    Direct only where the allowlist makes the kind ``direct`` and artifactr applies an agent's
    write (a rule acts as an external agent): artifactr makes a proposal of every agent's
    write to a kind whose ``write_policy`` is ``"propose"``, and of one that names a thread in
    ``suggest`` mode (``suggesting``). Deciding it here lets a write that becomes a proposal be
    sent as one, under its proposal's id only (ADR-0065).
    """
    return kind in allowlist.direct and write_policy != "propose" and not suggesting


def content_refusal(content: str, writer: Writer) -> Refusal | None:
    """Why ``content`` cannot be posted (``empty_content``, ``invalid_content``), or None."""
    if not content.strip():
        return Refusal(
            reasons.EMPTY_CONTENT,
            f"run {writer.run_id} of rule {writer.rule} tried to post empty content",
        )
    problem = text_problem(content)
    if problem is not None:
        return Refusal(
            reasons.INVALID_CONTENT,
            f"run {writer.run_id} of rule {writer.rule} tried to post content that {problem}",
        )
    return None


def id_refusal(what: str, value: str, writer: Writer) -> Refusal | None:
    """Why a ``what`` id (``thread``, ``artifact``) cannot be used (``invalid_id``), or None."""
    if not value:
        problem: str | None = "is empty"
    elif any(character.isspace() for character in value):
        problem = "holds white space, which no id does"
    else:
        problem = text_problem(value)
    if problem is None:
        return None
    return Refusal(
        reasons.INVALID_ID,
        f"run {writer.run_id} of rule {writer.rule} named a {what} id that {problem}",
    )


def archived_refusal(artifact_id: str, path: str | None, writer: Writer) -> Refusal:
    """An edit (``path``) or another change of an archived artifact: nothing can change it."""
    change = f"the edit of {path} in" if path is not None else "a change of"
    return Refusal(
        reasons.ARTIFACT_ARCHIVED,
        f"run {writer.run_id} of rule {writer.rule} asked for {change} artifact {artifact_id}, "
        "which is archived",
    )


def text_problem(text: str) -> str | None:
    """What keeps ``text`` out of every storage: a NUL, or a lone surrogate (not UTF-8)."""
    if "\x00" in text:
        return "holds a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return f"is not unicode text (a lone surrogate at {bad.start})"
    return None


def pointer_value(data: Any, path: str) -> tuple[Any] | tuple[()]:
    """The value at a JSON pointer, as a 1-tuple, or () when nothing is there.

    Raises:
        ValueError: If ``path`` is not a JSON pointer.
    """
    if path == "":
        return (data,)
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not a JSON pointer")
    node = data
    for raw in path[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return ()
    return (node,)
