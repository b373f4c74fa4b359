"""sqlaq: a PostgreSQL job queue for SQLAlchemy applications.

Statements for every queue operation that run inside the caller's own transaction,
Alembic revisions shipped as their own branch, and a thin worker. See README.md.
"""

from __future__ import annotations

from sqlaq import migrations, queries
from sqlaq.backoff import DEFAULT_BACKOFF, Backoff
from sqlaq.config import WorkerConfig
from sqlaq.context import JobContext, current_job
from sqlaq.control import PausedQueue, WorkerInfo, list_workers, pause, paused_queues, resume
from sqlaq.encoding import NewJob
from sqlaq.errors import (
    ConfigError,
    InvalidJobError,
    JobTimeoutError,
    LeaseLostError,
    PermanentError,
    SchemaOutOfDateError,
    Snooze,
    SqlaqError,
)
from sqlaq.explain import Reason, ReasonCode, explain
from sqlaq.lease import Lease
from sqlaq.limits import Rate
from sqlaq.models import Job
from sqlaq.ops import (
    ClaimedJob,
    EnqueueResult,
    LimitedClaim,
    PruneResult,
    cancel,
    claim,
    claim_limited,
    complete,
    enqueue,
    enqueue_copy,
    enqueue_many,
    extend_lease,
    fail,
    handback,
    prune,
    retry,
    snooze,
    sweep,
)
from sqlaq.periodic import Periodic, enqueue_periodic
from sqlaq.registry import Handler, Registry
from sqlaq.results import JobNotFoundError, JobOutcome, WaitTimeoutError, result, wait
from sqlaq.schema import JobStatus, jobs, metadata
from sqlaq.worker import JobResult, Worker

__all__ = [
    "DEFAULT_BACKOFF",
    "Backoff",
    "ClaimedJob",
    "ConfigError",
    "EnqueueResult",
    "Handler",
    "InvalidJobError",
    "Job",
    "JobContext",
    "JobNotFoundError",
    "JobOutcome",
    "JobResult",
    "JobStatus",
    "JobTimeoutError",
    "Lease",
    "LeaseLostError",
    "LimitedClaim",
    "NewJob",
    "PausedQueue",
    "Periodic",
    "PermanentError",
    "PruneResult",
    "Rate",
    "Reason",
    "ReasonCode",
    "Registry",
    "SchemaOutOfDateError",
    "Snooze",
    "SqlaqError",
    "WaitTimeoutError",
    "Worker",
    "WorkerConfig",
    "WorkerInfo",
    "cancel",
    "claim",
    "claim_limited",
    "complete",
    "current_job",
    "enqueue",
    "enqueue_copy",
    "enqueue_many",
    "enqueue_periodic",
    "explain",
    "extend_lease",
    "fail",
    "handback",
    "jobs",
    "list_workers",
    "metadata",
    "migrations",
    "pause",
    "paused_queues",
    "prune",
    "queries",
    "result",
    "resume",
    "retry",
    "snooze",
    "sweep",
    "wait",
]
