"""What a console page was asked for: the runs filter, a run, a thread, read from the URL.

Everything in a URL is typed by someone (or forged by a page elsewhere), so it is checked here
once, with the command line's rules for ids and durations (``relayr runs list --workspace
--since``): a bad value is :class:`BadQuery`, shown as one line naming the parameter (400),
before any storage is read. The filter's status names are reflexr's, the ones each row shows
(:data:`STATUS_FILTERS`); a rule is matched by its exact name, else by any part of its name in
any case, and a workspace filter takes a tenant too. Pages follow each other by a cursor
(keyset paging), so every run is reachable however deep.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final
from urllib.parse import urlencode

from relayr.core import parsing
from relayr.core.errors import RelayrError
from relayr.ledger.port import WorkspaceKey
from relayr.ops.rows import Cursor, RunFilter, RunRow

STATUS_FILTERS: Final = {
    "dead": "failed for good: its retry policy gave up, or the failure was permanent",
    "retrying": "its last attempt failed; reflexr tries it again at its next attempt",
    "running": "a worker holds it",
    "pending": "waits for a worker: its first attempt, or the one after a retry",
    "succeeded": "done",
    "cancelled": "cancelled by an operator",
    "skipped": "skipped by an operator (or acknowledged: it will never succeed)",
}
"""The runs page's statuses, reflexr's own names (the ones its rows show), and what each means."""

STATUS_HELP: Final = STATUS_FILTERS
"""What each status filter shows, in the filter's own words."""

STATUS_ALIASES: Final = {"due": "pending", "failed": "retrying"}
"""Names earlier releases of the console used, still read in links made then."""

ORDERS: Final = {"created": "newest created first", "changed": "last changed first"}
"""How the runs list may be sorted."""

PAGE_SIZE: Final = 50
"""Runs per page: a screen or two, and one read of at most ``page × 50 + 1`` runs."""

MAX_RULE_CHARS: Final = 200
"""The longest rule name a filter takes: longer is no rule's name."""

MAX_TEXT_CHARS: Final = 200
"""The longest text a search or a reason filter takes."""


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


