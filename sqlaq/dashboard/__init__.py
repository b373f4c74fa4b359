"""A web dashboard for a sqlaq queue: look at it, and act on it.

Two ways to run it (both need ``pip install 'sqlaq[dashboard]'``):

* ``sqlaq dashboard --database-url ...`` serves it with uvicorn on 127.0.0.1:8000;
* :func:`app` returns an ASGI application for a host to mount in its own
  Starlette or FastAPI app (``app.mount("/queue", sqlaq.dashboard.app(engine,
  allowed_hosts=["queue.example.com"], auth=...))``), with the host's own
  authentication as its ``auth`` hook, or :func:`basic_auth`.

Who may reach it: it answers only requests whose ``Host`` header names one of its
host names (``localhost``, ``127.0.0.1`` and ``::1`` unless told others), so a page of
another site cannot reach it through DNS rebinding; with an ``auth`` hook, only
requests the hook lets through; and its actions only POSTs from its own pages (a
signed CSRF token, ``Origin`` and ``Sec-Fetch-Site`` checked, see
:mod:`sqlaq.dashboard.csrf`).

Pages: the overview (counts per queue, kind and status; per-queue depth, oldest due
job, expired leases and failures in the last hour; plots of throughput and wait time,
refreshed every few seconds from a JSON endpoint), the jobs list (the filters of
``sqlaq list``, paged by id), a job's page, failures grouped by kind and error, the
workers and per-kind limits in use, and the periodic schedules. Actions (not in
read-only mode): retry and cancel a job, retry a failure group, delete old finished jobs,
pause and resume a queue, through the same operations as the ``sqlaq`` command.

Libraries, each the common choice for its part and actively maintained: Starlette (the
ASGI toolkit FastAPI is built on: routing, forms, static files, a test client), Jinja2
(templates with autoescaping), uvicorn (the ASGI server), python-multipart (Starlette's
form parser) and uPlot (a 50 kB MIT-licensed chart library for time series, shipped in
``static/`` with its licence: nothing is fetched from a CDN).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sqlaq import migrations
from sqlaq.commandline import db_error
from sqlaq.dashboard import csrf, display
from sqlaq.dashboard.forms import BadInput
from sqlaq.dashboard.guard import LOCAL_HOSTS, Authenticate, Guard, basic_auth, trusted_hosts
from sqlaq.dashboard.views import Views
from sqlaq.errors import SchemaOutOfDateError
from sqlaq.registry import Registry
from sqlaq.worker.core import sync_engine

__all__ = [
    "DEFAULT_REFRESH",
    "LOCAL_HOSTS",
    "SECURITY_HEADERS",
    "Authenticate",
    "app",
    "basic_auth",
    "serve",
]

_HERE = Path(__file__).resolve().parent
#: Seconds between two refreshes of the overview.
DEFAULT_REFRESH = 5.0
#: Sent with every response: scripts, styles and forms from the dashboard only, no
#: framing (its buttons cannot be clicked through another site's page).
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}
#: SQLSTATEs naming a column, table or function the schema lacks.
_UNDEFINED = frozenset({"42703", "42P01", "42883"})


def app(
    engine: Any,
    *,
    read_only: bool = False,
    registry: Registry | None = None,
    refresh: float = DEFAULT_REFRESH,
    allowed_hosts: Sequence[str] | None = None,
    auth: Authenticate | None = None,
    csrf_secret: bytes | str | None = None,
) -> Starlette:
    """The dashboard as an ASGI application over *engine*'s sqlaq tables.

    It answers requests for its *allowed_hosts* only (any other ``Host`` gets a 400),
    and, with *auth*, only those the hook lets through: mounted in a host's app, give
    it the host's authentication (or :func:`basic_auth`); without, it checks nobody.

    Args:
        engine: A SQLAlchemy Engine (an ``AsyncEngine`` works too: the dashboard then
            opens an Engine of its own on the same URL with psycopg).
        read_only: Hide the action buttons and refuse every action (403).
        registry: The workers' :class:`~sqlaq.Registry`, if the host has it: the
            workers page then shows each kind's limits, and the schedules page each
            schedule's next slot.
        refresh: Seconds between two refreshes of the overview.
        allowed_hosts: The host names (or addresses) it is served under, matched
            against each request's ``Host`` header; default :data:`LOCAL_HOSTS`.
            ``*.example.com`` takes any subdomain; ``["*"]`` turns the check off (for
            a host app that checks ``Host`` itself).
        auth: Called with every request first (static files included): returns None
            to let it through, or the response to answer instead; a coroutine
            function works too. :func:`basic_auth` is one.
        csrf_secret: The key signing the CSRF tokens (at least 16 bytes). Default: a
            random one per call, so tokens are good for this process only; give every
            process serving the same dashboard the same secret.

    Returns:
        A Starlette application.

    Raises:
        ConfigError: a bad host name, or a CSRF secret shorter than 16 bytes.
    """
    hosts = trusted_hosts(LOCAL_HOSTS if allowed_hosts is None else allowed_hosts)
    tokens = csrf.Tokens(csrf_secret)
    own = sync_engine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(application: Starlette) -> AsyncIterator[None]:
        yield
        if own is not engine:  # opened here for an AsyncEngine: closed here
            own.dispose()

    views = Views(
        own,
        _templates(),
        read_only=read_only,
        registry=registry,
        refresh=refresh,
        tokens=tokens,
    )
    routes = [
        Route("/", views.overview, name="overview"),
        Route("/api/overview", views.overview_api, name="overview_api"),
        Route("/jobs", views.jobs, name="jobs"),
        Route("/jobs/{job_id}", views.job, name="job"),
        Route("/jobs/{job_id}/raw/{field:str}", views.job_value, name="job_value"),
        Route("/jobs/{job_id}/{verb:str}", views.job_action, methods=["POST"], name="job_action"),
        Route("/queues/{verb:str}", views.queue_action, methods=["POST"], name="queue_action"),
        Route("/failures", views.failures, name="failures"),
        Route("/failures/retry", views.retry_group, methods=["GET", "POST"], name="retry_group"),
        Route("/prune", views.prune, methods=["GET", "POST"], name="prune"),
        Route("/workers", views.workers, name="workers"),
        Route("/schedules", views.schedules, name="schedules"),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    handlers = _error_handlers(views)
    return Starlette(
        routes=routes,
        exception_handlers=handlers,
        middleware=[
            Middleware(_Headers),
            Middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False),
            *([Middleware(Guard, auth=auth)] if auth is not None else []),
        ],
        lifespan=lifespan,
    )


def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    read_only: bool = False,
    log_level: str = "info",
    allowed_hosts: Sequence[str] | None = None,
    auth: Authenticate | None = None,
) -> None:
    """Serve :func:`app` with uvicorn until SIGINT or SIGTERM (``sqlaq dashboard``), then
    return: a stop is a clean exit, as for ``sqlaq-worker``.

    *allowed_hosts* and *auth* are :func:`app`'s."""
    import uvicorn

    application = app(engine, read_only=read_only, allowed_hosts=allowed_hosts, auth=auth)
    config = uvicorn.Config(application, host=host, port=port, log_level=log_level)
    # uvicorn stops on SIGINT or SIGTERM, then raises the signal again for the handler it
    # found in place: a quiet one here, so the process neither dies of the signal nor
    # prints a KeyboardInterrupt traceback.
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, _stopped) for sig in stops}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stopped(signum: int, frame: FrameType | None) -> None:
    """The handler uvicorn hands a stop signal back to: nothing more to do."""


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=True,  # every value is escaped: payloads and errors are shown as text
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(display.FILTERS)
    return Jinja2Templates(env=env)


