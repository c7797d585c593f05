"""Emission records: each way a record can be wrong is refused with its own named code."""

import json
from pathlib import Path
from typing import Any

import pytest

from relayr.core.emissions import (
    FIELDS,
    SCHEMA_VERSION,
    EmissionRecord,
    json_schema,
    validate_emission,
)
from relayr.core.errors import InvalidEmission
from tests.builders import emission

GOOD = emission(kind="message", policy="turn", outcome="asked", content="please look at build 42")


def changed(**changes: Any) -> dict[str, Any]:
    return GOOD.to_json() | changes


def without(field: str) -> dict[str, Any]:
    data = GOOD.to_json()
    del data[field]
    return data


BAD_RECORDS = [
    (changed(extra="x"), "UNKNOWN_FIELD"),
    (without("rule"), "MISSING_FIELD"),
    (without("emitted_at"), "MISSING_FIELD"),
    (changed(schema_version=2), "INVALID_SCHEMA_VERSION"),
    (changed(schema_version=True), "INVALID_SCHEMA_VERSION"),
    (changed(rule=""), "INVALID_SENDER"),
    (changed(rule="ops triage"), "INVALID_SENDER"),
    (changed(run_id=""), "INVALID_CONTEXT"),
    (changed(tenant_id=None), "INVALID_CONTEXT"),
    (changed(attempt=0), "INVALID_CONTEXT"),
    (changed(attempt=True), "INVALID_CONTEXT"),
    (changed(attempt="1"), "INVALID_CONTEXT"),
    (changed(epoch=0), "INVALID_CONTEXT"),
    (changed(attempt=3, epoch=2), "INVALID_CONTEXT"),
    (changed(thread_id=7), "INVALID_ORIGIN"),
    (changed(thread_id="thr 1"), "INVALID_ORIGIN"),
    (changed(message_id=""), "INVALID_PATH"),
    (changed(message_id="msg\n1"), "INVALID_PATH"),
    (changed(kind="reply"), "INVALID_KIND"),
    (changed(policy="loud"), "INVALID_POLICY"),
    (changed(policy="notice"), "INVALID_POLICY"),
    (changed(kind="notice", policy="turn", outcome="posted"), "INVALID_POLICY"),
    (changed(kind="notice", policy="notice", outcome="asked"), "INVALID_OUTCOME"),
    (changed(outcome="failed"), "INVALID_OUTCOME"),
    (changed(content=""), "EMPTY_CONTENT"),
    (changed(content=" \n\t"), "EMPTY_CONTENT"),
    (changed(content=None), "EMPTY_CONTENT"),
    (changed(emitted_at="yesterday"), "INVALID_EMITTED_AT"),
    (changed(emitted_at="2026-10-12T09:30:00"), "INVALID_EMITTED_AT"),
    (changed(emitted_at=1_760_261_400), "INVALID_EMITTED_AT"),
]


@pytest.mark.parametrize(("data", "code"), BAD_RECORDS)
def test_a_bad_record_is_refused_with_its_code(data: dict[str, Any], code: str) -> None:
    with pytest.raises(InvalidEmission) as refused:
        validate_emission(data)

    assert refused.value.code == code
    assert refused.value.message


def test_a_good_record_round_trips_through_json() -> None:
    stored = json.dumps(GOOD.to_json())

    assert validate_emission(json.loads(stored)) == GOOD


def test_a_record_without_a_schema_version_is_read_as_the_current_one() -> None:
    assert validate_emission(without("schema_version")).schema_version == SCHEMA_VERSION


def test_the_published_schema_is_the_models() -> None:
    """docs/emission-record.schema.json is what the model exports; regenerate it with
    ``python -c "from relayr.core.emissions import json_schema; print(json_schema(), end='')"``."""
    published = Path(__file__).resolve().parents[2] / "docs" / "emission-record.schema.json"

    assert published.read_text() == json_schema()


def test_the_schema_states_each_kinds_outcomes_and_what_another_route_finds() -> None:
    schema = json.loads(json_schema())

    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == FIELDS - {"schema_version"}
    rules = [(rule["if"]["properties"], rule["then"]["properties"]) for rule in schema["allOf"]]
    outcomes = {when["kind"]["const"]: then["outcome"] for when, then in rules if len(when) == 1}
    assert "asked" not in outcomes["notice"]["enum"]
    assert "asked" in outcomes["message"]["enum"]
    other_routes = {
        (when["kind"]["const"], when["policy"]["const"]): then["outcome"]
        for when, then in rules
        if len(when) == 2
    }
    assert other_routes == {
        ("notice", "turn"): {"const": "already_posted"},
        ("message", "notice"): {"const": "already_posted"},
    }


@pytest.mark.parametrize(("kind", "policy"), [("notice", "turn"), ("message", "notice")])
def test_a_route_that_found_an_earlier_attempts_write_of_the_other_kind_is_recorded(
    kind: str, policy: str
) -> None:
    """The route the allowlist decided (``policy``) beside what artifactr holds (``kind``)."""
    record = validate_emission(changed(kind=kind, policy=policy, outcome="already_posted"))

    assert (record.kind, record.policy) == (kind, policy)


def test_a_record_built_invalid_is_refused_with_its_code() -> None:
    with pytest.raises(InvalidEmission) as refused:
        EmissionRecord(**(GOOD.to_json() | {"kind": "notice"}))

    assert refused.value.code == "INVALID_POLICY"
