"""Find anything by its id, or runs by their error's text: the console's one search box.

An id may be a run's (reflexr's run ids are unique within a workspace only, so every workspace
that holds it is a hit of its own; found in the console's run index), an event's, a thread's, a
message's or an agent turn's; the others are looked up in every workspace, with the read its
library offers, :data:`LOOKUPS_AT_ONCE` workspaces at a time. An id whose prefix names its kind
(:data:`ID_KINDS`) is looked for as that kind first, as any kind only if nothing was found.
Anything else is text, looked for in the error and reason of the runs that failed (dead and
retrying), in any case. Every hit is a link to the page that shows it.
"""

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from artifactr.core import NotFound as ArtifactNotFound
from artifactr.core import Rejection as ArtifactRejection
from reflexr.workspace import WorkspaceRef

from relayr.core.parsing import ID_PATTERN
from relayr.ledger.port import WorkspaceKey
from relayr.ops.index import RunIndex
from relayr.ops.rows import RunFilter
from relayr.runtime.process import Runtime

from .queries import MAX_TEXT_CHARS, BadQuery, href
from .reads import READER

TEXT_HITS: Final = 100
"""The most runs a text search lists, newest changed first."""

KINDS: Final = frozenset({"run", "event", "thread", "turn", "message"})
"""What an id may name."""

ID_KINDS: Final = {"fir": "run", "evt": "event", "thr": "thread", "run": "turn", "msg": "message"}
"""The kind an id's prefix names when reflexr, artifactr or relayr made it: a run's (a firing's),
an event's, a thread's, an agent turn's, a message's."""

LOOKUPS_AT_ONCE: Final = 4
"""How many workspaces a search by id reads at once: its reads wait on the database, not on
the console, and a pool of PostgreSQL connections answers several at a time."""


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
        hits = await _by_id(runtime, query, index)
    if hits:
        return Found(query, hits, False)
    return Found(query, await _by_text(index, query), True)


async def _by_id(runtime: Runtime, found_id: str, index: RunIndex) -> list[Hit]:
    """What has this id: first only the kind its prefix names, then the other kinds if that
    found nothing (an id its writer chose may have any prefix)."""
    named = ID_KINDS.get(found_id.partition("_")[0])
    if named is None:
        return await _of_kinds(runtime, found_id, index, KINDS)
    hits = await _of_kinds(runtime, found_id, index, frozenset({named}))
    return hits or await _of_kinds(runtime, found_id, index, KINDS - {named})


async def _of_kinds(
    runtime: Runtime, found_id: str, index: RunIndex, kinds: frozenset[str]
) -> list[Hit]:
    hits = []
    if "run" in kinds:
        await index.refreshed()
        hits = [
            Hit(
                "run",
                row.id,
                row.workspace,
                href("/run", {"id": row.id, "workspace": str(row.workspace)}),
                f"{row.rule}, {row.status}",
            )
            for row in index.with_id(found_id)
        ]
    if not kinds - {"run"}:
        return hits
    gate = asyncio.Semaphore(LOOKUPS_AT_ONCE)

    async def look(ref: WorkspaceRef) -> list[Hit]:
        async with gate:
            return await _in_workspace(runtime, ref, found_id, kinds)

    workspaces = await runtime.application.rules.storage.workspaces()
    for found in await asyncio.gather(*map(look, workspaces)):
        hits += found
    return hits


async def _in_workspace(
    runtime: Runtime, ref: WorkspaceRef, found_id: str, kinds: frozenset[str]
) -> list[Hit]:
    """What of ``kinds`` has this id in the workspace: an event, then what artifactr holds."""
    key = WorkspaceKey(ref.tenant_id, ref.workspace_id)
    hits = []
    if "event" in kinds:
        async with runtime.application.rules.storage.transaction(ref) as transaction:
            envelope = await transaction.envelope(found_id)
        if envelope is not None:
            link = href("/event", {"workspace": str(key), "seq": envelope.seq})
            detail = f"#{envelope.seq} {envelope.event_type}"
            hits.append(Hit("event", found_id, key, link, detail))
    if kinds & {"thread", "turn", "message"}:
        hits += await _in_artifactr(runtime, key, found_id, kinds)
    return hits


async def _in_artifactr(
    runtime: Runtime, key: WorkspaceKey, found_id: str, kinds: frozenset[str]
) -> list[Hit]:
    """A thread, a message a run posted (the ledger knows its run) or an agent turn of this id
    in the workspace, of ``kinds``."""
    hits = []
    where = str(key)
    handle = await runtime.application.artifacts.open(key.tenant_id, key.workspace_id, actor=READER)
    if "thread" in kinds:
        try:
            thread = await handle.thread(found_id)
        except (ArtifactNotFound, ArtifactRejection):
            pass
        else:
            link = href("/thread", {"workspace": where, "id": thread.id})
            hits.append(Hit("thread", thread.id, key, link, thread.title))
    if "turn" in kinds:
        try:
            turn = await handle.run(found_id)
        except (ArtifactNotFound, ArtifactRejection):
            pass
        else:
            link = href("/thread", {"workspace": where, "id": turn.thread_id})
            hits.append(Hit("turn", turn.id, key, link, f"{turn.status} in {turn.thread_id}"))
    if "message" not in kinds:
        return hits
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
