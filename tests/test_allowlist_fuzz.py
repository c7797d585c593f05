"""The operators' allowlist file, mutated: refused whole, or granted exactly as written.

Hypothesis mutates the example file (``rules/allowlist.toml``) line by line (delete, repeat,
swap, uncomment, insert or replace with lines an operator might write, or mistype), character
by character, and byte by byte (through ``load_allowlist``, so invalid UTF-8 and BOMs are met
too). Whatever comes out:

- parsing raises nothing but ``InvalidAllowlist``, which names at least one problem;
- a file that parses grants each rule exactly what a tiny reference interpreter, written here
  from ``tomllib``'s output and the documented lookup (the rule's entry, else its namespace's,
  else ``[default]``; a field the entry leaves out is not granted; ``reflexr:*`` gets nothing),
  says it states, so never anything wider;
- a worker that reloads the mutated file has it in force if it parses, and keeps the last
  good allowlist otherwise.

tests/test_allowlist.py generates whole documents; this file starts from the real one.
"""

import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from relayr.allowlist_file import AllowlistFile, load_allowlist
from relayr.core.allowlist import MOST_RESTRICTIVE, Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = (REPO / "rules" / "allowlist.toml").read_text()
LINES = EXAMPLE.splitlines()

POOL = [
    "[default]",
    '[rules."ops:incident-triage"]',
    '[rules."ops:deploy-notice"]',
    '[rules."billing:refund"]',
    "[namespaces.ops]",
    "[namespaces.billing]",
    "[namespaces.reflexr]",
    '[rules."reflexr:tick"]',
    '[rules."ops:*"]',
    '[namespaces."ops:"]',
    "[rules.'ops:incident-triage']",
    '[ rules . "ops:incident-triage" ]',
    '[rules."ops:incident‐triage"]',
    '[rules."Ops:Incident-Triage"]',
    "[rules]",
    "[namespaces]",
    "[[rules]]",
    "[Default]",
    "[default",
    "turns = true",
    "turns = false",
    "turns = true # granted",
    'threads = "any"',
    'threads = "chain"',
    "threads = 'any'",
    'threads = "Any"',
    'threads = ["any"]',
    "create_threads = true",
    "create_threads = false",
    'direct = ["timeline"]',
    'direct = ["timeline", "triage_note"]',
    "direct = []",
    'direct = "timeline"',
    'direct = ["Timeline"]',
    'direct = ["timeline", "timeline"]',
    'direct = [["timeline"]]',
    'turns = "true"',
    "turns = 1",
    "turns = 1979-05-27",
    "turns = inf",
    "turns = {}",
    "TURNS = true",
    "turnѕ = true",
    "turn = true",
    "turns =",
    "turns = true\nturns = false",
    'rules."ops:other".turns = true',
    'default.threads = "any"',
    'namespaces.ops = { turns = true, threads = "any" }',
    '"ops:other" = { turns = true, create_threads = true }',
    'rules = { "ops:x" = { turns = true } }',
    "default = true",
    'a = """',
    '"""',
    "x = 1",
    "",
    "#",
    "\t",
]
CHARACTERS = st.sampled_from([*"[].\"'=#{},:*\n\t \\", "true", "any", "\x00", "\ufeff", "é"])
PROBES = [
    "ops:incident-triage",
    "ops:deploy-notice",
    "ops:other",
    "billing:refund",
    "billing:other",
    "misc:digest",
    "reflexr:tick",
    "ops",
    "",
]


@dataclass(frozen=True)
class Stated:
    """What the text literally grants one rule."""

    turns: bool = False
    threads: str = "chain"
    create_threads: bool = False
    direct: frozenset[str] = frozenset()


NOTHING = Stated()


