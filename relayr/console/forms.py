"""What a console form names: a run, a bulk retry's runs, the runs selected for an action, a
reason, where to go after a login.

A form's fields are typed by someone or forged by a page elsewhere, as a URL's parameters are,
so they are checked here with the rules of :mod:`relayr.console.queries`: a malformed one is
:class:`~relayr.console.queries.BadQuery` (400), raised before any run is read or changed. The
app reads a form only within :data:`MAX_FORM_FIELDS` fields of :data:`MAX_FIELD_BYTES` each,
and with no file. A run's page names its run as its form does (:func:`run_named`).
"""

from typing import Any, Final
from urllib.parse import urlsplit

from starlette.datastructures import FormData

from relayr.core.parsing import ID_PATTERN
from relayr.ledger.port import WorkspaceKey

from . import actions
from .queries import BadQuery, parse_id, parse_workspace

MAX_FORM_FIELDS: Final = actions.BULK_RETRY_MAX + 16
"""The most fields a form may carry: a bulk retry's runs and a few more."""

MAX_FIELD_BYTES: Final = 16 * 1024
"""The largest field a form may carry: a reason, a token, an id; nothing needs more."""

MAX_REASON_CHARS: Final = 500
"""The longest reason a cancel or skip records."""


def text(form: FormData, name: str) -> str:
    """A form's text field, or empty."""
    value = form.get(name)
    return value if isinstance(value, str) else ""


def run_named(params: Any) -> tuple[str, WorkspaceKey | None]:
    """The run a page or form names: ``id``, and ``workspace`` when given.

    Raises:
        BadQuery: When either is malformed.
    """
    run_id = parse_id("id", params.get("id") or "")
    where = params.get("workspace") or None
    return run_id, None if where is None else parse_workspace("workspace", where)


def run_ref(value: str) -> actions.RunRef:
    """``TENANT/WORKSPACE/RUN``, as a confirmation names a run.

    Raises:
        BadQuery: When it is not three ids joined by ``/``.
    """
    parts = value.split("/")
    if len(parts) != 3 or not all(ID_PATTERN.fullmatch(part) for part in parts):
        raise BadQuery(f"run {value!r} is malformed: expected TENANT/WORKSPACE/RUN")
    return actions.RunRef(WorkspaceKey(parts[0], parts[1]), parts[2])


def selected(params: Any) -> tuple[str, list[actions.RunRef]]:
    """The action (``retry``, ``cancel``, ``skip``) and the runs (``run``, each
    ``TENANT/WORKSPACE/RUN``, at most :data:`~relayr.console.actions.SELECTED_MAX`) a page or
    form names for it; a run named twice counts once.

    Raises:
        BadQuery: When the action is not one of those, no run or too many are named, or a run
            is malformed.
    """
    action = params.get("action") or ""
    if action not in actions.SELECTED:
        raise BadQuery(f"action {action[:40]!r} is not one of {', '.join(actions.SELECTED)}")
    named = [value for value in params.getlist("run") if isinstance(value, str)]
    if not named:
        raise BadQuery("no run selected: tick the runs to act on in the runs list")
    refs = list(dict.fromkeys(map(run_ref, named)))
    if len(refs) > actions.SELECTED_MAX:
        raise BadQuery(f"{len(refs)} runs selected: at most {actions.SELECTED_MAX} at once")
    return action, refs


def reason_of(form: FormData, *, default: str | None) -> str:
    """A cancel's or skip's reason: the console asks one for both (the command line's skip
    must give one, its cancel has a default).

    Raises:
        BadQuery: When it is missing without a default, or too long.
    """
    reason = text(form, "reason").strip() or default
    if reason is None:
        raise BadQuery("reason is required: say why the run will not run")
    if len(reason) > MAX_REASON_CHARS:
        raise BadQuery(f"reason is longer than {MAX_REASON_CHARS} characters")
    return reason


def next_path(value: str | None) -> str:
    """Where to go after logging in: a path of this console only, never another site.

    Browsers drop tabs and line breaks from a URL and read a backslash as a slash, so ``/``, a
    tab, ``/evil.example`` would lead to ``//evil.example``, another site. So the path must start
    with one slash, hold no backslash, no space and no control character, and have neither a
    scheme nor a host; anything else is ``/runs``, and so is the login page itself.
    """
    if not value or any(ord(character) <= 0x20 or ord(character) == 0x7F for character in value):
        return "/runs"
    if "\\" in value or not value.startswith("/") or value.startswith("//"):
        return "/runs"
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or parts.path == "/login":
        return "/runs"
    return value


def came_from(referer: str | None, host: str | None, pages: frozenset[str]) -> str:
    """Where a page answering a POST (a refusal, an error) sends the operator back to after a
    login: the console's own page the form was posted from (its ``Referer``), when it is one of
    ``pages`` (the paths a GET reads), else the overview. Never the action's own path: a login
    that went on to ``/run/skip`` would land on an action, which a GET cannot do.
    """
    if not referer or not host:
        return "/"
    parts = urlsplit(referer)
    if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
        return "/"
    if parts.path not in pages or parts.path == "/login":
        return "/"
    back = f"{parts.path}?{parts.query}" if parts.query else parts.path
    return back if next_path(back) == back else "/"
