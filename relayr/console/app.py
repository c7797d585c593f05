"""The console's ASGI app: server-rendered pages over the runtime, and the actions' POSTs.

:func:`create_app` builds a Starlette app on a :class:`Console` (the process's one runtime, the
enqueue ``relayr runs retry`` uses, the host names it answers to). Pages only read; an action
changes runs only for a logged-in session, by a POST carrying its CSRF token, and answers with a
redirect to its result (ADR-0070). Templates autoescape and carry no script. Its routes, from
the overview at ``/`` to ``/healthz`` for probes, are declared in :func:`create_app`.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import structlog
from reflexr import UserActor
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from relayr.ledger.port import WorkspaceKey
from relayr.ops.audit import audit_trail
from relayr.ops.index import RunIndex
from relayr.ops.runs import EnqueueRun, OperatorResult, not_enqueued, operator
from relayr.runtime.process import Runtime
from relayr.settings import redact

from . import actions, reads
from .forms import (
    MAX_FIELD_BYTES,
    MAX_FORM_FIELDS,
    came_from,
    next_path,
    reason_of,
    run_named,
    run_ref,
    selected,
    text,
)
from .operators import SHARED_TOKEN_NAME, holder
from .overview import overview
from .queries import BadQuery, RunQuery, href, parse_id, parse_workspace
from .rendering import STATIC, templates
from .search import parse_search, search
from .security import (
    CSRF_FIELD,
    LOGGED_IN_AT,
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    BodyLimit,
    SecurityHeaders,
    cross_site,
    login_current,
    new_csrf_token,
    same_secret,
    session_secret,
)

READ_ONLY: Final = "this console is read-only: RELAYR_CONSOLE_TOKEN is not set"
"""Why every POST is refused when the console has no token."""

logger = structlog.get_logger("relayr.console")

type Endpoint = Callable[[Request], Awaitable[Response]]


BANNER_TTL_S: Final = 5.0
"""How long the health banner's checks are reused before they are made again: every page shows
it, and a check reaches the broker and the database."""

REFRESH_S: Final = 15
"""How often a live page (the overview, the runs, an action's result) reloads itself."""

FAVICON: Final = STATIC / "favicon.ico"


@dataclass(frozen=True)
class Console:
    """What the console runs on.

    Attributes:
        runtime: The process's runtime: settings, the application, the ledger.
        enqueue: Hands a retried run to the workers (``relayr runs retry``'s).
        allowed_hosts: The host names it answers to besides IP addresses and ``localhost``
            (``--allowed-host``); None: every name
            (:func:`relayr.console.security.answers_to`).
        https_only: Whether it is reached over HTTPS only (a proxy terminates TLS): its session
            cookie is then Secure, so a browser never sends it in clear.
        operator_header: The request header a trusted proxy names the person in
            (``--operator-header``); None: actions are recorded under the token's name.
        operators: The operators' own tokens, by name (``RELAYR_CONSOLE_TOKENS``, read by
            :func:`relayr.console.operators.load_tokens`).
    """

    runtime: Runtime
    enqueue: EnqueueRun
    allowed_hosts: frozenset[str] | None = field(default_factory=frozenset)
    https_only: bool = False
    operator_header: str | None = None
    operators: Mapping[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> dict[str, str]:
        """Every token that lets its holder act, by the name the actions record."""
        shared = self.runtime.settings.console_token
        named = {} if shared is None else {SHARED_TOKEN_NAME: shared.get_secret_value()}
        return {**named, **self.operators}


class HealthBanner:
    """What is unhealthy now, for the banner every page shows: the health page's checks, made
    at most once every :data:`BANNER_TTL_S` seconds."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._at = -BANNER_TTL_S
        self._problems: list[str] = []

    async def problems(self) -> list[str]:
        now = time.monotonic()
        if now - self._at >= BANNER_TTL_S:
            self.saw((await reads.health_page(self.runtime)).problems)
        return self._problems

    def saw(self, problems: list[str]) -> None:
        """Take the checks a page made itself (the overview, the health page): its banner then
        says what the page says, however recent the last checks were."""
        self._problems, self._at = problems, time.monotonic()


def create_app(console: Console) -> Starlette:
    """The console's app on ``console``'s runtime."""
    pages = templates()
    runtime = console.runtime
    tokens = console.tokens
    acting = bool(tokens)
    outcomes = actions.Outcomes()
    banner = HealthBanner(runtime)
    engines = runtime.application.engines
    index = RunIndex(
        runtime.application.rules, runtime.bridge.limits, engine=engines[0] if engines else None
    )

    def logged_in(request: Request) -> bool:
        """Whether the request's session holds a login that has not expired; an expired one is
        cleared (the response then deletes its cookie)."""
        session = request.session
        if not session.get("ops"):
            return False
        if login_current(session.get(LOGGED_IN_AT), time.time()):
            return True
        session.clear()
        return False

    def access(request: Request) -> dict[str, Any]:
        if not acting:
            return {"mode": "read-only", "can_act": False, "csrf": "", "who": ""}
        if logged_in(request):
            return {
                "mode": "ops",
                "can_act": True,
                "csrf": request.session["csrf"],
                "who": operator_name(request),
            }
        return {"mode": "visitor", "can_act": False, "csrf": "", "who": ""}

    def operator_name(request: Request) -> str:
        """Who acts: the trusted proxy's header when the console was told to read one, else the
        name of the token the session logged in with."""
        if console.operator_header is not None:
            return request.headers.get(console.operator_header, "").strip()
        return str(request.session.get("operator") or SHARED_TOKEN_NAME)

    def actor_of(request: Request) -> UserActor:
        name = operator_name(request)
        if not name:
            raise HTTPException(
                403,
                f"refused: the request carries no {console.operator_header} header naming "
                "the operator (the console was started with --operator-header)",
            )
        try:
            return operator(name, via="console")
        except ValueError as error:
            raise HTTPException(403, f"refused: {error}") from None

    async def render(
        request: Request,
        name: str,
        status_code: int = 200,
        *,
        live: bool = False,
        **context: Any,
    ) -> Response:
        url = request.url
        here = back_here(request)
        paused = request.query_params.get("live") == "0"
        problems = [] if name in ("login.html",) else await banner.problems()
        page = pages.get_template(name).render(
            access=access(request),
            path=url.path,
            here=here,
            problems=problems,
            live=live and not paused,
            can_be_live=live,
            live_link=_toggle_live(request, paused),
            refresh_s=REFRESH_S,
            as_of=datetime.now(UTC),
            **context,
        )
        return HTMLResponse(page, status_code=status_code)

    def back_here(request: Request) -> str:
        """Where a page's login link leads back to: the page itself for a GET; for a POST's
        answer (a refusal), the page the form was on (:func:`came_from`), never the action."""
        url = request.url
        if request.method != "GET":
            return came_from(request.headers.get("referer"), request.headers.get("host"), readable)
        return f"{url.path}?{url.query}" if url.query else url.path

    async def checked_form(request: Request) -> FormData:
        """The POST's form, once it is known to come from this console's own page."""
        if not acting:
            raise HTTPException(403, READ_ONLY)
        why = cross_site(request)
        if why is not None:
            raise HTTPException(403, f"refused: {why}")
        form = await request.form(
            max_files=0, max_fields=MAX_FORM_FIELDS, max_part_size=MAX_FIELD_BYTES
        )
        if not same_secret(text(form, CSRF_FIELD), request.session.get("csrf")):
            raise HTTPException(
                403, "refused: the form's CSRF token is missing or stale; reload the page"
            )
        return form

    async def acting_form(request: Request) -> tuple[FormData, UserActor]:
        """:func:`checked_form`, for a logged-in session only, and who acts."""
        form = await checked_form(request)
        if not logged_in(request):
            raise HTTPException(403, "refused: log in with the console's token to act")
        return form, actor_of(request)

    async def home(request: Request) -> Response:
        figures, health, limits = await asyncio.gather(
            overview(runtime, index), reads.health_page(runtime), reads.limits_page(runtime)
        )
        banner.saw(health.problems)
        return await render(
            request,
            "overview.html",
            title="Overview",
            page=figures,
            health=health,
            limits=limits,
            live=True,
        )

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def favicon(request: Request) -> Response:
        return FileResponse(FAVICON, media_type="image/x-icon")

    async def runs(request: Request) -> Response:
        query = RunQuery.parse(request.query_params)
        page = await reads.runs_page(runtime, query, index)
        workspaces = index.workspaces()  # brought up to date by the page's read
        return await render(
            request,
            "runs.html",
            title="Runs",
            page=page,
            rules=reads.rule_names(runtime),
            workspaces=sorted({ref.tenant_id for ref in workspaces})
            + [f"{ref.tenant_id}/{ref.workspace_id}" for ref in workspaces],
            live=query.after is None,
        )

    async def run(request: Request) -> Response:
        run_id, workspace = run_named(request.query_params)
        if workspace is None:  # the index says which workspaces hold it
            held = (await index.refreshed()).with_id(run_id)
            if len(held) > 1:
                found = await search(runtime, run_id, index)
                return await render(
                    request, "search.html", title=f"Run {run_id}", found=found, ambiguous=True
                )
            if not held:
                raise HTTPException(404, f"no run {run_id}")
            workspace = held[0].workspace
        found_run = await reads.run_page(runtime, run_id, workspace)
        if found_run is None:
            where = f" in {workspace}" if workspace else ""
            raise HTTPException(404, f"no run {run_id}{where}")
        return await render(
            request,
            "run.html",
            title=f"Run {run_id}",
            page=found_run,
            now=runtime.application.rules.clock(),
        )

    async def find(request: Request) -> Response:
        query = parse_search(request.query_params.get("q"))
        found = await search(runtime, query, index)
        if len(found.hits) == 1 and not found.text:
            return RedirectResponse(found.hits[0].link, status_code=303)
        return await render(request, "search.html", title="Search", found=found, ambiguous=False)

    async def event(request: Request) -> Response:
        params = request.query_params
        workspace = parse_workspace("workspace", params.get("workspace", ""))
        seq_text = params.get("seq", "")
        if not seq_text.isdigit() or int(seq_text) < 1:
            raise BadQuery(f"seq {seq_text!r} is not a position in the log (1, 2, ...)")
        found = await reads.event_page(runtime, workspace, int(seq_text))
        if found is None:
            raise HTTPException(404, f"no event at {seq_text} in {workspace}")
        return await render(
            request, "event.html", title=f"Event {found.id}", event=found, workspace=workspace
        )

    async def thread(request: Request) -> Response:
        params = request.query_params
        workspace = parse_workspace("workspace", params.get("workspace", ""))
        thread_id = parse_id("id", params.get("id", ""))
        found = await reads.thread_page(runtime, workspace, thread_id)
        if found is None:
            raise HTTPException(404, f"thread {thread_id} does not exist in {workspace}")
        return await render(request, "thread.html", title=f"Thread {thread_id}", thread=found)

    async def allowlist(request: Request) -> Response:
        return await render(
            request, "allowlist.html", title="Allowlist", page=reads.allowlist_page(runtime)
        )

    async def limits(request: Request) -> Response:
        page = await reads.limits_page(runtime)
        return await render(request, "limits.html", title="Limits", page=page, live=True)

    async def health(request: Request) -> Response:
        page = await reads.health_page(runtime)
        banner.saw(page.problems)
        replayed = request.session.pop("replayed", None) if acting else None
        return await render(
            request, "health.html", title="Health", page=page, replayed=replayed, live=True
        )

    async def audit(request: Request) -> Response:
        held = (await index.refreshed()).workspaces()
        entries = await audit_trail(runtime.application.rules, limit=AUDIT_SHOWN, workspaces=held)
        return await render(request, "audit.html", title="Audit", entries=entries, live=True)

    async def login_form(request: Request) -> Response:
        return await login_page(request, next_path(request.query_params.get("next")))

    async def login_page(
        request: Request, after: str, *, status_code: int = 200, error: str | None = None
    ) -> Response:
        if not acting:
            return await render(request, "login.html", title="Log in", next=after, error=error)
        request.session.setdefault("csrf", new_csrf_token())
        return await render(
            request,
            "login.html",
            status_code=status_code,
            title="Log in",
            next=after,
            login_csrf=request.session["csrf"],
            error=error,
        )

    async def login(request: Request) -> Response:
        form = await checked_form(request)
        after = next_path(text(form, "next"))
        name = holder(tokens, text(form, "token"))
        if name is None:
            logger.warning("console login refused", client=client(request))
            return await login_page(
                request,
                after,
                status_code=403,
                error="That is not the console's token: try again.",
            )
        request.session.clear()
        request.session.update(
            {
                "ops": True,
                "csrf": new_csrf_token(),
                LOGGED_IN_AT: int(time.time()),
                "operator": name,
            }
        )
        logger.info("console login", client=client(request), operator=name)
        return RedirectResponse(after, status_code=303)

    async def logout(request: Request) -> Response:
        await checked_form(request)
        request.session.clear()
        return RedirectResponse("/", status_code=303)

    async def confirm_page(request: Request) -> Response:
        action = request.url.path.rsplit("/", 1)[1]
        run_id, workspace = run_named(request.query_params)
        found_run = await reads.run_page(runtime, run_id, workspace)
        if found_run is None:
            raise HTTPException(404, f"no run {run_id}")
        return await render(
            request,
            "confirm.html",
            title=f"{action.capitalize()} run {run_id}?",
            action=action,
            run=found_run.report.run,
            acknowledge=request.query_params.get("acknowledge") == "1",
        )

    async def retry_run(request: Request) -> Response:
        form, actor = await acting_form(request)
        run_id, workspace = run_named(form)
        results = await actions.retry_one(runtime, console.enqueue, run_id, workspace, actor=actor)
        return done(request, "Retry", actor, results, back=run_link(run_id, workspace))

    async def cancel_run(request: Request) -> Response:
        form, actor = await acting_form(request)
        run_id, workspace = run_named(form)
        reason = reason_of(form, default=None)
        results = await actions.cancel_one(runtime, run_id, workspace, reason=reason, actor=actor)
        return done(request, "Cancel", actor, results, back=run_link(run_id, workspace))

    async def skip_run(request: Request) -> Response:
        form, actor = await acting_form(request)
        run_id, workspace = run_named(form)
        reason = reason_of(form, default=None)
        results = await actions.skip_one(runtime, run_id, workspace, reason=reason, actor=actor)
        return done(request, "Skip", actor, results, back=run_link(run_id, workspace))

    async def preview_retry(request: Request) -> Response:
        query = RunQuery.parse(request.query_params, status="dead")
        preview = await actions.preview_retry(runtime, query, index)
        return await render(request, "preview.html", title="Retry dead runs", preview=preview)

    async def confirm_retry(request: Request) -> Response:
        form, actor = await acting_form(request)
        refs = [run_ref(value) for value in form.getlist("run") if isinstance(value, str)]
        if not refs:
            raise BadQuery("no run to retry: preview the dead runs again")
        query = RunQuery.parse(  # every field is read before any run is retried
            {
                k: v
                for k, v in form.items()
                if isinstance(v, str) and k in ("rule", "workspace", "since", "reason")
            },
            status="dead",
        )
        results = await actions.confirm_retry(runtime, console.enqueue, refs, actor=actor)
        return done(request, "Retry dead runs", actor, results, back=href("/runs", query.params()))

    async def preview_selected(request: Request) -> Response:
        action, refs = selected(request.query_params)
        selection = await actions.preview_selected(runtime, action, refs)
        title = f"{action.capitalize()} {len(refs)} selected run(s)?"
        back = list_of(came_from(request.headers.get("referer"), request.url.netloc, readable))
        return await render(request, "selected.html", title=title, selection=selection, back=back)

    async def act_on_selected(request: Request) -> Response:
        form, actor = await acting_form(request)
        action, refs = selected(form)
        reason = "" if action == "retry" else reason_of(form, default=None)
        results = await actions.act_on_selected(
            runtime, console.enqueue, action, refs, reason=reason, actor=actor
        )
        title = f"{action.capitalize()} selected runs"
        return done(request, title, actor, results, back=list_of(next_path(text(form, "back"))))

    async def replay_letters(request: Request) -> Response:
        form, actor = await acting_form(request)
        workspace = parse_workspace("workspace", text(form, "workspace"))
        ids = [
            parse_id("envelope", value)
            for value in form.getlist("envelope")
            if isinstance(value, str)
        ]
        replayed = await reads.replay(runtime, workspace, ids or None)
        logger.info(
            "console action",
            action="replay dead letters",
            workspace=str(workspace),
            bridged=len(replayed.bridged),
            failed=len(replayed.failed),
            operator=actor.name,
            client=client(request),
        )
        left = len(replayed.skipped) + len(replayed.not_found) + len(replayed.unknown)
        request.session["replayed"] = (
            f"{workspace}: {len(replayed.bridged)} bridged, {len(replayed.failed)} failed again, "
            f"{left} left waiting"
        )
        return RedirectResponse("/health#dead-letters", status_code=303)

    async def result(request: Request) -> Response:
        kept = outcomes.get(request.query_params.get("key", ""))
        if kept is None:
            raise HTTPException(
                404,
                "this action's result is no longer kept here (the console restarted, or "
                "another replica served the action): each run's page and the audit page say "
                "what was done",
            )
        states = await actions.current_states(runtime, kept.results)
        ongoing = any(row.status in ("pending", "running", "retrying") for row in states.values())
        return await render(
            request,
            "results.html",
            title=kept.action,
            outcome=kept,
            states=states,
            live=ongoing,
        )

    def done(
        request: Request, action: str, actor: UserActor, results: list[OperatorResult], *, back: str
    ) -> Response:
        logger.info(
            "console action",
            action=action,
            runs=[f"{result.workspace}/{result.run_id}" for result in results],
            done=sum(result.ok for result in results),
            refused=sum(not result.ok for result in results),
            operator=actor.name,
            client=client(request),
        )
        problem = not_enqueued(results, redact(runtime.settings.broker_url))
        key = outcomes.keep(actions.Outcome(action, actor.name or actor.id, results, problem, back))
        return RedirectResponse(href("/done", {"key": key}), status_code=303)

    async def bad_query(request: Request, error: Exception) -> Response:
        message = error.message if isinstance(error, BadQuery) else str(error)
        return await render(
            request, "error.html", status_code=400, title="Bad request", status=400, message=message
        )

    async def http_error(request: Request, error: Exception) -> Response:
        status = error.status_code if isinstance(error, HTTPException) else 500
        detail = error.detail if isinstance(error, HTTPException) else "internal error"
        return await render(
            request,
            "error.html",
            status_code=status,
            title=f"Error {status}",
            status=status,
            message=detail,
        )

    def guarded(endpoint: Endpoint) -> Endpoint:
        """``endpoint``, with any failure but a refusal shown as a page of its own (500), inside
        the middleware, so it carries the security headers as every page does."""

        async def guarded_endpoint(request: Request) -> Response:
            try:
                return await endpoint(request)
            except (HTTPException, BadQuery):
                raise
            except Exception as error:
                logger.exception("console page failed", path=request.url.path)
                message = (
                    f"the page failed ({type(error).__name__}); the console's log has the details"
                )
                return HTMLResponse(
                    pages.get_template("error.html").render(
                        access=access(request),
                        path=request.url.path,
                        here=back_here(request),
                        problems=[],
                        live=False,
                        can_be_live=False,
                        live_link="",
                        refresh_s=REFRESH_S,
                        as_of=datetime.now(UTC),
                        title="Error 500",
                        status=500,
                        message=message,
                    ),
                    status_code=500,
                )

        return guarded_endpoint

    pages_and_actions: list[tuple[str, Endpoint, str]] = [
        ("/", home, "GET"),
        ("/healthz", healthz, "GET"),
        ("/favicon.ico", favicon, "GET"),
        ("/runs", runs, "GET"),
        ("/run", run, "GET"),
        ("/search", find, "GET"),
        ("/event", event, "GET"),
        ("/thread", thread, "GET"),
        ("/allowlist", allowlist, "GET"),
        ("/limits", limits, "GET"),
        ("/health", health, "GET"),
        ("/audit", audit, "GET"),
        ("/login", login_form, "GET"),
        ("/login", login, "POST"),
        ("/logout", logout, "POST"),
        ("/run/retry", retry_run, "POST"),
        ("/run/cancel", confirm_page, "GET"),
        ("/run/cancel", cancel_run, "POST"),
        ("/run/skip", confirm_page, "GET"),
        ("/run/skip", skip_run, "POST"),
        ("/retry-dead", preview_retry, "GET"),
        ("/retry-dead", confirm_retry, "POST"),
        ("/runs/act", preview_selected, "GET"),
        ("/runs/act", act_on_selected, "POST"),
        ("/dead-letters/replay", replay_letters, "POST"),
        ("/done", result, "GET"),
    ]
    readable = frozenset(path for path, _, method in pages_and_actions if method == "GET")
    routes: list[BaseRoute] = [
        Route(path, guarded(endpoint), methods=[method])
        for path, endpoint, method in pages_and_actions
    ]
    routes.append(Mount("/static", StaticFiles(directory=STATIC), name="static"))
    middleware = [
        Middleware(SecurityHeaders, allowed_hosts=console.allowed_hosts),
        Middleware(BodyLimit),
    ]
    if acting:
        middleware.append(
            Middleware(
                SessionMiddleware,
                secret_key=session_secret(tokens),
                session_cookie=SESSION_COOKIE,
                max_age=SESSION_MAX_AGE_S,  # the cookie's; the login's own is LOGGED_IN_AT's
                same_site="strict",
                https_only=console.https_only,
            )
        )
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        BadQuery: bad_query,
        HTTPException: http_error,
    }

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        """Read every run into the index as the console starts, so the first page an operator
        opens does not wait for it (a page asked meanwhile waits for the read to end)."""
        loading = asyncio.create_task(_warm(index))
        try:
            yield
        finally:
            loading.cancel()

    return Starlette(
        routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan
    )


async def _warm(index: RunIndex) -> None:
    try:
        await index.refreshed()
    except Exception:  # the first page reads them, and says why it cannot
        logger.warning("the console could not read the runs at its start", exc_info=True)


AUDIT_SHOWN: Final = 200
"""How many operator actions the audit page shows, newest first."""


def _toggle_live(request: Request, paused: bool) -> str:
    """The link that pauses a live page (``live=0``) or resumes it."""
    params = {key: value for key, value in request.query_params.items() if key != "live"}
    if not paused:
        params["live"] = "0"
    return href(request.url.path, params)


def list_of(path: str) -> str:
    """``path`` when it is a page of the runs list, else the runs list: where an action on
    selected runs leads back to."""
    return path if path == "/runs" or path.startswith("/runs?") else "/runs"


def run_link(run_id: str, workspace: WorkspaceKey | None) -> str:
    return href("/run", {"id": run_id, "workspace": workspace})


def client(request: Request) -> str:
    """Who sent the request, for the log: its address and port."""
    if request.client is None:
        return "-"
    return f"{request.client.host}:{request.client.port}"
