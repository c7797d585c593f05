"""A bad allowlist file: refused whole, every problem named by its key and line.

Pure: ``parse_allowlist`` on texts written here, no file, no clock, no service. Generated
documents are in tests/core/test_allowlist_generated.py.
"""

import pytest

from relayr.core.allowlist import MOST_RESTRICTIVE, Allowlist
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist

BAD_FILES: list[tuple[str, str, list[tuple[str, int | None]]]] = [
    ("toml syntax", '[rules."ops:x"]\nturns = tru\n', [('rules."ops:x".turns', 2)]),
    ("unterminated table", '[rules."ops:x"\nturns = true\n', [("<toml>", 1)]),
    ("unknown table", '[rule."ops:x"]\nturns = true\n', [("rule", 1)]),
    ("permission outside an entry", "turns = true\n", [("turns", 1)]),
    ("unknown key", '[rules."ops:x"]\nturn = true\n', [('rules."ops:x".turn', 2)]),
    ("turns as a string", '[default]\nturns = "true"\n', [("default.turns", 2)]),
    ("turns as an integer", "[default]\nturns = 1\n", [("default.turns", 2)]),
    ("create_threads as a string", '[namespaces.ops]\ncreate_threads = "yes"\n',
     [("namespaces.ops.create_threads", 2)]),
    ("threads not chain or any", '[rules."ops:x"]\nthreads = "all"\n',
     [('rules."ops:x".threads', 2)]),
    ("threads as a boolean", '[rules."ops:x"]\nthreads = true\n', [('rules."ops:x".threads', 2)]),
    ("direct as a string", '[rules."ops:x"]\ndirect = "timeline"\n',
     [('rules."ops:x".direct', 2)]),
    ("direct with a number", '[rules."ops:x"]\ndirect = ["timeline", 3]\n',
     [('rules."ops:x".direct', 2)]),
    ("direct with a malformed kind", '[rules."ops:x"]\ndirect = ["Time Line"]\n',
     [('rules."ops:x".direct', 2)]),
    ("direct with a duplicate", '[rules."ops:x"]\ndirect = ["timeline", "timeline"]\n',
     [('rules."ops:x".direct', 2)]),
    ("malformed rule name", '[rules."Ops:X"]\nturns = true\n', [('rules."Ops:X"', 1)]),
    ("unquoted rule name", "[rules.ops]\nturns = true\n", [("rules.ops", 1)]),
    ("empty rule name", '[rules.""]\n', [('rules.""', 1)]),
    ("namespace wildcard as a rule", '[rules."ops:*"]\nturns = true\n', [('rules."ops:*"', 1)]),
    ("reserved namespace in rules", '[rules."reflexr:tick"]\nturns = true\n',
     [('rules."reflexr:tick"', 1)]),
    ("reserved namespace", "[namespaces.reflexr]\nturns = true\n", [("namespaces.reflexr", 1)]),
    ("malformed namespace", "[namespaces.Ops]\n", [("namespaces.Ops", 1)]),
    ("namespace with a wildcard", '[namespaces."ops:*"]\n', [('namespaces."ops:*"', 1)]),
    ("duplicate entry", '[rules."ops:x"]\nturns = true\n[rules."ops:x"]\n',
     [('rules."ops:x"', 3)]),
    ("duplicate entry, other quotes", "[namespaces.ops]\n[namespaces.\"ops\"]\n",
     [("namespaces.ops", 2)]),
    ("duplicate key", '[rules."ops:x"]\nturns = true\nturns = false\n',
     [('rules."ops:x".turns', 3)]),
    ("duplicate default", "[default]\n[default]\n", [("default", 2)]),
    ("entry not a table", '[rules]\n"ops:x" = true\n', [('rules."ops:x"', 2)]),
    ("rules not a table", 'rules = ["ops:x"]\n', [("rules", 1)]),
    ("default not a table", "default = true\n", [("default", 1)]),
    ("array of tables", '[[rules."ops:x"]]\nturns = true\n', [('rules."ops:x"', 1)]),
    ("namespaces holding a permission", "[namespaces]\nturns = true\n",
     [("namespaces.turns", 2)]),
    ("inline entry with a bad field", '[rules]\n"ops:x" = { turns = "yes" }\n',
     [('rules."ops:x".turns', 2)]),
    ("dotted key with a bad value", '[rules]\n"ops:x".threads = 1\n',
     [('rules."ops:x".threads', 2)]),
    ("top-level dotted key", 'rules."ops:x".turns = "yes"\n', [('rules."ops:x".turns', 1)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [pytest.param(text, expected, id=name) for name, text, expected in BAD_FILES],
)
def test_bad_file_names_the_key_and_line(text: str, expected: list[tuple[str, int | None]]) -> None:
    with pytest.raises(InvalidAllowlist) as raised:
        parse_allowlist(text, source="ops.toml")
    found = {(problem.key, problem.line) for problem in raised.value.problems}
    assert set(expected) <= found
    assert raised.value.code == "invalid_allowlist"
    assert raised.value.source == "ops.toml"
    for problem in raised.value.problems:
        assert problem.message[:1].islower()
        assert problem.key in str(raised.value)


def test_every_problem_is_reported() -> None:
    text = """\
turns = true
[rule."ops:x"]
[rules."ops:*"]
turn = true
[rules."reflexr:x"]
direct = ["a", "a", "B", 3]
[namespaces."ops:*"]
create_threads = "yes"
[namespaces.reflexr]
[default]
turns = 1
threads = "everywhere"
"""
    with pytest.raises(InvalidAllowlist) as raised:
        parse_allowlist(text)
    problems = raised.value.problems
    assert [(problem.key, problem.line) for problem in problems] == [
        ("turns", 1),
        ("rule", 2),
        ('rules."ops:*"', 3),
        ('rules."ops:*".turn', 4),
        ('rules."reflexr:x"', 5),
        ('rules."reflexr:x".direct', 6),
        ('rules."reflexr:x".direct', 6),
        ('rules."reflexr:x".direct', 6),
        ('namespaces."ops:*"', 7),
        ('namespaces."ops:*".create_threads', 8),
        ("namespaces.reflexr", 9),
        ("default.turns", 11),
        ("default.threads", 12),
    ]
    messages = " | ".join(problem.message for problem in problems)
    assert "[namespaces.ops]" in messages
    assert "did you mean turns?" in messages
    assert '"a" is listed twice' in messages
    assert "reserved" in messages


def test_every_duplicate_is_reported() -> None:
    text = '[rules."ops:x"]\n[namespaces.ops]\n[rules."ops:x"]\n[namespaces.ops]\n'
    with pytest.raises(InvalidAllowlist) as raised:
        parse_allowlist(text)
    assert [(p.key, p.line) for p in raised.value.problems] == [
        ('rules."ops:x"', 3),
        ("namespaces.ops", 4),
    ]
    assert "first declared at line 1" in raised.value.problems[0].message


@pytest.mark.parametrize(
    ("text", "rule", "stated"),
    [
        ('[namespaces.ops]\nturns = true\n[rules."ops:x"]\ndirect = ["a"]', "ops:x",
         Allowlist(direct=frozenset({"a"}))),
        ('[default]\ntreads = "any"\n', "ops:x", None),
        ('[default]\nthreads = "any"\ncreate_threads = true', "ops:x",
         Allowlist(threads="any", create_threads=True)),
        ('[rules."ops:x"]\nturns = false\n[namespaces.ops]\nturns = true', "ops:x",
         MOST_RESTRICTIVE),
        ('[namespaces.ops]\ndirect = []\n[default]\ndirect = ["a"]', "ops:y", MOST_RESTRICTIVE),
    ],
)  # fmt: skip
def test_a_valid_file_never_grants_more_than_stated(
    text: str, rule: str, stated: Allowlist | None
) -> None:
    if stated is None:
        with pytest.raises(InvalidAllowlist):
            parse_allowlist(text)
        return
    assert parse_allowlist(text).for_rule(rule) == stated


def test_rejects_whole_file_rather_than_dropping_the_bad_entry() -> None:
    text = '[rules."ops:good"]\nturns = true\n[rules."ops:bad"]\nturns = "yes"\n'
    with pytest.raises(InvalidAllowlist) as raised:
        parse_allowlist(text)
    assert [p.key for p in raised.value.problems] == ['rules."ops:bad".turns']
