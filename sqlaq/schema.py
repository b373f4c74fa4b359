"""The ``sqlaq_jobs`` table, its indexes, and the names of the objects around it.

This module owns the live description of the schema (``sqlaq.metadata``). The shipped
Alembic revisions do not import it: they are frozen literal DDL, and a test proves that
the head revision and this module describe the same table.

Design decisions written down here:

* The claim index holds pending rows only (``status IN ('queued','running')``) and is
  ordered like the claim (``queue, priority DESC, run_at, id``). A worker claims one
  queue per statement (``queue = :b_queue``), so the index returns rows already in claim
  order and the plan stays an index scan whatever the number of finished rows.
* The dedupe index is partial on pending rows *and* on ``dedupe_key IS NOT NULL``: jobs
  without a key (the common case) cost it nothing on insert. ``ON CONFLICT`` names the
  same predicate.
* The finished index (``finished_at`` on done/failed/cancelled rows) serves retention, so
  pruning a table of millions of finished rows never scans the table.
* The running index (``kind, run_at`` over running rows: a handful, whatever the
  backlog) lets a claim of a concurrency-limited kind count its live leases cheaply.
* Results and waiting (sqlaq_0003): a row trigger on ``UPDATE OF status`` notifies
  ``sqlaq_finished`` with the job's id when a job finishes, but only for jobs a waiter
  flagged (``awaited``); its ``WHEN`` clause keeps every other update free of a
  function call.
* Operators (sqlaq_0004): a paused queue is a row of ``sqlaq_paused_queues``, which
  every claim probes by primary key (an uncorrelated ``NOT EXISTS``: evaluated once per
  claim, before the claim index is read); each worker keeps a heartbeat row in
  ``sqlaq_workers``; ``headers`` carries what the enqueuer sends beside the payload
  (the trace context).
* Debounce and unique_for (sqlaq_0005): a debounced job keeps its key in
  ``debounce_key``, unique over never-started queued jobs (``status = 'queued' AND
  attempted_at IS NULL``): the arbiter of enqueue's ``ON CONFLICT ... DO UPDATE``. Not
  ``dedupe_key``, whose index covers running jobs too (a running holder would make the
  upsert update a job that already read its payload), and not every queued job: a
  started job that goes back to queued (a retry, a snooze) must not collide with the
  new one enqueued meanwhile. ``sqlaq_unique_holds`` holds a ``(kind, dedupe_key)``
  until ``expires_at`` whatever becomes of its job (a unique index cannot express a
  window); ``timeout`` is a job's own attempt timeout, over its handler's.
* Workflows (sqlaq_0006): a job enqueued to wait for others (its parents) is queued
  with ``run_at`` at WAITING_RUN_AT (never due: the claim is unchanged) and one row of
  ``sqlaq_job_deps`` per parent not yet finished. A parent's own rows are deleted by a
  row trigger when it finishes (``WHEN`` it ``has_dependents``: every other job pays a
  boolean test), in its finishing transaction; the same trigger applies the child's
  ``on_parent_failure`` and releases (``run_at = now()``) the children left with no
  row. No row is shared by two parents, so parents finish in parallel. Since
  sqlaq_0010, a finishing parent that sees another parent's row which no transaction
  is deleting (``xmax`` 0) leaves the child to that parent (it finishes later, and
  looks again then); when every row left is being deleted by a transaction in flight
  (parents finishing at once), it notifies ``sqlaq_release``, and whoever hears it
  waits for those transactions (``FOR KEY SHARE`` on the rows being deleted) and checks
  again; the maintenance leader sweeps what a lost notification left. A NOTIFY
  serializes the commits that send one, so the members of a fan-in send none but at
  its very end.
* Keys (sqlaq_0007): a job may carry a ``key`` (a tenant, an account). A kind with a
  per-key limit (``key_concurrency``) or strict order per key (``ordered``) is claimed
  under its kind lock like any limited kind: the live leases are counted per key from
  the running index, and the key index (``kind, key, id`` over queued, running and
  failed keyed rows) answers "is an earlier job of this key still pending or failed?"
  in one probe. Jobs without a key, and kinds without key limits, never read it.
* Workflow children (sqlaq_0010): a parent's ``sqlaq_job_deps`` rows go when it
  finishes, so its children are found from their side: a GIN index over ``parent_ids``
  (partial on ``parent_ids IS NOT NULL``: only jobs with parents pay for it on insert
  and update) answers ``parent_ids @> ARRAY[parent]``, the step down of every workflow
  walk (reading, cancelling, and retention's "is this workflow finished?").
  ``fastupdate`` is off: a walk probes it once per job it meets, and a pending list
  would be read whole at each probe.
* Status literals in predicates are inlined, never bound: a prepared ``ON CONFLICT ...
  WHERE status IN ($1, $2)`` stops matching the partial index once PostgreSQL switches
  to a generic plan.
"""

