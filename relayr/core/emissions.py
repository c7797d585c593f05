"""Emission records: one durable, validated record of each notice or send a run made.

A record says what was emitted, by which rule and run, where, by which route and with which
outcome. Its ``kind`` is what artifactr holds (ADR-0062); its ``policy`` is the route the
allowlist decided for this attempt, which differs from the kind's only for an earlier attempt's
write (``already_posted``, ADR-0101). It is validated when written and when read; a bad one is
refused with a code from :data:`CODES` (ADR-0105). Its JSON Schema is
``docs/emission-record.schema.json`` (:func:`json_schema`). Pure.
"""

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PlainValidator,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from relayr.core.errors import InvalidEmission

SCHEMA_VERSION: Final = 1

type EmissionKind = Literal["notice", "message"]
type EmissionPolicy = Literal["notice", "turn"]
type EmissionOutcome = Literal["posted", "already_posted", "asked"]

EMISSION_KINDS: Final = frozenset(get_args(EmissionKind.__value__))
EMISSION_POLICIES: Final = frozenset(get_args(EmissionPolicy.__value__))
EMISSION_OUTCOMES: Final = frozenset(get_args(EmissionOutcome.__value__))

POLICY_OF_KIND: Final[Mapping[EmissionKind, EmissionPolicy]] = {
    "notice": "notice",
    "message": "turn",
}
"""Which route writes each kind: a notice is posted as one, a message is a send. A record of
another route found the write an earlier attempt made: its outcome is ``already_posted``."""

OTHER_ROUTE_OUTCOME: Final = "already_posted"
"""The only outcome of a route that did not write what artifactr holds under its id."""

OUTCOMES_OF_KIND: Final[Mapping[str, frozenset[str]]] = {
    "notice": frozenset({"posted", "already_posted"}),
    "message": frozenset({"posted", "already_posted", "asked"}),
}
"""Which outcomes each kind can have: a notice never asks for a turn."""

CODES: Final = (
    "UNKNOWN_FIELD",
    "MISSING_FIELD",
    "INVALID_SCHEMA_VERSION",
    "INVALID_FIELD",
    "INVALID_SENDER",
    "INVALID_CONTEXT",
    "INVALID_ORIGIN",
    "INVALID_PATH",
    "INVALID_KIND",
    "INVALID_POLICY",
    "INVALID_OUTCOME",
    "EMPTY_CONTENT",
    "INVALID_EMITTED_AT",
    "INVALID_JSON",
)
"""Every named rejection of a record, in the order they are looked for: a record wrong in two
ways is refused with the first. Each names what a reader of the record needs (ADR-0105):
``INVALID_SENDER`` the rule that emitted (``rule``), ``INVALID_CONTEXT`` the run it emitted in
(``run_id``, ``attempt``, ``epoch``, ``tenant_id``, ``workspace_id``: an attempt is never past
its epoch), ``INVALID_ORIGIN`` the thread it went to (``thread_id``), ``INVALID_PATH`` where it
is found (``message_id``). ``INVALID_FIELD`` is what no other code names."""

_CODE_OF_FIELD: Final = {
    "schema_version": "INVALID_SCHEMA_VERSION",
    "rule": "INVALID_SENDER",
    "run_id": "INVALID_CONTEXT",
    "attempt": "INVALID_CONTEXT",
    "epoch": "INVALID_CONTEXT",
    "tenant_id": "INVALID_CONTEXT",
    "workspace_id": "INVALID_CONTEXT",
    "thread_id": "INVALID_ORIGIN",
    "message_id": "INVALID_PATH",
    "kind": "INVALID_KIND",
    "policy": "INVALID_POLICY",
    "outcome": "INVALID_OUTCOME",
    "content": "EMPTY_CONTENT",
    "emitted_at": "INVALID_EMITTED_AT",
}


