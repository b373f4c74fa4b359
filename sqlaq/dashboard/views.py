"""The dashboard's pages and actions: Starlette endpoints over :mod:`.reads`,
:mod:`.actions` and :mod:`.forms`.

Each endpoint reads its input (a bad value raises :class:`~.forms.BadInput`, a 400),
runs its database work in a worker thread (SQLAlchemy's engine is synchronous) and
renders a Jinja2 template with autoescaping on, so a payload or an error holding
``<script>`` is shown as text. Actions are POSTs that pass the CSRF check and are
refused (403) in read-only mode; bulk ones need ``confirm=yes``, which only their
confirmation page sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from sqlaq import migrations, queries
from sqlaq.dashboard import actions, csrf, forms, reads
from sqlaq.records import RetryResult
from sqlaq.registry import Registry

__all__ = ["NOTICES", "Views"]

T = TypeVar("T")

#: The notices a redirect after an action may show (by code: never text from the URL).
NOTICES = {
    "retried": "Job queued again.",
    "not-retried": "Nothing to retry: the job is not failed or cancelled any more.",
    "key-taken": "Not retried: another pending job holds its dedupe or debounce key; "
    "retry it once that job has finished.",
    "cancelled": "Job cancelled.",
    "paused": "Queue paused: no worker claims its jobs until it is resumed.",
    "not-paused": "The queue was paused already.",
    "resumed": "Queue resumed.",
    "not-resumed": "The queue was not paused.",
    "not-cancelled": "Nothing to cancel: the job is no longer queued or running.",
}


_JOB_ACTIONS = {"retry": actions.retry_job, "cancel": actions.cancel_job}


class Views:
    """The endpoints of one dashboard, bound to its engine and options."""

    def __init__(
        self,
        engine: Engine,
        templates: Jinja2Templates,
        *,
        read_only: bool,
        registry: Registry | None,
        refresh: float,
        tokens: csrf.Tokens,
    ) -> None:
        self.engine = engine
        self.templates = templates
        self.read_only = read_only
        self.registry = registry
        self.refresh = refresh
        self.tokens = tokens
        self.schema_checked = False

    # -- plumbing --------------------------------------------------------------------

    async def ensure_schema(self) -> None:
        """Check the schema (once) before an action writes."""
        await self.read(lambda conn: None)

    async def read(self, work: Callable[[Connection], T]) -> T:
        """Run *work* on a connection in a worker thread, once the schema is known to
        be at sqlaq's head (checked on the first read, and after an error naming a
        missing column or table)."""

        def run() -> T:
            with self.engine.connect() as conn:
                if not self.schema_checked:
                    migrations.check(conn)  # SchemaOutOfDateError: the schema page
                    self.schema_checked = True
                return work(conn)

        return await run_in_threadpool(run)

    def render(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        """Render template *name*; give the browser a CSRF token if it has none (or
        one the dashboard did not issue)."""
        token = self.tokens.issue(request)
        values = {
            "read_only": self.read_only,
            "csrf_field": csrf.FIELD,
            "csrf_token": token,
            "page": name.removesuffix(".html"),
            "path": lambda route, query="", **params: path_for(request, route, query, **params),
            **context,
        }
        response = self.templates.TemplateResponse(request, name, values, status_code=status)
        if request.cookies.get(csrf.COOKIE) != token:
            csrf.set_cookie(response, request, token)
        return response

    async def action_form(self, request: Request) -> FormData:
        """The form of an action, once it may run: not read-only, CSRF token good.

        Raises:
            HTTPException: 403 in read-only mode.
            CsrfError: the token is missing or wrong (a 403 too).
        """
        if self.read_only:
            raise HTTPException(403, "this dashboard is read-only: actions are turned off")
        form = await request.form()
        self.tokens.check(request, form.get(csrf.FIELD))
        return form

    def redirect(self, request: Request, name: str, query: str = "", **params: Any) -> Response:
        """A 303 to page *name* (after a POST: a reload does not repeat the action)."""
        return RedirectResponse(path_for(request, name, query, **params), status_code=303)

    # -- pages -----------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        """``GET /``: counts, queue health and the plots; refreshes itself."""
        hours = forms.hours(request.query_params)
        data = await self.read(lambda conn: reads.overview(conn, hours))
        notice = NOTICES.get(request.query_params.get("did", ""))
        return self.render(
            request,
            "overview.html",
            {
                "ov": data,
                "windows": list(reads.WINDOWS),
                "refresh": self.refresh,
                "notice": notice,
            },
        )

    async def overview_api(self, request: Request) -> Response:
        """``GET /api/overview``: the overview's plot data and tables (HTML), as JSON."""
        hours = forms.hours(request.query_params)
        data = await self.read(lambda conn: reads.overview(conn, hours))
        token = self.tokens.issue(request)
        tables = self.templates.get_template("_overview_tables.html").render(
            ov=data,
            read_only=self.read_only,
            csrf_field=csrf.FIELD,
            csrf_token=token,
            path=lambda route, query="", **params: path_for(request, route, query, **params),
        )
        response = JSONResponse({**data.series(), "tables": tables})
        if request.cookies.get(csrf.COOKIE) != token:
            csrf.set_cookie(response, request, token)
        return response

    async def jobs(self, request: Request) -> Response:
        """``GET /jobs``: the filters of ``sqlaq list``, paged by id."""
        f = forms.job_filter(request.query_params)
        found = await self.read(
            lambda conn: reads.jobs_page(
                conn,
                statuses=f.statuses,
                kind=f.kind,
                queue=f.queue,
                since=f.since,
                limit=f.limit,
                before=f.before,
                after=f.after,
            )
        )
        return self.render(
            request, "jobs.html", {"f": f, "found": found, "statuses": reads.STATUSES}
        )

    async def job(self, request: Request) -> Response:
        """``GET /jobs/{job_id}``: its columns; its payload, result and error up to
        :data:`~.reads.SHOWN` characters each, with a link to download the whole."""
        job_id = forms.job_id(request.path_params["job_id"])
        data = await self.read(lambda conn: reads.job(conn, job_id))
        if data is None:
            raise HTTPException(404, f"no job {job_id}")
        notice = NOTICES.get(request.query_params.get("did", ""))
        return self.render(
            request, "job.html", {"job": data, "notice": notice, "shown": reads.SHOWN}
        )

    async def job_value(self, request: Request) -> Response:
        """``GET /jobs/{job_id}/raw/{payload|result|last_error}``: the whole value, as
        a download (JSON text, or the error as plain text)."""
        job_id = forms.job_id(request.path_params["job_id"])
        name = request.path_params["field"]
        if name not in queries.LARGE_VALUES:
            raise HTTPException(404, f"no value {name!r}: {', '.join(queries.LARGE_VALUES)}")
        row = await self.read(lambda conn: reads.job_value(conn, job_id, name))
        if row is None:
            raise HTTPException(404, f"no job {job_id}")
        if row.value is None:
            raise HTTPException(404, f"job {job_id} has no {name.replace('_', ' ')}")
        is_json = name != "last_error"
        filename = f"job-{job_id}-{name.replace('_', '-')}.{'json' if is_json else 'txt'}"
        return Response(
            row.value,
            media_type="application/json" if is_json else "text/plain; charset=utf-8",
            headers={"content-disposition": f'attachment; filename="{filename}"'},
        )

    async def failures(self, request: Request) -> Response:
        """``GET /failures``: failed jobs grouped by kind and first error line."""
        since = forms.failures_since(request.query_params)
        groups = await self.read(lambda conn: reads.failure_groups(conn, since=since))
        return self.render(
            request,
            "failures.html",
            {"groups": groups, "since": since, "since_text": request.query_params.get("since")},
        )

    async def workers(self, request: Request) -> Response:
        """``GET /workers``: concurrency in use per kind, workers holding jobs, rates."""
        data = await self.read(lambda conn: reads.workers(conn, self.registry))
        return self.render(
            request,
            "workers.html",
            {
                "w": data,
                "has_registry": self.registry is not None,
                "busiest_keys": queries.BUSIEST_KEYS,
            },
        )

    async def schedules(self, request: Request) -> Response:
        """``GET /schedules``: periodic jobs, their last slot (and next, with a registry)."""
        data = await self.read(lambda conn: reads.schedules(conn, self.registry))
        return self.render(
            request,
            "schedules.html",
            {"schedules": data, "has_registry": self.registry is not None},
        )

    # -- actions ---------------------------------------------------------------------

    async def job_action(self, request: Request) -> Response:
        """``POST /jobs/{job_id}/retry`` and ``/cancel``: one job, then back to its page."""
        job_id = forms.job_id(request.path_params["job_id"])
        verb = request.path_params["verb"]
        act = _JOB_ACTIONS.get(verb)
        if act is None:
            raise HTTPException(404, f"no action {verb!r}: retry or cancel")
        await self.action_form(request)
        await self.ensure_schema()
        changed = await run_in_threadpool(act, self.engine, job_id)
        did = {"retry": "retried", "cancel": "cancelled"}[verb]
        did = did if changed else "not-" + did
        if isinstance(changed, RetryResult) and changed.skipped:
            did = "key-taken"
        return self.redirect(request, "job", f"did={did}", job_id=job_id)

    async def queue_action(self, request: Request) -> Response:
        """``POST /queues/pause`` and ``/resume`` (form field ``queue``), then back to
        the overview."""
        verb = request.path_params["verb"]
        if verb not in ("pause", "resume"):
            raise HTTPException(404, f"no action {verb!r}: pause or resume")
        form = await self.action_form(request)
        queue = forms.queue_name(form)
        await self.ensure_schema()
        if verb == "pause":
            who = f"dashboard@{request.client.host}" if request.client else "dashboard"
            changed = await run_in_threadpool(
                lambda: actions.pause_queue(self.engine, queue, by=who)
            )
        else:
            changed = await run_in_threadpool(actions.resume_queue, self.engine, queue)
        did = {"pause": "paused", "resume": "resumed"}[verb]
        return self.redirect(request, "overview", f"did={did if changed else 'not-' + did}")

    async def retry_group(self, request: Request) -> Response:
        """``GET /failures/retry``: confirm; ``POST``: retry every job of the group."""
        if request.method == "GET":
            group = forms.failure_group(request.query_params)
            rows = await self.read(
                lambda conn: reads.failure_groups(
                    conn, since=group.since, kind=group.kind, error=group.error
                )
            )
            return self.render(
                request, "confirm_retry.html", {"group": group, "row": rows[0] if rows else None}
            )
        form = await self.action_form(request)
        group = forms.failure_group(form)
        if not forms.confirmed(form):
            raise forms.BadInput("confirm: a bulk retry needs confirm=yes (its confirmation page)")
        await self.ensure_schema()
        done = await run_in_threadpool(
            lambda: actions.retry_group(
                self.engine, kind=group.kind, error=group.error, since=group.since
            )
        )
        return self.render(
            request, "done.html", {"verb": "retried", "done": done, "back": "failures"}
        )

    async def prune(self, request: Request) -> Response:
        """``GET /prune``: how many finished jobs would go; ``POST``: delete them."""
        if request.method == "GET":
            ages = forms.prune_ages(request.query_params)
            await self.ensure_schema()
            counts = await run_in_threadpool(actions.count_prunable, self.engine, ages)
            return self.render(request, "prune.html", {"ages": ages, "counts": counts})
        form = await self.action_form(request)
        ages = forms.prune_ages(form)
        if not forms.confirmed(form):
            raise forms.BadInput("confirm: deleting jobs needs confirm=yes (the form's button)")
        await self.ensure_schema()
        done = await run_in_threadpool(actions.prune, self.engine, ages)
        return self.render(request, "done.html", {"verb": "deleted", "done": done, "back": "prune"})


def path_for(request: Request, name: str, query: str = "", **params: Any) -> str:
    """The path of the dashboard's route *name*, under the dashboard's mount point (a
    host's ``Mount("/queue", ...)`` gives ``/queue/jobs``), with *query* appended.

    Built from the dashboard's own routes: ``request.url_for`` would look *name* up in
    the host's router, which knows the dashboard's routes only by a prefixed name.
    """
    own = request.app.url_path_for(name, **params)  # the dashboard's Starlette app
    path = request.scope.get("root_path", "") + str(own)
    return f"{path}?{query}" if query else path
