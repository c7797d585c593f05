"""The allowlist: lookup by whole entry, every problem of a bad file, warnings, live reload."""

import json
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from relayr.allowlist_file import AllowlistFile, load_allowlist
from relayr.core.allowlist import MOST_RESTRICTIVE, Allowlist, Allowlists, GrantSource, warnings
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist, Problem

REPO = Path(__file__).resolve().parent.parent

FILE = """\
[default]
threads = "any"

[namespaces.ops]
turns = true
direct = ["timeline"]

[rules."ops:incident-triage"]
create_threads = true

[rules."ops:quiet"]

[rules."billing:refunds"]
turns = true
threads = "chain"
"""

RULE = 'rules."ops:incident-triage"'


@pytest.mark.parametrize(
    ("rule", "expected", "entry"),
    [
        ("ops:incident-triage", Allowlist(create_threads=True), GrantSource("rule", RULE)),
        ("ops:quiet", MOST_RESTRICTIVE, GrantSource("rule", 'rules."ops:quiet"')),
        (
            "ops:paging",
            Allowlist(turns=True, direct=frozenset({"timeline"})),
            GrantSource("namespace", "namespaces.ops"),
        ),
        ("billing:refunds", Allowlist(turns=True), GrantSource("rule", 'rules."billing:refunds"')),
        ("billing:invoices", Allowlist(threads="any"), GrantSource("default", "default")),
        ("misc:anything", Allowlist(threads="any"), GrantSource("default", "default")),
        ("reflexr:tick", MOST_RESTRICTIVE, GrantSource("builtin")),
    ],
)
def test_lookup_takes_one_whole_entry(rule: str, expected: Allowlist, entry: GrantSource) -> None:
    allowlists = parse_allowlist(FILE)
    assert allowlists.for_rule(rule) == expected
    assert allowlists.explain(rule).entry == entry


@pytest.mark.parametrize(
    ("text", "rule", "expected"),
    [
        ("", "ops:x", MOST_RESTRICTIVE),
        (
            '[namespaces.ops]\nturns = true\n[default]\nthreads = "any"',
            "misc:x",
            Allowlist(threads="any"),
        ),
        ("[namespaces.ops]\nturns = true", "misc:x", MOST_RESTRICTIVE),
        ("[namespaces.ops]\nturns = true", "opsx:y", MOST_RESTRICTIVE),
        ("[namespaces.ops]\nturns = true", "ops", MOST_RESTRICTIVE),
        (
            '[default]\nturns = true\n[rules."ops:x"]\nthreads = "any"',
            "ops:x",
            Allowlist(threads="any"),
        ),
        ('[default]\ndirect = ["a", "b"]\n[namespaces.ops]', "ops:x", MOST_RESTRICTIVE),
    ],
)
def test_fields_an_entry_leaves_out_are_most_restrictive(
    text: str, rule: str, expected: Allowlist
) -> None:
    assert parse_allowlist(text).for_rule(rule) == expected


def test_empty_grants_nothing() -> None:
    empty = Allowlists.empty()
    assert empty.for_rule("ops:incident-triage") == MOST_RESTRICTIVE
    assert empty.explain("ops:x").entry == GrantSource("builtin")
    assert Allowlist() == MOST_RESTRICTIVE
    assert MOST_RESTRICTIVE.turns is False
    assert MOST_RESTRICTIVE.threads == "chain"
    assert MOST_RESTRICTIVE.create_threads is False
    assert MOST_RESTRICTIVE.direct == frozenset()


