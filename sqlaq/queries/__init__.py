"""Statement builders: the only SQL of sqlaq outside the shipped revisions.

Each ``*_stmt`` function returns an inert SQLAlchemy executable with its values bound,
and executes nothing: run it on any Connection or Session, inside any transaction, or
extend it first. The builders live in modules by stage of a job's life (the claim in
three: the plain claim, limited kinds, fair claims), and this package's namespace holds
them all (``sqlaq.queries.claim_stmt``)::

    queued --claim--> running --complete--> done
      ^                 |  \\--fail (no attempts left / permanent)--> failed --retry--+
      |                 |                                                           |
      +--fail (retry)---+   cancel (queued or running) --> cancelled --retry--------+
      +-------------------------------------------------------------------------------+

* :mod:`~sqlaq.queries.columns`: the job's columns, one table every INSERT is built from;
* :mod:`~sqlaq.queries.enqueue`: new jobs (one, many, uniform batches, COPY; dedupe,
  debounce, ``unique_for``);
* :mod:`~sqlaq.queries.claim`: claims (plain and bounded), the first due job, ``where=``;
* :mod:`~sqlaq.queries.limited`: the lock, limits, rate log and keyed candidates of limited
  kinds;
* :mod:`~sqlaq.queries.fair`: the fair claim, shared between a queue's keys;
* :mod:`~sqlaq.queries.settle`: what a lease's holder writes (extend, complete, fail,
  snooze, hand back);
* :mod:`~sqlaq.queries.retention`: retry, cancel, prune, sweep;
* :mod:`~sqlaq.queries.leader`: the leader lock, periodic schedules, the clock, vacuum;
* :mod:`~sqlaq.queries.operators`: paused queues, workers' heartbeats, the wake channel;
* :mod:`~sqlaq.queries.inspect`: reading jobs and queues (operators, tests, explain);
* :mod:`~sqlaq.queries.catalog`: the schema as the database has it;
* :mod:`~sqlaq.queries.dashboard`: what the dashboard shows;
* :mod:`~sqlaq.queries.workflow`: jobs that wait for other jobs (edges, holds, release).

Rules every builder keeps (each learnt the hard way):

* The clock is ``now()``: Python passes intervals (a lease, a delay), never timestamps.
* Status literals of partial-index predicates are inlined (``status IN ('queued',
  'running')``), never bound, so prepared statements keep matching the partial indexes.
* Bind parameters are named ``b_*`` (never like a column) and id lists use
  ``= ANY(:b_ids)``, so one prepared statement serves any list length.
* RETURNING lists its columns.
* Hot statements are built once and run many times, one way: a builder binds its values
  (``b_*``) and the matching ``*_params`` function gives the bind values for the same
  arguments; execution parameters override the values a statement was built with, so
  the caller builds the statement once, with placeholder values, and runs it with
  ``conn.execute(stmt, claim_params(...))``. A statement fenced by leases takes
  :func:`fence_params` (plus its one other value, e.g. ``b_lease``, by name). A builder
  that needs no argument (:func:`enqueue_uniform_stmt`) binds no values and is cached
  itself; its ``*_params`` gives them all. Building a claim costs about a millisecond in
  Python; running a cached one costs nothing extra.
* Claims and retention pick their rows in a ``MATERIALIZED`` CTE with ``FOR UPDATE SKIP
  LOCKED`` joined to the UPDATE/DELETE: the ``id IN (SELECT ... LIMIT n)`` form can be
  re-run per row under a nested loop and touch far more than *n* rows.
* Every compiled statement is pinned by ``tests/unit/test_sql_snapshot.py``.
"""

from __future__ import annotations

