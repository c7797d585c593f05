"""Generated allowlist documents and arbitrary text: refused, or granting only what they state.

Pure, under hypothesis: whole documents (valid entries nine draws in ten, so that many parse)
and lines of text are given to ``parse_allowlist``, whose grants are checked against the entry
the documented lookup chooses. tests/core/test_allowlist_mutated_text.py starts from the example
application's file instead.
"""

import json
import tomllib
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist
from tests.allowlist_helpers import FILE

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
