"""What :mod:`sqlaq.dashboard` shows (read-only).

Each reads pending rows through the claim or running index and finished rows through
the finished index over a bounded time range, so a page costs what is pending and
recent, not the table's history.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Interval,
    Select,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    null,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, TIMESTAMP

from sqlaq.queries._common import _FINISHED, _NOW, _PENDING, _RUNNING, _status, c
from sqlaq.queries.inspect import find_jobs_stmt, stats_health_stmt
from sqlaq.schema import (
    JobStatus,
    periodic,
    rates,
)

_ONE_HOUR: ColumnElement[Any] = literal_column("interval '1 hour'")

#: ``chr(10)``: a constant, not a bound value, so that the first-line expression of a
#: grouped query is the same in SELECT and GROUP BY.
_NEWLINE = func.chr(literal_column("10", Integer))

#: The percentiles of the wait-time plot.
WAIT_PERCENTILES = (0.5, 0.9, 0.99)

#: The job's columns that can hold large values, shown cut (:func:`job_page_stmt`) and
#: read whole by :func:`job_value_stmt` only.
LARGE_VALUES = ("payload", "result", "last_error")


def _finished_within(window: timedelta, name: str = "b_window") -> ColumnElement[bool]:
    # The finished index's predicate and a range on its column: an index range scan.
    return and_(_FINISHED, c.finished_at >= _NOW - bindparam(name, window, Interval))


def _bucket(moment: ColumnElement[Any], bucket: timedelta) -> ColumnElement[datetime]:
    """``date_bin(:b_bucket, moment, TIMESTAMPTZ 'epoch')``: *moment* rounded down to a
    multiple of *bucket* since 1970 (PostgreSQL 14+). Timestamp arithmetic: about half
    the cost of ``floor(extract(epoch ...))``, whose numerics are slow on a million rows."""
    return func.date_bin(
        bindparam("b_bucket", bucket, Interval),
        moment,
        literal_column("TIMESTAMPTZ 'epoch'"),
        type_=TIMESTAMP(timezone=True),
    )


def error_line(error: ColumnElement[str | None] = c.last_error) -> ColumnElement[str]:
    """``split_part(last_error, chr(10), 1)``: the first line of an error, the
    exception's ``Type: message``; failures are grouped by it."""
    return func.split_part(error, _NEWLINE, literal_column("1", Integer))


def overview_counts_stmt(*, window: timedelta) -> Select[Any]:
    """Select ``queue, kind, status, count``: every pending job, and the jobs that
    finished within *window* of ``now()``.

    Renders ``SELECT queue, kind, status, count(*) FROM sqlaq_jobs WHERE status IN
    ('queued', 'running') OR (status IN ('done', 'failed', 'cancelled') AND finished_at
    >= now() - :b_window) GROUP BY queue, kind, status``: a BitmapOr of the claim index
    and a range of the finished index, never the whole history (unlike
    :func:`stats_counts_stmt`).
    """
    return (
        select(c.queue, c.kind, c.status, func.count().label("count"))
        .where(or_(_PENDING, _finished_within(window)))
        .group_by(c.queue, c.kind, c.status)
        .order_by(c.queue, c.kind, c.status)
    )


def overview_health_stmt() -> Select[Any]:
    """:func:`stats_health_stmt` over the rows it needs only: pending jobs, and jobs
    that finished within the last hour (``WHERE status IN ('queued', 'running') OR
    (status IN (<finished>) AND finished_at > now() - interval '1 hour')``).

    The same figures per queue; a queue with nothing pending and no job finished within
    the hour is left out.
    """
    recent = and_(_FINISHED, c.finished_at > _NOW - _ONE_HOUR)
    return stats_health_stmt().where(or_(_PENDING, recent))


def throughput_stmt(*, window: timedelta, bucket: timedelta) -> Select[Any]:
    """Select ``bucket, status, count``: jobs finished within *window*, per *bucket* of
    ``finished_at`` (its start, a timestamp) and outcome (done, failed, cancelled).

    Renders ``SELECT date_bin(:b_bucket, finished_at, TIMESTAMPTZ 'epoch') AS bucket,
    status, count(*) ... WHERE <finished within :b_window> GROUP BY 1, 2 ORDER BY 1, 2``.
    Buckets without a finished job have no row.
    """
    start = _bucket(c.finished_at, bucket).label("bucket")
    return (
        select(start, c.status, func.count().label("count"))
        .where(_finished_within(window))
        .group_by(literal_column("1"), c.status)
        .order_by(literal_column("1"), c.status)
    )