from __future__ import annotations

import enum

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Identity,
    Index,
    Integer,
    Interval,
    MetaData,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID

TABLE_NAME = "sqlaq_jobs"
#: The NOTIFY channel the insert trigger signals, with the job's queue as payload,
#: followed (since sqlaq_0008) by the highest priority and the earliest ``run_at`` (in
#: microseconds since 1970) of the due jobs the statement inserted there:
#: ``'<queue> <priority> <microseconds>'`` (see :func:`sqlaq.worker.fetcher.parse_wake`).
CHANNEL = "sqlaq_jobs"
CLAIM_INDEX = "sqlaq_jobs_claim_idx"
DEDUPE_INDEX = "sqlaq_jobs_dedupe_idx"
FINISHED_INDEX = "sqlaq_jobs_finished_idx"
RUNNING_INDEX = "sqlaq_jobs_running_idx"
RATES_TABLE = "sqlaq_rates"
PERIODIC_TABLE = "sqlaq_periodic"
PAUSED_TABLE = "sqlaq_paused_queues"
WORKERS_TABLE = "sqlaq_workers"
UNIQUE_HOLDS_TABLE = "sqlaq_unique_holds"
DEBOUNCE_INDEX = "sqlaq_jobs_debounce_idx"
DEPS_TABLE = "sqlaq_job_deps"
WAITING_INDEX = "sqlaq_jobs_waiting_idx"
KEY_INDEX = "sqlaq_jobs_key_idx"
#: The fair claim's index (sqlaq_0009): pending jobs by queue and share in claim order.
FAIR_INDEX = "sqlaq_jobs_fair_idx"
#: The parents index (sqlaq_0010): GIN over ``parent_ids``, jobs with parents only; finds
#: a job's children (``parent_ids @> ARRAY[id]``) once its edge rows are gone.
PARENTS_INDEX = "sqlaq_jobs_parents_idx"
DEPS_FUNCTION = "sqlaq_jobs_settle_children"
DEPS_TRIGGER = "sqlaq_jobs_deps_trg"
#: The NOTIFY channel of waiting jobs whose parent finished while they kept a parent
#: that may be finishing at the same time: checked again after commit (the payload is
#: the waiting job's id).
RELEASE_CHANNEL = "sqlaq_release"
#: The NOTIFY channel :func:`sqlaq.cancel` signals, with the id of a running job it
#: cancelled as payload, so the worker running it is told at once.
CANCEL_CHANNEL = "sqlaq_cancel"
#: The first key of the transaction advisory lock a claim of a limited kind takes; the
#: second is ``hashtext(kind)`` (see :func:`sqlaq.queries.lock_kind_stmt`).
KIND_LOCK_CLASS = 0x73716C6B  # "sqlk"
#: The keys of the session advisory lock held by the maintenance leader.
LEADER_LOCK = (0x73716C6D, 0)  # "sqlm"
NOTIFY_FUNCTION = "sqlaq_jobs_notify"
NOTIFY_TRIGGER = "sqlaq_jobs_notify_trg"
#: The NOTIFY channel of finished jobs that someone waits for (``awaited``), with
#: the job's id as payload (see :func:`sqlaq.wait`).
FINISH_CHANNEL = "sqlaq_finished"
FINISH_FUNCTION = "sqlaq_jobs_notify_finish"
FINISH_TRIGGER = "sqlaq_jobs_finish_trg"
#: A SQL function that returns the schema's sqlaq revision (each revision replaces it).
REVISION_FUNCTION = "sqlaq_jobs_schema_revision"
#: Version table of the standalone path (``sqlaq migrate``), for databases with no
#: Alembic of their own.
VERSION_TABLE = "sqlaq_alembic_version"

