"""Queue operations over the caller's Connection or Session: the catalogue.

Every operation on a job, in lifecycle order, each written once as a plan (see
:mod:`sqlaq.drive`) in the module of its stage:

* :mod:`~sqlaq.ops.enqueuing`: :func:`enqueue`, :func:`enqueue_many`, :func:`enqueue_copy`;
* :mod:`~sqlaq.ops.claiming`: :func:`claim`, :func:`claim_limited`;
* :mod:`~sqlaq.ops.settling`: :func:`extend_lease`, :func:`complete`, :func:`fail`,
  :func:`snooze`, :func:`handback`;
* :mod:`~sqlaq.ops.retention`: :func:`retry`, :func:`cancel`, :func:`cancelled_among`,
  :func:`sweep`, :func:`prune`;
* :mod:`~sqlaq.ops.operators`: :func:`pause`, :func:`resume`, :func:`paused_queues`,
  :func:`list_workers`, :func:`notify_queues`;
* :mod:`~sqlaq.ops.workflows`: :func:`chain`, :func:`group`, :func:`chord`,
  :func:`batch`, :func:`parent_results`, :func:`release_waiting`,
  :func:`read_workflow`, :func:`cancel_workflow` (and ``enqueue(..., after=...)``).

The values they return (:class:`ClaimedJob`, :class:`EnqueueResult`, ...) live in
:mod:`sqlaq.records` and are importable here too.

Each operation validates its input, runs statements from :mod:`sqlaq.queries` on the
connection it is given, and maps rows to small frozen dataclasses. None of them commits
or rolls back: the caller's ``with engine.begin()`` or ``session.commit()`` decides, so
a job enqueued beside an order commits or rolls back with it.

Fenced operations (:func:`extend_lease`, :func:`complete`, :func:`fail`) change a job
only while the given lease is still its current one. By default they raise
:class:`~sqlaq.errors.LeaseLostError` when a lease was lost; the caller's transaction
stays usable (nothing failed in the database), and any other lease of the same call was
applied. Pass ``raise_on_lost=False`` to learn the outcome from the return value instead.

``@operation`` makes the sync function of this package from each plan (``enqueue(conn,
...)``), and :mod:`sqlaq.asyncio` the ``async`` twin (``await
sqlaq.asyncio.enqueue(async_conn, ...)``) from the same plan. Inside a plan, ``result =
yield statement, params`` runs a statement on the caller's connection.
"""

from __future__ import annotations

from sqlaq.drive import Executor
from sqlaq.ops._common import DEFAULT_LEASE, DEFAULT_PRUNE_BATCH
from sqlaq.ops.claiming import claim, claim_limited
from sqlaq.ops.enqueuing import enqueue, enqueue_copy, enqueue_many
from sqlaq.ops.operators import list_workers, notify_queues, pause, paused_queues, resume
from sqlaq.ops.retention import cancel, cancelled_among, prune, retry, sweep
from sqlaq.ops.settling import MAX_ERROR_LENGTH, complete, extend_lease, fail, handback, snooze
from sqlaq.ops.workflows import (
    batch,
    cancel_workflow,
    chain,
    chord,
    group,
    parent_results,
    read_workflow,
    release_waiting,
)
from sqlaq.records import (
    ClaimedJob,
    EnqueueOutcome,
    EnqueueResult,
    LimitedClaim,
    ParentResult,
    PausedQueue,
    PruneResult,
    RetryResult,
    SkippedRetry,
    WorkerInfo,
    Workflow,
    WorkflowJob,
    WorkflowJobs,
)

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_PRUNE_BATCH",
    "MAX_ERROR_LENGTH",
    "ClaimedJob",
    "EnqueueOutcome",
    "EnqueueResult",
    "Executor",
    "LimitedClaim",
    "ParentResult",
    "PausedQueue",
    "PruneResult",
    "RetryResult",
    "SkippedRetry",
    "WorkerInfo",
    "Workflow",
    "WorkflowJob",
    "WorkflowJobs",
    "batch",
    "cancel",
    "cancel_workflow",
    "cancelled_among",
    "chain",
    "chord",
    "claim",
    "claim_limited",
    "complete",
    "enqueue",
    "enqueue_copy",
    "enqueue_many",
    "extend_lease",
    "fail",
    "group",
    "handback",
    "list_workers",
    "notify_queues",
    "parent_results",
    "pause",
    "paused_queues",
    "prune",
    "read_workflow",
    "release_waiting",
    "resume",
    "retry",
    "snooze",
    "sweep",
]
