"""The core's decisions, as tables: where a post goes, what a refusal means, what a write may
hold, the lost-attempt count's format and what a person may type. No storage, no artifactr, no
clock."""

from datetime import timedelta
from typing import Any

import pytest

from relayr.core import reasons
from relayr.core.allowlist import Allowlist
from relayr.core.parsing import Unreadable, parse_duration
from relayr.core.refusals import RETRIED, Refusal, classify, storage_failure
from relayr.core.routing import (
    Route,
    Writer,
    content_refusal,
    id_refusal,
    is_direct,
    may_create_thread,
    pointer_value,
    route,
)

WRITER = Writer(rule="ops:triage", run_id="fir_1")
NOTHING = Allowlist()
TURNS = Allowlist(turns=True)
ANYWHERE = Allowlist(threads="any")
EVERYTHING = Allowlist(turns=True, threads="any", create_threads=True, direct=frozenset({"doc"}))
CHAIN = ("thr_a", "thr_b")

ROUTES: list[tuple[str, Allowlist, str, str | None, tuple[str, ...], bool, Route | str]] = [
    # name, allowlist, operation, thread named, chain, agent: a route, or a refusal's reason
    ("notice in the chain's first", NOTHING, "notice", None, CHAIN, True, Route("thr_a", False)),
    ("notice in a chain thread", NOTHING, "notice", "thr_b", CHAIN, True, Route("thr_b", False)),
    ("notice outside the chain", NOTHING, "notice", "thr_x", CHAIN, True, "not_allowed"),
    ("notice anywhere granted", ANYWHERE, "notice", "thr_x", CHAIN, True, Route("thr_x", False)),
    ("notice with no thread at all", EVERYTHING, "notice", None, (), True, "no_thread"),
    ("send without turns", NOTHING, "send", None, CHAIN, True, "not_allowed"),
    ("send with turns", TURNS, "send", None, CHAIN, True, Route("thr_a", True)),
    ("send with turns, no agent", TURNS, "send", None, CHAIN, False, "not_allowed"),
    ("post without turns", NOTHING, "post", None, CHAIN, True, Route("thr_a", False)),
    ("post without turns, no agent", NOTHING, "post", None, CHAIN, False, Route("thr_a", False)),
    ("post with turns", TURNS, "post", "thr_b", CHAIN, True, Route("thr_b", True)),
    ("post with turns, no agent", TURNS, "post", None, CHAIN, False, "not_allowed"),
    ("post outside the chain", TURNS, "post", "thr_x", CHAIN, True, "not_allowed"),
    ("an empty thread id", ANYWHERE, "notice", "", CHAIN, True, "invalid_id"),
    ("a thread id with a NUL", ANYWHERE, "notice", "thr\x00", CHAIN, True, "invalid_id"),
    ("a surrogate thread id", ANYWHERE, "post", "thr\ud800", CHAIN, True, "invalid_id"),
    ("the chain refuses first", NOTHING, "notice", "thr\x00", CHAIN, True, "not_allowed"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("allowlist", "operation", "thread", "chain", "agent", "expected"),
    [pytest.param(*row[1:], id=row[0]) for row in ROUTES],
)
def test_route(
    allowlist: Allowlist,
    operation: Any,
    thread: str | None,
    chain: tuple[str, ...],
    agent: bool,
    expected: Route | str,
) -> None:
    decided = route(allowlist, operation, thread, chain, WRITER, agent=agent)

    if isinstance(expected, Route):
        assert decided == expected
    else:
        assert isinstance(decided, Refusal)
        assert (decided.reason, decided.permanent) == (expected, True)
        assert decided.message == decided.message.lower() or "ops:triage" in decided.message


def test_a_refused_send_says_what_to_do_instead() -> None:
    refused = route(NOTHING, "send", None, CHAIN, WRITER)
    assert isinstance(refused, Refusal)
    assert refused.message == "rule ops:triage may not start turns; post a notice"


CLASSIFIED = [
    # artifactr's code, the entity not found, the reason, whether a retry may help
    ("not_found", "thread", "thread_not_found", False),
    ("not_found", "artifact", "not_found", True),
    ("not_found", "artifact type", "not_found", True),
    ("not_found", None, "not_found", True),
    ("validation_failed", None, "validation_failed", True),
    ("patch_failed", None, "patch_failed", True),
    ("thread_busy", None, "thread_busy", True),
    ("version_conflict", None, "version_conflict", True),
    ("forbidden", None, "forbidden", False),
    ("invalid_state", None, "invalid_state", False),
    ("something_new", None, "rejected", False),
    ("rejected", None, "rejected", False),
]


@pytest.mark.parametrize(("code", "entity", "reason", "retried"), CLASSIFIED)
def test_classify(code: str, entity: str | None, reason: str, retried: bool) -> None:
    refusal = classify(
        code, "thread thr_x does not exist", doing="posting notice msg_1", entity=entity
    )

    assert (refusal.reason, refusal.permanent) == (reason, not retried)
    named = "" if reason == code or code == "not_found" else f" (artifactr's code {code})"
    assert refusal.message == f"posting notice msg_1: thread thr_x does not exist{named}"


def test_every_retried_refusal_and_every_known_code_is_in_the_one_list() -> None:
    assert RETRIED <= reasons.WRITE_REFUSALS
    for code, _, reason, _ in CLASSIFIED:
        assert code in reasons.ALL or code == "something_new"
        assert reason in reasons.WRITE_REFUSALS


def test_a_storage_failure_is_retried_and_names_the_write() -> None:
    refusal = storage_failure(
        OSError("database is locked\n[SQL: INSERT ...]"), doing="posting notice msg_1"
    )

    assert (refusal.reason, refusal.permanent) == ("storage_unavailable", False)
    assert (
        refusal.message == "posting notice msg_1: the storage failed (OSError: database is locked)"
    )


CONTENT = [
    ("hello", None),
    (" x ", None),
    ("", "empty_content"),
    (" \n\t", "empty_content"),
    ("a\x00b", "invalid_content"),
    ("a\udfffb", "invalid_content"),
]


@pytest.mark.parametrize(("content", "reason"), CONTENT)
def test_content_refusal(content: str, reason: str | None) -> None:
    refused = content_refusal(content, WRITER)

    assert (None if refused is None else refused.reason) == reason
    if refused is not None:
        assert "run fir_1 of rule ops:triage" in refused.message


@pytest.mark.parametrize(
    ("value", "refused"), [("art_1", False), ("", True), ("a\x00", True), ("\ud800", True)]
)
def test_id_refusal(value: str, refused: bool) -> None:
    found = id_refusal("artifact", value, WRITER)
    assert (found is not None) == refused
    assert found is None or found.reason == reasons.INVALID_ID


def test_thread_creation_and_direct_writes_need_their_grants() -> None:
    refused = may_create_thread(NOTHING, WRITER)
    assert refused is not None
    assert refused.reason == reasons.NOT_ALLOWED
    assert may_create_thread(EVERYTHING, WRITER) is None


DIRECT: list[tuple[str, str, bool, bool]] = [
    # kind, its type's write policy, a thread in suggest mode: applied directly?
    ("doc", "direct", False, True),
    ("note", "direct", False, False),  # not in the allowlist's direct
    ("doc", "propose", False, False),  # artifactr makes agents propose it
    ("doc", "direct", True, False),  # artifactr makes agents propose in the thread
]


@pytest.mark.parametrize(("kind", "write_policy", "suggesting", "direct"), DIRECT)
def test_a_write_is_direct_only_where_artifactr_applies_it(
    kind: str, write_policy: str, suggesting: bool, direct: bool
) -> None:
    assert is_direct(EVERYTHING, kind, write_policy, suggesting=suggesting) is direct


POINTERS: list[tuple[Any, str, tuple[Any, ...]]] = [
    ({"a": 1}, "", ({"a": 1},)),
    ({"a": {"b": [1, 2]}}, "/a/b/1", (2,)),
    ({"a/b": 1, "c~d": 2}, "/a~1b", (1,)),
    ({"a/b": 1, "c~d": 2}, "/c~0d", (2,)),
    ({"a": [1]}, "/a/5", ()),
    ({"a": 1}, "/missing", ()),
]


@pytest.mark.parametrize(("data", "path", "found"), POINTERS)
def test_pointer_value(data: Any, path: str, found: tuple[Any, ...]) -> None:
    assert pointer_value(data, path) == found


def test_a_path_that_is_no_pointer_is_an_error() -> None:
    with pytest.raises(ValueError, match="is not a JSON pointer"):
        pointer_value({}, "text")


@pytest.mark.parametrize("lost", [1, 2, 3, 17])
def test_the_lost_attempt_count_reads_back_what_it_wrote(lost: int) -> None:
    error = reasons.abandoned_error(lost)

    assert error.startswith(reasons.ABANDONED_ERROR)
    assert reasons.lost_in_a_row(reasons.ABANDONED, error) == lost


LOST = [
    (None, None, 0),
    ("timeout", "the action timed out", 0),
    ("worker_lost", reasons.abandoned_error(4), 0),
    ("abandoned", None, 0),
    ("abandoned", "the attempt was abandoned: its executor stopped", 1),
    ("abandoned", "the attempt was abandoned: its executor stopped (1 attempt lost in a row)", 1),
]


@pytest.mark.parametrize(("reason", "error", "lost"), LOST)
def test_lost_in_a_row(reason: str | None, error: str | None, lost: int) -> None:
    assert reasons.lost_in_a_row(reason, error) == lost


def test_a_count_starts_at_one() -> None:
    with pytest.raises(ValueError, match="starts at 1"):
        reasons.abandoned_error(0)


DURATIONS: list[tuple[str, timedelta | None]] = [
    ("90s", timedelta(seconds=90)),
    ("1h30m", timedelta(hours=1, minutes=30)),
    ("7d", timedelta(days=7)),
    ("", None),
    ("90", None),
    ("1h 30m", None),
    ("-5m", None),
    ("99999999999d", None),  # past what a timedelta holds
    ("999999999d999999999d", None),
    (f"{10**30}s", None),
]


@pytest.mark.parametrize(("text", "expected"), DURATIONS)
def test_parse_duration(text: str, expected: timedelta | None) -> None:
    if expected is not None:
        assert parse_duration("--older-than", text) == expected
        return
    with pytest.raises(Unreadable) as unreadable:
        parse_duration("--older-than", text)
    assert unreadable.value.code == "bad_input"
    assert str(unreadable.value).startswith(f"--older-than {text!r} is ")