def wait_percentiles_stmt(*, window: timedelta, bucket: timedelta) -> Select[Any]:
    """Select ``bucket, count, waits``: how long jobs waited before their first attempt
    started, per *bucket* of that start, with ``waits`` the :data:`WAIT_PERCENTILES` of
    the wait (an array of intervals).

    The wait is ``attempted_at - created_at`` of jobs that finished within *window* on
    their first attempt (``attempts = 1``). It is the claim minus the time the job was
    due for jobs enqueued without a delay; a delay (or a snooze, which refunds its
    attempt) counts as waiting. Retried jobs are left out: their claim overwrote
    ``run_at``, the only record of when a retry was due. Renders ``SELECT <bucket of
    attempted_at>, count(*), percentile_cont(:b_fractions) WITHIN GROUP (ORDER BY
    attempted_at - created_at) ... WHERE <finished within :b_window> AND attempts = 1
    AND attempted_at >= now() - :b_window GROUP BY 1`` (intervals sort faster than the
    numerics ``extract(epoch ...)`` would make of them).
    """
    wait = c.attempted_at - c.created_at
    fractions = bindparam("b_fractions", list(WAIT_PERCENTILES), ARRAY(Float))
    return (
        select(
            _bucket(c.attempted_at, bucket).label("bucket"),
            func.count().label("count"),
            func.percentile_cont(fractions, type_=ARRAY(Interval))
            .within_group(wait)
            .label("waits"),
        )
        .where(
            _finished_within(window),
            c.attempts == literal_column("1", Integer),
            c.attempted_at >= _NOW - bindparam("b_window", window, Interval),
        )
        .group_by(literal_column("1"))
        .order_by(literal_column("1"))
    )


def _failed_since(since: timedelta | None) -> list[ColumnElement[bool]]:
    failed = c.status == _status(JobStatus.FAILED)
    return [failed] if since is None else [_finished_within(since, "b_since"), failed]


def failure_groups_stmt(
    *,
    since: timedelta | None,
    kind: str | None = None,
    error: str | None = None,
    limit: int = 100,
) -> Select[Any]:
    """Select failed jobs grouped by kind and the first line of ``last_error``:
    ``kind, error, count, latest`` (the newest ``finished_at``), ``newest_id``, and
    ``queues`` (an array), the largest groups first.

    *since* keeps jobs that failed within that interval of ``now()`` (through the
    finished index); None, every failed job (a scan of the table). *kind* and *error*
    narrow it to one group. Renders ``SELECT kind, split_part(last_error, chr(10), 1)
    AS error, count(*), ... WHERE status = 'failed' [AND <finished within :b_since>]
    GROUP BY kind, error ORDER BY count(*) DESC, kind, error LIMIT :b_limit``.
    """
    line = error_line()
    stmt = select(
        c.kind,
        line.label("error"),
        func.count().label("count"),
        func.max(c.finished_at).label("latest"),
        func.max(c.id).label("newest_id"),
        func.array_agg(c.queue.distinct()).label("queues"),
    ).where(*_failed_since(since))
    if kind is not None:
        stmt = stmt.where(c.kind == bindparam("b_kind", kind, Text))
    if error is not None:
        stmt = stmt.where(line == bindparam("b_error", error, Text))
    return (
        stmt.group_by(c.kind, line)
        .order_by(func.count().desc(), c.kind, line)
        .limit(bindparam("b_limit", limit, Integer))
    )


def failure_group_ids_stmt(
    *, kind: str, error: str, since: timedelta | None, after_id: int, limit: int
) -> Select[Any]:
    """Select the ids of one failure group (see :func:`failure_groups_stmt`) above
    *after_id*, in id order, at most *limit*: the batches of a bulk retry.

    Renders ``SELECT id FROM sqlaq_jobs WHERE status = 'failed' [AND <finished within
    :b_since>] AND kind = :b_kind AND split_part(last_error, chr(10), 1) = :b_error AND
    id > :b_after ORDER BY id LIMIT :b_limit``.
    """
    return (
        select(c.id)
        .where(
            *_failed_since(since),
            c.kind == bindparam("b_kind", kind, Text),
            error_line() == bindparam("b_error", error, Text),
            c.id > bindparam("b_after", after_id, BigInteger),
        )
        .order_by(c.id)
        .limit(bindparam("b_limit", limit, Integer))
    )


def running_by_kind_stmt() -> Select[Any]:
    """Select, per kind with running jobs: ``kind, running, expired`` (leases that
    ended), ``workers`` (distinct ``locked_by``) and ``oldest`` (the earliest
    ``attempted_at``): the concurrency each kind uses. Reads the running index only."""
    return (
        select(
            c.kind,
            func.count().label("running"),
            func.count().filter(c.run_at < _NOW).label("expired"),
            func.count(c.locked_by.distinct()).label("workers"),
            func.min(c.attempted_at).label("oldest"),
        )
        .where(_RUNNING)
        .group_by(c.kind)
        .order_by(c.kind)
    )


def running_workers_stmt() -> Select[Any]:
    """Select, per worker holding running jobs (``locked_by``): ``worker, jobs,
    queues, kinds`` (arrays), ``first_started`` and ``lease_until`` (the latest lease
    end). sqlaq keeps no table of workers: an idle worker holds no row, so is not here."""
    return (
        select(
            c.locked_by.label("worker"),
            func.count().label("jobs"),
            func.array_agg(c.queue.distinct()).label("queues"),
            func.array_agg(c.kind.distinct()).label("kinds"),
            func.min(c.attempted_at).label("first_started"),
            func.max(c.run_at).label("lease_until"),
        )
        .where(_RUNNING)
        .group_by(c.locked_by)
        .order_by(func.count().desc(), c.locked_by)
    )


