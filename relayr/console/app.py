"""The console's ASGI app: server-rendered pages over the runtime, and the actions' POSTs.

:func:`create_app` builds a Starlette app on a :class:`Console` (the process's one runtime, the
enqueue ``relayr runs retry`` uses, the host names it answers to). Pages read
(:mod:`relayr.console.reads`); actions (:mod:`relayr.console.actions`) need a logged-in session
and a POST with its CSRF token (:mod:`relayr.console.security`, ADR-0070). Pages: ``/runs``,
``/run``, ``/thread``, ``/allowlist``, ``/health``, ``/retry-dead``, ``/login``, ``/logout``, and
``/healthz`` for probes.
"""

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import structlog
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from relayr.ledger.port import WorkspaceKey
from relayr.ops.rows import AmbiguousRun
from relayr.ops.runs import EnqueueRun, OperatorResult, not_enqueued
from relayr.runtime.process import Runtime
from relayr.settings import redact

from . import actions, reads
from .forms import (
    MAX_FIELD_BYTES,
    MAX_FORM_FIELDS,
    next_path,
    reason_of,
    run_named,
    run_ref,
    text,
)
from .queries import BadQuery, RunQuery, href, parse_id, parse_workspace
from .rendering import STATIC, templates
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
    """

    runtime: Runtime
    enqueue: EnqueueRun
    allowed_hosts: frozenset[str] | None = field(default_factory=frozenset)
    https_only: bool = False

    @property
    def token(self) -> str | None:
        secret = self.runtime.settings.console_token
        return None if secret is None else secret.get_secret_value()


def create_app(console: Console) -> Starlette:
    """The console's app on ``console``'s runtime."""
    pages = templates()
    runtime = console.runtime
    token = console.token

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
        if token is None:
            return {"mode": "read-only", "can_act": False, "csrf": ""}
        if logged_in(request):
            return {"mode": "ops", "can_act": True, "csrf": request.session["csrf"]}
        return {"mode": "visitor", "can_act": False, "csrf": ""}

    def render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        url = request.url
        here = f"{url.path}?{url.query}" if url.query and request.method == "GET" else url.path
        page = pages.get_template(name).render(
            access=access(request), path=url.path, here=here, **context
        )
        return HTMLResponse(page, status_code=status_code)

    async def checked_form(request: Request) -> FormData:
        """The POST's form, once it is known to come from this console's own page."""
        if token is None:
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

    async def acting_form(request: Request) -> FormData:
        """:func:`checked_form`, for a logged-in session only."""
        form = await checked_form(request)
        if not logged_in(request):
            raise HTTPException(403, "refused: log in with the console's token to act")
        return form

    async def home(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=303)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def runs(request: Request) -> Response:
        query = RunQuery.parse(request.query_params)
        page = await reads.runs_page(runtime, query)
        return render(request, "runs.html", title="Runs", page=page)

    async def run(request: Request) -> Response:
        run_id, workspace = run_named(request.query_params)
        try:
            found = await reads.run_page(runtime, run_id, workspace)
        except AmbiguousRun as error:
            raise HTTPException(400, str(error)) from None
        if found is None:
            where = f" in {workspace}" if workspace else ""
            raise HTTPException(404, f"no run {run_id}{where}")
        return render(
            request,
            "run.html",
            title=f"Run {run_id}",
            page=found,
            now=runtime.application.rules.clock(),
        )

    async def thread(request: Request) -> Response:
        params = request.query_params
        workspace = parse_workspace("workspace", params.get("workspace", ""))
        thread_id = parse_id("id", params.get("id", ""))
        found = await reads.thread_page(runtime, workspace, thread_id)
        if found is None:
            raise HTTPException(404, f"thread {thread_id} does not exist in {workspace}")
        return render(request, "thread.html", title=f"Thread {thread_id}", thread=found)

    async def allowlist(request: Request) -> Response:
        return render(
            request, "allowlist.html", title="Allowlist", page=reads.allowlist_page(runtime)
        )

    async def health(request: Request) -> Response:
        page = await reads.health_page(runtime)
        return render(request, "health.html", title="Health", page=page, now=datetime.now(UTC))

    async def login_form(request: Request) -> Response:
        if token is None:
            return render(
                request,
                "login.html",
                title="Log in",
                next=next_path(request.query_params.get("next")),
            )
        request.session.setdefault("csrf", new_csrf_token())
        return render(
            request,
            "login.html",
            title="Log in",
            next=next_path(request.query_params.get("next")),
            login_csrf=request.session["csrf"],
        )

    async def login(request: Request) -> Response:
        form = await checked_form(request)
        if not same_secret(text(form, "token"), token):
            logger.warning("console login refused", client=client(request))
            raise HTTPException(403, "refused: that is not the console's token")
        request.session.clear()
        request.session.update(
            {"ops": True, "csrf": new_csrf_token(), LOGGED_IN_AT: int(time.time())}
        )
        logger.info("console login", client=client(request))
        return RedirectResponse(next_path(text(form, "next")), status_code=303)

    async def logout(request: Request) -> Response:
        await checked_form(request)
        request.session.clear()
        return RedirectResponse("/runs", status_code=303)

    async def retry_run(request: Request) -> Response:
        form = await acting_form(request)
        run_id, workspace = run_named(form)
        results = await actions.retry_one(runtime, console.enqueue, run_id, workspace)
        return done(request, "Retry", results, back=run_link(run_id, workspace))

    async def cancel_run(request: Request) -> Response:
        form = await acting_form(request)
        run_id, workspace = run_named(form)
        reason = reason_of(form, default=actions.DEFAULT_CANCEL_REASON)
        results = await actions.cancel_one(runtime, run_id, workspace, reason=reason)
        return done(request, "Cancel", results, back=run_link(run_id, workspace))

    async def skip_run(request: Request) -> Response:
        form = await acting_form(request)
        run_id, workspace = run_named(form)
        reason = reason_of(form, default=None)
        results = await actions.skip_one(runtime, run_id, workspace, reason=reason)
        return done(request, "Skip", results, back=run_link(run_id, workspace))

    async def preview_retry(request: Request) -> Response:
        query = RunQuery.parse(request.query_params, status="dead")
        preview = await actions.preview_retry(runtime, console.enqueue, query)
        return render(request, "preview.html", title="Retry dead runs", preview=preview)

    async def confirm_retry(request: Request) -> Response:
        form = await acting_form(request)
        refs = [run_ref(value) for value in form.getlist("run") if isinstance(value, str)]
        if not refs:
            raise BadQuery("no run to retry: preview the dead runs again")
        query = RunQuery.parse(  # every field is read before any run is retried
            {
                k: v
                for k, v in form.items()
                if isinstance(v, str) and k in ("rule", "workspace", "since")
            },
            status="dead",
        )
        results = await actions.confirm_retry(runtime, console.enqueue, refs)
        return done(request, "Retry dead runs", results, back=href("/runs", query.params()))

    def done(
        request: Request, action: str, results: list[OperatorResult], *, back: str
    ) -> Response:
        logger.info(
            "console action",
            action=action,
            runs=[f"{result.workspace}/{result.run_id}" for result in results],
            done=sum(result.ok for result in results),
            refused=sum(not result.ok for result in results),
            client=client(request),
        )
        problem = not_enqueued(results, redact(runtime.settings.broker_url))
        return render(
            request,
            "results.html",
            title=action,
            action=action,
            results=results,
            problem=problem,
            back=back,
        )

    async def bad_query(request: Request, error: Exception) -> Response:
        message = error.message if isinstance(error, BadQuery) else str(error)
        return render(
            request, "error.html", status_code=400, title="Bad request", status=400, message=message
        )

    async def http_error(request: Request, error: Exception) -> Response:
        status = error.status_code if isinstance(error, HTTPException) else 500
        detail = error.detail if isinstance(error, HTTPException) else "internal error"
        return render(
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
                return render(
                    request,
                    "error.html",
                    status_code=500,
                    title="Error 500",
                    status=500,
                    message=message,
                )

        return guarded_endpoint

    pages_and_actions: list[tuple[str, Endpoint, str]] = [
        ("/", home, "GET"),
        ("/healthz", healthz, "GET"),
        ("/runs", runs, "GET"),
        ("/run", run, "GET"),
        ("/thread", thread, "GET"),
        ("/allowlist", allowlist, "GET"),
        ("/health", health, "GET"),
        ("/login", login_form, "GET"),
        ("/login", login, "POST"),
        ("/logout", logout, "POST"),
        ("/run/retry", retry_run, "POST"),
        ("/run/cancel", cancel_run, "POST"),
        ("/run/skip", skip_run, "POST"),
        ("/retry-dead", preview_retry, "GET"),
        ("/retry-dead", confirm_retry, "POST"),
    ]
    routes: list[BaseRoute] = [
        Route(path, guarded(endpoint), methods=[method])
        for path, endpoint, method in pages_and_actions
    ]
    routes.append(Mount("/static", StaticFiles(directory=STATIC), name="static"))
    middleware = [
        Middleware(SecurityHeaders, allowed_hosts=console.allowed_hosts),
        Middleware(BodyLimit),
    ]
    if token is not None:
        middleware.append(
            Middleware(
                SessionMiddleware,
                secret_key=session_secret(token),
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
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


def run_link(run_id: str, workspace: WorkspaceKey | None) -> str:
    return href("/run", {"id": run_id, "workspace": workspace})


def client(request: Request) -> str:
    """Who sent the request, for the log: its address and port."""
    if request.client is None:
        return "-"
    return f"{request.client.host}:{request.client.port}"
