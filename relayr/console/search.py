"""Find anything by its id, or runs by their error's text: the console's one search box.

An id may be a run's (reflexr's run ids are unique within a workspace only, so every workspace
that holds it is a hit of its own), an event's, a thread's, a message's or an agent turn's; each
is looked up in every workspace, with the read its library offers for it. Anything else is text,
looked for in the error and reason of the runs that failed (dead and retrying), in any case.
Every hit is a link to the page that shows it.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from artifactr.core import NotFound as ArtifactNotFound
from artifactr.core import Rejection as ArtifactRejection

from relayr.core.parsing import ID_PATTERN
from relayr.ledger.port import WorkspaceKey
from relayr.ops.index import RunIndex
from relayr.ops.rows import RunFilter, runs_with_id
from relayr.runtime.process import Runtime

from .queries import MAX_TEXT_CHARS, BadQuery, href
from .reads import READER

TEXT_HITS: Final = 100
"""The most runs a text search lists, newest changed first."""


@dataclass(frozen=True)
class Hit:
    """One thing found: what it is, where, and the link to its page."""

    kind: str
    id: str
    workspace: WorkspaceKey
    link: str
    detail: str = ""


@dataclass(frozen=True)
class Found:
    """What a search found, in the order it looked."""

    query: str
    hits: list[Hit]
    text: bool
    """Whether the query was searched as text (errors and reasons), not as an id."""


def parse_search(text: str | None) -> str:
    """The search box's query, stripped.

    Raises:
        BadQuery: When it is longer than :data:`MAX_TEXT_CHARS`.
    """
    query = (text or "").strip()
    if len(query) > MAX_TEXT_CHARS:
        raise BadQuery(f"q is longer than {MAX_TEXT_CHARS} characters")
    return query


async def search(runtime: Runtime, query: str, index: RunIndex) -> Found:
    """Everything ``query`` names, as an id in every workspace; as text when nothing has it
    (in the runs of the console's run index)."""
    if not query:
        return Found(query, [], False)
    hits: list[Hit] = []
    if ID_PATTERN.fullmatch(query):
        hits = await _by_id(runtime, query)
    if hits:
        return Found(query, hits, False)
    return Found(query, await _by_text(index, query), True)


async def _by_id(runtime: Runtime, found_id: str) -> list[Hit]:
    rules = runtime.application.rules
    hits = [
        Hit(
            "run",
            row.id,
            row.workspace,
            href("/run", {"id": row.id, "workspace": str(row.workspace)}),
            f"{row.rule}, {row.status}",
        )
        for row in await runs_with_id(rules, found_id)
    ]
    for ref in await rules.storage.workspaces():
        key = WorkspaceKey(ref.tenant_id, ref.workspace_id)
        async with rules.storage.transaction(ref) as transaction:
            envelope = await transaction.envelope(found_id)
        if envelope is not None:
            link = href("/event", {"workspace": str(key), "seq": envelope.seq})
            hits.append(Hit("event", found_id, key, link, f"#{envelope.seq} {envelope.event_type}"))
        hits += await _in_artifactr(runtime, key, found_id)
    return hits


async def _in_artifactr(runtime: Runtime, key: WorkspaceKey, found_id: str) -> list[Hit]:
    """A thread, a message a run posted (the ledger knows its run) or an agent turn of this id
    in the workspace."""
    hits = []
    where = str(key)
    handle = await runtime.application.artifacts.open(key.tenant_id, key.workspace_id, actor=READER)
    try:
        thread = await handle.thread(found_id)
    except (ArtifactNotFound, ArtifactRejection):
        pass
    else:
        link = href("/thread", {"workspace": where, "id": thread.id})
        hits.append(Hit("thread", thread.id, key, link, thread.title))
    try:
        turn = await handle.run(found_id)
    except (ArtifactNotFound, ArtifactRejection):
        pass
    else:
        link = href("/thread", {"workspace": where, "id": turn.thread_id})
        hits.append(Hit("turn", turn.id, key, link, f"{turn.status} in {turn.thread_id}"))
    cause = await runtime.bridge.ledger.cause(key, "message", found_id)
    if cause is not None:
        emitted = await runtime.bridge.ledger.emissions(key, cause.run_id)
        threads = {record.thread_id for record in emitted if record.message_id == found_id}
        for thread_id in sorted(threads):
            link = href("/thread", {"workspace": where, "id": thread_id}) + f"#{found_id}"
            hits.append(Hit("message", found_id, key, link, f"in {thread_id}"))
        run_link = href("/run", {"id": cause.run_id, "workspace": where})
        hits.append(Hit("message's run", cause.run_id, key, run_link, "the run that posted it"))
    return hits


async def _by_text(index: RunIndex, text: str) -> list[Hit]:
    await index.refreshed()
    wanted = text.casefold()
    hits = []
    for status in ("dead", "retrying"):
        rows = index.select(RunFilter(status=status, limit=None, order="changed"))
        for row in rows:
            if wanted in f"{row.error or ''} {row.reason or ''}".casefold():
                link = href("/run", {"id": row.id, "workspace": str(row.workspace)})
                detail = f"{row.rule}, {status}: {row.reason or '-'}: {row.error or ''}"
                hits.append(Hit("run", row.id, row.workspace, link, detail))
    return _first(hits, TEXT_HITS)


def _first(hits: Iterable[Hit], count: int) -> list[Hit]:
    return list(hits)[:count]