def _timestamp(value: object) -> datetime:
    """An aware time, or an ISO 8601 text of one; nothing else (not a number of seconds)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise PydanticCustomError(
                "INVALID_EMITTED_AT", "emitted_at {value} is not an ISO 8601 time", {"value": value}
            ) from None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise PydanticCustomError("INVALID_EMITTED_AT", "emitted_at must be a timezone-aware time")
    return value


def _version(value: object) -> int:
    if type(value) is not int or value != SCHEMA_VERSION:
        raise PydanticCustomError(
            "INVALID_SCHEMA_VERSION",
            "schema_version {value} is not {version}",
            {"value": repr(value), "version": SCHEMA_VERSION},
        )
    return value


def _content(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PydanticCustomError("EMPTY_CONTENT", "content is empty or whitespace only")
    return value


_Id = Annotated[StrictStr, Field(min_length=1)]
_Name = Annotated[StrictStr, Field(min_length=1, pattern=r"^\S+$")]
"""An id or a rule's name: no storage or participant holds one with a space."""
_Count = Annotated[StrictInt, Field(ge=1)]
_Timestamp = Annotated[
    datetime,
    PlainValidator(_timestamp),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
_Version = Annotated[
    int,
    PlainValidator(_version),
    WithJsonSchema({"const": SCHEMA_VERSION, "type": "integer", "default": SCHEMA_VERSION}),
]
_Content = Annotated[
    str, PlainValidator(_content), WithJsonSchema({"type": "string", "pattern": r"\S"})
]


def _kind_rules() -> list[JsonValue]:
    """The JSON Schema's form of :data:`OUTCOMES_OF_KIND` and :data:`POLICY_OF_KIND`."""
    outcomes: list[JsonValue] = [
        {
            "if": {"properties": {"kind": {"const": kind}}},
            "then": {
                "properties": {
                    "outcome": {"enum": list[JsonValue](sorted(OUTCOMES_OF_KIND[kind]))},
                }
            },
        }
        for kind in sorted(EMISSION_KINDS)
    ]
    other_routes: list[JsonValue] = [
        {
            "if": {
                "properties": {"kind": {"const": kind}, "policy": {"const": policy}},
                "required": ["kind", "policy"],
            },
            "then": {"properties": {"outcome": {"const": OTHER_ROUTE_OUTCOME}}},
        }
        for kind in sorted(EMISSION_KINDS)
        for policy in sorted(EMISSION_POLICIES)
        if POLICY_OF_KIND[kind] != policy
    ]
    return outcomes + other_routes


class EmissionRecord(BaseModel):
    """What one notice or send of one attempt did.

    ``attempt`` counts from 1 again after an operator's retry; ``epoch`` never goes back, so
    (run, epoch, message) names one emission for good.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        title="relayr emission record",
        json_schema_extra={"allOf": _kind_rules()},
    )

    kind: EmissionKind
    rule: _Name
    run_id: _Id
    attempt: _Count
    epoch: _Count
    tenant_id: _Id
    workspace_id: _Id
    thread_id: _Name
    message_id: _Name
    policy: EmissionPolicy
    outcome: EmissionOutcome
    content: _Content
    emitted_at: _Timestamp
    schema_version: _Version = SCHEMA_VERSION

    @model_validator(mode="wrap")
    @classmethod
    def _named(cls, data: Any, handler: Any) -> Any:
        """Every refusal as :class:`InvalidEmission` with its named code, not pydantic's."""
        try:
            record = handler(data)
        except ValidationError as invalid:
            raise _named_error(invalid, data) from None
        if record.attempt > record.epoch:
            raise InvalidEmission(
                "INVALID_CONTEXT",
                f"attempt {record.attempt} is past epoch {record.epoch}: an attempt counts "
                "from 1 again after an operator's retry, an epoch never goes back",
            )
        if POLICY_OF_KIND[record.kind] != record.policy and record.outcome != OTHER_ROUTE_OUTCOME:
            raise InvalidEmission(
                "INVALID_POLICY",
                f"policy {record.policy!r} does not write a {record.kind}: only an earlier "
                f"attempt's {record.kind} can be found by it ({OTHER_ROUTE_OUTCOME})",
            )
        if record.outcome not in OUTCOMES_OF_KIND[record.kind]:
            raise InvalidEmission(
                "INVALID_OUTCOME", f"a {record.kind} cannot have outcome {record.outcome!r}"
            )
        return record

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready data, the form it is stored in."""
        data = self.model_dump()
        data["emitted_at"] = self.emitted_at.isoformat()
        return data


FIELDS: Final = frozenset(EmissionRecord.model_fields)


def validate_emission(data: Mapping[str, Any]) -> EmissionRecord:
    """Return the record ``data`` describes, or raise naming what is wrong.

    Raises:
        InvalidEmission: With one of :data:`CODES`.
    """
    if not isinstance(data, Mapping):
        raise InvalidEmission("INVALID_JSON", "an emission record is a JSON object")
    return EmissionRecord.model_validate(dict(data))


def json_schema() -> str:
    """The record's JSON Schema as ``docs/emission-record.schema.json`` holds it."""
    schema = EmissionRecord.model_json_schema(mode="validation")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _named_error(invalid: ValidationError, data: Any) -> InvalidEmission:
    """The first problem of ``invalid``, in the order of :data:`CODES`, as a named refusal."""
    errors = invalid.errors()
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return InvalidEmission("UNKNOWN_FIELD", f"unknown emission field(s): {', '.join(unknown)}")
    missing = sorted(str(e["loc"][0]) for e in errors if e["type"] == "missing")
    if missing:
        return InvalidEmission("MISSING_FIELD", f"missing emission field(s): {', '.join(missing)}")
    named = sorted((_code(error), _message(error, data)) for error in errors)
    code, message = min(named, key=lambda found: CODES.index(found[0]))
    return InvalidEmission(code, message)


def _code(error: ErrorDetails) -> str:
    if error["type"] in CODES:
        return error["type"]
    field = str(error["loc"][0]) if error["loc"] else ""
    return _CODE_OF_FIELD.get(field, "INVALID_FIELD")


def _message(error: ErrorDetails, data: Any) -> str:
    if error["type"] in CODES:
        return error["msg"]
    field = str(error["loc"][0]) if error["loc"] else "record"
    given = data.get(field) if isinstance(data, Mapping) else None
    if field in ("kind", "policy", "outcome"):
        return f"{field} {given!r} is not one of {sorted(_CHOICES[field])}"
    if field in ("attempt", "epoch"):
        return f"{field} must be a positive integer, not {given!r}"
    if field in ("rule", "thread_id", "message_id"):
        return f"{field} must be a non-empty string without spaces, not {given!r}"
    return f"{field} must be a non-empty string"


_CHOICES: Final = {
    "kind": EMISSION_KINDS,
    "policy": EMISSION_POLICIES,
    "outcome": EMISSION_OUTCOMES,
}
