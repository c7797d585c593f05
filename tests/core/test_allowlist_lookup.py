"""The allowlist's lookup: one whole entry per rule, the source of each field, warnings.

Pure: ``parse_allowlist`` on texts written here, no file, no clock, no service.
"""

import json
from typing import Any

import pytest
from pydantic import ValidationError

from relayr.core.allowlist import MOST_RESTRICTIVE, Allowlist, Allowlists, GrantSource, warnings
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import Problem
from tests.allowlist_helpers import FILE

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
        "limits": [],
    }


def test_entries_keep_their_lines() -> None:
    allowlists = parse_allowlist(FILE)
    assert allowlists.default is not None
    assert allowlists.default.line == 1
    assert allowlists.namespaces["ops"].line == 4
    assert allowlists.rules["ops:incident-triage"].line == 8


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
