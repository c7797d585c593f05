"""What a console page was asked for: the runs filter, a run, a thread, read from the URL.

Everything in a URL is typed by someone (or forged by a page elsewhere), so it is checked here
once, with the command line's rules for ids and durations (``relayr runs list --workspace
--since``): a bad value is :class:`BadQuery`, shown as one line naming the parameter (400),
before any storage is read. The filter's status names are the ones ops use (``dead``,
``failed``, ``running``, ``due``, ``succeeded``, and ``cancelled``, ``skipped``), each mapped to
reflexr's status in :data:`STATUS_FILTERS`.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final
from urllib.parse import urlencode

from relayr.core import parsing
from relayr.core.errors import RelayrError
from relayr.ledger.port import WorkspaceKey
from relayr.ops.rows import RunFilter

STATUS_FILTERS: Final = {
    "dead": "dead",
    "failed": "retrying",
    "running": "running",
    "due": "pending",
    "succeeded": "succeeded",
    "cancelled": "cancelled",
    "skipped": "skipped",
}
"""The runs page's statuses, by the name ops use, to reflexr's: ``failed`` is a run whose last
attempt failed and which waits for its next (``retrying``); ``due`` one that waits for its
first, or for a worker after a retry (``pending``)."""

STATUS_HELP: Final = {
    "dead": "failed for good: its retry policy gave up, or the failure was permanent",
    "failed": "its last attempt failed; reflexr retries it (retrying)",
    "running": "a worker holds it",
    "due": "waits for a worker (pending)",
    "succeeded": "done",
    "cancelled": "cancelled by ops",
    "skipped": "skipped by ops",
}
"""What each status filter shows, in the filter's own words."""

PAGE_SIZE: Final = 50
"""Runs per page: a screen or two, and one read of at most ``page × 50 + 1`` runs."""

MAX_PAGE: Final = 200
"""The last page a URL may ask for (10,000 runs deep): past that, narrow the filter."""

MAX_RULE_CHARS: Final = 200
"""The longest rule name a filter takes: longer is no rule's name."""


class BadQuery(RelayrError):
    """Raised when a URL's parameter cannot be used; the message names it and the value."""

    code = "bad_query"


def parse_duration(name: str, text: str) -> timedelta:
    """``90s``, ``15m``, ``2h``, ``7d``, or a sum such as ``1h30m``, as ``--since`` takes.

    Raises:
        BadQuery: Naming the parameter and the text, when it is not a duration.
    """
    return _checked(parsing.parse_duration, name, text)


def parse_id(name: str, text: str) -> str:
    """Check an id.

    Raises:
        BadQuery: Naming the parameter and the text, when it is not an id.
    """
    return _checked(parsing.parse_id, name, text)


def parse_workspace(name: str, text: str) -> WorkspaceKey:
    """``TENANT/WORKSPACE``.

    Raises:
        BadQuery: Naming the parameter and the text, when it is not two ids joined by ``/``.
    """
    return WorkspaceKey(*_checked(parsing.parse_workspace, name, text))


def _checked[T](parse: Callable[[str, str], T], name: str, text: str) -> T:
    """``parse(name, text)``, one of :mod:`relayr.core.parsing`'s, its refusal a BadQuery."""
    try:
        return parse(name, text)
    except parsing.Unreadable as unreadable:
        raise BadQuery(unreadable.message) from None


def href(path: str, params: Mapping[str, object] | None = None) -> str:
    """A link to one of the console's own pages, its parameters quoted (empty ones left out)."""
    kept = {name: str(value) for name, value in (params or {}).items() if value not in (None, "")}
    return f"{path}?{urlencode(kept)}" if kept else path


@dataclass(frozen=True)
class RunQuery:
    """The runs page's filter: status (by :data:`STATUS_FILTERS`' names), rule, workspace,
    since, and the page."""

    status: str | None = None
    rule: str | None = None
    workspace: WorkspaceKey | None = None
    since: str | None = None
    page: int = 1

    @classmethod
    def parse(cls, params: Mapping[str, str], *, status: str | None = None) -> "RunQuery":
        """Read the filter from a URL's parameters (empty ones are left out); ``status``, when
        given, is the filter's whatever the URL says (the bulk retry takes dead runs only).

        Raises:
            BadQuery: Naming the first parameter that cannot be used.
        """
        chosen = status or params.get("status") or None
        if chosen is not None and chosen not in STATUS_FILTERS:
            raise BadQuery(f"status {chosen!r} is not one of {', '.join(STATUS_FILTERS)}")
        rule = params.get("rule") or None
        if rule is not None and len(rule) > MAX_RULE_CHARS:
            raise BadQuery(f"rule is longer than {MAX_RULE_CHARS} characters")
        where = params.get("workspace") or None
        since = params.get("since") or None
        if since is not None:
            parse_duration("since", since)
        page_text = params.get("page") or "1"
        if not page_text.isdigit() or not 1 <= int(page_text) <= MAX_PAGE:
            raise BadQuery(f"page {page_text!r} is not a page number from 1 to {MAX_PAGE}")
        return cls(
            status=chosen,
            rule=rule,
            workspace=None if where is None else parse_workspace("workspace", where),
            since=since,
            page=int(page_text),
        )

    def run_filter(self, now: datetime, *, limit: int | None) -> RunFilter:
        """The filter :func:`relayr.ops.rows.list_runs` takes, as ``relayr runs list`` builds it."""
        return RunFilter(
            status=None if self.status is None else STATUS_FILTERS[self.status],
            rule=self.rule,
            workspace=self.workspace,
            since=None if self.since is None else now - parse_duration("since", self.since),
            limit=limit,
        )

    def params(self, **changed: object) -> dict[str, object]:
        """The filter as URL parameters (for links to other pages of it), with ``changed``."""
        current: dict[str, object] = {
            "status": self.status,
            "rule": self.rule,
            "workspace": None if self.workspace is None else str(self.workspace),
            "since": self.since,
            "page": None if self.page == 1 else self.page,
        }
        return {**current, **changed}
