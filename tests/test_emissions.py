"""Emission records: each way a record can be wrong is refused with its own named code."""

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from relayr.emissions import SCHEMA_VERSION, EmissionRecord, validate_emission
from relayr.errors import InvalidEmission

NOW = datetime(2026, 10, 12, 9, 30, tzinfo=UTC)

GOOD = EmissionRecord(
    kind="message",
    rule="ops:triage",
    run_id="fir-1",
    attempt=1,
    epoch=1,
    tenant_id="tenant-1",
    workspace_id="ws-1",
    thread_id="thr-1",
    message_id="msg-1",
    policy="turn",
    outcome="asked",
    content="please look at build 42",
    emitted_at=NOW,
)


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
    (changed(run_id=""), "INVALID_FIELD"),
    (changed(thread_id=7), "INVALID_FIELD"),
    (changed(attempt=0), "INVALID_FIELD"),
    (changed(attempt=True), "INVALID_FIELD"),
    (changed(attempt="1"), "INVALID_FIELD"),
    (changed(epoch=0), "INVALID_FIELD"),
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
