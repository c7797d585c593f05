"""The operators' allowlist file, mutated, and the oracle its mutants are held to.

Hypothesis mutates the example file (``rules/allowlist.toml``) line by line (delete, repeat,
swap, uncomment, insert or replace with lines an operator might write, or mistype) and
character by character; tests/runtime/test_allowlist_mutated_files.py mutates it byte by byte too.
Whatever comes out, ``assert_refused_or_granted_as_written`` checks that:

- parsing raises nothing but ``InvalidAllowlist``, which names at least one problem;
- a file that parses grants each rule exactly what a tiny reference interpreter, written here
  from ``tomllib``'s output and the documented lookup (the rule's entry, else its namespace's,
  else ``[default]``; a field the entry leaves out is not granted; ``reflexr:*`` gets nothing),
  says it states, so never anything wider.

tests/core/test_allowlist_generated.py generates whole documents; these mutations start from the
real one.
"""

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st

from relayr.core.allowlist import MOST_RESTRICTIVE
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


# ─── inputs that escape the parser (findings) ─────────────────────────────────

ESCAPES = {
    "nested arrays": "[default]\ndirect = " + "[" * 2000 + "]" * 2000 + "\n",
    "nested inline tables": "[default]\nturns = " + "{a = " * 2000 + "1" + "}" * 2000 + "\n",
    "a 5000-digit integer": "[default]\nturns = " + "9" * 5000 + "\n",
    "a 5000-digit hex integer": "[default]\nturns = 0x" + "f" * 5000 + "\n",
}
"""What tomllib fails to read with RecursionError (deep nesting) or ValueError (integers over
4300 digits), not TOMLDecodeError: refused as invalid files all the same."""
