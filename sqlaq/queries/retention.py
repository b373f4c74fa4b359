"""Retention: retry, cancel, prune and sweep: what becomes of jobs after (or instead
of) running, and the upkeep of ``unique_for`` holds."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    ColumnElement,
    Delete,
    Integer,
    Interval,
    Select,
    SmallInteger,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    column,
    delete,
    exists,
    func,
    literal_column,
    null,
    or_,
    select,
    table,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, REGCLASS
from sqlalchemy.sql.dml import ReturningDelete

from sqlaq.queries._common import (
    _FINISHED,
    _IDS,
    _NOW,
    _PENDING,
    _RUNNING,
    _expired_error,
    _status,
    c,
)
from sqlaq.queries._graph import in_unfinished_workflow, workflow_cte
from sqlaq.schema import (
    CANCEL_CHANNEL,
    JobStatus,
    jobs,
    unique_holds,
)


def retry_stmt(*, job_ids: Collection[int], queue: str | None = None) -> Select[Any]:
    """Queue failed or cancelled jobs again, due now, with a fresh set of attempts, but
    never two jobs of one key: select ``id, retried, dedupe_key, dedupe_holder,
    debounce_key, debounce_holder`` for each job retried or left for its key.

    Renders::

        WITH picked AS MATERIALIZED (
            SELECT id, kind, dedupe_key,
                CASE WHEN attempted_at IS NULL THEN debounce_key END AS debounce_key
            FROM sqlaq_jobs WHERE id = ANY(:b_ids) AND status IN ('failed', 'cancelled')
            ORDER BY id FOR UPDATE),
        ranked AS (
            SELECT id, dedupe_key, debounce_key,
                CASE WHEN dedupe_key IS NOT NULL THEN coalesce(
                    (SELECT min(id) FROM sqlaq_jobs AS twin WHERE <a pending job of
                        the same kind and dedupe_key, not this one>),
                    nullif(min(id) OVER (PARTITION BY kind, dedupe_key), id))
                END AS dedupe_holder,
                CASE WHEN debounce_key IS NOT NULL THEN coalesce(
                    (<a never-started queued job of the same kind and debounce_key>),
                    nullif(min(id) OVER (PARTITION BY kind, debounce_key), id))
                END AS debounce_holder
            FROM picked),
        retried AS (
            UPDATE sqlaq_jobs SET status = 'queued', run_at = now(), attempts = 0,
                finished_at = NULL, locked_by = NULL, lease_token = NULL
            FROM ranked WHERE sqlaq_jobs.id = ranked.id
                AND dedupe_holder IS NULL AND debounce_holder IS NULL
            RETURNING sqlaq_jobs.id)
        SELECT ranked.id, retried.id IS NOT NULL AS retried, dedupe_key, dedupe_holder,
            debounce_key, debounce_holder
        FROM ranked LEFT JOIN retried ON retried.id = ranked.id
        WHERE retried.id IS NOT NULL OR dedupe_holder IS NOT NULL
            OR debounce_holder IS NOT NULL
        ORDER BY ranked.id

    The keys a retry can collide on are those of the unique indexes: ``(kind,
    dedupe_key)`` among pending (queued or running) jobs, and ``(kind, debounce_key)``
    among never-started queued jobs (a job that has started once is out of that index
    for good, so its debounce key is NULL in ``picked``). A job whose key a pending job
    holds is left alone and named with that job (its *holder*); among the jobs of one
    key in the call, the lowest id is retried and the others name it. ``last_error`` is
    kept as history. ``unique_for`` holds are not consulted: a retry queues the same job
    again, it does not enqueue a new one.

    With *queue* (a job table distributed on Citus by queue): only the jobs of that queue,
    and their keys' holders in it (the unique indexes lead with ``queue`` there), every
    reference to the table pinned to ``queue = :b_queue``: one shard's statement.

    The holders are read from the statement's snapshot: a job enqueued with the key
    after it began still makes the UPDATE fail with a unique violation
    (:func:`sqlaq.retry` runs it in a savepoint and falls back to one job at a time).
    """
    ids = bindparam("b_ids", list(job_ids), _IDS)
    twin = jobs.alias("twin")
    # On Citus (see sqlaq.queries.citus): the jobs of one queue, their keys' holders in
    # that queue (the unique indexes lead with queue there), every reference pinned.
    queue_ = bindparam("b_queue", queue, Text)
    mine, twins = ([c.queue == queue_], [twin.c.queue == queue_]) if queue is not None else ([], [])
    picked = (
        select(
            c.id,
            c.kind,
            c.dedupe_key,
            case((c.attempted_at.is_(None), c.debounce_key)).label("debounce_key"),
        )
        .where(
            *mine,
            c.id == func.any(ids),
            c.status.in_([_status(JobStatus.FAILED), _status(JobStatus.CANCELLED)]),
        )
        .order_by(c.id)
        .with_for_update()
        .cte("picked")
        .prefix_with("MATERIALIZED")
    )
    p = picked.c
    dedupe_twin = (
        select(func.min(twin.c.id))
        .where(
            *twins,
            twin.c.kind == p.kind,
            twin.c.dedupe_key == p.dedupe_key,
            twin.c.status.in_([_status(JobStatus.QUEUED), _status(JobStatus.RUNNING)]),
            twin.c.id != p.id,
        )
        .scalar_subquery()
    )
    debounce_twin = (
        select(func.min(twin.c.id))
        .where(
            *twins,
            twin.c.kind == p.kind,
            twin.c.debounce_key == p.debounce_key,
            twin.c.status == _status(JobStatus.QUEUED),
            twin.c.attempted_at.is_(None),
            twin.c.id != p.id,
        )
        .scalar_subquery()
    )

    def holder(key: Any, live: Any) -> Any:
        first = func.min(p.id).over(partition_by=[p.kind, key])
        return case((key.is_not(None), func.coalesce(live, func.nullif(first, p.id))))

    ranked = select(
        p.id,
        p.dedupe_key,
        holder(p.dedupe_key, dedupe_twin).label("dedupe_holder"),
        p.debounce_key,
        holder(p.debounce_key, debounce_twin).label("debounce_holder"),
    ).cte("ranked")
    r = ranked.c
    retried = (
        update(jobs)
        .where(*mine, c.id == r.id, r.dedupe_holder.is_(None), r.debounce_holder.is_(None))
        .values(
            status=_status(JobStatus.QUEUED),
            run_at=_NOW,
            attempts=literal_column("0", Integer),
            finished_at=null(),
            locked_by=null(),
            lease_token=null(),
        )
        .returning(c.id)
        .cte("retried")
    )
    done = retried.c.id.is_not(None)
    return (
        select(
            r.id,
            done.label("retried"),
            r.dedupe_key,
            r.dedupe_holder,
            r.debounce_key,
            r.debounce_holder,
        )
        .select_from(ranked.outerjoin(retried, retried.c.id == r.id))
        .where(or_(done, r.dedupe_holder.is_not(None), r.debounce_holder.is_not(None)))
        .order_by(r.id)
    )


def cancel_stmt(*, job_ids: Collection[int]) -> Select[Any]:
    """Cancel pending (queued or running) jobs; tell the workers running them.

    Renders::

        WITH was AS MATERIALIZED (
            SELECT id, status FROM sqlaq_jobs
            WHERE id = ANY(:b_ids) AND status IN ('queued', 'running') FOR UPDATE),
        cancelled AS (
            UPDATE sqlaq_jobs SET status = 'cancelled', finished_at = now(),
                lease_token = NULL
            FROM was WHERE sqlaq_jobs.id = was.id RETURNING sqlaq_jobs.id, was.status)
        SELECT id, CASE WHEN status = 'running'
            THEN pg_notify('sqlaq_cancel', id::text) END FROM cancelled

    A running job's holder loses its lease: its complete, fail and extend change nothing
    afterwards, so no result is written over the cancel. The notification (sent on
    commit) tells that worker at once; its heartbeat finds the lost lease anyway. The
    locking CTE reads each row's latest status, so a job claimed meanwhile is known to
    be running.
    """
    return _cancel(c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)))


def cancel_workflow_stmt(*, job_id: int) -> Select[Any]:
    """Cancel every pending job of *job_id*'s workflow (see :func:`cancel_stmt`).

    :func:`cancel_stmt` over ``id IN (SELECT id FROM workflow)``, the walk of
    :func:`~sqlaq.queries.workflow_cte` from *job_id* (its parents and children, in
    either direction, to the end): a chain, a chord or a batch is cancelled whole from
    any of its jobs, its members too. Its finished jobs are left alone. One statement:
    the trigger of a cancelled parent finds its children cancelled already.
    """
    walk = workflow_cte(job_id=job_id)
    return _cancel(c.id.in_(select(walk.c.id)))


def _cancel(which: ColumnElement[bool]) -> Select[Any]:
    was = (
        select(c.id, c.status)
        .where(which, _PENDING)
        .with_for_update()
        .cte("was")
        .prefix_with("MATERIALIZED")
    )
    cancelled = (
        update(jobs)
        .where(c.id == was.c.id)
        .values(status=_status(JobStatus.CANCELLED), finished_at=_NOW, lease_token=null())
        .returning(c.id, was.c.status.label("was"))
        .cte("cancelled")
    )
    channel = literal_column(f"'{CANCEL_CHANNEL}'", Text)
    notify = case(
        (
            cancelled.c.was == _status(JobStatus.RUNNING),
            func.pg_notify(channel, cast(cancelled.c.id, Text)),
        )
    )
    return select(cancelled.c.id, notify.label("notified"))


def cancelled_among_stmt(*, job_ids: Collection[int]) -> Select[Any]:
    """Select which of *job_ids* are cancelled: ``SELECT id ... WHERE id = ANY(:b_ids)
    AND status = 'cancelled'`` (a worker asks after losing their leases)."""
    return select(c.id).where(
        c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)),
        c.status == _status(JobStatus.CANCELLED),
    )


class Reference(NamedTuple):
    """A host's foreign key to ``sqlaq_jobs.id`` that stops a job's deletion (``ON
    DELETE NO ACTION`` or ``RESTRICT``): the referencing table and column."""

    schema: str
    table: str
    column: str

    @property
    def qualified(self) -> str:
        """``schema.table``, for messages."""
        return f"{self.schema}.{self.table}"


def blocking_references_stmt() -> Select[Any]:
    """Select the foreign keys that stop a job's deletion: ``schema, table, column``.

    Reads ``pg_constraint`` for foreign keys referencing ``sqlaq_jobs`` (resolved on the
    search path, like every statement here) whose ``ON DELETE`` is ``NO ACTION`` or
    ``RESTRICT`` (``confdeltype IN ('a', 'r')``); ``SET NULL`` and ``CASCADE`` never stop
    a delete. A partition's copy of its parent's key is left out (the parent's covers
    it). Ordered by schema, table and column.
    """
    con = table(
        "pg_constraint",
        column("conrelid"),
        column("confrelid"),
        column("contype"),
        column("confdeltype"),
        column("conparentid"),
        column("conkey", ARRAY(SmallInteger)),
        schema="pg_catalog",
    )
    rel = table(
        "pg_class", column("oid"), column("relname"), column("relnamespace"), schema="pg_catalog"
    )
    nsp = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")
    att = table(
        "pg_attribute", column("attrelid"), column("attnum"), column("attname"), schema="pg_catalog"
    )
    jobs_oid = cast(literal_column(f"'{jobs.name}'", Text), REGCLASS)
    return (
        select(nsp.c.nspname, rel.c.relname, att.c.attname)
        .select_from(con)
        .join(rel, rel.c.oid == con.c.conrelid)
        .join(nsp, nsp.c.oid == rel.c.relnamespace)
        .join(att, and_(att.c.attrelid == con.c.conrelid, att.c.attnum == con.c.conkey[1]))
        .where(
            con.c.contype == literal_column("'f'"),
            con.c.confrelid == jobs_oid,
            con.c.confdeltype.in_([literal_column("'a'"), literal_column("'r'")]),
            con.c.conparentid == literal_column("0"),
        )
        .order_by(nsp.c.nspname, rel.c.relname, att.c.attname)
    )


def _referenced(references: Sequence[Reference]) -> ColumnElement[bool]:
    """True for a job some row of *references* points at (``EXISTS`` per key)."""
    found = []
    for ref in references:
        host = table(ref.table, column(ref.column), schema=ref.schema)
        found.append(exists().where(host.c[ref.column] == c.id))
    return or_(*found)


def prune_stmt(
    *,
    older_than: timedelta,
    statuses: Collection[JobStatus],
    limit: int,
    spare: Sequence[Reference] = (),
) -> Delete:
    """Delete up to *limit* finished jobs that finished more than *older_than* ago.

    Renders::

        WITH doomed AS MATERIALIZED (
            SELECT id FROM sqlaq_jobs
            WHERE status IN ('done', 'failed', 'cancelled') AND status = ANY(:b_statuses)
              AND finished_at < now() - :b_older_than
              AND NOT <in an unfinished workflow>
            LIMIT :b_limit FOR UPDATE SKIP LOCKED)
        DELETE FROM sqlaq_jobs USING doomed WHERE sqlaq_jobs.id = doomed.id

    Pending rows can never match (the literal predicate), and the finished index serves
    the scan. Run it repeatedly, committing between batches, to prune a large backlog.

    A workflow's finished jobs are kept while the workflow has a job not finished (see
    ``in_unfinished_workflow`` in ``sqlaq/queries/_graph.py``): a chord's member whose
    callback still waits is not deleted from under :func:`sqlaq.parent_results`. Jobs
    outside workflows pay a test of two columns of the row.

    With *spare* (from :func:`blocking_references_stmt`), jobs a row of those tables
    still references are left out (``AND NOT (EXISTS (SELECT FROM host WHERE host.col =
    sqlaq_jobs.id) OR ...)``) instead of failing the whole batch with a foreign key
    violation. Each probe is the lookup PostgreSQL's own foreign-key check would make
    on delete, so it is as cheap as the host's column is indexed.
    """
    which = [_prunable(older_than, statuses)]
    if spare:
        which.append(~_referenced(spare))
    doomed = (
        select(c.id)
        .where(*which)
        .limit(bindparam("b_limit", limit, Integer))
        .with_for_update(skip_locked=True)
        .cte("doomed")
        .prefix_with("MATERIALIZED")
    )
    return delete(jobs).where(c.id == doomed.c.id)


def count_referenced_stmt(
    *,
    older_than: timedelta,
    statuses: Collection[JobStatus],
    references: Sequence[Reference],
    limit: int,
) -> Select[int]:
    """Count, up to *limit*, the jobs :func:`prune_stmt` would delete but for a row of
    *references* pointing at them: ``SELECT count(*) FROM (SELECT 1 ... LIMIT n)``."""
    held = (
        select(literal_column("1"))
        .select_from(jobs)
        .where(_prunable(older_than, statuses), _referenced(references))
        .limit(bindparam("b_limit", limit, Integer))
        .subquery("held")
    )
    return select(func.count()).select_from(held)


def _prunable(older_than: timedelta, statuses: Collection[JobStatus]) -> ColumnElement[bool]:
    return and_(
        _FINISHED,
        c.status == func.any(bindparam("b_statuses", sorted(statuses), ARRAY(Text))),
        c.finished_at < _NOW - bindparam("b_older_than", older_than, Interval),
        ~in_unfinished_workflow(),
    )


def count_prunable_stmt(*, older_than: timedelta, statuses: Collection[JobStatus]) -> Select[int]:
    """Count the jobs :func:`prune_stmt` would delete (for a progress bar)."""
    return select(func.count()).where(_prunable(older_than, statuses))


def sweep_stmt(*, limit: int) -> Update:
    """End up to *limit* expired leases, whether or not anyone claims their queue.

    A running job whose lease expired on its last attempt is marked ``failed`` (its
    worker died or stalled and no attempt is left); one with attempts left is queued
    again, due now. Either way ``last_error`` says the lease expired. The claim does the
    same to the rows it meets; this catches the rest (a queue no worker serves, or a
    kind that is never claimed again). Picks rows through the running index in a
    ``MATERIALIZED`` CTE with ``FOR UPDATE SKIP LOCKED``; ``RETURNING id, status``.
    """
    expired = (
        select(c.id)
        .where(_RUNNING, c.run_at <= _NOW)
        .limit(bindparam("b_limit", limit, Integer))
        .with_for_update(skip_locked=True)
        .cte("expired")
        .prefix_with("MATERIALIZED")
    )
    exhausted = c.attempts >= c.max_attempts
    return (
        update(jobs)
        .where(c.id == expired.c.id)
        .values(
            status=case((exhausted, _status(JobStatus.FAILED)), else_=_status(JobStatus.QUEUED)),
            finished_at=case((exhausted, _NOW), else_=null()),
            run_at=case((exhausted, c.run_at), else_=_NOW),
            locked_by=null(),
            lease_token=null(),
            last_error=case((exhausted, _expired_error()), else_=_expired_error("queued again")),
        )
        .returning(c.id, c.status)
    )


def prune_unique_holds_stmt(*, limit: int) -> ReturningDelete[Any]:
    """Delete up to *limit* expired ``unique_for`` holds (the leader's upkeep)::

    DELETE FROM sqlaq_unique_holds WHERE (kind, key) IN (SELECT kind, key
        FROM sqlaq_unique_holds WHERE expires_at <= now() LIMIT :b_limit
        FOR UPDATE SKIP LOCKED) RETURNING kind
    """
    h = unique_holds.c
    expired = (
        select(h.kind, h.key)
        .where(h.expires_at <= _NOW)
        .limit(bindparam("b_limit", limit, Integer))
        .with_for_update(skip_locked=True)
    )
    return delete(unique_holds).where(tuple_(h.kind, h.key).in_(expired)).returning(h.kind)
