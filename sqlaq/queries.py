"""Statement builders: the only SQL of sqlaq outside the shipped revisions.

Each ``*_stmt`` function returns an inert SQLAlchemy executable with its values bound,
and executes nothing: run it on any Connection or Session, inside any transaction, or
extend it first. Builders appear in lifecycle order (enqueue, claim, extend, complete,
fail, retry, cancel, prune), so this file reads like the state diagram::

    queued --claim--> running --complete--> done
      ^                 |  \\--fail (no attempts left / permanent)--> failed --retry--+
      |                 |                                                           |
      +--fail (retry)---+   cancel (queued or running) --> cancelled --retry--------+
      +-------------------------------------------------------------------------------+

Rules every builder keeps (each learnt the hard way, see DESIGN.md B):

* The clock is ``now()``: Python passes intervals (a lease, a delay), never timestamps.
* Status literals of partial-index predicates are inlined (``status IN ('queued',
  'running')``), never bound, so prepared statements keep matching the partial indexes.
* Bind parameters are named ``b_*`` (never like a column) and id lists use
  ``= ANY(:b_ids)``, so one prepared statement serves any list length.
* RETURNING lists its columns.
* Hot statements can be built once and run many times: each ``*_params`` function gives
  the bind values of its builder, and execution parameters override the values a
  statement was built with (``conn.execute(stmt, claim_params(...))``). Building a claim
  costs about a millisecond in Python; running a cached one costs nothing extra.
* Claims and retention pick their rows in a ``MATERIALIZED`` CTE with ``FOR UPDATE SKIP
  LOCKED`` joined to the UPDATE/DELETE: the ``id IN (SELECT ... LIMIT n)`` form can be
  re-run per row under a nested loop and touch far more than *n* rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from functools import cache
from typing import Any, NamedTuple
from uuid import UUID

import psycopg.sql
from sqlalchemy import (
    BigInteger,
    Boolean,
    ClauseElement,
    ColumnElement,
    Delete,
    Float,
    FromClause,
    Insert,
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
    false,
    func,
    literal_column,
    null,
    or_,
    select,
    table,
    text,
    tuple_,
    update,
)
from sqlalchemy import insert as core_insert
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, REGCLASS, TIMESTAMP, insert
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.dialects.postgresql import Insert as PgInsert
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.dml import ReturningDelete
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.types import UserDefinedType

from sqlaq.encoding import NewJob, encode_payload
from sqlaq.errors import ConfigError
from sqlaq.lease import Lease
from sqlaq.limits import Rate
from sqlaq.schema import (
    CANCEL_CHANNEL,
    CHANNEL,
    KIND_LOCK_CLASS,
    LEADER_LOCK,
    REVISION_FUNCTION,
    JobStatus,
    jobs,
    paused_queues,
    periodic,
    rates,
    unique_holds,
    workers,
)

__all__ = [
    "WAIT_PERCENTILES",
    "Reference",
    "blocking_references_stmt",
    "cancel_stmt",
    "cancelled_among_stmt",
    "catalog_constraints_stmt",
    "catalog_functions_stmt",
    "catalog_indexes_stmt",
    "catalog_tables_stmt",
    "catalog_triggers_stmt",
    "claim_params",
    "claim_stmt",
    "clock_stmt",
    "complete_result_params",
    "complete_result_stmt",
    "complete_stmt",
    "count_jobs_stmt",
    "count_prunable_stmt",
    "count_referenced_stmt",
    "debounce_enqueue_stmt",
    "dedupe_twin_stmt",
    "due_queues_stmt",
    "enqueue_copy_stmt",
    "enqueue_many_stmt",
    "enqueue_params",
    "enqueue_stmt",
    "enqueue_uniform_params",
    "enqueue_uniform_stmt",
    "enqueued_jobs_stmt",
    "error_line",
    "extend_lease_stmt",
    "fail_params",
    "fail_stmt",
    "failure_group_ids_stmt",
    "failure_groups_stmt",
    "fence_params",
    "find_jobs_stmt",
    "find_pending_duplicate_stmt",
    "find_pending_duplicates_stmt",
    "forget_worker_stmt",
    "get_job_stmt",
    "handback_stmt",
    "has_schema_revision_stmt",
    "heartbeat_stmt",
    "job_outcome_stmt",
    "jobs_ahead_stmt",
    "kind_limit_state_params",
    "kind_limit_state_stmt",
    "listen_stmt",
    "lock_kind_stmt",
    "notify_queues_stmt",
    "overview_counts_stmt",
    "overview_health_stmt",
    "pause_stmt",
    "paused_queues_stmt",
    "periodic_advance_stmt",
    "periodic_insert_stmt",
    "periodic_lock_stmt",
    "periodic_slots_stmt",
    "prune_stmt",
    "prune_unique_holds_stmt",
    "prune_workers_stmt",
    "rate_logs_stmt",
    "record_starts_params",
    "record_starts_stmt",
    "resign_stmt",
    "resume_stmt",
    "retarget_hold_stmt",
    "retry_stmt",
    "running_by_kind_stmt",
    "running_workers_stmt",
    "schema_revision_stmt",
    "serving_workers_stmt",
    "snooze_stmt",
    "stats_counts_stmt",
    "stats_health_stmt",
    "sweep_stmt",
    "throughput_stmt",
    "try_lead_stmt",
    "unique_enqueue_stmt",
    "unique_holder_stmt",
    "vacuum_need_stmt",
    "vacuum_stmt",
    "wait_percentiles_stmt",
    "watch_job_stmt",
    "workers_stmt",
]

c = jobs.c


def _status(value: JobStatus) -> ColumnElement[str]:
    # Inlined, never bound: see the module docstring.
    return literal_column(f"'{value.value}'", Text)


_RUNNING = c.status == _status(JobStatus.RUNNING)
# The predicates of the partial indexes (schema.py), as column expressions so they are
# qualified in joins; their literals are inlined, so the planner can match the indexes.
_PENDING = c.status.in_([_status(JobStatus.QUEUED), _status(JobStatus.RUNNING)])
_FINISHED = c.status.in_(
    [_status(s) for s in (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED)]
)
_DEDUPE = and_(_PENDING, c.dedupe_key.is_not(None))
# The debounce index's predicate (schema.DEBOUNCE_SQL), literals inlined.
_DEBOUNCE = and_(
    c.status == _status(JobStatus.QUEUED), c.attempted_at.is_(None), c.debounce_key.is_not(None)
)
_NOW = func.now()
_IDS = ARRAY(BigInteger)
_UUIDS = ARRAY(PG_UUID(as_uuid=True))

#: Columns a claim returns, in this order.
CLAIM_COLUMNS = (
    c.id,
    c.queue,
    c.kind,
    c.payload,
    c.priority,
    c.status,
    c.attempts,
    c.max_attempts,
    c.lease_token,
    c.run_at,
    c.created_at,
    c.headers,
    c.timeout,
)


def enqueue_params(job: NewJob, *, headers: str | None = None) -> dict[str, Any]:
    """The bind values of :func:`enqueue_stmt` for *job* (and its *headers*, JSON text:
    what :func:`sqlaq.tracing.capture` returns)."""
    return {
        "b_queue": job.queue,
        "b_kind": job.kind,
        "b_payload": job.payload_json,
        "b_priority": job.priority,
        "b_delay": job.delay,
        "b_max_attempts": job.max_attempts,
        "b_dedupe_key": job.dedupe_key,
        "b_headers": headers,
        "b_run_at": job.run_at,
        "b_timeout": job.timeout,
    }


def enqueue_stmt(*, job: NewJob, headers: str | None = None) -> Insert:
    """Insert one job; ``RETURNING id``.

    Renders ``INSERT INTO sqlaq_jobs (...) VALUES (..., now() + :b_delay, ...)``. With a
    ``dedupe_key`` it adds ``ON CONFLICT (kind, dedupe_key) WHERE <pending> DO NOTHING``,
    so a duplicate returns no row and leaves the caller's transaction usable.

    *headers* (JSON text, or None) is stored in ``headers``: what the enqueuer sends
    beside the payload, the trace context of :func:`sqlaq.tracing.capture`. Execution
    parameters without ``b_headers`` leave it NULL.
    """
    v = enqueue_params(job, headers=headers)
    # Core's insert() when there is no ON CONFLICT: SQLAlchemy before 2.0.3x gives the
    # PostgreSQL dialect's Insert no cache key, so it would be compiled on every call.
    stmt = (core_insert if job.dedupe_key is None else insert)(jobs).values(
        queue=bindparam("b_queue", v["b_queue"], Text),
        kind=bindparam("b_kind", v["b_kind"], Text),
        payload=cast(bindparam("b_payload", v["b_payload"], Text), JSONB),
        priority=bindparam("b_priority", v["b_priority"], SmallInteger),
        # An absolute run_at when given, else now() + delay (one of them is zero/None).
        run_at=func.coalesce(
            bindparam("b_run_at", v["b_run_at"], TIMESTAMP(timezone=True)),
            _NOW + bindparam("b_delay", v["b_delay"], Interval),
        ),
        max_attempts=bindparam("b_max_attempts", v["b_max_attempts"], Integer),
        dedupe_key=bindparam("b_dedupe_key", v["b_dedupe_key"], Text),
        headers=cast(bindparam("b_headers", v["b_headers"], Text), JSONB),
        timeout=bindparam("b_timeout", v["b_timeout"], Interval),
    )
    if isinstance(stmt, PgInsert):
        stmt = stmt.on_conflict_do_nothing(
            index_elements=[c.kind, c.dedupe_key], index_where=_DEDUPE
        )
    return stmt.returning(c.id)


def debounce_enqueue_stmt(
    *,
    job: NewJob,
    debounce_key: str,
    debounce: timedelta,
    max_wait: timedelta | None = None,
    headers: str | None = None,
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
    """
    v = enqueue_params(job, headers=headers)
    delay = _NOW + bindparam("b_debounce", debounce, Interval)
    stmt = insert(jobs).values(
        queue=bindparam("b_queue", v["b_queue"], Text),
        kind=bindparam("b_kind", v["b_kind"], Text),
        payload=cast(bindparam("b_payload", v["b_payload"], Text), JSONB),
        priority=bindparam("b_priority", v["b_priority"], SmallInteger),
        run_at=delay,
        max_attempts=bindparam("b_max_attempts", v["b_max_attempts"], Integer),
        debounce_key=bindparam("b_debounce_key", debounce_key, Text),
        headers=cast(bindparam("b_headers", v["b_headers"], Text), JSONB),
        timeout=bindparam("b_timeout", v["b_timeout"], Interval),
    )
    excluded = stmt.excluded
    stmt = stmt.on_conflict_do_update(
        index_elements=[c.kind, c.debounce_key],
        index_where=_DEBOUNCE,
        set_={
            "payload": excluded.payload,
            "priority": excluded.priority,
            "max_attempts": excluded.max_attempts,
            "timeout": excluded.timeout,
            "headers": excluded.headers,
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
    source = select(
        hold.c.job_id,
        bindparam("b_queue", v["b_queue"], Text),
        kind,
        cast(bindparam("b_payload", v["b_payload"], Text), JSONB),
        bindparam("b_priority", v["b_priority"], SmallInteger),
        func.coalesce(
            bindparam("b_run_at", v["b_run_at"], TIMESTAMP(timezone=True)),
            _NOW + bindparam("b_delay", v["b_delay"], Interval),
        ),
        bindparam("b_max_attempts", v["b_max_attempts"], Integer),
        key,
        cast(bindparam("b_headers", v["b_headers"], Text), JSONB),
        cast(bindparam("b_timeout", v["b_timeout"], Interval), Interval),
    )
    columns = [
        "id",
        "queue",
        "kind",
        "payload",
        "priority",
        "run_at",
        "max_attempts",
        "dedupe_key",
        "headers",
        "timeout",
    ]
    inserted = (
        insert(jobs)
        .from_select(columns, source)
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


def enqueue_many_stmt(*, jobs_: Sequence[NewJob], headers: str | None = None) -> Insert:
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
    is the lighter statement for jobs that differ only in their payload.
    """
    arrays: dict[str, tuple[list[Any], ARRAY[Any]]] = {
        "b_queues": ([j.queue for j in jobs_], ARRAY(Text)),
        "b_kinds": ([j.kind for j in jobs_], ARRAY(Text)),
        "b_priorities": ([j.priority for j in jobs_], ARRAY(SmallInteger)),
        "b_delays": ([j.delay for j in jobs_], ARRAY(Interval)),
        "b_max_attempts": ([j.max_attempts for j in jobs_], ARRAY(Integer)),
        "b_dedupe_keys": ([j.dedupe_key for j in jobs_], ARRAY(Text)),
        "b_run_ats": ([j.run_at for j in jobs_], ARRAY(TIMESTAMP(timezone=True))),
        "b_timeouts": ([j.timeout for j in jobs_], ARRAY(Interval)),
    }
    rows = (
        func.unnest(*(bindparam(name, value, type_) for name, (value, type_) in arrays.items()))
        .table_valued(
            "queue",
            "kind",
            "priority",
            "delay",
            "max_attempts",
            "dedupe_key",
            "run_at",
            "timeout",
            with_ordinality="ordinality",
        )
        .render_derived(name="new_jobs")
    )
    payloads_json = f"[{','.join([j.payload_json for j in jobs_])}]"
    payloads = (
        func.jsonb_array_elements(cast(bindparam("b_payloads", payloads_json, Text), JSONB))
        .table_valued("value", with_ordinality="ordinality")
        .render_derived(name="payloads")
    )
    source = (
        select(
            rows.c.queue,
            rows.c.kind,
            payloads.c.value,
            rows.c.priority,
            func.coalesce(rows.c.run_at, _NOW + rows.c.delay),
            rows.c.max_attempts,
            rows.c.dedupe_key,
            cast(bindparam("b_headers", headers, Text), JSONB),
            rows.c.timeout,
        )
        .select_from(rows.join(payloads, payloads.c.ordinality == rows.c.ordinality))
        .order_by(rows.c.ordinality)
    )
    columns = ["queue", "kind", "payload", "priority", "run_at", "max_attempts", "dedupe_key"]
    stmt = insert(jobs).from_select([*columns, "headers", "timeout"], source)
    stmt = stmt.on_conflict_do_nothing(index_elements=[c.kind, c.dedupe_key], index_where=_DEDUPE)
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
    source = select(
        cast(bindparam("b_queue", type_=Text), Text),
        cast(bindparam("b_kind", type_=Text), Text),
        payloads.c.value,
        cast(bindparam("b_priority", type_=SmallInteger), SmallInteger),
        func.coalesce(
            cast(bindparam("b_run_at", type_=TIMESTAMP(timezone=True)), TIMESTAMP(timezone=True)),
            _NOW + cast(bindparam("b_delay", type_=Interval), Interval),
        ),
        cast(bindparam("b_max_attempts", type_=Integer), Integer),
        cast(bindparam("b_headers", type_=Text), JSONB),
        cast(bindparam("b_timeout", type_=Interval), Interval),
    ).order_by(payloads.c.ordinality)
    columns = ["queue", "kind", "payload", "priority", "run_at", "max_attempts", "headers"]
    stmt = insert(jobs).from_select([*columns, "timeout"], source)
    return stmt.returning(c.id)


def enqueue_uniform_params(
    job: NewJob, payloads_json: str, *, headers: str | None = None
) -> dict[str, Any]:
    """The bind values of :func:`enqueue_uniform_stmt`: every column but the payload
    from *job*, the payloads as one JSON array text (one element per job, in order),
    and the *headers* (JSON text) of every job."""
    return {
        "b_queue": job.queue,
        "b_kind": job.kind,
        "b_payloads": payloads_json,
        "b_priority": job.priority,
        "b_delay": job.delay,
        "b_run_at": job.run_at,
        "b_max_attempts": job.max_attempts,
        "b_headers": headers,
        "b_timeout": job.timeout,
    }


#: Columns :func:`enqueue_copy_stmt` loads, in this order; ``run_at`` and ``created_at``
#: keep their default, ``now()``.
COPY_COLUMNS = ("queue", "kind", "payload", "priority", "max_attempts")


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


def claim_params(
    *,
    queue: str,
    worker_id: UUID,
    limit: int,
    lease: timedelta,
    kind: str | None = None,
    exclude_kinds: Collection[str] = (),
) -> dict[str, Any]:
    """The bind values of :func:`claim_stmt` (built with the same *kind* or
    *exclude_kinds* choice: each variant is a statement of its own)."""
    params = {"b_queue": queue, "b_worker": worker_id, "b_limit": limit, "b_lease": lease}
    if kind is not None:
        params["b_kind"] = kind
    if exclude_kinds:
        params["b_excluded"] = sorted(exclude_kinds)
    return params


def claim_stmt(
    *,
    queue: str,
    worker_id: UUID,
    limit: int,
    lease: timedelta,
    kind: str | None = None,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Update:
    """Claim up to *limit* due jobs of *queue*, in priority order; never more.

    With *kind*, only jobs of that kind (``AND kind = :b_kind``): the claim of a limited
    kind, run under :func:`lock_kind_stmt`. With *exclude_kinds*, jobs of any other kind
    (``AND kind <> ALL(:b_excluded)``): the claim that must not bypass those limits.

    *where* narrows the claim (worker affinity): one boolean clause, or a sequence of
    them, over :data:`sqlaq.jobs` columns, e.g. ``jobs.c.payload["region"].astext ==
    "eu"``. The clauses land inside the locking CTE, beside the due-job predicate, so
    only matching rows are locked and claimed. (``claim_stmt(...).where(...)`` would
    filter the UPDATE after the CTE had locked and counted other rows: fewer jobs
    claimed, and rows of other workers locked until commit.) A clause may use another
    table only inside a subquery (``EXISTS``/``IN``); the CTE's FROM stays
    ``sqlaq_jobs``.

    Raises:
        ConfigError: *where* is not a SQLAlchemy clause, or brings another table into
            the claim's FROM.

    Renders::

        WITH candidates AS MATERIALIZED (
            SELECT id FROM sqlaq_jobs
            WHERE status IN ('queued', 'running') AND queue = :b_queue AND run_at <= now()
              AND NOT EXISTS (SELECT * FROM sqlaq_paused_queues
                              WHERE sqlaq_paused_queues.queue = :b_queue)
            ORDER BY priority DESC, run_at, id LIMIT :b_limit FOR UPDATE SKIP LOCKED)
        UPDATE sqlaq_jobs SET status = 'running', attempts = attempts + 1,
            locked_by = :b_worker, lease_token = gen_random_uuid(), run_at = now() + :b_lease
        FROM candidates WHERE sqlaq_jobs.id = candidates.id
            AND sqlaq_jobs.id = ANY (ARRAY(SELECT candidates.id FROM candidates))
        RETURNING ...

    A paused queue (a row in ``sqlaq_paused_queues``, see :mod:`sqlaq.control`) gives
    nothing: its jobs stay as they are until it is resumed.

    A due ``running`` row is a job whose lease expired. If it has attempts left it is
    claimed again (``last_error`` records the expiry). If it was on its last attempt it
    is marked ``failed`` in the same statement with a ``last_error`` saying the lease
    expired, and returned with status ``failed`` so the caller can skip it: a job that
    kills its worker every time ends failed and never loops.
    """
    v = claim_params(queue=queue, worker_id=worker_id, limit=limit, lease=lease)
    which: list[ColumnElement[bool]] = []
    if kind is not None:
        which.append(c.kind == bindparam("b_kind", kind, Text))
    if exclude_kinds:
        excluded = bindparam("b_excluded", sorted(exclude_kinds), ARRAY(Text))
        which.append(c.kind != func.all(excluded))
    narrowed = _where_clauses(where)
    queue_ = bindparam("b_queue", v["b_queue"], Text)
    candidates = (
        select(c.id)
        .where(
            _PENDING,
            c.queue == queue_,
            c.run_at <= _NOW,
            # Uncorrelated, so PostgreSQL runs it once per claim (an InitPlan: one probe
            # of the paused table's primary key) and skips the claim index's walk
            # altogether while the queue is paused (a one-time filter).
            ~exists().where(paused_queues.c.queue == queue_),
            *which,
            *narrowed,
        )
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(bindparam("b_limit", v["b_limit"], Integer))
        .with_for_update(skip_locked=True)
        .cte("candidates")
        .prefix_with("MATERIALIZED")
    )
    exhausted = and_(_RUNNING, c.attempts >= c.max_attempts)
    expired_error = _expired_error()
    reclaimed_error = _expired_error("claimed again")
    # The join alone lets the planner hash the whole table when the limit is large and
    # the table small (a 200-row claim beside 20,000 queued rows: a seq scan, 7.3 ms);
    # "id = ANY(ARRAY(<the candidates>))" hands it the ids as an index condition, read
    # once from the materialized CTE (an InitPlan, never re-run per row): 2.5 ms.
    picked = func.any(func.array(select(candidates.c.id).scalar_subquery()))
    return (
        update(jobs)
        .where(c.id == candidates.c.id, c.id == picked)
        .values(
            status=case((exhausted, _status(JobStatus.FAILED)), else_=_status(JobStatus.RUNNING)),
            attempts=case((exhausted, c.attempts), else_=c.attempts + literal_column("1", Integer)),
            locked_by=case(
                (exhausted, null()),
                else_=bindparam("b_worker", v["b_worker"], PG_UUID(as_uuid=True)),
            ),
            lease_token=case((exhausted, null()), else_=func.gen_random_uuid()),
            run_at=case(
                (exhausted, c.run_at), else_=_NOW + bindparam("b_lease", v["b_lease"], Interval)
            ),
            finished_at=case((exhausted, _NOW), else_=null()),
            attempted_at=case((exhausted, c.attempted_at), else_=_NOW),
            last_error=case(
                (exhausted, expired_error),
                (_RUNNING, reclaimed_error),
                else_=c.last_error,
            ),
        )
        .returning(*CLAIM_COLUMNS)
    )


def _where_clauses(
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]],
) -> list[ColumnElement[bool]]:
    """*where* as a list of clauses over ``sqlaq_jobs`` alone (see :func:`claim_stmt`)."""
    clauses = list(where) if isinstance(where, Sequence) else [where]
    for clause in clauses:
        if not isinstance(clause, ClauseElement) or isinstance(clause, FromClause):
            raise ConfigError(
                f"where must be a SQLAlchemy boolean clause (or a sequence of them) over "
                f"sqlaq.jobs columns, got {type(clause).__name__}: e.g. "
                "sqlaq.jobs.c.payload['region'].astext == 'eu'"
            )
    if clauses:
        froms = select(c.id).where(*clauses).get_final_froms()
        others = [f for f in froms if f is not jobs]
        if others:
            names = ", ".join(sorted(str(getattr(f, "name", f)) for f in others))
            raise ConfigError(
                f"where uses {names} beside sqlaq_jobs: a claim reads sqlaq_jobs only; "
                "test other tables inside a subquery, e.g. exists().where(...)"
            )
    return clauses


def lock_kind_stmt(*, kind: str) -> Select[Any]:
    """Take the claim lock of a limited *kind* until the transaction ends.

    Renders ``SELECT pg_advisory_xact_lock(<KIND_LOCK_CLASS>, hashtext(:b_kind))``. Run
    it first, in its own statement: the statements after it then see every claim
    committed by the lock's previous holder (each statement of a READ COMMITTED
    transaction takes a fresh snapshot; a lock taken inside a statement would not).
    Two kinds whose names hash alike share a lock, which only makes them take turns.
    """
    key = func.hashtext(bindparam("b_kind", kind, Text))
    return select(func.pg_advisory_xact_lock(literal_column(str(KIND_LOCK_CLASS), Integer), key))


def kind_limit_state_params(*, kind: str, rate: Rate | None) -> dict[str, Any]:
    """The bind values of :func:`kind_limit_state_stmt`."""
    return {
        "b_kind": kind,
        "b_period": rate.period if rate else timedelta(0),
        "b_count": rate.count if rate else 1,
    }


def kind_limit_state_stmt(*, kind: str, rate: Rate | None) -> Select[Any]:
    """Select what a limited claim of *kind* needs: ``running, recent, pivot, now``.

    * ``running``: the kind's live leases (running rows whose lease has not expired; an
      expired one is claimable again, so it no longer holds a slot), counted through
      the running index.
    * ``recent``: how many starts of the kind's log (``sqlaq_rates``) count against
      *rate* now: those less than a period old, and any later than ``now()`` (written
      by a transaction that started after this one but took the lock first).
    * ``pivot``: the start that must leave the window before one more may start once
      the log is full: the ``count``-th newest counted start, else the oldest one (NULL
      when none counts).
    * ``now``: the transaction's clock, to which new starts are written.

    The log stays in the database: only two numbers and a timestamp come back.
    """
    v = kind_limit_state_params(kind=kind, rate=rate)
    kind_ = bindparam("b_kind", v["b_kind"], Text)
    running = (
        select(func.count())
        .select_from(jobs)
        .where(_RUNNING, c.kind == kind_, c.run_at > _NOW)
        .scalar_subquery()
    )
    start = _counted_starts(bindparam("b_period", v["b_period"], Interval), kind_)
    recent = select(func.count()).select_from(start).scalar_subquery()
    kth_newest = (
        select(start.c.s)
        .order_by(start.c.s.desc())
        .offset(bindparam("b_count", v["b_count"], Integer) - literal_column("1", Integer))
        .limit(1)
        .scalar_subquery()
    )
    oldest = select(func.min(start.c.s)).scalar_subquery()
    return select(
        running.label("running"),
        recent.label("recent"),
        func.coalesce(kth_newest, oldest).label("pivot"),
        _NOW.label("now"),
    )


def _counted_starts(period: ColumnElement[Any], kind: ColumnElement[str]) -> Any:
    """``SELECT s FROM sqlaq_rates, unnest(starts) AS s WHERE kind = :kind AND s > now() -
    :period``, as a subquery with column ``s``."""
    s = func.unnest(rates.c.starts).table_valued("s").render_derived(name="start")
    return (
        select(s.c.s)
        .select_from(rates)
        .join(s, literal_column("true", Boolean))
        .where(rates.c.kind == kind, s.c.s > _NOW - period)
        .subquery("counted")
    )


def record_starts_params(*, kind: str, rate: Rate, started: int) -> dict[str, Any]:
    """The bind values of :func:`record_starts_stmt`."""
    return {"b_kind": kind, "b_period": rate.period, "b_count": rate.count, "b_started": started}


def record_starts_stmt(*, kind: str, rate: Rate, started: int) -> Insert:
    """Log *started* new starts of *kind* at ``now()``, keeping only the starts that
    still count and at most the rate's count of them (the newest).

    Renders ``INSERT INTO sqlaq_rates (kind, starts) VALUES (:b_kind, <new starts>) ON
    CONFLICT (kind) DO UPDATE SET starts = ARRAY(SELECT s FROM (<counted old starts>
    UNION ALL <new starts>) ORDER BY s DESC LIMIT :b_count)``. The caller holds the
    kind's claim lock, so no one else writes the row meanwhile; the array never leaves
    the database.
    """
    v = record_starts_params(kind=kind, rate=rate, started=started)
    new = select(_NOW.label("s")).select_from(
        func.generate_series(
            literal_column("1", Integer), bindparam("b_started", v["b_started"], Integer)
        )
    )
    count = bindparam("b_count", v["b_count"], Integer)
    stmt = insert(rates).values(
        kind=bindparam("b_kind", v["b_kind"], Text),
        starts=func.array(new.limit(count).scalar_subquery()),
    )
    old = func.unnest(rates.c.starts).table_valued("s").render_derived(name="old")
    period = bindparam("b_period", v["b_period"], Interval)
    kept = select(old.c.s).where(old.c.s > _NOW - period).union_all(new).subquery("kept")
    merged = select(kept.c.s).order_by(kept.c.s.desc()).limit(count).scalar_subquery()
    return stmt.on_conflict_do_update(
        index_elements=[rates.c.kind], set_={"starts": func.array(merged)}
    )


def _expired_error(then: str | None = None) -> ColumnElement[str]:
    """``last_error`` of a job whose lease expired: ``'lease expired on attempt N of M:
    the worker stopped or crashed while running the job; not retried'`` on its last
    attempt, else ``'lease expired on attempt N; <then>'`` (claimed or queued again)."""
    head = literal_column("'lease expired on attempt '", Text) + cast(c.attempts, Text)
    if then is not None:
        return head + literal_column(f"'; {then}'", Text)
    return (
        head
        + literal_column("' of '", Text)
        + cast(c.max_attempts, Text)
        + literal_column(
            "': the worker stopped or crashed while running the job; not retried'", Text
        )
    )


def fence_params(leases: Collection[Lease]) -> dict[str, Any]:
    """The bind values that fence :func:`complete_stmt` (and the others) to *leases*.

    The id and token lists travel as array literals in text (``'{1,2,3}'``), cast to
    ``bigint[]`` and ``uuid[]`` by the statement: psycopg adapts a list element by
    element in Python, which cost a completing worker a few percent of its time, while a
    joined string is one parameter.
    """
    return {
        "b_ids": "{" + ",".join([str(lease.job_id) for lease in leases]) + "}",
        "b_tokens": "{" + ",".join([str(lease.token) for lease in leases]) + "}",
    }


class _ArrayLiteral(UserDefinedType[str]):
    """A bind parameter holding an array literal in text (``'{1,2,3}'``), rendered with
    the array's cast (``%(b_ids)s::BIGINT[]``). psycopg sends a str untyped, so the
    server types the parameter as the array itself and parses it in C: the planner sees
    an array parameter, exactly as with a list (a ``CAST`` of a text parameter instead
    hides the array's size from it and can turn the primary-key lookup into a scan).

    asyncpg types every parameter from the prepared statement and wants a list for an
    array: on that driver the literal is split back into one (*element* converts each
    item), which costs what binding a list costs anyway."""

    cache_ok = True
    render_bind_cast = True

    def __init__(self, spec: str, element: Callable[[str], Any] = str) -> None:
        self.spec = spec
        self.element = element

    def get_col_spec(self, **_kw: Any) -> str:
        return self.spec

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        if dialect.driver != "asyncpg":
            return None
        element = self.element

        def as_list(value: Any) -> Any:
            if not isinstance(value, str):
                return value
            inner = value[1:-1]
            return [element(item) for item in inner.split(",")] if inner else []

        return as_list


_ID_LITERAL = _ArrayLiteral("BIGINT[]", int)
_UUID_LITERAL = _ArrayLiteral("UUID[]", UUID)


def _fence(leases: Collection[Lease]) -> ColumnElement[bool]:
    # The token is unique to one claim of one job, so "id = ANY AND token = ANY" can only
    # match a (job, token) pair that belongs together; id = ANY lets the primary key find
    # the rows.
    v = fence_params(leases)
    return and_(
        c.id == func.any(bindparam("b_ids", v["b_ids"], _ID_LITERAL)),
        c.lease_token == func.any(bindparam("b_tokens", v["b_tokens"], _UUID_LITERAL)),
        _RUNNING,
    )


def extend_lease_stmt(*, leases: Collection[Lease], lease: timedelta) -> Update:
    """Move the end of every still-held lease in *leases* to ``now() + lease``.

    Renders ``UPDATE sqlaq_jobs SET run_at = now() + :b_lease WHERE id = ANY(:b_ids) AND
    lease_token = ANY(:b_tokens) AND status = 'running' RETURNING id, run_at``: one
    statement per heartbeat whatever the number of jobs in flight. A lease that was
    lost (reclaimed, cancelled, finished) returns no row.
    """
    return (
        update(jobs)
        .where(_fence(leases))
        .values(run_at=_NOW + bindparam("b_lease", lease, Interval))
        .returning(c.id, c.run_at)
    )


def complete_stmt(*, leases: Collection[Lease]) -> Update:
    """Mark done every job in *leases* whose lease is still its current one.

    Renders ``UPDATE sqlaq_jobs SET status = 'done', finished_at = now(), lease_token =
    NULL WHERE <fence> RETURNING id``. Matches no row for a lease that is no longer the
    job's current one, so a worker whose job was reclaimed cannot finish the newer
    attempt.
    """
    return (
        update(jobs)
        .where(_fence(leases))
        .values(status=_status(JobStatus.DONE), finished_at=_NOW, lease_token=null())
        .returning(c.id)
    )


def complete_result_params(*, lease: Lease, result_json: str) -> dict[str, Any]:
    """The bind values of :func:`complete_result_stmt`."""
    return fence_params([lease]) | {"b_result": result_json}


def complete_result_stmt(*, lease: Lease, result_json: str) -> Update:
    """Mark the job held by *lease* done and store *result_json* (JSON text) with it.

    Renders ``UPDATE sqlaq_jobs SET status = 'done', finished_at = now(), lease_token =
    NULL, result = CAST(:b_result AS JSONB) WHERE <fence> RETURNING id``: what
    :func:`complete_stmt` does for one lease, plus the handler's return value. No row
    when the lease was lost, so a stale holder stores no result either.
    """
    v = complete_result_params(lease=lease, result_json=result_json)
    return (
        update(jobs)
        .where(_fence([lease]))
        .values(
            status=_status(JobStatus.DONE),
            finished_at=_NOW,
            lease_token=null(),
            result=cast(bindparam("b_result", v["b_result"], Text), JSONB),
        )
        .returning(c.id)
    )


def fail_params(*, lease: Lease, error: str, retry_in: timedelta | None) -> dict[str, Any]:
    """The bind values of :func:`fail_stmt`."""
    return fence_params([lease]) | {
        "b_retry": retry_in is not None,
        "b_retry_in": retry_in or timedelta(0),
        "b_error": error,
    }


def fail_stmt(*, lease: Lease, error: str, retry_in: timedelta | None) -> Update:
    """Record a failed attempt of the job held by *lease*.

    With *retry_in* and attempts left: ``status = 'queued', run_at = now() + retry_in``.
    Otherwise ``status = 'failed', finished_at = now()``. Either way ``last_error =
    error`` and the lease is released. ``RETURNING id, status, run_at``; no row when the
    lease was lost.
    """
    v = fail_params(lease=lease, error=error, retry_in=retry_in)
    retry = and_(bindparam("b_retry", v["b_retry"], Boolean), c.attempts < c.max_attempts)
    return (
        update(jobs)
        .where(_fence([lease]))
        .values(
            status=case((retry, _status(JobStatus.QUEUED)), else_=_status(JobStatus.FAILED)),
            run_at=case(
                (retry, _NOW + bindparam("b_retry_in", v["b_retry_in"], Interval)),
                else_=c.run_at,
            ),
            finished_at=case((retry, null()), else_=_NOW),
            last_error=bindparam("b_error", v["b_error"], Text),
            locked_by=null(),
            lease_token=null(),
        )
        .returning(c.id, c.status, c.run_at)
    )


def retry_stmt(*, job_ids: Collection[int]) -> Update:
    """Queue failed or cancelled jobs again, due now, with a fresh set of attempts.

    Renders ``UPDATE sqlaq_jobs SET status = 'queued', run_at = now(), attempts = 0,
    finished_at = NULL WHERE id = ANY(:b_ids) AND status IN ('failed', 'cancelled') AND
    NOT EXISTS (<a pending job with the same kind and dedupe_key>) RETURNING id``.
    ``last_error`` is kept as history. A job whose dedupe key is held by another pending
    job is left alone (retrying it would break the at-most-one-pending rule), and so is a
    never-started job whose debounce key another never-started queued job holds.
    """
    twin = jobs.alias("twin")
    return (
        update(jobs)
        .where(
            c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)),
            c.status.in_([_status(JobStatus.FAILED), _status(JobStatus.CANCELLED)]),
            ~exists().where(
                twin.c.kind == c.kind,
                twin.c.dedupe_key == c.dedupe_key,
                twin.c.status.in_([_status(JobStatus.QUEUED), _status(JobStatus.RUNNING)]),
                twin.c.id != c.id,
            ),
            ~exists().where(
                twin.c.kind == c.kind,
                twin.c.debounce_key == c.debounce_key,
                twin.c.status == _status(JobStatus.QUEUED),
                twin.c.attempted_at.is_(None),
                c.attempted_at.is_(None),
                twin.c.id != c.id,
            ),
        )
        .values(
            status=_status(JobStatus.QUEUED),
            run_at=_NOW,
            attempts=literal_column("0", Integer),
            finished_at=null(),
            locked_by=null(),
            lease_token=null(),
        )
        .returning(c.id)
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
    was = (
        select(c.id, c.status)
        .where(c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)), _PENDING)
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
            LIMIT :b_limit FOR UPDATE SKIP LOCKED)
        DELETE FROM sqlaq_jobs USING doomed WHERE sqlaq_jobs.id = doomed.id

    Pending rows can never match (the literal predicate), and the finished index serves
    the scan. Run it repeatedly, committing between batches, to prune a large backlog.

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
    )


def count_prunable_stmt(*, older_than: timedelta, statuses: Collection[JobStatus]) -> Select[int]:
    """Count the jobs :func:`prune_stmt` would delete (for a progress bar)."""
    return select(func.count()).where(_prunable(older_than, statuses))


# --- maintenance (the leader) and periodic jobs ---


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


def clock_stmt() -> Select[Any]:
    """``SELECT now()``: the database's clock, the only one sqlaq reads."""
    return select(_NOW)


def periodic_insert_stmt(*, name: str, slot: datetime) -> Insert:
    """Record periodic job *name* at *slot* if it has no row yet; ``RETURNING name``
    (no row: it had one). Waits for a concurrent first insert of the same name."""
    stmt = insert(periodic).values(
        name=bindparam("b_name", name, Text),
        last_slot=bindparam("b_slot", slot, TIMESTAMP(timezone=True)),
    )
    return stmt.on_conflict_do_nothing(index_elements=[periodic.c.name]).returning(periodic.c.name)


def periodic_lock_stmt(*, name: str) -> Select[Any]:
    """``SELECT last_slot FROM sqlaq_periodic WHERE name = :b_name FOR UPDATE``: waits
    for any other transaction holding the row, then reads what it committed."""
    return (
        select(periodic.c.last_slot)
        .where(periodic.c.name == bindparam("b_name", name, Text))
        .with_for_update()
    )


def periodic_advance_stmt(*, name: str, slot: datetime) -> Update:
    """Move periodic job *name* to *slot* (the caller holds its row lock)."""
    return (
        update(periodic)
        .where(periodic.c.name == bindparam("b_name", name, Text))
        .values(last_slot=bindparam("b_slot", slot, TIMESTAMP(timezone=True)), updated_at=_NOW)
    )


# The leader lock's two keys, inlined like the other constants of schema.py.
_LEADER_KEY = tuple(literal_column(str(k), Integer) for k in LEADER_LOCK)


def try_lead_stmt() -> Select[Any]:
    """``SELECT pg_try_advisory_lock(<LEADER_LOCK>)``: true for the one session that
    holds the maintenance leader's lock (until it unlocks or its connection ends)."""
    return select(func.pg_try_advisory_lock(*_LEADER_KEY))


def resign_stmt() -> Select[Any]:
    """``SELECT pg_advisory_unlock(<LEADER_LOCK>)``: give leadership up."""
    return select(func.pg_advisory_unlock(*_LEADER_KEY))


# --- vacuum during deep drains (sqlaq.worker.vacuum) ---


def vacuum_need_stmt() -> Any:
    """One row: the jobs table's dead and live row versions by the statistics
    (``pg_stat_user_tables.n_dead_tup``, ``n_live_tup``; 0 before any report) and
    whether this role may ``VACUUM`` it: a member of its owner's role, a superuser, or,
    on PostgreSQL 17 and later, a role granted ``MAINTAIN`` on it (asked only there:
    older servers do not know the privilege's name).
    """
    rel = table("pg_class", column("oid"), column("relowner"), schema="pg_catalog")
    stats = table(
        "pg_stat_user_tables",
        column("relid"),
        column("n_dead_tup"),
        column("n_live_tup"),
        schema="pg_catalog",
    )
    roles = table("pg_roles", column("rolname"), column("rolsuper"), schema="pg_catalog")
    superuser = (
        select(roles.c.rolsuper).where(roles.c.rolname == func.current_user()).scalar_subquery()
    )
    maintain = case(
        (
            cast(func.current_setting(literal_column("'server_version_num'")), Integer) >= 170000,
            func.has_table_privilege(rel.c.oid, literal_column("'MAINTAIN'")),
        ),
        else_=false(),
    )
    return (
        select(
            func.coalesce(stats.c.n_dead_tup, 0),
            func.coalesce(stats.c.n_live_tup, 0),
            or_(func.pg_has_role(rel.c.relowner, literal_column("'USAGE'")), superuser, maintain),
        )
        .select_from(rel.outerjoin(stats, stats.c.relid == rel.c.oid))
        .where(rel.c.oid == cast(literal_column(f"'{jobs.fullname}'", Text), REGCLASS))
    )


def vacuum_stmt() -> TextClause:
    """``VACUUM (SKIP_LOCKED) sqlaq_jobs``: skipped at once, not waited for, while
    another vacuum (autovacuum's, another worker's) holds the table. Runs outside a
    transaction: execute it on a connection in autocommit."""
    return text(f"VACUUM (SKIP_LOCKED) {jobs.fullname}")


# --- operators: paused queues and the workers' heartbeat rows ---

_WAKE_CHANNEL = literal_column(f"'{CHANNEL}'", Text)


def pause_stmt(*, queue: str, paused_by: str | None = None) -> Insert:
    """Pause *queue*: no claim takes its jobs until :func:`resume_stmt`.

    Renders ``INSERT INTO sqlaq_paused_queues (queue, paused_by) VALUES (:b_queue,
    :b_by) ON CONFLICT (queue) DO NOTHING RETURNING queue``: no row when the queue was
    paused already (its row is kept as it was). Every claim probes this table (see
    :func:`claim_stmt`), so the pause holds for every claim that starts after the
    commit, on every worker, with nothing to notify: running jobs are left alone.
    """
    return (
        insert(paused_queues)
        .values(
            queue=bindparam("b_queue", queue, Text),
            paused_by=bindparam("b_by", paused_by, Text),
        )
        .on_conflict_do_nothing(index_elements=[paused_queues.c.queue])
        .returning(paused_queues.c.queue)
    )


def resume_stmt(*, queue: str) -> Select[Any]:
    """Resume *queue*, and wake its workers on commit.

    Renders::

        WITH resumed AS (
            DELETE FROM sqlaq_paused_queues WHERE queue = :b_queue RETURNING queue)
        SELECT resumed.queue, pg_notify('sqlaq_jobs', resumed.queue) FROM resumed

    No row: the queue was not paused. The notification (the insert trigger's, on the
    same channel) makes idle workers of the queue claim at once instead of at their
    next poll.
    """
    resumed = (
        delete(paused_queues)
        .where(paused_queues.c.queue == bindparam("b_queue", queue, Text))
        .returning(paused_queues.c.queue)
        .cte("resumed")
    )
    return select(resumed.c.queue, func.pg_notify(_WAKE_CHANNEL, resumed.c.queue))


def paused_queues_stmt(*, queue: str | None = None) -> Select[Any]:
    """Select the paused queues (or *queue*, if paused): ``queue, paused_at,
    paused_by``, by name."""
    stmt = select(
        paused_queues.c.queue, paused_queues.c.paused_at, paused_queues.c.paused_by
    ).order_by(paused_queues.c.queue)
    if queue is not None:
        stmt = stmt.where(paused_queues.c.queue == bindparam("b_queue", queue, Text))
    return stmt


def heartbeat_stmt(
    *, worker_id: UUID, hostname: str, pid: int, queues: Sequence[str], concurrency: int
) -> Insert:
    """Record that a worker is alive: insert its row, or move its ``last_seen_at`` to
    ``now()``.

    Renders ``INSERT INTO sqlaq_workers (worker_id, hostname, pid, queues, concurrency)
    VALUES (...) ON CONFLICT (worker_id) DO UPDATE SET last_seen_at = now()``; the first
    one sets ``started_at`` too (its default). A row pruned meanwhile (the worker stalled
    for longer than :func:`prune_workers_stmt` allows) comes back as new.
    """
    stmt = insert(workers).values(
        worker_id=bindparam("b_worker", worker_id, PG_UUID(as_uuid=True)),
        hostname=bindparam("b_hostname", hostname, Text),
        pid=bindparam("b_pid", pid, Integer),
        queues=bindparam("b_queues", list(queues), ARRAY(Text)),
        concurrency=bindparam("b_concurrency", concurrency, Integer),
    )
    return stmt.on_conflict_do_update(
        index_elements=[workers.c.worker_id], set_={"last_seen_at": _NOW}
    )


def forget_worker_stmt(*, worker_id: UUID) -> Delete:
    """``DELETE FROM sqlaq_workers WHERE worker_id = :b_worker``: a worker that stops."""
    return delete(workers).where(
        workers.c.worker_id == bindparam("b_worker", worker_id, PG_UUID(as_uuid=True))
    )


def prune_workers_stmt(*, older_than: timedelta) -> ReturningDelete[Any]:
    """Delete the rows of workers not seen for *older_than* (killed, or lost the
    database): ``DELETE FROM sqlaq_workers WHERE last_seen_at < now() - :b_older_than
    RETURNING worker_id``."""
    return (
        delete(workers)
        .where(workers.c.last_seen_at < _NOW - bindparam("b_older_than", older_than, Interval))
        .returning(workers.c.worker_id)
    )


def workers_stmt(*, worker_id: UUID | None = None) -> Select[Any]:
    """Select the workers' rows (or *worker_id*'s): ``worker_id, hostname, pid, queues,
    concurrency, started_at, last_seen_at`` and ``seen_ago`` (``now() -
    last_seen_at``), oldest first."""
    stmt = select(*workers.c, (_NOW - workers.c.last_seen_at).label("seen_ago")).order_by(
        workers.c.started_at, workers.c.worker_id
    )
    if worker_id is not None:
        stmt = stmt.where(
            workers.c.worker_id == bindparam("b_worker", worker_id, PG_UUID(as_uuid=True))
        )
    return stmt


def serving_workers_stmt(*, queue: str, within: timedelta) -> Select[int, Any]:
    """Select how many workers that serve *queue* were seen within *within* of
    ``now()`` (``recent``), and when one was seen last (``last_seen``, NULL if none
    ever was): ``SELECT count(*) FILTER (WHERE last_seen_at > now() - :b_within),
    max(last_seen_at) FROM sqlaq_workers WHERE :b_queue = ANY(queues)``."""
    seen = workers.c.last_seen_at
    return select(
        func.count().filter(seen > _NOW - bindparam("b_within", within, Interval)).label("recent"),
        func.max(seen).label("last_seen"),
    ).where(bindparam("b_queue", queue, Text) == func.any(workers.c.queues))


# --- why a job does not run (sqlaq.explain) ---


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


# --- the schema as the database has it (sqlaq.migrations.check(deep=True)) ---
#
# Each reads the catalog for sqlaq's objects found on the search path (to_regclass,
# to_regprocedure), as every statement here resolves them, and returns PostgreSQL's
# own rendering of each definition with the schema's name (``quote_ident``) beside it.

_pg_class = table(
    "pg_class",
    column("oid"),
    column("relname"),
    column("relnamespace"),
    column("reloptions", ARRAY(Text)),
    schema="pg_catalog",
)
_pg_namespace = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")
_pg_index = table(
    "pg_index",
    column("indexrelid"),
    column("indrelid"),
    column("indisvalid", Boolean),
    schema="pg_catalog",
)
_pg_constraint = table(
    "pg_constraint",
    column("oid"),
    column("conname"),
    column("conrelid"),
    column("contype"),
    column("conindid"),
    schema="pg_catalog",
)
_pg_trigger = table(
    "pg_trigger",
    column("oid"),
    column("tgname"),
    column("tgrelid"),
    column("tgenabled"),
    column("tgisinternal", Boolean),
    schema="pg_catalog",
)
_pg_proc = table(
    "pg_proc", column("oid"), column("proname"), column("pronamespace"), schema="pg_catalog"
)


def _regclasses(tables: Sequence[str]) -> ColumnElement[Any]:
    """``ANY(ARRAY(SELECT to_regclass(t) FROM unnest(:b_tables) AS t))``: the oids of
    *tables* found on the search path."""
    names = (
        func.unnest(bindparam("b_tables", list(tables), ARRAY(Text)))
        .table_valued("t")
        .render_derived(name="named")
    )
    return func.any(func.array(select(func.to_regclass(names.c.t)).scalar_subquery()))


def _schema_of(relation: Any) -> ColumnElement[str]:
    return (
        select(func.quote_ident(_pg_namespace.c.nspname))
        .where(_pg_namespace.c.oid == relation)
        .scalar_subquery()
    )


def catalog_tables_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select each of *tables*: ``name, schema`` (NULL: not found on the search path)
    and ``reloptions`` (its storage parameters, ``{'k=v', ...}``)."""
    wanted = (
        func.unnest(bindparam("b_tables", list(tables), ARRAY(Text)))
        .table_valued("name")
        .render_derived(name="wanted")
    )
    found = _pg_class.c.oid == func.to_regclass(wanted.c.name)
    return (
        select(wanted.c.name, _schema_of(_pg_class.c.relnamespace).label("schema"))
        .add_columns(_pg_class.c.reloptions)
        .select_from(wanted.outerjoin(_pg_class, found))
        .order_by(wanted.c.name)
    )


def catalog_indexes_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select every index of *tables*: ``table, name, definition``
    (``pg_get_indexdef``), ``valid`` (``indisvalid``: false after a failed ``CREATE
    INDEX CONCURRENTLY``), ``constraint`` (it backs a primary key or unique
    constraint), ``schema``."""
    table_ = _pg_class.alias("tbl")
    index_ = _pg_class.alias("idx")
    backs = exists().where(_pg_constraint.c.conindid == _pg_index.c.indexrelid)
    return (
        select(
            table_.c.relname.label("table"),
            index_.c.relname.label("name"),
            func.pg_get_indexdef(_pg_index.c.indexrelid, type_=Text).label("definition"),
            _pg_index.c.indisvalid.label("valid"),
            backs.label("constraint"),
            _schema_of(table_.c.relnamespace).label("schema"),
        )
        .select_from(_pg_index)
        .join(table_, table_.c.oid == _pg_index.c.indrelid)
        .join(index_, index_.c.oid == _pg_index.c.indexrelid)
        .where(_pg_index.c.indrelid == _regclasses(tables))
        .order_by(table_.c.relname, index_.c.relname)
    )


def catalog_constraints_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select the constraints of *tables* but NOT NULL ones: ``table, name,
    definition`` (``pg_get_constraintdef``), ``schema``."""
    table_ = _pg_class.alias("tbl")
    return (
        select(
            table_.c.relname.label("table"),
            _pg_constraint.c.conname.label("name"),
            func.pg_get_constraintdef(_pg_constraint.c.oid, type_=Text).label("definition"),
            _schema_of(table_.c.relnamespace).label("schema"),
        )
        .select_from(_pg_constraint)
        .join(table_, table_.c.oid == _pg_constraint.c.conrelid)
        .where(
            _pg_constraint.c.conrelid == _regclasses(tables),
            _pg_constraint.c.contype != literal_column("'n'"),
        )
        .order_by(table_.c.relname, _pg_constraint.c.conname)
    )


def catalog_triggers_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select the triggers of *tables* (not the internal ones of foreign keys):
    ``table, name, definition`` (``pg_get_triggerdef``), ``enabled`` (``tgenabled``:
    ``'O'`` on, ``'D'`` disabled), ``schema``."""
    table_ = _pg_class.alias("tbl")
    return (
        select(
            table_.c.relname.label("table"),
            _pg_trigger.c.tgname.label("name"),
            func.pg_get_triggerdef(_pg_trigger.c.oid, type_=Text).label("definition"),
            cast(_pg_trigger.c.tgenabled, Text).label("enabled"),
            _schema_of(table_.c.relnamespace).label("schema"),
        )
        .select_from(_pg_trigger)
        .join(table_, table_.c.oid == _pg_trigger.c.tgrelid)
        .where(_pg_trigger.c.tgrelid == _regclasses(tables), ~_pg_trigger.c.tgisinternal)
        .order_by(table_.c.relname, _pg_trigger.c.tgname)
    )


def catalog_functions_stmt(*, functions: Sequence[str]) -> Select[Any]:
    """Select each of *functions* (names of functions without arguments): ``name,
    definition`` (``pg_get_functiondef``; NULL: not found on the search path),
    ``schema``."""
    wanted = (
        func.unnest(bindparam("b_functions", list(functions), ARRAY(Text)))
        .table_valued("name")
        .render_derived(name="wanted")
    )
    found = _pg_proc.c.oid == func.to_regprocedure(func.concat(wanted.c.name, "()"))
    return (
        select(
            wanted.c.name,
            func.pg_get_functiondef(_pg_proc.c.oid, type_=Text).label("definition"),
            _schema_of(_pg_proc.c.pronamespace).label("schema"),
        )
        .select_from(wanted.outerjoin(_pg_proc, found))
        .order_by(wanted.c.name)
    )


# --- inspection (operators and tests) ---


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


def get_job_stmt(*, job_id: int) -> Select[Any]:
    """Select one job, every column, by id."""
    return select(jobs).where(c.id == bindparam("b_id", job_id, BigInteger))


#: Columns :func:`job_outcome_stmt` and :func:`watch_job_stmt` return, in this order.
OUTCOME_COLUMNS = (c.id, c.status, c.result, c.last_error, c.finished_at)


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


def has_schema_revision_stmt() -> Any:
    """Select whether the revision marker function exists (on the search path)."""
    return select(
        func.to_regprocedure(literal_column(f"'{REVISION_FUNCTION}()'", Text)).is_not(None)
    )


def schema_revision_stmt() -> Any:
    """Select the sqlaq revision the schema records (fails if the marker is missing)."""
    return select(getattr(func, REVISION_FUNCTION)())


# --- worker support ---


def _requeued(run_at: ColumnElement[Any]) -> dict[str, Any]:
    # Back to queued without counting the attempt: for hand-back and snooze.
    return {
        "status": _status(JobStatus.QUEUED),
        "run_at": run_at,
        "attempts": func.greatest(
            c.attempts - literal_column("1", Integer), literal_column("0", Integer)
        ),
        "locked_by": null(),
        "lease_token": null(),
    }


def snooze_stmt(*, leases: Collection[Lease], delay: timedelta) -> Update:
    """Queue held jobs again at ``now() + delay`` without counting the attempt.

    Renders ``UPDATE sqlaq_jobs SET status = 'queued', run_at = now() + :b_delay,
    attempts = greatest(attempts - 1, 0), locked_by = NULL, lease_token = NULL WHERE
    <fence> RETURNING id``: what a handler's ``raise sqlaq.Snooze(delay)`` writes.
    """
    return (
        update(jobs)
        .where(_fence(leases))
        .values(_requeued(_NOW + bindparam("b_delay", delay, Interval)))
        .returning(c.id)
    )


def handback_stmt(*, leases: Collection[Lease]) -> Select[int, Any]:
    """Give running jobs back to their queue, due now, with the attempt refunded.

    For a worker that stops before its jobs finish: a deploy is not a failure, so the
    attempt the claim counted is taken back and another worker may start the job at
    once. Renders::

        WITH handed AS (
            UPDATE sqlaq_jobs SET status = 'queued', run_at = now(),
                attempts = greatest(attempts - 1, 0), locked_by = NULL, lease_token = NULL
            WHERE <fence> RETURNING id, queue)
        SELECT handed.id, pg_notify('sqlaq_jobs', handed.queue) FROM handed

    Fenced like complete: a lease already lost changes nothing. The notification (sent
    on commit, one per queue) wakes idle workers instead of leaving the jobs to a poll.
    ``last_error`` is kept.
    """
    handed = (
        update(jobs)
        .where(_fence(leases))
        .values(_requeued(_NOW))
        .returning(c.id, c.queue)
        .cte("handed")
    )
    # The channel is a constant of schema.py, inlined like the status literals.
    channel = literal_column(f"'{CHANNEL}'", Text)
    return select(handed.c.id, func.pg_notify(channel, handed.c.queue))


def notify_queues_stmt(*, queues: Sequence[str]) -> Select[Any]:
    """``SELECT pg_notify('sqlaq_jobs', q) FROM unnest(:b_queues) AS q``: wake the
    workers of *queues* (on commit), as the insert trigger does for new jobs."""
    names = (
        func.unnest(bindparam("b_queues", list(queues), ARRAY(Text)))
        .table_valued("q")
        .render_derived(name="woken")
    )
    channel = literal_column(f"'{CHANNEL}'", Text)
    return select(func.pg_notify(channel, names.c.q)).select_from(names)


def listen_stmt(*, channel: str | Sequence[str] = CHANNEL) -> psycopg.sql.Composed:
    """``LISTEN "<channel>"`` (one ``LISTEN`` per channel given), for the worker's
    dedicated psycopg connection.

    A psycopg statement rather than a SQLAlchemy one: LISTEN must run on a raw autocommit
    connection that stays outside the pool (see :mod:`sqlaq.worker.listener`).
    """
    channels = [channel] if isinstance(channel, str) else list(channel)
    return psycopg.sql.SQL("; ").join(
        psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(name)) for name in channels
    )


def privileges_stmt(*, needed: Mapping[str, Sequence[str]]) -> Select[Any]:
    """Select the privileges of *needed* (table name -> privileges) the role lacks.

    Renders ``SELECT needed.table_name, needed.privilege FROM unnest(:b_tables,
    :b_privileges) AS needed(table_name, privilege) WHERE NOT
    has_table_privilege(needed.table_name, needed.privilege)``: no row, nothing missing.
    Tables are looked up on the search path, like every other statement; each must exist.
    """
    pairs = [(table, privilege) for table, privileges in needed.items() for privilege in privileges]
    rows = (
        func.unnest(
            bindparam("b_tables", [t for t, _ in pairs], ARRAY(Text)),
            bindparam("b_privileges", [p for _, p in pairs], ARRAY(Text)),
        )
        .table_valued("table_name", "privilege")
        .render_derived(name="needed")
    )
    granted = func.has_table_privilege(rows.c.table_name, rows.c.privilege, type_=Boolean)
    return select(rows.c.table_name, rows.c.privilege).select_from(rows).where(~granted)


# --- the dashboard (read-only) ---
#
# What sqlaq.dashboard shows. Each reads pending rows through the claim or running index
# and finished rows through the finished index over a bounded time range, so a page
# costs what is pending and recent, not the table's history.

_ONE_HOUR: ColumnElement[Any] = literal_column("interval '1 hour'")
#: ``chr(10)``: a constant, not a bound value, so that the first-line expression of a
#: grouped query is the same in SELECT and GROUP BY.
_NEWLINE = func.chr(literal_column("10", Integer))
#: The percentiles of the wait-time plot.
WAIT_PERCENTILES = (0.5, 0.9, 0.99)


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
