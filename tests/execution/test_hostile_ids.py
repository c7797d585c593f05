"""How each hostile id a rule's action names is refused: a ``RunFailure`` with a stable reason,
logged once as "write refused", and nothing written.

Ids no storage can hold (empty, blank, NUL, a lone surrogate, 300 characters, a path) and a
thread that does not exist, asked of notice, create, propose and edit, under ``threads =
"chain"`` and ``"any"``; on real artifactr storage (in memory and SQLite) with a real Runner
(:mod:`tests.execution.isolation_world`).
"""

import asyncio
from pathlib import Path
from typing import Any

import pytest
from reflexr.workspace import RunFailure

from relayr.core.allowlist_toml import parse_allowlist
from relayr.execution.actions import RunActions
from tests.execution.isolation_world import HOME, RULE, IsolationNote, StorageKind, opened
from tests.execution.isolation_world import (
    template as template,  # the fixture, a migrated SQLite file
)

SURROGATE = "thr_" + chr(0xD800)
HOSTILE_THREADS = {
    "empty": "",
    "blank": " ",
    "nul": "thr_\x00",
    "lone surrogate": SURROGATE,
    "300 characters": "thr_" + "f" * 300,
    "a path": "../ops",
    "missing": "thr_0000000000000000",
}
REFUSED: dict[str, frozenset[str]] = {
    "empty": frozenset({"invalid_id"}),
    "blank": frozenset({"invalid_id"}),
    "nul": frozenset({"invalid_id"}),
    "lone surrogate": frozenset({"invalid_id"}),
}
"""The reasons a hostile id may be refused with, when the rule may act anywhere; else
``thread_not_found`` (``not_found`` for an artifact id). Under ``chain`` every one of them is
``not_allowed``. An id no storage can hold
is refused before storage is asked, a missing thread before a proposal could name it."""
OPERATIONS = ("notice", "create", "propose", "edit")


def hostile_cases() -> list[Any]:
    cases = []
    # A chain refusal comes before storage is asked, so memory is enough for it; an artifact id
    # is no thread, so the scope does not apply to edit; on SQLite, the ways ids reach storage.
    for kind, scope, operations_ in (
        ("memory", "chain", OPERATIONS[:3]),
        ("memory", "any", OPERATIONS),
        ("sqlite", "any", ("notice", "create", "edit")),
    ):
        for operation in operations_:
            for name in HOSTILE_THREADS:
                case_id = f"{kind}-{scope}-{operation}-{name}"
                cases.append(pytest.param(kind, scope, operation, name, id=case_id))
    return cases


@pytest.mark.parametrize(("kind", "scope", "operation", "name"), hostile_cases())
def test_a_hostile_id_is_refused_with_a_stable_reason(
    template: Path, kind: StorageKind, scope: str, operation: str, name: str
) -> None:
    asyncio.run(refusal(kind, template, scope, operation, HOSTILE_THREADS[name], name))


async def ask(actions: RunActions, operation: str, target: str) -> None:
    if operation == "notice":
        await actions.notice("hello", thread_id=target)
    elif operation in ("create", "propose"):
        await actions.create(IsolationNote(text="hello"), thread_id=target)
    else:
        await actions.edit(target, "/text", "hello")


async def refusal(
    kind: StorageKind, template: Path, scope: str, operation: str, target: str, name: str
) -> None:
    direct = '["isolation_note"]' if operation == "create" else "[]"
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(
            f'[rules."{RULE}"]\nthreads = "{scope}"\ndirect = {direct}\n'
        )
        chain = (await (await world.handle(HOME)).create_thread("incident")).id
        before = await world.log(HOME)
        actions = await world.attempt(HOME, chain)
        with pytest.raises(RunFailure) as refused:
            await ask(actions, operation, target)
        missing = "not_found" if operation == "edit" else "thread_not_found"
        expected = {"not_allowed"} if scope == "chain" else REFUSED.get(name, {missing})
        assert refused.value.reason in expected
        assert await world.log(HOME) == before
        lines = [line for line in world.logs if line["event"].startswith("write refused")]
        assert [line.get("reason") for line in lines] == [refused.value.reason]