def parse_moment(name: str, text: str) -> datetime:
    """An absolute time, ISO 8601 (``2026-12-01T14:00``, ``2026-12-01 14:00:00+00:00``); one
    without a zone is UTC.

    Raises:
        BadQuery: Naming the parameter and the text, when it is not a time.
    """
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise BadQuery(
            f"{name} {text!r} is not a time: give ISO 8601, such as 2026-12-01T14:00"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_cursor(text: str) -> Cursor:
    """A page's cursor, as :meth:`RunQuery.cursor_of` writes it:
    ``MOMENT~SEQ~TENANT/WORKSPACE/RUN``.

    Raises:
        BadQuery: When it is not one.
    """
    fields = text.split("~")
    parts = fields[-1].split("/")
    if len(fields) != 3 or not fields[1].isdigit() or len(parts) != 3:
        raise BadQuery(f"after {text!r} is not a page's cursor: follow the page's own links")
    for part in parts:
        parse_id("after", part)
    moment = parse_moment("after", fields[0])
    return Cursor(moment, int(fields[1]), parts[0], parts[1], parts[2])


@dataclass(frozen=True)
class WorkspaceChoice:
    """A workspace filter: one workspace (``acme/ops``) or a tenant's (``acme``)."""

    tenant: str
    workspace: str | None = None

    def __str__(self) -> str:
        return self.tenant if self.workspace is None else f"{self.tenant}/{self.workspace}"

    @property
    def key(self) -> WorkspaceKey | None:
        return None if self.workspace is None else WorkspaceKey(self.tenant, self.workspace)


def parse_workspace_choice(name: str, text: str) -> WorkspaceChoice:
    """``TENANT/WORKSPACE`` or ``TENANT``.

    Raises:
        BadQuery: Naming the parameter, when it is neither.
    """
    if "/" in text:
        key = parse_workspace(name, text)
        return WorkspaceChoice(key.tenant_id, key.workspace_id)
    try:
        return WorkspaceChoice(parsing.parse_id(name, text))
    except parsing.Unreadable:
        raise BadQuery(
            f"{name} {text!r} is malformed: expected TENANT or TENANT/WORKSPACE"
        ) from None


@dataclass(frozen=True)
class RunQuery:
    """The runs page's filter: status (reflexr's names), a part of a rule's name (any case), a
    workspace or a tenant, a reason, when they changed (since a duration ago, or between two
    times), the order, and the page's cursor."""

    status: str | None = None
    rule: str | None = None
    workspace: WorkspaceChoice | None = None
    since: str | None = None
    start: datetime | None = None
    end: datetime | None = None
    reason: str | None = None
    sort: str = "created"
    after: Cursor | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str], *, status: str | None = None) -> "RunQuery":
        """Read the filter from a URL's parameters (empty ones are left out); ``status``, when
        given, is the filter's whatever the URL says (the bulk retry takes dead runs only).

        Raises:
            BadQuery: Naming the first parameter that cannot be used.
        """
        chosen = status or params.get("status") or None
        chosen = STATUS_ALIASES.get(chosen or "", chosen)
        if chosen is not None and chosen not in STATUS_FILTERS:
            raise BadQuery(f"status {chosen!r} is not one of {', '.join(STATUS_FILTERS)}")
        rule = (params.get("rule") or "").strip() or None
        if rule is not None and len(rule) > MAX_RULE_CHARS:
            raise BadQuery(f"rule is longer than {MAX_RULE_CHARS} characters")
        reason = (params.get("reason") or "").strip() or None
        if reason is not None and len(reason) > MAX_TEXT_CHARS:
            raise BadQuery(f"reason is longer than {MAX_TEXT_CHARS} characters")
        where = (params.get("workspace") or "").strip() or None
        since = params.get("since") or None
        if since is not None:
            parse_duration("since", since)
        start = params.get("from") or None
        end = params.get("to") or None
        sort = params.get("sort") or "created"
        if sort not in ORDERS:
            raise BadQuery(f"sort {sort!r} is not one of {', '.join(ORDERS)}")
        after = params.get("after") or None
        return cls(
            status=chosen,
            rule=rule,
            workspace=None if where is None else parse_workspace_choice("workspace", where),
            since=since,
            start=None if start is None else parse_moment("from", start),
            end=None if end is None else parse_moment("to", end),
            reason=reason,
            sort=sort,
            after=None if after is None else parse_cursor(after),
        )

    def rule_names(self, known: Iterable[str]) -> tuple[str, ...] | None:
        """The rules the filter selects among ``known``: the one it names exactly, else every
        rule it names a part of (any case); None when the filter names no rule. So a link to
        one rule's runs lists that rule's only, though its name is part of another's."""
        if self.rule is None:
            return None
        names = set(known)
        if self.rule in names:
            return (self.rule,)
        part = self.rule.casefold()
        return tuple(sorted(name for name in names if part in name.casefold()))

    def run_filter(
        self, now: datetime, *, limit: int | None, known: Iterable[str] = ()
    ) -> RunFilter:
        """The filter :func:`relayr.ops.rows.list_runs` takes."""
        since = None if self.since is None else now - parse_duration("since", self.since)
        if self.start is not None:
            since = self.start if since is None else max(since, self.start)
        return RunFilter(
            status=self.status,
            rules=self.rule_names(known),
            workspace=None if self.workspace is None else self.workspace.key,
            tenant=None if self.workspace is None else self.workspace.tenant,
            since=since,
            until=self.end,
            reason=self.reason,
            order="changed" if self.sort == "changed" else "created",
            after=self.after,
            limit=limit,
        )

    def cursor_of(self, row: RunRow) -> str:
        """The cursor of the page that follows ``row``."""
        cursor = Cursor.after(row, "changed" if self.sort == "changed" else "created")
        where = f"{cursor.tenant_id}/{cursor.workspace_id}/{cursor.run_id}"
        return f"{cursor.moment.isoformat()}~{cursor.fired_seq}~{where}"

    def params(self, **changed: object) -> dict[str, object]:
        """The filter as URL parameters (for links to other pages of it), with ``changed``."""
        current: dict[str, object] = {
            "status": self.status,
            "rule": self.rule,
            "workspace": None if self.workspace is None else str(self.workspace),
            "reason": self.reason,
            "since": self.since,
            "from": None if self.start is None else self.start.isoformat(),
            "to": None if self.end is None else self.end.isoformat(),
            "sort": None if self.sort == "created" else self.sort,
        }
        return {**current, **changed}
