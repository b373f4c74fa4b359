"""Inspection: reading jobs and queues (for operators, tests and
:mod:`sqlaq.explain`, which asks why a job does not run)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Integer,
    Interval,
    Select,
    SmallInteger,
    Text,
    Update,
    and_,
    bindparam,
    cast,
    func,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP

from sqlaq.encoding import encode_payload
from sqlaq.queries._common import _DEDUPE, _NOW, _PENDING, _RUNNING, _key_rows, _status, c
from sqlaq.queries.columns import OUTCOME_COLUMNS
from sqlaq.schema import (
    JobStatus,
    jobs,
    periodic,
    rates,
    unique_holds,
)


def dedupe_twin_stmt(*, job_id: int, kind: str, dedupe_key: str) -> Select[Any]:
    """Select another pending job holding ``(kind, dedupe_key)``: ``id, status`` (no
    row: none). Through the dedupe index."""
    return (
        select(c.id, c.status)
        .where(
            c.kind == bindparam("b_kind", kind, Text),
            c.dedupe_key == bindparam("b_dedupe_key", dedupe_key, Text),
            _DEDUPE,
            c.id != bindparam("b_id", job_id, BigInteger),
        )
        .limit(1)
    )


def jobs_ahead_stmt(
    *, queue: str, priority: int, run_at: datetime, job_id: int, limit: int
) -> Select[int]:
    """Count, up to *limit*, the due pending jobs of *queue* a claim takes before the
    job ``(priority, run_at, job_id)``: ``SELECT count(*) FROM (SELECT 1 ... WHERE
    <pending> AND queue = :b_queue AND run_at <= now() AND (priority > :b_priority OR
    (priority = :b_priority AND (run_at, id) < (:b_run_at, :b_id))) LIMIT :b_limit)``,
    along the claim index."""
    prio = bindparam("b_priority", priority, SmallInteger)
    ahead = (
        select(literal_column("1"))
        .select_from(jobs)
        .where(
            _PENDING,
            c.queue == bindparam("b_queue", queue, Text),
            c.run_at <= _NOW,
            or_(
                c.priority > prio,
                and_(
                    c.priority == prio,
                    tuple_(c.run_at, c.id)
                    < tuple_(
                        bindparam("b_run_at", run_at, TIMESTAMP(timezone=True)),
                        bindparam("b_id", job_id, BigInteger),
                    ),
                ),
            ),
        )
        .limit(bindparam("b_limit", limit, Integer))
        .subquery("ahead")
    )
    return select(func.count()).select_from(ahead)


def due_queues_stmt() -> Select[str]:
    """Select the queues that hold a due job: ``SELECT DISTINCT queue ... ORDER BY``."""
    return select(c.queue).where(_PENDING, c.run_at <= _NOW).distinct().order_by(c.queue)


def enqueued_jobs_stmt(
    *, kind: str | None = None, payload: Mapping[str, Any] | None = None, queue: str | None = None
) -> Select[Any]:
    """Select queued jobs (every column), oldest first, optionally filtered.

    *payload* matches by JSON containment (``payload @> :b_payload``): the job's payload
    holds those keys with those values, and may hold more.
    """
    stmt = select(jobs).where(c.status == _status(JobStatus.QUEUED)).order_by(c.id)
    if kind is not None:
        stmt = stmt.where(c.kind == bindparam("b_kind", kind, Text))
    if queue is not None:
        stmt = stmt.where(c.queue == bindparam("b_queue", queue, Text))
    if payload is not None:
        wanted = cast(bindparam("b_payload", encode_payload(payload), Text), JSONB)
        stmt = stmt.where(c.payload.contains(wanted))
    return stmt


def stats_counts_stmt() -> Select[str, str, str, int]:
    """Select ``queue, kind, status, count`` over the whole table (a full scan)."""
    return (
        select(c.queue, c.kind, c.status, func.count())
        .group_by(c.queue, c.kind, c.status)
        .order_by(c.queue, c.kind, c.status)
    )


def stats_health_stmt() -> Select[Any]:
    """Per queue: due jobs, the oldest due job's age, running jobs whose lease expired,
    and jobs that failed in the last hour (one pass with ``FILTER``)."""
    queued_due = and_(c.status == _status(JobStatus.QUEUED), c.run_at <= _NOW)
    return (
        select(
            c.queue,
            func.count().filter(queued_due).label("due"),
            (_NOW - func.min(c.run_at).filter(queued_due)).label("oldest_due_age"),
            func.count().filter(_RUNNING, c.run_at < _NOW).label("expired_leases"),
            func.count()
            .filter(
                c.status == _status(JobStatus.FAILED),
                c.finished_at > _NOW - literal_column("interval '1 hour'"),
            )
            .label("failed_last_hour"),
        )
        .group_by(c.queue)
        .order_by(c.queue)
    )


def key_state_stmt(*, kind: str, key: str, job_id: int) -> Select[Any]:
    """What holds back a job of a keyed kind: ``running, earlier_id, earlier_status``.

    * ``running``: the live leases of ``(kind, key)`` (running rows whose lease has
      not expired), as the keyed claim counts them;
    * ``earlier_id``, ``earlier_status``: the first job of ``(kind, key)`` before
      *job_id* that is queued, running or failed (strict order's head of the line), or
      NULL; through the key index.
    """
    kind_ = bindparam("b_kind", kind, Text)
    key_ = bindparam("b_key", key, Text)
    running = (
        select(func.count())
        .select_from(jobs)
        .where(_RUNNING, c.kind == kind_, c.run_at > _NOW, c.key == key_)
        .scalar_subquery()
    )
    earlier = (
        select(c.id, c.status)
        .where(
            _key_rows(jobs),
            c.kind == kind_,
            c.key == key_,
            c.id < bindparam("b_id", job_id, BigInteger),
        )
        .order_by(c.id)
        .limit(1)
        .subquery("earlier")
    )
    return select(
        running.label("running"),
        select(earlier.c.id).scalar_subquery().label("earlier_id"),
        select(earlier.c.status).scalar_subquery().label("earlier_status"),
    )


def get_job_stmt(*, job_id: int) -> Select[Any]:
    """Select one job, every column, by id."""
    return select(jobs).where(c.id == bindparam("b_id", job_id, BigInteger))


def job_outcome_stmt(*, job_id: int) -> Select[Any]:
    """Select ``id, status, result, last_error, finished_at`` of one job by id (no row:
    no such job)."""
    return select(*OUTCOME_COLUMNS).where(c.id == bindparam("b_id", job_id, BigInteger))


def watch_job_stmt(*, job_id: int) -> Update:
    """Mark a pending job awaited, so that its finish is notified on ``sqlaq_finished``.

    Renders ``UPDATE sqlaq_jobs SET awaited = true WHERE id = :b_id AND status IN
    ('queued', 'running') AND NOT awaited RETURNING id, status, result, last_error,
    finished_at``. Writes nothing for a job already finished (or already awaited): no
    row comes back, and the caller reads the job with :func:`job_outcome_stmt`, in a
    statement of its own so that it sees what committed meanwhile. A completion that
    commits while this runs holds the row's lock: the UPDATE waits for it, then
    re-checks the finished row and leaves it alone. Commit at once: the flag, while
    uncommitted, locks the row against the completion it waits for.
    """
    return (
        update(jobs)
        .where(c.id == bindparam("b_id", job_id, BigInteger), _PENDING, ~c.awaited)
        .values(awaited=literal_column("true", Boolean))
        .returning(*OUTCOME_COLUMNS)
    )


def count_jobs_stmt(
    *, statuses: Collection[JobStatus] = (), kind: str | None = None, queue: str | None = None
) -> Select[int]:
    """Count the jobs :func:`find_jobs_stmt` would select with these filters."""
    found = find_jobs_stmt(statuses=statuses, kind=kind, queue=queue).subquery()
    return select(func.count()).select_from(found)


def find_jobs_stmt(
    *,
    statuses: Collection[JobStatus] = (),
    kind: str | None = None,
    queue: str | None = None,
    since: timedelta | None = None,
    after_id: int | None = None,
    limit: int | None = None,
    newest_first: bool = False,
) -> Select[Any]:
    """Select jobs (every column) by status, kind, queue and age, ordered by id.

    *since* keeps jobs created within that interval of ``now()``; *after_id* pages by
    id (with ``newest_first``, ids below it), so bulk operations walk the table in
    bounded batches without OFFSET.
    """
    stmt = select(jobs)
    if statuses:
        stmt = stmt.where(c.status.in_([_status(JobStatus(s)) for s in sorted(statuses)]))
    if kind is not None:
        stmt = stmt.where(c.kind == bindparam("b_kind", kind, Text))
    if queue is not None:
        stmt = stmt.where(c.queue == bindparam("b_queue", queue, Text))
    if since is not None:
        stmt = stmt.where(c.created_at >= _NOW - bindparam("b_since", since, Interval))
    if after_id is not None:
        bound = bindparam("b_after", after_id, BigInteger)
        stmt = stmt.where(c.id < bound if newest_first else c.id > bound)
    stmt = stmt.order_by(c.id.desc() if newest_first else c.id)
    if limit is not None:
        stmt = stmt.limit(bindparam("b_limit", limit, Integer))
    return stmt


def travel_stmts(*, by: timedelta) -> list[Update]:
    """Move every stored time of the queue *by* into the past: for tests, the same as
    the database clock moving forward (``sqlaq.testing.travel``).

    Renders four UPDATEs: on ``sqlaq_jobs`` (``run_at``, ``created_at``,
    ``attempted_at``, ``finished_at``), on ``sqlaq_rates`` (each logged start), on
    ``sqlaq_periodic`` (``last_slot``, ``updated_at``), and on ``sqlaq_unique_holds``
    (``expires_at``).
    """
    shift = bindparam("b_by", by, Interval)
    start = func.unnest(rates.c.starts).table_valued("s").render_derived(name="start")
    shifted = select(func.array_agg(start.c.s - shift)).select_from(start).scalar_subquery()
    return [
        update(jobs).values(
            run_at=c.run_at - shift,
            created_at=c.created_at - shift,
            attempted_at=c.attempted_at - shift,
            finished_at=c.finished_at - shift,
        ),
        update(rates).values(starts=func.coalesce(shifted, rates.c.starts)),
        update(periodic).values(
            last_slot=periodic.c.last_slot - shift, updated_at=periodic.c.updated_at - shift
        ),
        update(unique_holds).values(expires_at=unique_holds.c.expires_at - shift),
    ]