def stated(data: dict[str, Any], rule: str) -> Stated:
    """The reference interpreter: the one entry that applies, read literally."""
    rules = data.get("rules", {})
    namespaces = data.get("namespaces", {})
    namespace, colon, _ = rule.partition(":")
    if colon and namespace == "reflexr":
        entry = None
    elif rule in rules:
        entry = rules[rule]
    elif colon and namespace in namespaces:
        entry = namespaces[namespace]
    else:
        entry = data.get("default")
    if entry is None:
        return NOTHING
    return Stated(
        turns=entry.get("turns") is True,
        threads="any" if entry.get("threads") == "any" else "chain",
        create_threads=entry.get("create_threads") is True,
        direct=frozenset(entry.get("direct", ())),
    )


def probes(data: dict[str, Any]) -> list[str]:
    names = [*PROBES, *data.get("rules", {})]
    names += [f"{namespace}:probe" for namespace in data.get("namespaces", {})]
    return names


def assert_refused_or_granted_as_written(text: str) -> str:
    """Parse ``text``; return "refused" or "parsed" after checking every probe's grant."""
    try:
        allowlists = parse_allowlist(text)
    except InvalidAllowlist as invalid:
        refused: InvalidAllowlist | None = invalid
    else:
        refused = None
    if currently_in_test_context():
        event(f"verdict: {'refused' if refused is not None else 'parsed'}")
    if refused is not None:
        assert refused.code == "invalid_allowlist"
        assert refused.problems
        assert all(problem.key and problem.message for problem in refused.problems)
        return "refused"
    data = tomllib.loads(text)
    for rule in probes(data):
        granted = allowlists.for_rule(rule)
        literal = stated(data, rule)
        wider = [
            field
            for field, widens in (
                ("turns", granted.turns and not literal.turns),
                ("threads", granted.threads == "any" and literal.threads != "any"),
                ("create_threads", granted.create_threads and not literal.create_threads),
                ("direct", not granted.direct <= literal.direct),
            )
            if widens
        ]
        assert wider == [], f"{rule} got {granted} beyond {literal} from:\n{text}"
        as_read = Stated(granted.turns, granted.threads, granted.create_threads, granted.direct)
        assert as_read == literal, f"{rule}: {granted} is not {literal}"
        assert allowlists.explain(rule).allowlist == granted
        if granted != MOST_RESTRICTIVE and currently_in_test_context():
            source = allowlists.explain(rule).entry.kind
            for field, value in granted.to_json().items():
                if value != MOST_RESTRICTIVE.to_json()[field]:
                    event(f"granted: {field}, by a {source} entry")
    return "parsed"


# ─── mutations ────────────────────────────────────────────────────────────────

type Mutation = Callable[[list[str]], list[str]]


def at(lines: list[str], index: int) -> int:
    return index % len(lines) if lines else 0


def delete(index: int) -> Mutation:
    return lambda lines: [line for i, line in enumerate(lines) if i != at(lines, index)]


def repeat(index: int) -> Mutation:
    def apply(lines: list[str]) -> list[str]:
        i = at(lines, index)
        return lines[: i + 1] + lines[i : i + 1] + lines[i + 1 :]

    return apply


def swap(first: int, second: int) -> Mutation:
    def apply(lines: list[str]) -> list[str]:
        if not lines:
            return lines
        i, j = at(lines, first), at(lines, second)
        swapped = list(lines)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        return swapped

    return apply


def uncomment(index: int) -> Mutation:
    def apply(lines: list[str]) -> list[str]:
        i = at(lines, index)
        changed = list(lines)
        if changed:
            changed[i] = changed[i].lstrip("#").strip()
        return changed

    return apply


def insert(index: int, line: str) -> Mutation:
    def apply(lines: list[str]) -> list[str]:
        i = at(lines, index) if lines else 0
        return [*lines[:i], line, *lines[i:]]

    return apply


def append(line: str) -> Mutation:
    return lambda lines: [*lines, line]


def after_header(index: int, line: str) -> Mutation:
    """Insert ``line`` right under one of the file's table headers, where a grant takes effect."""

    def apply(lines: list[str]) -> list[str]:
        headers = [i for i, text in enumerate(lines) if text.lstrip().startswith("[")]
        if not headers:
            return [*lines, line]
        i = headers[index % len(headers)] + 1
        return [*lines[:i], line, *lines[i:]]

    return apply


