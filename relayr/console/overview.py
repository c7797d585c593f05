"""The overview, the console's home page: how many runs are in each state, where, and lately.

Counts by status, by rule and by workspace; the runs that ended (succeeded, dead) or failed an
attempt (retrying) in each of the last :data:`HOURS` hours, by when they last changed, drawn as
an SVG chart on the server; how long the oldest waiting run has waited (dispatch latency). Each
figure carries the runs filter that lists the runs behind it, so every number is a link. Health
(the queue's depth, the followers' lag in time) comes from :func:`relayr.console.reads.health_page`.

The figures are the console's run index's (:class:`relayr.ops.index.RunIndex`), brought up to
date first: reflexr's storage offers no count, and the index keeps them as runs change
(ADR-0109).
"""

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from relayr.ledger.port import WorkspaceKey
from relayr.ops.index import RunIndex
from relayr.runtime.process import Runtime

from .queries import STATUS_FILTERS, href

HOURS: Final = 24
"""How many hours the chart shows, one bar each."""

SERIES: Final = ("succeeded", "retrying", "dead")
"""The chart's series, bottom up: what ended well, what failed an attempt, what died."""

CHART_HEIGHT: Final = 120
"""The chart's bars' height, in SVG units, for the tallest hour."""

BAR_WIDTH: Final = 14
BAR_GAP: Final = 4


@dataclass(frozen=True)
class Count:
    """A figure and the runs page that lists what it counts."""

    label: str
    count: int
    link: str


@dataclass(frozen=True)
class Segment:
    """One series' part of an hour's bar: where it is drawn and the runs behind it."""

    series: str
    count: int
    x: int
    y: int
    height: int
    link: str


@dataclass(frozen=True)
class Hour:
    """One hour of the chart."""

    start: datetime
    segments: list[Segment]

    @property
    def total(self) -> int:
        return sum(segment.count for segment in self.segments)


@dataclass(frozen=True)
class Overview:
    """Every figure of the home page."""

    total: int
    by_status: list[Count]
    by_rule: list[Count]
    by_workspace: list[Count]
    hours: list[Hour]
    oldest_waiting_s: float | None
    """How long the oldest pending run has been due (dispatch latency); None: none waits."""
    oldest_waiting: str | None
    """The link to the waiting runs, oldest first."""
    now: datetime

    @property
    def chart_width(self) -> int:
        return HOURS * (BAR_WIDTH + BAR_GAP)

    @property
    def chart_height(self) -> int:
        return CHART_HEIGHT


async def overview(runtime: Runtime, index: RunIndex) -> Overview:
    """The overview of every run in the store, now."""
    await index.refreshed()
    now = runtime.application.rules.clock()
    by_status: Counter[str] = Counter()
    by_rule: Counter[str] = Counter()
    by_workspace: Counter[WorkspaceKey] = Counter()
    for (status, rule, where), count in index.tally.items():
        by_status[status] += count
        by_rule[rule] += count
        by_workspace[where] += count
    waiting = [row for row in index.pending.values() if row.next_attempt_at <= now]
    oldest = min((row.next_attempt_at for row in waiting), default=None)
    return Overview(
        total=by_status.total(),
        by_status=[
            Count(status, by_status[status], href("/runs", {"status": status}))
            for status in STATUS_FILTERS
        ],
        by_rule=[
            Count(rule, count, href("/runs", {"rule": rule}))
            for rule, count in sorted(by_rule.items(), key=lambda item: (-item[1], item[0]))
        ],
        by_workspace=[
            Count(str(where), count, href("/runs", {"workspace": str(where)}))
            for where, count in sorted(
                by_workspace.items(), key=lambda item: (-item[1], str(item[0]))
            )
        ],
        hours=_hours(index.hours, now),
        oldest_waiting_s=None if oldest is None else max((now - oldest).total_seconds(), 0.0),
        oldest_waiting=href("/runs", {"status": "pending"}) if waiting else None,
        now=now,
    )


def _hours(counts: Counter[tuple[datetime, str]], now: datetime) -> list[Hour]:
    """The last :data:`HOURS` whole hours to now, each with its runs by series (``counts``: the
    runs by the hour they last changed in, and their status)."""
    this_hour = now.replace(minute=0, second=0, microsecond=0)
    starts = [this_hour - timedelta(hours=back) for back in range(HOURS - 1, -1, -1)]
    tallest = max(
        (sum(counts[(start, series)] for series in SERIES) for start in starts), default=0
    )
    scale = CHART_HEIGHT / tallest if tallest else 0.0
    hours = []
    for index, start in enumerate(starts):
        x = index * (BAR_WIDTH + BAR_GAP)
        bottom = CHART_HEIGHT
        segments = []
        for series in SERIES:
            count = counts[(start, series)]
            if not count:
                continue
            height = max(round(count * scale), 1)
            bottom -= height
            link = href(
                "/runs",
                {
                    "status": series,
                    "from": start.isoformat(),
                    "to": (start + timedelta(hours=1)).isoformat(),
                    "sort": "changed",
                },
            )
            segments.append(Segment(series, count, x, bottom, height, link))
        hours.append(Hour(start, segments))
    return hours