#: Predicates, as SQL text, shared by the indexes and by the statements that must match
#: them for the planner to use them.
PENDING_SQL = "status IN ('queued', 'running')"
FINISHED_SQL = "status IN ('done', 'failed', 'cancelled')"
RUNNING_SQL = "status = 'running'"
DEDUPE_SQL = f"{PENDING_SQL} AND dedupe_key IS NOT NULL"
#: Never-started queued jobs with a debounce key: what a debounced enqueue may update.
DEBOUNCE_SQL = "status = 'queued' AND attempted_at IS NULL AND debounce_key IS NOT NULL"
#: Queued jobs with parents: the waiting ones among them have ``run_at`` at
#: WAITING_RUN_AT (the rest were released and are due).
WAITING_SQL = "status = 'queued' AND parent_ids IS NOT NULL"
#: Jobs of a key that are queued, running or failed for good: what strict order per key
#: looks for before a job (an earlier one of its key holds it back).
KEY_SQL = "key IS NOT NULL AND status IN ('queued', 'running', 'failed')"
#: A waiting job's ``run_at``: later than any an enqueue accepts (encoding.MAX_RUN_AT),
#: so never due, yet readable by Python (``'infinity'`` is not).
WAITING_RUN_AT = "9999-01-01 00:00:00+00"
#: Every ``run_at`` from this one on is a waiting job's (a retry's or a snooze's is at
#: most 100 years ahead; an enqueue's at most encoding.MAX_RUN_AT).
WAITING_FROM = "9900-01-01 00:00:00+00"

DEFAULT_QUEUE = "default"
DEFAULT_MAX_ATTEMPTS = 5
#: Longest accepted ``kind``, ``queue`` or job ``key`` (characters).
MAX_NAME_LENGTH = 255
#: Longest accepted ``dedupe_key`` (UTF-8 bytes): (kind, dedupe_key) must fit a btree entry.
MAX_DEDUPE_KEY_BYTES = 1000


