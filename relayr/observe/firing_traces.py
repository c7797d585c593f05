"""The trace each fired run continues, kept from its evaluation to the pass that enqueues it.

:class:`Evaluation` notes it, :data:`firings` keeps it (bounded, one dispatcher process), and
:func:`relayr.observe.telemetry.enqueuing` takes it for the message's span (ADR-0080). Nothing
here starts or reads a span: only :mod:`relayr.observe.telemetry` imports OpenTelemetry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

REMEMBERED_FIRINGS: Final = 10_000
"""How many runs' trace contexts the dispatcher keeps between the evaluation that fired them and
the pass that enqueues them. A run forgotten (a backlog deeper than this) is still traced in
the worker, as a child of its event's envelope; only the dispatcher's enqueue span loses it."""


class FiringTraces:
    """The trace context each run fired in, from the evaluation that fired it to the pass
    that enqueues it, in one dispatcher process; bounded (:data:`REMEMBERED_FIRINGS`)."""

    def __init__(self, limit: int = REMEMBERED_FIRINGS) -> None:
        self._limit = limit
        self._contexts: MutableMapping[str, SpanContext] = OrderedDict()

    def fired(self, run_id: str, found: SpanContext | None) -> None:
        if found is None:
            return
        self._contexts[run_id] = found
        while len(self._contexts) > self._limit:
            self._contexts.pop(next(iter(self._contexts)))

    def take(self, run_id: str) -> SpanContext | None:
        return self._contexts.pop(run_id, None)


firings: Final = FiringTraces()
"""This process's :class:`FiringTraces` (the dispatcher's)."""


class TracedRun(Protocol):
    """What relayr reads of a reflexr run to trace it."""

    @property
    def id(self) -> str: ...

    @property
    def fired_seq(self) -> int: ...

    @property
    def attempts(self) -> int: ...

    @property
    def epoch(self) -> int: ...


@dataclass
class Evaluation:
    """What an evaluation's span lends the facts and runs it makes.

    Attributes:
        traceparent: The evaluation span's, for the facts it appends (None: untraced).
    """

    traceparent: str | None = None
    own: SpanContext | None = None
    events: dict[int, SpanContext] = field(default_factory=dict)
    count: int = 0

    def fired(self, runs: Iterable[TracedRun]) -> None:
        """Remember the trace each run continues until the dispatcher enqueues it: the
        evaluation's when that is its event's trace, else its event's (:data:`firings`)."""
        if self.own is None:
            return
        for run in runs:
            self.count += 1
            event = self.events.get(run.fired_seq)
            own = event is None or event.trace_id == self.own.trace_id
            firings.fired(run.id, self.own if own else event)
