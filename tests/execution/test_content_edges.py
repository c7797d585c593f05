"""Content at the edges, through notice, send and post: a clear refusal or a faithful post.

On real artifactr storage (in memory and SQLite, with the SQL ledger on SQLite) and a real
Runner, each content is posted by three attempts of one run, as retries would:

- refused: a ``RunFailure`` with a stable reason, no message, no emission record;
- posted: one message, read back equal to what was sent (no trimming, no normalization), the
  same id on every attempt, one emission record per attempt carrying the content, and for a
  send one turn, not one per attempt.

Contents: empty, whitespace (ASCII and Unicode), 100 kB (ASCII, 2-byte, 4-byte characters,
one line, many lines), NUL, control characters, CR/LF, right-to-left text and overrides,
emoji sequences, combining characters next to their composed forms, BOM, noncharacters,
markup. Lone surrogates (invalid UTF-8 once encoded) and NUL can never be stored: they are
refused for good (``invalid_content``) before the ledger or artifactr is written.
"""

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from artifactr.core import MessagePosted, RunStarted
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reflexr.workspace import RunFailure

from relayr.core.allowlist_toml import parse_allowlist
from tests.execution.isolation_world import (
    HOME,
    RULE,
    RULE_AUTHOR,
    StorageKind,
    World,
    migrated_template,
    opened,
)

ROUTES = {
    "notice": ("notice", False),
    "send": ("send", True),
    "post-as-notice": ("post", False),
    "post-as-send": ("post", True),
}
"""Route name: (the RunActions method, whether the allowlist grants turns)."""

ATTEMPTS = 3


@dataclass(frozen=True)
class Case:
    content: str
    refused: str | None = None
    """The reason it is refused with, or None: it is posted."""