class JobStatus(enum.StrEnum):
    """The states of a job. ``queued -> running -> done | failed``, or ``cancelled``."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


PENDING_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.RUNNING})
FINISHED_STATUSES = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED})

#: Autovacuum storage parameters of the table (set by the shipped revision). A queue table
#: turns over its rows constantly: vacuum after ~1% churn instead of the default 20%, and
#: let vacuum work at full speed so dead claim-index entries do not pile up.
STORAGE_PARAMETERS = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_limit": "2000",
}

NAMING_CONVENTION = {
    "ix": "%(column_0_label)s_idx",
    "uq": "%(table_name)s_%(column_0_name)s_key",
    "ck": "%(table_name)s_%(constraint_name)s_check",
    "fk": "%(table_name)s_%(column_0_name)s_fkey",
    "pk": "%(table_name)s_pkey",
}

#: The MetaData of sqlaq's tables (with its naming convention): a host's Alembic env.py
#: never hands it to autogenerate (see :func:`sqlaq.migrations.include_name`).
metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: The jobs table, ``sqlaq_jobs``: one row per job, from enqueue until pruned.
jobs = Table(
    TABLE_NAME,
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("queue", Text, nullable=False, server_default=text("'default'")),
    Column("kind", Text, nullable=False),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("status", Text, nullable=False, server_default=text("'queued'")),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("run_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False, server_default=text("5")),
    Column("locked_by", UUID(as_uuid=True)),
    # A fresh random token per claim: the fence of complete/fail/extend. A worker holding
    # an older claim of the same job (even with the same locked_by) no longer matches.
    Column("lease_token", UUID(as_uuid=True)),
    Column("last_error", Text),
    Column("dedupe_key", Text),
    Column("created_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    Column("finished_at", TIMESTAMP(timezone=True)),
    # When the current (or last) attempt started: the claim's now().
    Column("attempted_at", TIMESTAMP(timezone=True)),
    # The handler's return value (JSON), written by the completion that marks it done.
    Column("result", JSONB),
    # Someone waits for this job (sqlaq.wait): the finish trigger notifies only then.
    Column("awaited", Boolean, nullable=False, server_default=text("false")),
    # What the enqueuer sent beside the payload: the trace context (sqlaq.tracing).
    Column("headers", JSONB),
    # A debounced job's key (sqlaq_0005): see DEBOUNCE_SQL.
    Column("debounce_key", Text),
    # The job's own attempt timeout, over its handler's (NULL: the handler's).
    Column("timeout", Interval),
    # Workflows (sqlaq_0006): another job waits for this one (the trigger's flag), what
    # this job does when a parent fails (NULL: 'cancel'), and all its parents.
    Column("has_dependents", Boolean, nullable=False, server_default=text("false")),
    Column("on_parent_failure", Text),
    Column("parent_ids", ARRAY(BigInteger)),
    # Keys (sqlaq_0007): the job's key (a tenant, an account), what per-key limits and
    # strict order per key count over; NULL: none.
    Column("key", Text),
    CheckConstraint(
        "status IN ('queued', 'running', 'done', 'failed', 'cancelled')", name="status"
    ),
    CheckConstraint("max_attempts > 0", name="max_attempts"),
    CheckConstraint("on_parent_failure IN ('cancel', 'run', 'fail')", name="on_parent_failure"),
    Index(
        CLAIM_INDEX,
        "queue",
        text("priority DESC"),
        "run_at",
        "id",
        postgresql_where=text(PENDING_SQL),
    ),
    Index(
        DEDUPE_INDEX,
        "kind",
        "dedupe_key",
        unique=True,
        postgresql_where=text(DEDUPE_SQL),
    ),
    Index(FINISHED_INDEX, "finished_at", postgresql_where=text(FINISHED_SQL)),
    Index(RUNNING_INDEX, "kind", "run_at", postgresql_where=text(RUNNING_SQL)),
    Index(
        DEBOUNCE_INDEX,
        "kind",
        "debounce_key",
        unique=True,
        postgresql_where=text(DEBOUNCE_SQL),
    ),
    Index(WAITING_INDEX, "id", postgresql_where=text(WAITING_SQL)),
    Index(KEY_INDEX, "kind", "key", "id", postgresql_where=text(KEY_SQL)),
    # Fair claiming (sqlaq_0009): a queue's pending keyed jobs by key in claim order,
    # walked one key at a time (see sqlaq.queries.fair_claim_stmt); jobs without a key
    # are not in it, so they cost it nothing.
    Index(
        FAIR_INDEX,
        "queue",
        "key",
        text("priority DESC"),
        "run_at",
        "id",
        postgresql_where=text(f"{PENDING_SQL} AND key IS NOT NULL"),
    ),
    # Workflow children (sqlaq_0010): a job's children by parent, whatever their status
    # (a workflow's walk steps down through it); jobs without parents are not in it.
    Index(
        PARENTS_INDEX,
        "parent_ids",
        postgresql_using="gin",
        postgresql_with={"fastupdate": "off"},
        postgresql_where=text("parent_ids IS NOT NULL"),
    ),
)

#: The recent starts of each rate-limited kind (a sliding-window log, at most the rate's
#: count of timestamps per row), read and trimmed under the kind's claim lock.
rates = Table(
    RATES_TABLE,
    metadata,
    Column("kind", Text, primary_key=True),
    Column(
        "starts",
        ARRAY(TIMESTAMP(timezone=True)),
        nullable=False,
        server_default=text("'{}'::timestamp with time zone[]"),
    ),
)

#: The last schedule slot enqueued for each periodic job (see :mod:`sqlaq.periodic`).
periodic = Table(
    PERIODIC_TABLE,
    metadata,
    Column("name", Text, primary_key=True),
    Column("last_slot", TIMESTAMP(timezone=True), nullable=False),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
)

#: Paused queues (see :mod:`sqlaq.control`): no claim takes a job of a queue listed here.
paused_queues = Table(
    PAUSED_TABLE,
    metadata,
    Column("queue", Text, primary_key=True),
    Column("paused_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    Column("paused_by", Text),
)

#: One row per running worker: its heartbeat, written by its maintenance thread.
workers = Table(
    WORKERS_TABLE,
    metadata,
    Column("worker_id", UUID(as_uuid=True), primary_key=True),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("queues", ARRAY(Text), nullable=False),
    Column("concurrency", Integer, nullable=False),
    Column("started_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    Column("last_seen_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
)

#: unique_for (see :func:`sqlaq.enqueue`): a row per ``(kind, dedupe_key)`` that no second
#: job may take until ``expires_at``, whatever the status of its job (``job_id``).
unique_holds = Table(
    UNIQUE_HOLDS_TABLE,
    metadata,
    Column("kind", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    Column("job_id", BigInteger, nullable=False),
    Column("expires_at", TIMESTAMP(timezone=True), nullable=False, index=True),
)


#: Workflows: one row per (parent not yet finished, job waiting for it).
job_deps = Table(
    DEPS_TABLE,
    metadata,
    Column("parent_id", BigInteger, primary_key=True),
    Column("child_id", BigInteger, primary_key=True),
    # "Any parent left?" probes it from the finishing parent's own position.
    Index(None, "child_id", "parent_id"),
)