@pytest.mark.parametrize(
    "fields",
    [{"turns": "yes"}, {"create_threads": 1}, {"threads": "all"}, {"turn": True}],
)
def test_an_allowlist_in_code_is_validated_too(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Allowlist(**fields)


def test_an_allowlist_is_frozen() -> None:
    with pytest.raises(ValidationError):
        MOST_RESTRICTIVE.turns = True


@pytest.mark.parametrize(
    ("rule", "field", "source"),
    [
        ("ops:incident-triage", "create_threads", GrantSource("rule", RULE)),
        ("ops:incident-triage", "turns", GrantSource("builtin")),
        ("ops:incident-triage", "threads", GrantSource("builtin")),
        ("ops:paging", "turns", GrantSource("namespace", "namespaces.ops")),
        ("ops:paging", "direct", GrantSource("namespace", "namespaces.ops")),
        ("ops:paging", "threads", GrantSource("builtin")),
        ("misc:x", "threads", GrantSource("default", "default")),
        ("misc:x", "turns", GrantSource("builtin")),
        ("reflexr:tick", "threads", GrantSource("builtin")),
    ],
)
def test_explain_names_the_source_of_each_field(rule: str, field: str, source: GrantSource) -> None:
    assert parse_allowlist(FILE).explain(rule).fields[field] == source


def test_explain_as_json() -> None:
    grant = parse_allowlist(FILE, source="rules/allowlist.toml").explain("ops:paging")
    data = json.loads(json.dumps(grant.to_json()))
    assert data == {
        "rule": "ops:paging",
        "source": "rules/allowlist.toml",
        "entry": {"kind": "namespace", "key": "namespaces.ops"},
        "allowlist": {
            "turns": True,
            "threads": "chain",
            "create_threads": False,
            "direct": ["timeline"],
        },
        "fields": {
            "turns": {"value": True, "kind": "namespace", "key": "namespaces.ops"},
            "threads": {"value": "chain", "kind": "builtin", "key": None},
            "create_threads": {"value": False, "kind": "builtin", "key": None},
            "direct": {"value": ["timeline"], "kind": "namespace", "key": "namespaces.ops"},
        },
    }


def test_entries_keep_their_lines() -> None:
    allowlists = parse_allowlist(FILE)
    assert allowlists.default is not None
    assert allowlists.default.line == 1
    assert allowlists.namespaces["ops"].line == 4
    assert allowlists.rules["ops:incident-triage"].line == 8


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


def test_load_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "allowlist.toml"
    path.write_bytes(b'\xef\xbb\xbf[rules."ops:x"]\nturns = true\n')
    allowlists = load_allowlist(path)
    assert allowlists.source == str(path)
    assert allowlists.for_rule("ops:x").turns is True


def test_unreadable_files(tmp_path: Path) -> None:
    cases: list[tuple[Path, str, int | None]] = []
    cases.append((tmp_path / "missing.toml", "no such file", None))
    cases.append((tmp_path, "directory", None))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[rules."ops:x"]\n# caf\xe9\n')
    cases.append((latin, "not utf-8", 2))
    for path, message, line in cases:
        with pytest.raises(InvalidAllowlist) as raised:
            load_allowlist(path)
        (problem,) = raised.value.problems
        assert problem.key == "<file>"
        assert message in problem.message
        assert problem.line == line
        assert raised.value.source == str(path)


def test_unreadable_for_permissions(tmp_path: Path) -> None:
    """A file the worker may not read is refused as such ("permission denied"), not as a
    missing or invalid one.

    Root reads any file, whatever its mode, and CI runs as root: there the load runs in a
    process that stays root but without the capabilities that bypass a file's mode
    (``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``), so the mode applies to it as to anyone.
    """
    path = tmp_path / "locked.toml"
    path.write_text("[default]\n")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            problems = load_without_privileges(path)
        else:
            with pytest.raises(InvalidAllowlist) as raised:
                load_allowlist(path)
            problems = [problem.message for problem in raised.value.problems]
    finally:
        path.chmod(0o600)
    assert problems == ["cannot read: permission denied"]


UNPRIVILEGED_LOAD = """
import json, os, sys
from relayr.allowlist_file import load_allowlist
from relayr.core.errors import InvalidAllowlist
assert not os.access(sys.argv[1], os.R_OK), "the file is still readable: privileges kept"
try:
    load_allowlist(sys.argv[1])
except InvalidAllowlist as invalid:
    print(json.dumps([problem.message for problem in invalid.problems]))
else:
    print("[]")
"""


def load_without_privileges(path: Path) -> list[str]:
    """The problems ``load_allowlist(path)`` raises in a process without the capabilities that
    read any file (dropped from its bounding set by util-linux's ``setpriv``)."""
    setpriv = shutil.which("setpriv")
    command = [
        str(setpriv),
        "--bounding-set=-dac_override,-dac_read_search",
        sys.executable,
        "-c",
        UNPRIVILEGED_LOAD,
        str(path),
    ]
    done = None if setpriv is None else subprocess.run(command, capture_output=True, text=True)
    if done is None or done.returncode != 0:
        why = "setpriv is missing" if done is None else done.stderr.strip()
        message = f"cannot drop the privileges that read any file: {why}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI=true: this test may not skip)")
        pytest.skip(message)
    problems: list[str] = json.loads(done.stdout)
    return problems


def test_the_example_application_file() -> None:
    allowlists = load_allowlist(REPO / "rules" / "allowlist.toml")
    assert set(allowlists.rules) == {"ops:incident-triage"}
    assert allowlists.for_rule("ops:incident-triage") == Allowlist(turns=True)
    assert allowlists.for_rule("ops:other") == MOST_RESTRICTIVE
    assert allowlists.explain("ops:other").entry == GrantSource("default", "default")
    assert allowlists.default is not None
    assert allowlists.default.threads == "chain"
    assert warnings(allowlists, ["ops:incident-triage", "ops:other"]) == []