def replace(index: int, line: str) -> Mutation:
    def apply(lines: list[str]) -> list[str]:
        if not lines:
            return [line]
        i = at(lines, index)
        return [*lines[:i], line, *lines[i + 1 :]]

    return apply


def edit_characters(index: int, position: int, drop: int, added: str) -> Mutation:
    def apply(lines: list[str]) -> list[str]:
        if not lines:
            return [added]
        i = at(lines, index)
        line = lines[i]
        cut = position % (len(line) + 1)
        return [*lines[:i], line[:cut] + added + line[cut + drop :], *lines[i + 1 :]]

    return apply


indexes = st.integers(min_value=0, max_value=200)
pool_lines = st.sampled_from(POOL) | st.text(max_size=12)
mutations = st.one_of(
    st.builds(delete, indexes),
    st.builds(repeat, indexes),
    st.builds(swap, indexes, indexes),
    st.builds(uncomment, indexes),
    st.builds(insert, indexes, pool_lines),
    st.builds(append, pool_lines),
    st.builds(after_header, indexes, pool_lines),
    # twice more, with lines an operator writes: a grant under a header takes effect
    st.builds(after_header, indexes, st.sampled_from(POOL)),
    st.builds(after_header, indexes, st.sampled_from(POOL)),
    st.builds(replace, indexes, pool_lines),
    st.builds(
        edit_characters,
        indexes,
        indexes,
        st.integers(min_value=0, max_value=3),
        CHARACTERS | st.text(max_size=3),
    ),
)


VALID_HEADERS = [
    "[default]",
    '[rules."ops:deploy-notice"]',
    '[rules."ops:other"]',
    '[rules."billing:refund"]',
    "[namespaces.ops]",
    "[namespaces.billing]",
    "[namespaces.misc]",
]
VALID_GRANTS = {
    "turns": ["turns = true", "turns = false"],
    "threads": ['threads = "any"', 'threads = "chain"'],
    "create_threads": ["create_threads = true", "create_threads = false"],
    "direct": ['direct = ["timeline"]', 'direct = ["timeline", "triage_note"]', "direct = []"],
}


def entry(header: str, grants: list[str]) -> Mutation:
    return lambda lines: [*lines, "", header, *grants]


entries = st.builds(
    entry,
    st.sampled_from(VALID_HEADERS),
    st.lists(st.sampled_from(sorted(VALID_GRANTS)), unique=True, max_size=4).flatmap(
        lambda fields: st.tuples(*(st.sampled_from(VALID_GRANTS[f]) for f in fields)).map(list)
    ),
)
valid_leaning = st.one_of(
    entries,
    entries,
    st.builds(
        after_header, indexes, st.sampled_from([g for v in VALID_GRANTS.values() for g in v])
    ),
    st.builds(delete, indexes),
    st.builds(swap, indexes, indexes),
)


def mutated(changes: list[Mutation], ending: str) -> str:
    lines = list(LINES)
    for change in changes:
        lines = change(lines)
    return "\n".join(lines) + ending


def test_the_example_file_grants_as_written() -> None:
    assert assert_refused_or_granted_as_written(EXAMPLE) == "parsed"
    assert stated(tomllib.loads(EXAMPLE), "ops:incident-triage") == Stated(turns=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutations, min_size=1, max_size=6), st.sampled_from(["\n", "", "\r\n", "\n\n"]))
def test_a_mutated_file_is_refused_whole_or_granted_as_written(
    changes: list[Mutation], ending: str
) -> None:
    assert_refused_or_granted_as_written(mutated(changes, ending))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(valid_leaning, min_size=1, max_size=6))