# c: the jobs table's columns, importable here as before (not in __all__).
from sqlaq.queries._common import c as c
from sqlaq.queries._graph import workflow_cte
from sqlaq.queries.catalog import (
    catalog_constraints_stmt,
    catalog_functions_stmt,
    catalog_indexes_stmt,
    catalog_tables_stmt,
    catalog_triggers_stmt,
    create_database_stmt,
    drop_database_stmt,
    has_schema_revision_stmt,
    ping_stmt,
    privileges_stmt,
    schema_revision_stmt,
)
from sqlaq.queries.claim import (
    FULL_CLAIM,
    ClaimPosition,
    claim_params,
    claim_stmt,
    first_due_params,
    first_due_stmt,
    relaxed_commit_stmt,
    relaxed_stmt,
    where_check_stmt,
    where_text,
)
from sqlaq.queries.columns import (
    CLAIM_COLUMNS,
    COPY_COLUMNS,
    OUTCOME_COLUMNS,
    enqueue_params,
    enqueue_uniform_params,
)
from sqlaq.queries.dashboard import (
    BUSIEST_KEYS,
    LARGE_VALUES,
    WAIT_PERCENTILES,
    busiest_keys_stmt,
    error_line,
    failure_group_ids_stmt,
    failure_groups_stmt,
    job_page_stmt,
    job_value_stmt,
    jobs_list_stmt,
    overview_counts_stmt,
    overview_health_stmt,
    periodic_slots_stmt,
    rate_logs_stmt,
    running_by_kind_stmt,
    running_workers_stmt,
    throughput_stmt,
    wait_percentiles_stmt,
)
from sqlaq.queries.enqueue import (
    debounce_enqueue_stmt,
    enqueue_copy_stmt,
    enqueue_many_stmt,
    enqueue_stmt,
    enqueue_uniform_stmt,
    find_pending_duplicate_stmt,
    find_pending_duplicates_stmt,
    retarget_hold_stmt,
    unique_enqueue_stmt,
    unique_holder_stmt,
)
from sqlaq.queries.fair import fair_claim_params, fair_claim_stmt
from sqlaq.queries.inspect import (
    count_jobs_stmt,
    dedupe_twin_stmt,
    due_queues_stmt,
    enqueued_jobs_stmt,
    find_jobs_stmt,
    get_job_stmt,
    job_outcome_stmt,
    jobs_ahead_stmt,
    key_state_stmt,
    stats_counts_stmt,
    stats_health_stmt,
    travel_stmts,
    watch_job_stmt,
)
from sqlaq.queries.leader import (
    clock_stmt,
    periodic_advance_stmt,
    periodic_insert_stmt,
    periodic_lock_stmt,
    resign_stmt,
    try_lead_stmt,
    vacuum_need_stmt,
    vacuum_stmt,
)
from sqlaq.queries.limited import (
    key_running_stmt,
    keyed_candidates_params,
    keyed_candidates_stmt,
    kind_limit_state_params,
    kind_limit_state_stmt,
    lock_kind_stmt,
    record_starts_params,
    record_starts_stmt,
)
from sqlaq.queries.operators import (
    forget_worker_stmt,
    heartbeat_stmt,
    listen_stmt,
    notify_queues_stmt,
    pause_stmt,
    paused_queues_stmt,
    prune_workers_stmt,
    resume_stmt,
    serving_workers_stmt,
    workers_stmt,
)
from sqlaq.queries.retention import (
    Reference,
    blocking_references_stmt,
    cancel_stmt,
    cancel_workflow_stmt,
    cancelled_among_stmt,
    count_prunable_stmt,
    count_referenced_stmt,
    prune_stmt,
    prune_unique_holds_stmt,
    retry_stmt,
    sweep_stmt,
)
from sqlaq.queries.settle import (
    complete_result_params,
    complete_result_stmt,
    complete_stmt,
    extend_lease_stmt,
    fail_params,
    fail_stmt,
    fence_params,
    handback_stmt,
    snooze_stmt,
)
from sqlaq.queries.workflow import (
    end_children_stmt,
    hold_stmt,
    link_stmt,
    mark_parents_stmt,
    parent_results_stmt,
    release_stmt,
    release_waiting_stmt,
    set_setting_stmt,
    wait_finishing_stmt,
    waiting_for_stmt,
    workflow_stmt,
)

__all__ = [
    "BUSIEST_KEYS",
    "CLAIM_COLUMNS",
    "COPY_COLUMNS",
    "FULL_CLAIM",
    "LARGE_VALUES",
    "OUTCOME_COLUMNS",
    "WAIT_PERCENTILES",
    "ClaimPosition",
    "Reference",
    "blocking_references_stmt",
    "busiest_keys_stmt",
    "cancel_stmt",
    "cancel_workflow_stmt",
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
    "create_database_stmt",
    "debounce_enqueue_stmt",
    "dedupe_twin_stmt",
    "drop_database_stmt",
    "due_queues_stmt",
    "end_children_stmt",
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
    "fair_claim_params",
    "fair_claim_stmt",
    "fence_params",
    "find_jobs_stmt",
    "find_pending_duplicate_stmt",
    "find_pending_duplicates_stmt",
    "first_due_params",
    "first_due_stmt",
    "forget_worker_stmt",
    "get_job_stmt",
    "handback_stmt",
    "has_schema_revision_stmt",
    "heartbeat_stmt",
    "hold_stmt",
    "job_outcome_stmt",
    "job_page_stmt",
    "job_value_stmt",
    "jobs_ahead_stmt",
    "jobs_list_stmt",
    "key_running_stmt",
    "key_state_stmt",
    "keyed_candidates_params",
    "keyed_candidates_stmt",
    "kind_limit_state_params",
    "kind_limit_state_stmt",
    "link_stmt",
    "listen_stmt",
    "lock_kind_stmt",
    "mark_parents_stmt",
    "notify_queues_stmt",
    "overview_counts_stmt",
    "overview_health_stmt",
    "parent_results_stmt",
    "pause_stmt",
    "paused_queues_stmt",
    "periodic_advance_stmt",
    "periodic_insert_stmt",
    "periodic_lock_stmt",
    "periodic_slots_stmt",
    "ping_stmt",
    "privileges_stmt",
    "prune_stmt",
    "prune_unique_holds_stmt",
    "prune_workers_stmt",
    "rate_logs_stmt",
    "record_starts_params",
    "record_starts_stmt",
    "relaxed_commit_stmt",
    "relaxed_stmt",
    "release_stmt",
    "release_waiting_stmt",
    "resign_stmt",
    "resume_stmt",
    "retarget_hold_stmt",
    "retry_stmt",
    "running_by_kind_stmt",
    "running_workers_stmt",
    "schema_revision_stmt",
    "serving_workers_stmt",
    "set_setting_stmt",
    "snooze_stmt",
    "stats_counts_stmt",
    "stats_health_stmt",
    "sweep_stmt",
    "throughput_stmt",
    "travel_stmts",
    "try_lead_stmt",
    "unique_enqueue_stmt",
    "unique_holder_stmt",
    "vacuum_need_stmt",
    "vacuum_stmt",
    "wait_finishing_stmt",
    "wait_percentiles_stmt",
    "waiting_for_stmt",
    "watch_job_stmt",
    "where_check_stmt",
    "where_text",
    "workers_stmt",
    "workflow_cte",
    "workflow_stmt",
]
