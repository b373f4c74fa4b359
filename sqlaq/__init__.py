"""sqlaq: a PostgreSQL job queue for SQLAlchemy applications.

Statements for every queue operation that run inside the caller's own transaction,
Alembic revisions shipped as their own branch, and a thin worker. See README.md.

Importing the package is light: the pure modules (errors, :class:`NewJob`, backoff,
leases, rates) and :func:`explain` are imported here, every other public name on first
use (PEP 562 ``__getattr__``), so a worker process never imports what it does not run:
the ORM model :class:`Job` (and with it ``sqlalchemy.orm``), the asyncio driver, the
control and periodic helpers, Alembic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sqlaq.backoff import DEFAULT_BACKOFF, Backoff
from sqlaq.bounds import DEFAULT_MAX_PAYLOAD_BYTES, set_max_payload_bytes
from sqlaq.encoding import JobBatch, NewJob
from sqlaq.errors import (
    ConfigError,
    DatabaseUnavailableError,
    InvalidJobError,
    JobTimeoutError,
    LeaseLostError,
    PermanentError,
    SchemaOutOfDateError,
    Snooze,
    SqlaqError,
)

# Eager: the function shares its name with its module, and importing the module later
# (sqlaq-admin does) would set the package's attribute to the module.
from sqlaq.explain import Reason, ReasonCode, explain
from sqlaq.lease import Lease
from sqlaq.limits import Rate

if TYPE_CHECKING:
    from sqlaq import migrations, queries
    from sqlaq.config import WorkerConfig
    from sqlaq.context import JobContext, current_job
    from sqlaq.models import Job
    from sqlaq.ops import (
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
        batch,
        cancel,
        cancel_workflow,
        chain,
        chord,
        claim,
        claim_limited,
        complete,
        enqueue,
        enqueue_copy,
        enqueue_many,
        extend_lease,
        fail,
        group,
        handback,
        list_workers,
        parent_results,
        pause,
        paused_queues,
        prune,
        read_workflow,
        release_waiting,
        resume,
        retry,
        snooze,
        sweep,
    )
    from sqlaq.periodic import Periodic, enqueue_periodic
    from sqlaq.registry import Handler, Registry
    from sqlaq.results import JobNotFoundError, JobOutcome, WaitTimeoutError, result, wait
    from sqlaq.schema import JobStatus, jobs, metadata
    from sqlaq.worker import JobResult, Worker

# The public names imported on first use, and the module of each (the TYPE_CHECKING
# block above names them for type checkers; tests/unit/test_public_api.py checks both agree).
_LAZY: dict[str, str] = {
    **dict.fromkeys(("migrations", "queries"), ""),
    "WorkerConfig": "sqlaq.config",
    **dict.fromkeys(("JobContext", "current_job"), "sqlaq.context"),
    "Job": "sqlaq.models",
    **dict.fromkeys(
        (
            "ClaimedJob",
            "EnqueueOutcome",
            "EnqueueResult",
            "LimitedClaim",
            "PausedQueue",
            "PruneResult",
            "WorkerInfo",
            "RetryResult",
            "SkippedRetry",
            "ParentResult",
            "Workflow",
            "WorkflowJob",
            "WorkflowJobs",
            "batch",
            "chain",
            "chord",
            "group",
            "parent_results",
            "release_waiting",
            "cancel",
            "cancel_workflow",
            "claim",
            "claim_limited",
            "complete",
            "enqueue",
            "enqueue_copy",
            "enqueue_many",
            "extend_lease",
            "fail",
            "handback",
            "list_workers",
            "pause",
            "paused_queues",
            "prune",
            "read_workflow",
            "resume",
            "retry",
            "snooze",
            "sweep",
        ),
        "sqlaq.ops",
    ),
    **dict.fromkeys(("Periodic", "enqueue_periodic"), "sqlaq.periodic"),
    **dict.fromkeys(("Handler", "Registry"), "sqlaq.registry"),
    **dict.fromkeys(
        ("JobNotFoundError", "JobOutcome", "WaitTimeoutError", "result", "wait"), "sqlaq.results"
    ),
    **dict.fromkeys(("JobStatus", "jobs", "metadata"), "sqlaq.schema"),
    **dict.fromkeys(("JobResult", "Worker"), "sqlaq.worker"),
}


if not TYPE_CHECKING:  # hidden from type checkers, which would take any name as valid

    def __getattr__(name: str) -> Any:
        """Import a public name on first use (then it is an ordinary attribute)."""
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'sqlaq' has no attribute {name!r}")
        if module:
            value = getattr(importlib.import_module(module), name)
        else:  # a submodule
            value = importlib.import_module(f"sqlaq.{name}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DEFAULT_BACKOFF",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "Backoff",
    "ClaimedJob",
    "ConfigError",
    "DatabaseUnavailableError",
    "EnqueueOutcome",
    "EnqueueResult",
    "Handler",
    "InvalidJobError",
    "Job",
    "JobBatch",
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
    "ParentResult",
    "PausedQueue",
    "Periodic",
    "PermanentError",
    "PruneResult",
    "Rate",
    "Reason",
    "ReasonCode",
    "Registry",
    "RetryResult",
    "SchemaOutOfDateError",
    "SkippedRetry",
    "Snooze",
    "SqlaqError",
    "WaitTimeoutError",
    "Worker",
    "WorkerConfig",
    "WorkerInfo",
    "Workflow",
    "WorkflowJob",
    "WorkflowJobs",
    "batch",
    "cancel",
    "cancel_workflow",
    "chain",
    "chord",
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
    "group",
    "handback",
    "jobs",
    "list_workers",
    "metadata",
    "migrations",
    "parent_results",
    "pause",
    "paused_queues",
    "prune",
    "queries",
    "read_workflow",
    "release_waiting",
    "result",
    "resume",
    "retry",
    "set_max_payload_bytes",
    "snooze",
    "sweep",
    "wait",
]