def test_entries_added_moved_or_removed_grant_only_what_they_state(
    changes: list[Mutation],
) -> None:
    assert_refused_or_granted_as_written(mutated(changes, "\n"))


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    raw = bytearray(EXAMPLE.encode())
    if draw(st.booleans()):
        raw[:0] = b"\xef\xbb\xbf"
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        position = draw(st.integers(min_value=0, max_value=len(raw)))
        kind = draw(st.sampled_from(["flip", "insert", "delete"]))
        if kind == "flip" and position < len(raw):
            raw[position] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif kind == "insert":
            raw[position:position] = draw(
                st.binary(min_size=1, max_size=4)
                | st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\n"])
            )
        else:
            del raw[position : position + draw(st.integers(min_value=1, max_value=8))]
    return bytes(raw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowlists")


@settings(max_examples=200, deadline=None)
@given(byte_mutations())
def test_a_file_mutated_byte_wise_is_refused_whole_or_granted_as_written(
    folder: Path, raw: bytes
) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".toml", delete=False) as file:
        file.write(raw)
    path = Path(file.name)
    refused: InvalidAllowlist | None = None
    loaded: Allowlists | None = None
    try:
        loaded = load_allowlist(path)
    except InvalidAllowlist as invalid:
        refused = invalid
    finally:
        path.unlink()
    if refused is not None:
        assert refused.source == str(path)
        assert refused.problems
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        assert loaded is None
        return
    verdict = assert_refused_or_granted_as_written(text)
    assert verdict == ("refused" if loaded is None else "parsed")
    if loaded is not None:
        parsed = parse_allowlist(text)
        assert [loaded.for_rule(rule) for rule in PROBES] == [
            parsed.for_rule(rule) for rule in PROBES
        ]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=60, deadline=None)
@given(st.lists(mutations, min_size=1, max_size=4))
def test_a_worker_reloading_a_mutated_file_keeps_the_last_good_one_or_takes_it_whole(
    folder: Path, changes: list[Mutation]
) -> None:
    path = folder / f"reload-{id(changes)}.toml"
    path.write_text(EXAMPLE)
    invalid: list[InvalidAllowlist] = []
    clock = Clock()
    allowlist_file = AllowlistFile.open(
        path, clock=clock, on_invalid=invalid.append, on_reload=lambda _: None
    )
    good = allowlist_file.current()
    text = mutated(changes, "\n")
    path.write_text(text)
    try:
        in_force = allowlist_file.reload()
    finally:
        path.unlink()
    verdict = assert_refused_or_granted_as_written(text)
    if verdict == "refused":
        assert in_force is good
        assert len(invalid) == 1
        assert allowlist_file.last_error is invalid[0]
    else:
        assert invalid == []
        for rule in PROBES:
            assert in_force.for_rule(rule) == parse_allowlist(text).for_rule(rule)


# ─── inputs that escape the parser (findings) ─────────────────────────────────

ESCAPES = {
    "nested arrays": "[default]\ndirect = " + "[" * 2000 + "]" * 2000 + "\n",
    "nested inline tables": "[default]\nturns = " + "{a = " * 2000 + "1" + "}" * 2000 + "\n",
    "a 5000-digit integer": "[default]\nturns = " + "9" * 5000 + "\n",
    "a 5000-digit hex integer": "[default]\nturns = 0x" + "f" * 5000 + "\n",
}
"""What tomllib fails to read with RecursionError (deep nesting) or ValueError (integers over
4300 digits), not TOMLDecodeError: refused as invalid files all the same."""


@pytest.mark.parametrize("text", ESCAPES.values(), ids=ESCAPES.keys())
def test_what_tomllib_cannot_read_is_refused_not_a_crash(text: str) -> None:
    with pytest.raises(InvalidAllowlist):
        parse_allowlist(text)


@pytest.mark.parametrize("text", ESCAPES.values(), ids=ESCAPES.keys())
def test_a_worker_reloading_such_a_file_keeps_the_last_good_allowlist(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "allowlist.toml"
    path.write_text(EXAMPLE)
    invalid: list[InvalidAllowlist] = []
    allowlist_file = AllowlistFile.open(path, on_invalid=invalid.append)
    good = allowlist_file.current()
    path.write_text(text)
    assert allowlist_file.reload() is good
    assert len(invalid) == 1
