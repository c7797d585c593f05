"""Emission records: one durable, validated record of each notice or send a run made.

Modelled on the "Operator Messages" seed: the record says what was emitted, by which rule and
run, where, by which route (``policy``) and with which outcome. A record is validated when it is
written and again when it is read; a bad one is refused with a named code and never stored, so
what ops read back is always a record this schema allows. Pure: no clock, no I/O.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal, get_args

from relayr.errors import InvalidEmission

SCHEMA_VERSION = 1

type EmissionKind = Literal["notice", "message"]
type Policy = Literal["notice", "turn"]
type Outcome = Literal["posted", "already_posted", "asked"]

KINDS: frozenset[str] = frozenset(get_args(EmissionKind.__value__))
POLICIES: frozenset[str] = frozenset(get_args(Policy.__value__))
OUTCOMES: frozenset[str] = frozenset(get_args(Outcome.__value__))

# Which route each kind takes, and which outcomes it can have: a notice never asks for a turn.
_POLICY_OF_KIND: Mapping[str, str] = {"notice": "notice", "message": "turn"}
_OUTCOMES_OF_KIND: Mapping[str, frozenset[str]] = {
    "notice": frozenset({"posted", "already_posted"}),
    "message": frozenset({"posted", "already_posted", "asked"}),
}

_TEXT_FIELDS = ("rule", "run_id", "tenant_id", "workspace_id", "thread_id", "message_id")


@dataclass(frozen=True)
class EmissionRecord:
    """What one notice or send of one attempt did.

    ``attempt`` counts from 1 again after an operator's retry; ``epoch`` never goes back, so
    (run, epoch, message) names one emission for good.
    """

    kind: EmissionKind
    rule: str
    run_id: str
    attempt: int
    epoch: int
    tenant_id: str
    workspace_id: str
    thread_id: str
    message_id: str
    policy: Policy
    outcome: Outcome
    content: str
    emitted_at: datetime
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready data, the form it is stored in."""
        data = asdict(self)
        data["emitted_at"] = self.emitted_at.isoformat()
        return data


FIELDS: frozenset[str] = frozenset(EmissionRecord.__dataclass_fields__)


def validate_emission(data: Mapping[str, Any]) -> EmissionRecord:
    """Return the record ``data`` describes, or raise naming what is wrong.

    Raises:
        InvalidEmission: ``UNKNOWN_FIELD``, ``MISSING_FIELD``, ``INVALID_SCHEMA_VERSION``,
            ``INVALID_FIELD`` (a wrong type or an empty id), ``INVALID_KIND``,
            ``INVALID_POLICY``, ``INVALID_OUTCOME``, ``EMPTY_CONTENT`` or
            ``INVALID_EMITTED_AT``.
    """
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise InvalidEmission("UNKNOWN_FIELD", f"unknown emission field(s): {', '.join(unknown)}")
    missing = sorted(FIELDS - set(data) - {"schema_version"})
    if missing:
        raise InvalidEmission("MISSING_FIELD", f"missing emission field(s): {', '.join(missing)}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise InvalidEmission(
            "INVALID_SCHEMA_VERSION", f"schema_version {version!r} is not {SCHEMA_VERSION}"
        )
    for name in _TEXT_FIELDS:
        value = data[name]
        if not isinstance(value, str) or not value:
            raise InvalidEmission("INVALID_FIELD", f"{name} must be a non-empty string")
    for name in ("attempt", "epoch"):
        number = data[name]
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise InvalidEmission(
                "INVALID_FIELD", f"{name} must be a positive integer, not {number!r}"
            )
    kind, policy, outcome = data["kind"], data["policy"], data["outcome"]
    if kind not in KINDS:
        raise InvalidEmission("INVALID_KIND", f"kind {kind!r} is not one of {sorted(KINDS)}")
    if policy not in POLICIES or _POLICY_OF_KIND[kind] != policy:
        raise InvalidEmission("INVALID_POLICY", f"a {kind} cannot have policy {policy!r}")
    if outcome not in _OUTCOMES_OF_KIND[kind]:
        raise InvalidEmission("INVALID_OUTCOME", f"a {kind} cannot have outcome {outcome!r}")
    content = data["content"]
    if not isinstance(content, str) or not content.strip():
        raise InvalidEmission("EMPTY_CONTENT", "content is empty or whitespace only")
    emitted_at = _timestamp(data["emitted_at"])
    return EmissionRecord(
        kind=kind,
        rule=data["rule"],
        run_id=data["run_id"],
        attempt=data["attempt"],
        epoch=data["epoch"],
        tenant_id=data["tenant_id"],
        workspace_id=data["workspace_id"],
        thread_id=data["thread_id"],
        message_id=data["message_id"],
        policy=policy,
        outcome=outcome,
        content=content,
        emitted_at=emitted_at,
        schema_version=SCHEMA_VERSION,
    )


def _timestamp(value: object) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidEmission(
                "INVALID_EMITTED_AT", f"emitted_at {value!r} is not an ISO 8601 time"
            ) from None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidEmission("INVALID_EMITTED_AT", "emitted_at must be a timezone-aware time")
    return value