def rate_logs_stmt(*, periods: Mapping[str, timedelta] | None = None) -> Select[Any]:
    """Select each rate-limited kind's start log (``sqlaq_rates``): ``kind, logged``
    (starts kept), ``newest`` (the latest start), and ``recent``: for the kinds of
    *periods* (kind -> its rate's period), the starts within that period of ``now()``,
    what the rate counts now (NULL for the other kinds).

    The log is trimmed at each claim of its kind, so ``logged`` may still hold starts
    that no longer count.
    """
    given = dict(periods or {})
    limits = (
        func.unnest(
            bindparam("b_kinds", list(given), ARRAY(Text)),
            bindparam("b_periods", list(given.values()), ARRAY(Interval)),
        )
        .table_valued("kind", "period")
        .render_derived(name="limits")
    )
    start = func.unnest(rates.c.starts).table_valued("s").render_derived(name="start")
    recent = (
        select(func.count())
        .select_from(start)
        .where(start.c.s > _NOW - limits.c.period)
        .scalar_subquery()
    )
    return (
        select(
            rates.c.kind,
            func.cardinality(rates.c.starts).label("logged"),
            select(func.max(start.c.s)).select_from(start).scalar_subquery().label("newest"),
            case((limits.c.period.is_(None), null()), else_=recent).label("recent"),
        )
        .select_from(rates.outerjoin(limits, limits.c.kind == rates.c.kind))
        .order_by(rates.c.kind)
    )


def periodic_slots_stmt() -> Select[Any]:
    """Select every periodic schedule's row: ``name, last_slot, updated_at``."""
    return select(periodic.c.name, periodic.c.last_slot, periodic.c.updated_at).order_by(
        periodic.c.name
    )


def jobs_list_stmt(
    *,
    statuses: Collection[JobStatus] = (),
    kind: str | None = None,
    queue: str | None = None,
    since: timedelta | None = None,
    after_id: int | None = None,
    limit: int | None = None,
    newest_first: bool = False,
    error_head: int = 200,
) -> Select[Any]:
    """:func:`find_jobs_stmt` (the same filters and keyset) selecting what the jobs list
    shows only: ``id, queue, kind, status, attempts, max_attempts, run_at, created_at``
    and ``error_head``, the first *error_head* characters of ``last_error``.

    No payload and no result: a page of large jobs reads a few columns, not megabytes.
    ``left()`` reads a slice of a long error, not all of it.
    """
    return find_jobs_stmt(
        statuses=statuses,
        kind=kind,
        queue=queue,
        since=since,
        after_id=after_id,
        limit=limit,
        newest_first=newest_first,
    ).with_only_columns(
        c.id,
        c.queue,
        c.kind,
        c.status,
        c.attempts,
        c.max_attempts,
        c.run_at,
        c.created_at,
        func.left(c.last_error, bindparam("b_error_head", error_head, Integer)).label("error_head"),
    )


def job_page_stmt(*, job_id: int, head: int) -> Select[Any]:
    """Select what a job's page shows: its columns but the large ones, and the first
    *head* characters of the text of each of :data:`LARGE_VALUES`, as
    ``payload_head``, ``result_head`` (NULL without a result) and ``error_head``.

    Ask for one character more than is shown: a head longer than that was cut. Each
    value is turned into text once (``left(payload::text, :b_head)``); the page never
    holds more than *head* characters of it.
    """
    size = bindparam("b_head", head, Integer)
    return select(
        c.id,
        c.queue,
        c.kind,
        c.status,
        c.priority,
        c.attempts,
        c.max_attempts,
        c.created_at,
        c.run_at,
        c.attempted_at,
        c.finished_at,
        c.locked_by,
        c.dedupe_key,
        c.debounce_key,
        c.timeout,
        c.has_dependents,
        c.parent_ids,
        func.left(cast(c.payload, Text), size).label("payload_head"),
        func.left(cast(c.result, Text), size).label("result_head"),
        func.left(c.last_error, size).label("error_head"),
    ).where(c.id == bindparam("b_id", job_id, BigInteger))


def job_value_stmt(*, job_id: int, name: str) -> Select[Any]:
    """Select one of :data:`LARGE_VALUES` of job *job_id* whole, as text (``value``):
    the JSON text of ``payload`` or ``result``, or ``last_error``. No row: no such job;
    NULL: no such value.

    Raises:
        ValueError: *name* is not one of :data:`LARGE_VALUES`.
    """
    if name not in LARGE_VALUES:
        raise ValueError(f"no value {name!r}: one of {', '.join(LARGE_VALUES)}")
    column = c[name]
    value = column if name == "last_error" else cast(column, Text)
    return select(value.label("value")).where(c.id == bindparam("b_id", job_id, BigInteger))
