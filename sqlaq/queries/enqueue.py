"""Enqueue: the INSERTs of new jobs (one, many, a uniform batch, COPY), with their
dedupe, debounce and ``unique_for`` variants."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import cache
from typing import Any

import psycopg.sql
from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Insert,
    Interval,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    cast,
    func,
    literal_column,
    select,
    update,
)
from sqlalchemy import insert as core_insert
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.dialects.postgresql import Insert as PgInsert

from sqlaq.encoding import NewJob
from sqlaq.queries._common import _DEBOUNCE, _DEDUPE, _NOW, c
from sqlaq.queries.columns import (
    COPY_COLUMNS,
    JOB_FIELDS,
    JobField,
    bound,
    enqueue_params,
    row_values,
)
from sqlaq.schema import (
    jobs,
    unique_holds,
)


def enqueue_stmt(*, job: NewJob, headers: str | None = None, per_queue: bool = False) -> Insert:
    """Insert one job; ``RETURNING id``.

    Renders ``INSERT INTO sqlaq_jobs (...) VALUES (..., now() + :b_delay, ...)``. With a
    ``dedupe_key`` it adds ``ON CONFLICT (kind, dedupe_key) WHERE <pending> DO NOTHING``,
    so a duplicate returns no row and leaves the caller's transaction usable.

    *headers* (JSON text, or None) is stored in ``headers``: what the enqueuer sends
    beside the payload, the trace context of :func:`sqlaq.tracing.capture`. Execution
    parameters without ``b_headers`` leave it NULL.

    *per_queue*: ``ON CONFLICT (queue, kind, dedupe_key)``, the dedupe index of a job table
    distributed on Citus (see :mod:`sqlaq.queries.citus`).
    """
    v = enqueue_params(job, headers=headers)
    # Core's insert() when there is no ON CONFLICT: SQLAlchemy before 2.0.3x gives the
    # PostgreSQL dialect's Insert no cache key, so it would be compiled on every call.
    stmt = (core_insert if job.dedupe_key is None else insert)(jobs).values(
        row_values(lambda field: bound(field, v))
    )
    if isinstance(stmt, PgInsert):
        stmt = stmt.on_conflict_do_nothing(
            index_elements=_dedupe_columns(per_queue), index_where=_DEDUPE
        )
    return stmt.returning(c.id)


def _dedupe_columns(per_queue: bool) -> list[Any]:
    # The dedupe index's columns: (kind, dedupe_key), led by queue on Citus.
    return [c.queue, c.kind, c.dedupe_key] if per_queue else [c.kind, c.dedupe_key]


def debounce_enqueue_stmt(
    *,
    job: NewJob,
    debounce_key: str,
    debounce: timedelta,
    max_wait: timedelta | None = None,
    headers: str | None = None,
    per_queue: bool = False,
) -> Insert:
    """Insert a debounced job, or push back the queued one of ``(kind, debounce_key)``.

    Bind values: :func:`enqueue_params` and ``b_debounce_key``, ``b_debounce``,
    ``b_max_wait`` (None: no cap). Renders::

        INSERT INTO sqlaq_jobs (..., run_at, debounce_key, ...)
        VALUES (..., now() + :b_debounce, :b_debounce_key, ...)
        ON CONFLICT (kind, debounce_key)
            WHERE status = 'queued' AND attempted_at IS NULL AND debounce_key IS NOT NULL
        DO UPDATE SET payload = excluded.payload, priority = excluded.priority,
            max_attempts = excluded.max_attempts, timeout = excluded.timeout,
            headers = excluded.headers,
            run_at = least(now() + :b_debounce, sqlaq_jobs.created_at + :b_max_wait)
        RETURNING id, xmax::text <> '0' AS debounced

    One statement, so racing enqueuers serialize on the queued row (or on the
    speculative insertion of the first) and none of them fails: each one either inserts
    the job or updates it. ``least`` ignores a NULL ``b_max_wait``. A job that has
    started (``attempted_at`` set) is not in the arbiter index: a new enqueue then
    inserts a new job. ``debounced`` is true when an existing job was updated (its row
    is locked by this transaction: ``xmax`` is set; a fresh insert has none).

    *per_queue* (a job table distributed on Citus): ``ON CONFLICT (queue, kind,
    debounce_key)``, and ``run_at = excluded.run_at``: Citus takes only IMMUTABLE
    functions in ``DO UPDATE SET``, so no ``now()`` and no ``created_at + max_wait``
    there (*max_wait* is not applied: the caller refuses it).
    """
    v = enqueue_params(job, headers=headers)
    delay = _NOW + bindparam("b_debounce", debounce, Interval)
    row = row_values(lambda field: bound(field, v), run_at=delay, skip={"dedupe_key"})
    row["debounce_key"] = bindparam("b_debounce_key", debounce_key, Text)
    stmt = insert(jobs).values(row)
    excluded = stmt.excluded
    # The update takes the new enqueue's values of every column but the job's identity
    # (queue, kind, its debounce key, its job key) and run_at, which moves back but
    # never past max_wait.
    identity = {"queue", "kind", "debounce_key", "key", "run_at"}
    replaced = {name: excluded[name] for name in row if name not in identity}
    if per_queue:
        stmt = stmt.on_conflict_do_update(
            index_elements=[c.queue, c.kind, c.debounce_key],
            index_where=_DEBOUNCE,
            set_={**replaced, "run_at": excluded.run_at},
        )
        return stmt.returning(c.id, literal_column("xmax::text <> '0'", Boolean).label("debounced"))
    stmt = stmt.on_conflict_do_update(
        index_elements=[c.kind, c.debounce_key],
        index_where=_DEBOUNCE,
        set_={
            **replaced,
            "run_at": func.least(
                # Cast: a NULL (no cap) must still be an interval to add.
                delay,
                c.created_at + cast(bindparam("b_max_wait", max_wait, Interval), Interval),
            ),
        },
    )
    return stmt.returning(c.id, literal_column("xmax::text <> '0'", Boolean).label("debounced"))


def unique_enqueue_stmt(*, job: NewJob, unique_for: timedelta, headers: str | None = None) -> Any:
    """Insert a job with a ``dedupe_key`` unless the key is held: taken by a job enqueued
    less than ``unique_for`` ago, whatever became of it.

    Bind values: :func:`enqueue_params` and ``b_unique_for``. Renders::

        WITH hold AS (
            INSERT INTO sqlaq_unique_holds (kind, key, job_id, expires_at)
            VALUES (:b_kind, :b_dedupe_key, nextval(<the jobs' id sequence>),
                    now() + :b_unique_for)
            ON CONFLICT (kind, key) DO UPDATE SET job_id = excluded.job_id,
                expires_at = excluded.expires_at
                WHERE sqlaq_unique_holds.expires_at <= now()
            RETURNING job_id),
        inserted AS (
            INSERT INTO sqlaq_jobs (id, ...) SELECT hold.job_id, ... FROM hold
            ON CONFLICT (kind, dedupe_key) WHERE <pending> DO NOTHING RETURNING id)
        SELECT (SELECT job_id FROM hold) AS taken, (SELECT id FROM inserted) AS inserted

    One row always: ``taken`` is NULL when the key is held (then
    :func:`unique_holder_stmt` names the holder), ``inserted`` is NULL when the hold was
    taken but a pending job holds the dedupe key (then :func:`retarget_hold_stmt`
    points the hold at it). Racing enqueuers serialize on the hold's row, so exactly one
    takes it; the others wait for its commit and find it held.
    """
    v = enqueue_params(job, headers=headers)
    kind = bindparam("b_kind", v["b_kind"], Text)
    key = bindparam("b_dedupe_key", v["b_dedupe_key"], Text)
    sequence = func.pg_get_serial_sequence(
        literal_column(f"'{jobs.fullname}'"), literal_column("'id'")
    )
    next_id = func.nextval(sequence)
    take = insert(unique_holds).values(
        kind=kind,
        key=key,
        job_id=next_id,
        expires_at=_NOW + bindparam("b_unique_for", unique_for, Interval),
    )
    hold = (
        take.on_conflict_do_update(
            index_elements=[unique_holds.c.kind, unique_holds.c.key],
            set_={"job_id": take.excluded.job_id, "expires_at": take.excluded.expires_at},
            where=unique_holds.c.expires_at <= _NOW,
        )
        .returning(unique_holds.c.job_id)
        .cte("hold")
    )
    shared = {"kind": kind, "dedupe_key": key}
    row = row_values(
        lambda field: shared[field.name] if field.name in shared else bound(field, v),
        cast_untyped=True,
    )
    source = select(hold.c.job_id, *row.values())
    inserted = (
        insert(jobs)
        .from_select(["id", *row], source)
        .on_conflict_do_nothing(index_elements=[c.kind, c.dedupe_key], index_where=_DEDUPE)
        .returning(c.id)
        .cte("inserted")
    )
    return select(
        select(hold.c.job_id).scalar_subquery().label("taken"),
        select(inserted.c.id).scalar_subquery().label("inserted"),
    )


def unique_holder_stmt(*, kind: str, key: str) -> Select[Any]:
    """``SELECT job_id FROM sqlaq_unique_holds WHERE kind = :b_kind AND key = :b_key``:
    the job that holds a ``unique_for`` key."""
    h = unique_holds.c
    return select(h.job_id).where(
        h.kind == bindparam("b_kind", kind, Text), h.key == bindparam("b_key", key, Text)
    )


def retarget_hold_stmt(*, kind: str, key: str, job_id: int, unique_for: timedelta) -> Update:
    """Point the hold of ``(kind, key)`` at *job_id* (the pending job that held the
    dedupe key when the hold was taken, or the job inserted after it), held until that
    job's ``created_at + unique_for``."""
    h = unique_holds.c
    target = bindparam("b_job_id", job_id, BigInteger)
    created = select(c.created_at).where(c.id == target).scalar_subquery()
    return (
        update(unique_holds)
        .where(h.kind == bindparam("b_kind", kind, Text), h.key == bindparam("b_key", key, Text))
        .values(
            job_id=target,
            expires_at=func.coalesce(created, _NOW)
            + bindparam("b_unique_for", unique_for, Interval),
        )
    )


def find_pending_duplicate_stmt(*, kind: str, dedupe_key: str) -> Any:
    """Select the pending job holding ``(kind, dedupe_key)``: ``SELECT id ... LIMIT 1``."""
    return (
        select(c.id)
        .where(
            c.kind == bindparam("b_kind", kind, Text),
            c.dedupe_key == bindparam("b_dedupe_key", dedupe_key, Text),
            _DEDUPE,
        )
        .limit(1)
    )


def enqueue_many_stmt(
    *, jobs_: Sequence[NewJob], headers: str | None = None, per_queue: bool = False
) -> Insert:
    """Insert many jobs in one statement; ``RETURNING id, kind, dedupe_key``.

    Renders ``INSERT INTO sqlaq_jobs (...) SELECT ... FROM unnest(:b_queues, ...) WITH
    ORDINALITY AS new_jobs JOIN jsonb_array_elements(:b_payloads::jsonb) WITH ORDINALITY
    AS payloads ON payloads.ordinality = new_jobs.ordinality ORDER BY
    new_jobs.ordinality ON CONFLICT ... DO NOTHING``: eight array parameters and the
    payloads as one JSON array (text; a ``text[]`` of payloads would be escaped element
    by element, the larger part of the client's cost), whatever the number of jobs, so
    the statement is prepared once. Identity values are drawn in ``ORDER BY`` order, so
    sorting the returned rows by id gives the inserted jobs in input order; a job
    skipped as a duplicate returns no row. *headers* (JSON text, one value for every
    job: the enqueue's trace context) fills ``headers``. :func:`enqueue_uniform_stmt`
    is the lighter statement for jobs that differ only in their payload. *per_queue*: as
    :func:`enqueue_stmt`'s.
    """
    # One array per field that differs between jobs, in JOB_FIELDS order.
    arrays = [
        (f.name, bindparam(f.many, f.of(jobs_), ARRAY(f.type)))
        for f in JOB_FIELDS
        if f.many is not None
    ]
    rows = (
        func.unnest(*(array for _, array in arrays))
        .table_valued(*(name for name, _ in arrays), with_ordinality="ordinality")
        .render_derived(name="new_jobs")
    )
    payloads_json = f"[{','.join([j.payload_json for j in jobs_])}]"
    payloads = (
        func.jsonb_array_elements(cast(bindparam("b_payloads", payloads_json, Text), JSONB))
        .table_valued("value", with_ordinality="ordinality")
        .render_derived(name="payloads")
    )
    given = {"b_headers": headers}

    def read(field: JobField) -> ColumnElement[Any]:
        if field.name == "payload":
            return payloads.c.value
        return rows.c[field.name] if field.many else bound(field, given)

    row = row_values(read)
    source = (
        select(*row.values())
        .select_from(rows.join(payloads, payloads.c.ordinality == rows.c.ordinality))
        .order_by(rows.c.ordinality)
    )
    stmt = insert(jobs).from_select(list(row), source)
    stmt = stmt.on_conflict_do_nothing(
        index_elements=_dedupe_columns(per_queue), index_where=_DEDUPE
    )
    return stmt.returning(c.id, c.kind, c.dedupe_key)


@cache
def enqueue_uniform_stmt() -> Insert:
    """Insert jobs that differ only in their payload, none with a dedupe key; ``RETURNING
    id``: :func:`sqlaq.enqueue_many`'s path for the common batch.

    Renders::

        INSERT INTO sqlaq_jobs (queue, kind, payload, priority, run_at, max_attempts,
                                headers, timeout)
        SELECT :b_queue, :b_kind, new_jobs.value, :b_priority,
               coalesce(:b_run_at, now() + :b_delay), :b_max_attempts, :b_headers::jsonb,
               :b_timeout
        FROM jsonb_array_elements(:b_payloads::jsonb) WITH ORDINALITY AS new_jobs
        ORDER BY new_jobs.ordinality
        RETURNING sqlaq_jobs.id

    Bind values: :func:`enqueue_uniform_params`. The payloads travel as one JSON array
    (text): one parameter the driver sends as it is, where a ``text[]`` of payloads is
    escaped element by element (the larger part of the client's cost), and every other
    column is one scalar. Identity values are drawn in ``ORDER BY`` order, so the sorted
    ids are the jobs' in input order. No ``ON CONFLICT``: without dedupe keys nothing
    can conflict. Built once (cached), on first use.
    """
    payloads = (
        func.jsonb_array_elements(cast(bindparam("b_payloads", type_=Text), JSONB))
        .table_valued("value", with_ordinality="ordinality")
        .render_derived(name="new_jobs")
    )

    def read(field: JobField) -> ColumnElement[Any]:
        # Every value cast (no value is bound at build time to type it).
        if field.name == "payload":
            return payloads.c.value
        value = bindparam(field.bind, type_=field.type)
        return cast(value, JSONB if field.json else field.type)

    row = row_values(read, skip={"dedupe_key"})
    source = select(*row.values()).order_by(payloads.c.ordinality)
    stmt = insert(jobs).from_select(list(row), source)
    return stmt.returning(c.id)


def enqueue_copy_stmt() -> psycopg.sql.Composed:
    """``COPY sqlaq_jobs (queue, kind, payload, priority, max_attempts) FROM STDIN``.

    The fastest way in for many jobs (rows in :data:`COPY_COLUMNS` order): no ids come
    back and there is no ``ON CONFLICT``, so it takes no dedupe keys, and ``run_at`` is
    the column's default, ``now()``, so no delays either. COPY fires the statement-level
    insert trigger like an INSERT, so workers are notified on commit. A psycopg
    statement rather than a SQLAlchemy one: SQLAlchemy has no COPY, so it runs on the
    driver connection under the caller's (see :func:`sqlaq.enqueue_copy`).
    """
    return psycopg.sql.SQL("COPY {} ({}) FROM STDIN").format(
        psycopg.sql.Identifier(jobs.name),
        psycopg.sql.SQL(", ").join(map(psycopg.sql.Identifier, COPY_COLUMNS)),
    )


def find_pending_duplicates_stmt(*, kinds: Sequence[str], dedupe_keys: Sequence[str]) -> Any:
    """Select ``id, kind, dedupe_key`` of pending jobs holding any of the given pairs."""
    pairs = (
        func.unnest(
            bindparam("b_kinds", list(kinds), ARRAY(Text)),
            bindparam("b_dedupe_keys", list(dedupe_keys), ARRAY(Text)),
        )
        .table_valued("kind", "dedupe_key")
        .render_derived(name="wanted")
    )
    return (
        select(c.id, c.kind, c.dedupe_key)
        .join_from(jobs, pairs, and_(c.kind == pairs.c.kind, c.dedupe_key == pairs.c.dedupe_key))
        .where(_DEDUPE)
    )
