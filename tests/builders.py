"""What several test modules build the same way: emission records and the gates that hold an
action until the test releases it. One place each, so the tests agree on them."""

import asyncio
import dataclasses
from datetime import UTC, datetime
from typing import Any

from relayr.core.emissions import EmissionRecord

NOW = datetime(2026, 10, 12, 9, 30, tzinfo=UTC)
"""The fixed time emission records are stamped with."""


def emission(**changes: Any) -> EmissionRecord:
    """A notice's record (``ops:triage``, run ``fir-1``, ``tenant-1/ws-1``), with ``changes``.

    The changes are not validated: a test builds a bad record to see it refused where records
    are validated (the ledger, :func:`relayr.core.emissions.validate_emission`).
    """
    record = EmissionRecord(
        kind="notice",
        rule="ops:triage",
        run_id="fir-1",
        attempt=1,
        epoch=1,
        tenant_id="tenant-1",
        workspace_id="ws-1",
        thread_id="thr-1",
        message_id="msg-1",
        policy="notice",
        outcome="posted",
        content="build 42 failed",
        emitted_at=NOW,
    )
    return record.model_copy(update=changes)


@dataclasses.dataclass
class Gates:
    """How a test steers an action that waits: it says it started, then waits to be released.

    The application's ``app_deps``; ``calls`` counts the action's calls.
    """

    started: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    release: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    calls: int = 0