def test_warnings() -> None:
    text = """\
[rules."ops:gone"]
turns = true
[rules."ops:triage"]
turns = true
[namespaces.billing]
turns = true
[namespaces.legacy]
[default]
turns = true
"""
    allowlists = parse_allowlist(text)
    found = warnings(allowlists, ["ops:triage", "billing:refunds", "misc:digest"])
    assert [(problem.key, problem.line) for problem in found] == [
        ('rules."ops:gone"', 1),
        ("namespaces.billing", 5),
        ("namespaces.legacy", 7),
        ("default", 8),
    ]
    assert "billing:refunds" in found[1].message
    assert "misc:digest" in found[3].message
    assert all(isinstance(problem, Problem) for problem in found)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Saves:
    """Writes the file as a later save: the mtime moves on even within one clock tick."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mtime_ns = 1_700_000_000_000_000_000

    def __call__(self, text: str) -> None:
        self.path.write_text(text)
        self.mtime_ns += 1_000_000_000
        os.utime(self.path, ns=(self.mtime_ns, self.mtime_ns))


GRANTED = '[rules."ops:x"]\nturns = true\n'
REVOKED = '[rules."ops:x"]\nturns = false\n'
BROKEN = '[rules."ops:x"]\nturns = "no"\nthreads = "all"\n'


@pytest.fixture
def save(tmp_path: Path) -> Saves:
    saves = Saves(tmp_path / "allowlist.toml")
    saves(GRANTED)
    return saves


class Reports:
    def __init__(self) -> None:
        self.invalid: list[InvalidAllowlist] = []
        self.reloaded: list[Allowlists] = []


def open_file(save: Saves, clock: Clock, reports: Reports) -> AllowlistFile:
    return AllowlistFile.open(
        save.path,
        clock=clock,
        on_invalid=reports.invalid.append,
        on_reload=reports.reloaded.append,
    )


def test_reloads_a_changed_file_at_the_next_check(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    assert allowlist_file.current().for_rule("ops:x").turns is True
    save(REVOKED)
    clock.now += 0.5
    assert allowlist_file.current().for_rule("ops:x").turns is True
    clock.now += 0.5
    assert allowlist_file.current().for_rule("ops:x").turns is False
    assert len(reports.reloaded) == 1
    clock.now += 5
    assert allowlist_file.current().for_rule("ops:x").turns is False
    assert len(reports.reloaded) == 1
    assert reports.invalid == []


def test_keeps_the_last_good_allowlist_and_reports_a_bad_version_once(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    good = allowlist_file.current()
    save(BROKEN)
    for _ in range(3):
        clock.now += 1
        assert allowlist_file.current() is good
    (error,) = reports.invalid
    assert [p.key for p in error.problems] == ['rules."ops:x".turns', 'rules."ops:x".threads']
    assert allowlist_file.last_error is error
    save(BROKEN + "# still broken\n")
    clock.now += 1
    assert allowlist_file.current() is good
    assert len(reports.invalid) == 2
    save(REVOKED)
    clock.now += 1
    assert allowlist_file.current().for_rule("ops:x").turns is False
    assert allowlist_file.last_error is None
    assert len(reports.reloaded) == 1


def test_a_removed_file_keeps_the_last_good_allowlist(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    save.path.unlink()
    clock.now += 1
    assert allowlist_file.current().for_rule("ops:x").turns is True
    clock.now += 1
    allowlist_file.current()
    (error,) = reports.invalid
    assert "no such file" in str(error)


def test_reload_checks_at_once(save: Saves) -> None:
    clock, reports = Clock(), Reports()
    allowlist_file = open_file(save, clock, reports)
    save(REVOKED)
    assert allowlist_file.current().for_rule("ops:x").turns is True
    assert allowlist_file.reload().for_rule("ops:x").turns is False
    assert allowlist_file.current().for_rule("ops:x").turns is False
    save(BROKEN)
    allowlist_file.reload()
    allowlist_file.reload()
    assert len(reports.invalid) == 2
    assert allowlist_file.current().for_rule("ops:x").turns is False


def test_the_default_report_logs_every_problem(
    save: Saves, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    allowlist_file = AllowlistFile(save.path, clock=clock, check_interval_s=0.25)
    save(BROKEN)
    clock.now += 0.25
    with caplog.at_level(logging.INFO, logger="relayr.allowlist"):
        allowlist_file.current()
        allowlist_file.current()
    (record,) = caplog.records
    assert record.name == "relayr.allowlist"
    assert record.levelno == logging.ERROR
    assert 'rules."ops:x".turns (line 2)' in record.getMessage()
    assert 'rules."ops:x".threads (line 3)' in record.getMessage()
    assert "last good" in record.getMessage()


@pytest.mark.parametrize("text", [None, BROKEN])
def test_an_unusable_file_at_start_is_an_error(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "allowlist.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(InvalidAllowlist) as raised:
        AllowlistFile.open(path)
    assert raised.value.source == str(path)


VALID_RULES = ["ops:a", "ops:b", "billing:x", "misc:y"]
BAD_RULES = ["ops:*", "reflexr:x", "Ops:a", "ops", "ops:", ""]
VALID_NAMESPACES = ["ops", "billing", "misc"]
BAD_NAMESPACES = ["reflexr", "ops:*", "Ops", "1ops"]
FIELD_KEYS = ["turns", "threads", "create_threads", "direct", "turn", "extra"]
PROBE_RULES = ["ops:a", "ops:b", "ops:zz", "billing:x", "billing:zz", "misc:x", "reflexr:x"]


def mostly(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> Any:
    """Nine draws in ten from ``valid``, so that many generated files parse."""
    return st.integers(min_value=0, max_value=9).flatmap(lambda n: valid if n else invalid)


scalars = st.one_of(
    st.booleans(),
    st.sampled_from(["chain", "any", "all", "timeline", "Time Line", ""]),
    st.integers(min_value=-2, max_value=2),
    st.text(max_size=5),
)
values = st.one_of(scalars, st.lists(scalars, max_size=4))
kinds = st.sampled_from(["timeline", "notes", "runbook"])
valid_entries = st.fixed_dictionaries(
    {},
    optional={
        "turns": mostly(st.booleans(), values),
        "threads": mostly(st.sampled_from(["chain", "any"]), values),
        "create_threads": mostly(st.booleans(), values),
        "direct": mostly(st.lists(kinds, unique=True, max_size=3), st.lists(values, max_size=3)),
    },
)
entries = mostly(valid_entries, st.dictionaries(st.sampled_from(FIELD_KEYS), values) | values)
rule_names = mostly(st.sampled_from(VALID_RULES), st.sampled_from(BAD_RULES) | st.text(max_size=6))
namespace_names = mostly(st.sampled_from(VALID_NAMESPACES), st.sampled_from(BAD_NAMESPACES))
documents = mostly(
    st.fixed_dictionaries(
        {},
        optional={
            "default": entries,
            "rules": st.dictionaries(rule_names, entries, max_size=4),
            "namespaces": st.dictionaries(namespace_names, entries, max_size=3),
        },
    ),
    st.dictionaries(st.sampled_from(["default", "rules", "rule", "turns"]), entries, max_size=3),
)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(document: dict[str, Any], headers: bool) -> str:
    lines: list[str] = []
    tables: list[str] = []
    for top, body in document.items():
        if not headers or not isinstance(body, dict):
            lines.append(f"{json.dumps(top)} = {toml_value(body)}")
            continue
        tables.append(f"[{json.dumps(top)}]")
        nested = {name: entry for name, entry in body.items() if isinstance(entry, dict)}
        tables.extend(
            f"{json.dumps(name)} = {toml_value(entry)}"
            for name, entry in body.items()
            if name not in nested
        )
        for name, entry in nested.items():
            tables.append(f"[{json.dumps(top)}.{json.dumps(name)}]")
            tables.extend(f"{json.dumps(k)} = {toml_value(v)}" for k, v in entry.items())
    return "\n".join(lines + tables) + "\n"


def chosen_entry(data: dict[str, Any], rule: str) -> dict[str, Any]:
    rules = data.get("rules", {})
    namespaces = data.get("namespaces", {})
    namespace, colon, _ = rule.partition(":")
    if rule in rules:
        entry = rules[rule]
    elif colon and namespace in namespaces:
        entry = namespaces[namespace]
    else:
        entry = data.get("default", {})
    assert isinstance(entry, dict)
    return entry


def assert_granted_only_as_stated(text: str) -> None:
    try:
        allowlists = parse_allowlist(text)
    except InvalidAllowlist:
        return
    data = tomllib.loads(text)
    for rule in [*PROBE_RULES, *data.get("rules", {})]:
        allowlist, stated = allowlists.for_rule(rule), chosen_entry(data, rule)
        assert not allowlist.turns or stated.get("turns") is True
        assert allowlist.threads == "chain" or stated.get("threads") == "any"
        assert not allowlist.create_threads or stated.get("create_threads") is True
        assert allowlist.direct <= set(stated.get("direct", []))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents, st.booleans())
def test_parsing_never_widens_and_never_crashes(document: dict[str, Any], headers: bool) -> None:
    assert_granted_only_as_stated(toml_document(document, headers))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([*FILE.splitlines(), "[rules]", '"ops:x" = {turns = true}', "turns =", "["])
        | st.text(max_size=20),
        max_size=12,
    )
)
def test_arbitrary_text_is_refused_or_granted_only_as_stated(lines: list[str]) -> None:
    assert_granted_only_as_stated("\n".join(lines))