def _error_handlers(views: Views) -> dict[Any, Any]:
    """One page for each way a request can fail, never a traceback."""

    def page(
        request: Request, status: int, title: str, message: str, template: str = "error.html"
    ) -> Response:
        if request.url.path.startswith(request.scope.get("root_path", "") + "/api/"):
            return JSONResponse({"error": message}, status_code=status)
        context = {"title": title, "message": message, "head": migrations.HEAD}
        return views.render(request, template, context, status=status)

    async def bad_input(request: Request, exc: Exception) -> Response:
        return page(request, 400, "Bad request", str(exc))

    async def forbidden(request: Request, exc: Exception) -> Response:
        return page(request, 403, "Forbidden", str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "error"
        return page(request, status, f"{status}", str(detail))

    async def schema(request: Request, exc: Exception) -> Response:
        views.schema_checked = False
        return page(request, 503, "Schema not ready", str(exc), "schema.html")

    async def database(request: Request, exc: Exception) -> Response:
        if isinstance(exc, sa_exc.DBAPIError):
            if getattr(exc.orig, "sqlstate", None) in _UNDEFINED:
                views.schema_checked = False  # check again: is the schema behind?
                try:
                    await views.ensure_schema()
                except SchemaOutOfDateError as out_of_date:
                    return await schema(request, out_of_date)
                except sa_exc.DBAPIError:
                    pass
            message = f"database error: {db_error(exc)}"
        else:
            message = "database error"
        return page(request, 503, "Database unavailable", message)

    return {
        BadInput: bad_input,
        csrf.CsrfError: forbidden,
        HTTPException: http_error,
        SchemaOutOfDateError: schema,
        sa_exc.DBAPIError: database,
    }


class _Headers:
    """ASGI middleware adding :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.extend((k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items())
                message["headers"] = headers
            await send(message)

        await self.inner(scope, receive, with_headers)