CASES = {
    "empty": Case("", "empty_content"),
    "whitespace": Case(" \t\n\r\x0b\x0c ", "empty_content"),
    "unicode whitespace": Case("\u00a0\u2003\u3000\u2028\u2029\u1680", "empty_content"),
    "zero-width space": Case("\u200b"),
    "100 kB ascii": Case("x" * 100_000),
    "100 kB two-byte": Case("é" * 50_000),
    "100 kB four-byte": Case("🚀" * 25_000),
    "100 kB one line": Case("word " * 20_000),
    "100 kB of lines": Case("line\n" * 20_000),
    "nul inside": Case("a\x00b", "invalid_content"),
    "nul only": Case("\x00", "invalid_content"),
    "control characters": Case("\x1b[31mred\x1b[0m\x07\x08\x7f"),
    "cr lf": Case("a\r\nb\rc\n"),
    "surrounding whitespace": Case("  kept as is  \n"),
    "right to left": Case("שלום עולם — مرحبا بالعالم"),
    "bidi override": Case("abc\u202edcba\u202c ok"),
    "emoji sequences": Case("👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇺🇦"),
    "combining (nfd)": Case("cafe\u0301 re\u0301sume\u0301"),
    "composed (nfc)": Case("café résumé"),
    "bom": Case("\ufeffhello"),
    "noncharacters": Case("\ufffe\uffff\U0010ffff\U0001fffe"),
    "line separator inside": Case("a\u2028b"),
    "markup": Case("<script>alert(1)</script> **bold** `code` {{ x }}"),
}
UNREPRESENTABLE = {
    "lone high surrogate": "a\ud800b",
    "lone low surrogate": "\udfff",
    "half an emoji": "\ud83d",
    "reversed pair": "\ude80\ud83d",
    "nul": "a\x00b",
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return asyncio.run(migrated_template(tmp_path_factory.mktemp("content")))


def allowlist(turns: bool) -> str:
    return f'[rules."{RULE}"]\nturns = {"true" if turns else "false"}\n'


async def attempt_thrice(world: World, method: str, content: str) -> tuple[str, list[Any]]:
    """Three attempts of one run, each posting ``content``; the thread and their results."""
    thread = (await (await world.handle(HOME)).create_thread("edges")).id
    results: list[Any] = []
    for attempt in range(1, ATTEMPTS + 1):
        actions = await world.attempt(HOME, thread, attempt)
        try:
            results.append(await getattr(actions, method)(content))
        except RunFailure as refused:
            results.append(refused)
    return thread, results


async def check(
    world: World, route: str, name: str, content: str, refused: str | None
) -> list[str]:
    """Post ``content`` by three attempts; return what is wrong, if anything."""
    method, turns = ROUTES[route]
    thread, results = await attempt_thrice(world, method, content)
    await world.settle()
    handle = await world.handle(HOME)
    log = await handle.read(threads={thread})
    mine = [e.event for e in log if e.actor.participant == RULE_AUTHOR]
    messages = [m for m in mine if isinstance(m, MessagePosted)]
    run_id = (await world.reaction(HOME, thread)).run_id
    records = await world.records(HOME, run_id)
    problems: list[str] = []
    if refused is not None:
        reasons = {r.reason if isinstance(r, RunFailure) else f"posted {r}" for r in results}
        if reasons != {refused}:
            problems.append(f"{name}: expected refusal {refused}, got {reasons}")
        if messages or records:
            problems.append(
                f"{name}: refused, yet {len(messages)} messages, {len(records)} records"
            )
        return problems
    ids = {r if isinstance(r, str) else f"refused {r.reason}: {r.message[:80]}" for r in results}
    if len(ids) != 1 or not next(iter(ids)).startswith("msg_"):
        return [f"{name}: expected one message id, got {ids}"]
    [message_id] = ids
    kind = "message" if turns else "notice"
    found = [(m.message_id, m.kind, m.content == content) for m in messages]
    if found != [(message_id, kind, True)]:
        problems.append(f"{name}: expected one faithful {kind}, got {found}")
    if [record.content == content for record in records] != [True] * ATTEMPTS:
        problems.append(f"{name}: emission records {[(r.attempt, r.outcome) for r in records]}")
    if turns:
        started = [e.event for e in log if isinstance(e.event, RunStarted)]
        if len(started) != 1:
            problems.append(f"{name}: {len(started)} turns for one send")
    return problems


SENT_ON_SQLITE = (
    "empty",
    "100 kB four-byte",
    "100 kB of lines",
    "nul inside",
    "cr lf",
    "combining (nfd)",
)
"""What a send carries through SQLite: a turn per case costs a second there, and the notice
route already takes every case through the same columns."""


async def edges(kind: StorageKind, template: Path, route: str, names: tuple[str, ...]) -> list[str]:
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(allowlist(ROUTES[route][1]))
        problems: list[str] = []
        for name in names:
            problems += await check(world, route, name, CASES[name].content, CASES[name].refused)
        return problems


def edge_cases() -> list[Any]:
    cases = [pytest.param("memory", route, tuple(CASES), id=f"memory-{route}") for route in ROUTES]
    cases.append(pytest.param("sqlite", "notice", tuple(CASES), id="sqlite-notice"))
    cases.append(pytest.param("sqlite", "send", SENT_ON_SQLITE, id="sqlite-send"))
    return cases


@pytest.mark.parametrize(("kind", "route", "names"), edge_cases())
def test_each_edge_is_refused_clearly_or_posted_faithfully_once(
    template: Path, kind: StorageKind, route: str, names: tuple[str, ...]
) -> None:
    assert asyncio.run(edges(kind, template, route, names)) == []


async def unrepresentable(kind: StorageKind, template: Path, route: str, content: str) -> None:
    method, turns = ROUTES[route]
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(allowlist(turns))
        thread = (await (await world.handle(HOME)).create_thread("edges")).id
        before = await world.log(HOME)
        world.ledger.written.clear()
        actions = await world.attempt(HOME, thread)
        with pytest.raises(RunFailure) as refused:
            await getattr(actions, method)(content)
        assert refused.value.permanent
        assert refused.value.reason
        assert await world.log(HOME) == before
        assert world.ledger.written == []


@pytest.mark.parametrize(
    ("kind", "route", "name"),
    [
        *(("memory", route, name) for route in ("notice", "send") for name in UNREPRESENTABLE),
        ("sqlite", "notice", "lone high surrogate"),
        ("sqlite", "send", "nul"),
    ],
)
def test_content_that_can_never_post_is_refused_for_good_before_any_write(
    template: Path, kind: StorageKind, route: str, name: str
) -> None:
    asyncio.run(unrepresentable(kind, template, route, UNREPRESENTABLE[name]))


# ─── any text ─────────────────────────────────────────────────────────────────

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    [case.content for case in CASES.values() if len(case.content) < 1000]
)


async def any_text(kind: StorageKind, template: Path | None, route: str, content: str) -> None:
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(allowlist(ROUTES[route][1]))
        refused = None
        if not content.strip():
            refused = "empty_content"
        elif "\x00" in content:
            refused = "invalid_content"
        event(f"expected: {refused or 'posted'}")
        assert await check(world, route, "text", content, refused) == []


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.sampled_from(sorted(ROUTES)))
def test_in_memory_any_text_is_refused_clearly_or_posted_faithfully_once(
    content: str, route: str
) -> None:
    asyncio.run(any_text("memory", None, route, content))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.sampled_from(sorted(ROUTES)))
def test_on_sqlite_any_text_is_refused_clearly_or_posted_faithfully_once(
    template: Path, content: str, route: str
) -> None:
    asyncio.run(any_text("sqlite", template, route, content))
