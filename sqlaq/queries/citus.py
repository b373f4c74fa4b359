"""Citus: the conversion of an installed schema to a distributed job table, the
catalog reads that detect one, and the router-shaped statements the operations run on it.

``sqlaq_jobs`` is distributed by ``queue`` (``create_distributed_table('sqlaq_jobs',
'queue')``): every job of a queue lives in one shard, so a statement that pins ``queue =
:b_queue`` on the job table is a *router* statement, run whole by the worker node holding
that shard (EXPLAIN: one task). What Citus 13 refuses, and so what these statements
avoid (measured on the 3-node cluster of ``../shared/citus``):

* ``FOR UPDATE [SKIP LOCKED]`` and UPDATE/DELETE over several shards: every UPDATE pins
  ``queue = :b_queue`` on the statement itself, not only in its CTE;
* VOLATILE functions in an UPDATE (``gen_random_uuid()``): a claim's lease token is
  ``md5(:b_token || id::text)::uuid``, *b_token* a random value drawn by the client for
  this claim only, so each claim of each job still gets a token of its own;
* a non-IMMUTABLE function inside CASE/COALESCE (``now()``, and ``timestamptz +
  interval``, which is STABLE): the clock enters through the CTE (``now() AS t, now()
  + :b_lease AS until``), computed once by the coordinator;
* triggers on a distributed table: no insert/finish/dependency triggers, so the
  notification of new jobs is a statement of its own (:func:`sqlaq.queries.notify_queues_stmt`,
  a ``SELECT pg_notify(...)`` with no table: it runs on the coordinator, where the
  workers listen). A ``pg_notify()`` inside a routed statement would run on a worker node,
  where no listener hears it.

The plain statements of the other modules are untouched: on plain PostgreSQL nothing of
this module runs (``tests/unit/test_sql_snapshot.py`` pins their SQL).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Integer,
    Interval,
    Select,
    Text,
    TextClause,
    Update,
    and_,
    bindparam,
    case,
    cast,
    delete,
    func,
    literal_column,
    null,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.sql.dml import ReturningDelete

from sqlaq.queries._common import _IDS, _NOW, _PENDING, _RUNNING, _expired_error, _status, c
from sqlaq.queries.claim import _where_clauses, claim_params
from sqlaq.queries.columns import CLAIM_COLUMNS
from sqlaq.queries.enqueue import find_pending_duplicate_stmt
from sqlaq.queries.retention import _prunable
from sqlaq.queries.settle import _extended_end, _fence, _requeued
from sqlaq.schema import (
    CANCEL_CHANNEL,
    DEBOUNCE_INDEX,
    DEBOUNCE_SQL,
    DEDUPE_INDEX,
    DEDUPE_SQL,
    DEPS_TRIGGER,
    FINISH_CHANNEL,
    FINISH_TRIGGER,
    NOTIFY_TRIGGER,
    PAUSED_TABLE,
    TABLE_NAME,
    JobStatus,
    jobs,
    paused_queues,
)

#: The distribution column of ``sqlaq_jobs`` on Citus.
DISTRIBUTION_COLUMN = "queue"
#: The triggers of ``sqlaq_jobs`` the conversion drops (Citus refuses a distributed
#: table with triggers): the insert NOTIFY, the finish NOTIFY, the workflows' settling.
JOB_TRIGGERS = (NOTIFY_TRIGGER, FINISH_TRIGGER, DEPS_TRIGGER)
#: Small tables every shard reads (a claim probes the paused queues): reference tables,
#: a copy on every node. The others (rates, periodic, workers, unique holds, job deps)
#: stay plain tables of the coordinator.
REFERENCE_TABLES = (PAUSED_TABLE,)


def citus_version_stmt() -> TextClause:
    """``SELECT extversion FROM pg_extension WHERE extname = 'citus'``: Citus's version
    in this database; no row without the extension."""
    return text("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'citus'")


def citus_distribution_stmt() -> TextClause:
    """Citus's record of ``sqlaq_jobs`` (run only where the extension exists): one row,
    ``method, column`` (``'h'`` and ``'queue'`` once distributed by queue), or none while
    it is a plain local table. Bind ``b_table``."""
    return text(
        "SELECT partmethod::text AS method, "
        "pg_catalog.column_to_column_name(logicalrelid, partkey) AS column "
        "FROM pg_catalog.pg_dist_partition WHERE logicalrelid = to_regclass(:b_table)"
    ).bindparams(bindparam("b_table", TABLE_NAME, Text))


def foreign_keys_to_jobs_stmt() -> TextClause:
    """The foreign keys of other tables that reference ``sqlaq_jobs``: ``name, table``
    (Citus cannot keep a foreign key from a local table to a distributed one)."""
    return text(
        "SELECT conname::text AS name, conrelid::regclass::text AS table "
        "FROM pg_catalog.pg_constraint WHERE contype = 'f' "
        "AND confrelid = to_regclass(:b_table) AND conrelid <> confrelid ORDER BY 1"
    ).bindparams(bindparam("b_table", TABLE_NAME, Text))


def jobs_triggers_stmt() -> TextClause:
    """The names of the (non-internal) triggers of ``sqlaq_jobs``."""
    return text(
        "SELECT tgname::text FROM pg_catalog.pg_trigger "
        "WHERE tgrelid = to_regclass(:b_table) AND NOT tgisinternal ORDER BY 1"
    ).bindparams(bindparam("b_table", TABLE_NAME, Text))


def sequential_mode_stmt() -> TextClause:
    """``SET LOCAL citus.multi_shard_modify_mode TO 'sequential'``: the rest of this
    transaction runs its multi-shard commands one connection per node. A revision on a
    distributed job table needs it: Citus runs its DDL on the shards in parallel, then
    refuses a function command (``CREATE OR REPLACE FUNCTION``) in the same transaction."""
    return text("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")


def distribute_ddl(*, triggers: Collection[str] = JOB_TRIGGERS) -> list[str]:
    """The DDL that distributes an installed schema (at sqlaq's head) on Citus, in order,
    one statement per item; run in one transaction by ``sqlaq citus-distribute``.

    * drop the job table's triggers (*triggers*: those it has, of :data:`JOB_TRIGGERS`);
    * primary key ``(id, queue)``: a unique index must hold the distribution column;
    * the dedupe and debounce unique indexes lead with ``queue``: dedupe and debounce
      become per queue (the same key in two queues makes two jobs);
    * ``sqlaq_paused_queues`` a reference table (every claim probes it);
    * ``create_distributed_table('sqlaq_jobs', 'queue')``: the rows move to the shards.
    """
    ddl = [f"DROP TRIGGER {name} ON {TABLE_NAME}" for name in JOB_TRIGGERS if name in triggers]
    ddl += [
        f"ALTER TABLE {TABLE_NAME} DROP CONSTRAINT {TABLE_NAME}_pkey, "
        f"ADD CONSTRAINT {TABLE_NAME}_pkey PRIMARY KEY (id, queue)",
        f"DROP INDEX {DEDUPE_INDEX}",
        f"CREATE UNIQUE INDEX {DEDUPE_INDEX} ON {TABLE_NAME} (queue, kind, dedupe_key) "
        f"WHERE {DEDUPE_SQL}",
        f"DROP INDEX {DEBOUNCE_INDEX}",
        f"CREATE UNIQUE INDEX {DEBOUNCE_INDEX} ON {TABLE_NAME} (queue, kind, debounce_key) "
        f"WHERE {DEBOUNCE_SQL}",
    ]
    ddl += [f"SELECT create_reference_table('{name}')" for name in REFERENCE_TABLES]
    ddl.append(f"SELECT create_distributed_table('{TABLE_NAME}', '{DISTRIBUTION_COLUMN}')")
    return ddl


def ddl_stmt(ddl: str) -> TextClause:
    """One statement of :func:`distribute_ddl`, as an executable statement (DDL takes
    no binds)."""
    return text(ddl)


def citus_find_pending_duplicate_stmt() -> Select[Any]:
    """:func:`sqlaq.queries.find_pending_duplicate_stmt` within one queue (dedupe is per
    queue on Citus): the pending job holding ``(queue, kind, dedupe_key)``; bind
    ``b_queue``, ``b_kind``, ``b_dedupe_key``."""
    found: Select[Any] = find_pending_duplicate_stmt(kind="_", dedupe_key="_")
    return found.where(c.queue == bindparam("b_queue", "_", Text))


# -- router-shaped statements -------------------------------------------------------------


def citus_claim_params(
    *,
    queue: str,
    worker_id: Any,
    limit: int,
    lease: Any,
    token: str,
    kind: str | None = None,
    exclude_kinds: Collection[str] = (),
    ids: Collection[int] | None = None,
) -> dict[str, Any]:
    """The bind values of :func:`citus_claim_stmt`; *token* is this claim's own random
    text (e.g. ``uuid4().hex``), from which each job's lease token is made."""
    params = claim_params(
        queue=queue,
        worker_id=worker_id,
        limit=limit,
        lease=lease,
        kind=kind,
        exclude_kinds=exclude_kinds,
        ids=None if ids is None else list(ids),
    )
    params["b_token"] = token
    return params


def citus_claim_stmt(
    *,
    kind: bool = False,
    exclude_kinds: bool = False,
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
    ids: bool = False,
) -> Update:
    """:func:`sqlaq.queries.claim_stmt` shaped for a table distributed by queue: a router
    statement on the queue's shard. Built once with placeholders; run with
    :func:`citus_claim_params`. Renders::

        WITH candidates AS MATERIALIZED (
            SELECT id, now() AS t, now() + :b_lease AS until FROM sqlaq_jobs
            WHERE status IN ('queued', 'running') AND queue = :b_queue AND run_at <= now()
              AND NOT EXISTS (SELECT * FROM sqlaq_paused_queues
                              WHERE sqlaq_paused_queues.queue = :b_queue)
            ORDER BY priority DESC, run_at, id LIMIT :b_limit FOR UPDATE SKIP LOCKED)
        UPDATE sqlaq_jobs SET status = CASE ... END, ...,
            lease_token = CASE WHEN <exhausted> THEN NULL
                          ELSE CAST(md5(:b_token || CAST(sqlaq_jobs.id AS TEXT)) AS UUID) END,
            run_at = CASE WHEN <exhausted> THEN sqlaq_jobs.run_at ELSE candidates.until END
        FROM candidates
        WHERE sqlaq_jobs.queue = :b_queue AND sqlaq_jobs.id = candidates.id
        RETURNING ...

    The same outcomes as the plain claim: a due running row (an expired lease) with
    attempts left is claimed again, one on its last attempt is marked failed and
    returned with that status. With *kind*, only ``kind = :b_kind``; with
    *exclude_kinds*, ``kind <> ALL(:b_excluded)``; with *ids*, only the jobs bound as
    ``b_ids`` (a keyed claim's picks, see :func:`sqlaq.queries.claim_stmt`). *where* narrows it as
    :func:`sqlaq.queries.claim_stmt`'s does (inside the locking CTE).

    Raises:
        ConfigError: *where* is not a SQLAlchemy clause over ``sqlaq_jobs`` alone.
    """
    queue_ = bindparam("b_queue", "_", Text)
    which = []
    if kind:
        which.append(c.kind == bindparam("b_kind", "_", Text))
    if exclude_kinds:
        which.append(c.kind != func.all(bindparam("b_excluded", ["_"], ARRAY(Text))))
    if ids:
        which.append(c.id == func.any(bindparam("b_ids", [], _IDS)))
    lease = bindparam("b_lease", None, Interval)
    candidates = (
        select(c.id, _NOW.label("t"), (_NOW + lease).label("until"))
        .where(
            _PENDING,
            c.queue == queue_,
            c.run_at <= _NOW,
            ~select(paused_queues.c.queue).where(paused_queues.c.queue == queue_).exists(),
            *which,
            *_where_clauses(where),
        )
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(bindparam("b_limit", 1, Integer))
        .with_for_update(skip_locked=True)
        .cte("candidates")
        .prefix_with("MATERIALIZED")
    )
    exhausted = and_(_RUNNING, c.attempts >= c.max_attempts)
    token = cast(
        func.md5(bindparam("b_token", "_", Text) + cast(c.id, Text)), PG_UUID(as_uuid=True)
    )
    return (
        update(jobs)
        .where(c.queue == queue_, c.id == candidates.c.id)
        .values(
            status=case((exhausted, _status(JobStatus.FAILED)), else_=_status(JobStatus.RUNNING)),
            attempts=case((exhausted, c.attempts), else_=c.attempts + literal_column("1", Integer)),
            locked_by=case(
                (exhausted, null()), else_=bindparam("b_worker", None, PG_UUID(as_uuid=True))
            ),
            lease_token=case((exhausted, null()), else_=token),
            run_at=case((exhausted, c.run_at), else_=candidates.c.until),
            finished_at=case((exhausted, candidates.c.t), else_=null()),
            attempted_at=case((exhausted, c.attempted_at), else_=candidates.c.t),
            last_error=case(
                (exhausted, _expired_error()),
                (_RUNNING, _expired_error("claimed again")),
                else_=c.last_error,
            ),
        )
        .returning(*CLAIM_COLUMNS)
    )


def _pinned(stmt: Update) -> Update:
    """*stmt* (an UPDATE of the job table fenced by leases) with ``queue = :b_queue``: the
    leases of one queue at a time, a router statement."""
    return stmt.where(c.queue == bindparam("b_queue", "_", Text))


def citus_extend_lease_stmt() -> Update:
    """:func:`sqlaq.queries.extend_lease_stmt` for the leases of one queue (``AND queue =
    :b_queue``); bind :func:`sqlaq.queries.fence_params`, ``b_lease`` and ``b_queue``."""
    return _pinned(
        update(jobs)
        .where(_fence([]))
        .values(run_at=_extended_end(bindparam("b_lease", None, Interval)))
        .returning(c.id, c.run_at)
    )


def citus_complete_stmt() -> Update:
    """:func:`sqlaq.queries.complete_stmt` for the leases of one queue (``AND queue =
    :b_queue``), ``RETURNING id, awaited`` (a waiter is told by
    :func:`citus_notify_finished_stmt`); bind :func:`sqlaq.queries.fence_params` and
    ``b_queue``."""
    return _pinned(
        update(jobs)
        .where(_fence([]))
        .values(status=_status(JobStatus.DONE), finished_at=_NOW, lease_token=null())
        .returning(c.id, c.awaited)
    )


def citus_notify_finished_stmt(*, job_ids: Sequence[int]) -> Select[Any]:
    """``SELECT pg_notify('sqlaq_finished', id::text) FROM unnest(:b_ids) AS id``: tell
    the waiters of *job_ids* (:func:`sqlaq.wait`) that they finished, as the finish
    trigger does on plain PostgreSQL; a statement with no table, so it runs on the
    coordinator, where the waiters listen."""
    ids = (
        func.unnest(bindparam("b_ids", list(job_ids), _IDS))
        .table_valued("id")
        .render_derived(name="finished")
    )
    channel = literal_column(f"'{FINISH_CHANNEL}'", Text)
    return select(func.pg_notify(channel, cast(ids.c.id, Text))).select_from(ids)


def citus_complete_result_stmt() -> Update:
    """:func:`sqlaq.queries.complete_result_stmt` pinned to the lease's queue; bind
    :func:`sqlaq.queries.complete_result_params` and ``b_queue``."""
    return _pinned(
        update(jobs)
        .where(_fence([]))
        .values(
            status=_status(JobStatus.DONE),
            finished_at=_NOW,
            lease_token=null(),
            result=cast(bindparam("b_result", None, Text), JSONB),
        )
        .returning(c.id, c.awaited)
    )


def citus_fail_stmt() -> Update:
    """:func:`sqlaq.queries.fail_stmt` pinned to the lease's queue, with the clock from a
    CTE (``now()`` may not stand inside CASE on Citus); bind
    :func:`sqlaq.queries.fail_params` and ``b_queue``. Renders::

        WITH clock AS (SELECT now() AS t, now() + :b_retry_in AS retry_at, :b_queue AS q)
        UPDATE sqlaq_jobs SET status = CASE WHEN <retry> THEN 'queued' ELSE 'failed' END,
            run_at = CASE WHEN <retry> THEN clock.retry_at ELSE sqlaq_jobs.run_at END,
            finished_at = CASE WHEN <retry> THEN NULL ELSE clock.t END, ...
        FROM clock WHERE <fence> AND sqlaq_jobs.queue = clock.q
            AND sqlaq_jobs.queue = :b_queue
        RETURNING id, status, run_at
    """
    queue_ = bindparam("b_queue", "_", Text)
    clock = select(
        _NOW.label("t"),
        (_NOW + bindparam("b_retry_in", None, Interval)).label("retry_at"),
        queue_.label("q"),
    ).cte("clock")
    retry = and_(bindparam("b_retry", False, Boolean), c.attempts < c.max_attempts)
    return _pinned(
        update(jobs)
        .where(_fence([]), c.queue == clock.c.q)
        .values(
            status=case((retry, _status(JobStatus.QUEUED)), else_=_status(JobStatus.FAILED)),
            run_at=case((retry, clock.c.retry_at), else_=c.run_at),
            finished_at=case((retry, null()), else_=clock.c.t),
            last_error=bindparam("b_error", "", Text),
            locked_by=null(),
            lease_token=null(),
        )
        .returning(c.id, c.status, c.run_at, c.awaited)
    )


def citus_snooze_stmt() -> Update:
    """:func:`sqlaq.queries.snooze_stmt` for the leases of one queue; bind
    :func:`sqlaq.queries.fence_params`, ``b_delay`` and ``b_queue``."""
    return _pinned(
        update(jobs)
        .where(_fence([]))
        .values(_requeued(_NOW + bindparam("b_delay", None, Interval)))
        .returning(c.id)
    )


def citus_handback_stmt() -> Update:
    """:func:`sqlaq.queries.handback_stmt` for the leases of one queue, without its
    ``pg_notify`` (a routed statement would send it from a worker node): ``UPDATE ...
    RETURNING id``; the caller wakes the queue with
    :func:`sqlaq.queries.notify_queues_stmt` in the same transaction."""
    return _pinned(update(jobs).where(_fence([])).values(_requeued(_NOW)).returning(c.id))


# -- cancel, sweep, prune: find the rows (no lock, every shard), then one queue at a time --


def citus_locate_stmt(*, pending: bool = True) -> Select[Any]:
    """``SELECT id, queue FROM sqlaq_jobs WHERE id = ANY(:b_ids) AND status IN ('queued',
    'running')`` (or, not *pending*, ``IN ('failed', 'cancelled')``): which queue each
    job of *b_ids* is in (read on every shard, without a lock; the per-queue statement
    locks and checks again)."""
    which = (
        _PENDING
        if pending
        else c.status.in_([_status(JobStatus.FAILED), _status(JobStatus.CANCELLED)])
    )
    return select(c.id, c.queue).where(c.id == func.any(bindparam("b_ids", [], _IDS)), which)


def citus_cancel_stmt() -> Update:
    """:func:`sqlaq.queries.cancel_stmt` for the jobs *b_ids* of queue *b_queue*, without
    its ``pg_notify`` (sent from the coordinator by :func:`citus_notify_cancel_stmt`).
    Renders::

        WITH was AS MATERIALIZED (
            SELECT id, status FROM sqlaq_jobs WHERE queue = :b_queue AND id = ANY(:b_ids)
              AND status IN ('queued', 'running') FOR UPDATE)
        UPDATE sqlaq_jobs SET status = 'cancelled', finished_at = now(), lease_token = NULL
        FROM was WHERE sqlaq_jobs.queue = :b_queue AND sqlaq_jobs.id = was.id
        RETURNING sqlaq_jobs.id, was.status
    """
    queue_ = bindparam("b_queue", "_", Text)
    was = (
        select(c.id, c.status)
        .where(c.queue == queue_, c.id == func.any(bindparam("b_ids", [], _IDS)), _PENDING)
        .with_for_update()
        .cte("was")
        .prefix_with("MATERIALIZED")
    )
    return (
        update(jobs)
        .where(c.queue == queue_, c.id == was.c.id)
        .values(status=_status(JobStatus.CANCELLED), finished_at=_NOW, lease_token=null())
        .returning(c.id, was.c.status.label("was"), c.awaited)
    )


def citus_notify_cancel_stmt() -> Select[Any]:
    """``SELECT pg_notify('sqlaq_cancel', id) FROM unnest(:b_ids) AS id``: tell the
    workers running the cancelled jobs *b_ids* (text), from the coordinator."""
    ids = func.unnest(bindparam("b_ids", [], ARRAY(Text))).table_valued("id").render_derived("ids")
    channel = literal_column(f"'{CANCEL_CHANNEL}'", Text)
    return select(func.pg_notify(channel, ids.c.id)).select_from(ids)


def citus_expired_stmt() -> Select[Any]:
    """``SELECT id, queue FROM sqlaq_jobs WHERE status = 'running' AND run_at <= now()
    LIMIT :b_limit``: expired leases, read on every shard through the running index."""
    return (
        select(c.id, c.queue)
        .where(_RUNNING, c.run_at <= _NOW)
        .limit(bindparam("b_limit", 1, Integer))
    )


def citus_sweep_stmt() -> Update:
    """:func:`sqlaq.queries.sweep_stmt` for the jobs *b_ids* of queue *b_queue* (found by
    :func:`citus_expired_stmt`), their expiry checked again under the row lock, the clock
    from a CTE (no ``now()`` inside CASE on Citus); ``RETURNING id, status``."""
    queue_ = bindparam("b_queue", "_", Text)
    clock = select(_NOW.label("t"), queue_.label("q")).cte("clock")
    exhausted = c.attempts >= c.max_attempts
    return (
        update(jobs)
        .where(
            c.queue == clock.c.q,
            c.queue == queue_,
            c.id == func.any(bindparam("b_ids", [], _IDS)),
            _RUNNING,
            c.run_at <= clock.c.t,
        )
        .values(
            status=case((exhausted, _status(JobStatus.FAILED)), else_=_status(JobStatus.QUEUED)),
            finished_at=case((exhausted, clock.c.t), else_=null()),
            run_at=case((exhausted, c.run_at), else_=clock.c.t),
            locked_by=null(),
            lease_token=null(),
            last_error=case((exhausted, _expired_error()), else_=_expired_error("queued again")),
        )
        .returning(c.id, c.status, c.awaited)
    )


def citus_prunable_stmt() -> Select[Any]:
    """``SELECT id, queue FROM sqlaq_jobs WHERE <prunable> LIMIT :b_limit``: finished jobs
    older than *b_older_than* of *b_statuses*, read on every shard through the finished
    index, without a lock."""
    return (
        select(c.id, c.queue)
        .where(_prunable(timedelta(0), (), workflows=False))
        .limit(bindparam("b_limit", 1, Integer))
    )


def citus_prune_stmt() -> ReturningDelete[Any]:
    """Delete the jobs *b_ids* of queue *b_queue* that are still prunable (checked again
    under the row lock: a job retried meanwhile stays); ``RETURNING id``."""
    return (
        delete(jobs)
        .where(
            c.queue == bindparam("b_queue", "_", Text),
            c.id == func.any(bindparam("b_ids", [], _IDS)),
            _prunable(timedelta(0), (), workflows=False),
        )
        .returning(c.id)
    )


__all__ = [
    "DISTRIBUTION_COLUMN",
    "JOB_TRIGGERS",
    "REFERENCE_TABLES",
    "citus_cancel_stmt",
    "citus_claim_params",
    "citus_claim_stmt",
    "citus_complete_result_stmt",
    "citus_complete_stmt",
    "citus_distribution_stmt",
    "citus_expired_stmt",
    "citus_extend_lease_stmt",
    "citus_fail_stmt",
    "citus_find_pending_duplicate_stmt",
    "citus_handback_stmt",
    "citus_locate_stmt",
    "citus_notify_cancel_stmt",
    "citus_notify_finished_stmt",
    "citus_prunable_stmt",
    "citus_prune_stmt",
    "citus_snooze_stmt",
    "citus_sweep_stmt",
    "citus_version_stmt",
    "ddl_stmt",
    "distribute_ddl",
    "foreign_keys_to_jobs_stmt",
    "jobs_triggers_stmt",
]
