"""The small frozen values every floor passes around: what an enqueue did
(:class:`EnqueueResult`), a claimed job (:class:`ClaimedJob`), a limited claim
(:class:`LimitedClaim`), what a prune did (:class:`PruneResult`), what a retry did
(:class:`RetryResult`, :class:`SkippedRetry`), a paused queue (:class:`PausedQueue`) a
worker's heartbeat (:class:`WorkerInfo`), and a workflow's jobs (:class:`WorkflowJobs`).

The ground floor: it imports nothing of sqlaq but :mod:`sqlaq.lease`, so the context,
the outcome, the registry, tracing and the worker can name these types without
importing the operations. Each is also importable from :mod:`sqlaq.ops` and
:mod:`sqlaq`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from sqlaq.lease import Lease


class EnqueueOutcome(enum.StrEnum):
    """What an enqueue did (:attr:`EnqueueResult.outcome`)."""

    #: A new job was inserted.
    INSERTED = "inserted"
    #: Nothing was inserted: a pending (queued or running) job holds the dedupe key.
    DUPLICATE = "duplicate"
    #: Nothing was inserted: the never-started queued job of the debounce key was
    #: updated (its payload replaced, its ``run_at`` pushed back).
    DEBOUNCED = "debounced"
    #: Nothing was inserted: a job took the dedupe key less than ``unique_for`` ago,
    #: whatever its status now.
    HELD = "held"


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """The outcome of one enqueue.

    Attributes:
        job_id: The new job; or the job that already held the key: the pending twin
            (duplicate), the queued job that was updated (debounced), the job that holds
            the ``unique_for`` key (held; it may since have been pruned).
        duplicate: True when nothing new was inserted (any outcome but ``INSERTED``):
            *job_id* is an existing job.
        outcome: Which of inserted, duplicate, debounced or held
            (:class:`EnqueueOutcome`). ``EnqueueResult(id, duplicate=True)`` means
            ``DUPLICATE``.
    """

    job_id: int
    duplicate: bool = False
    outcome: EnqueueOutcome = EnqueueOutcome.INSERTED

    def __post_init__(self) -> None:
        if self.duplicate and self.outcome is EnqueueOutcome.INSERTED:
            object.__setattr__(self, "outcome", EnqueueOutcome.DUPLICATE)
        object.__setattr__(self, "duplicate", self.outcome is not EnqueueOutcome.INSERTED)

    @property
    def inserted(self) -> bool:
        """True when a new job was inserted."""
        return self.outcome is EnqueueOutcome.INSERTED


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job claimed for running, with the lease that fences its outcome.

    Attributes:
        id: The job's id.
        queue: The queue it was claimed from.
        kind: Which handler runs it.
        payload: The handler's argument, decoded.
        priority: Its priority.
        attempt: This attempt's number (1 for the first run).
        max_attempts: How many attempts it may have in all.
        created_at: When it was enqueued (database clock).
        lease: Pass it to complete, fail and extend_lease.
        attempted_at: When this attempt started: the claim's ``now()``.
        headers: What the enqueuer stored with the job: its trace context (JSON object),
            or None.
        timeout: The job's own attempt timeout (``enqueue(..., timeout=...)``), which
            the worker uses over its handler's; None: the handler's.
    """

    id: int
    queue: str
    kind: str
    payload: dict[str, Any]
    priority: int
    attempt: int
    max_attempts: int
    created_at: datetime
    lease: Lease
    attempted_at: datetime | None = None
    headers: dict[str, Any] | None = None
    timeout: timedelta | None = None


@dataclass(frozen=True, slots=True)
class LimitedClaim:
    """What :func:`~sqlaq.ops.claim_limited` claimed, and what held it back.

    Attributes:
        jobs: The claimed jobs.
        full: The kind's concurrency limit is reached, or (a keyed kind) some key was
            at its ``key_concurrency`` when the claim took fewer jobs than it could:
            claim it again once a job of it ends (or at the next poll, for jobs other
            workers run).
        rate_wait: The rate may be holding jobs back: how long until it lets the next
            one start. None when the rate is not what stopped the claim.

    Both are False/None when the claim took fewer jobs than the limits allowed and no
    key was full: then nothing more of the kind was due.
    """

    jobs: list[ClaimedJob]
    full: bool = False
    rate_wait: timedelta | None = None


class PruneResult(int):
    """What :func:`~sqlaq.ops.prune` did: an ``int``, the number of jobs deleted, as it always was,
    with what it had to leave.

    Attributes:
        skipped: Jobs old enough to delete that a host's foreign key (one without ``ON
            DELETE``) still references, so they stay. Counted, up to the call's
            *limit*, only by a call that ran out of jobs to delete (it returned less than
            *limit*), so a loop of calls reports them once; 0 otherwise.
        referenced_by: The tables (``schema.table``) whose foreign keys hold those jobs.
    """

    skipped: int
    referenced_by: tuple[str, ...]

    def __new__(
        cls, deleted: int, skipped: int = 0, referenced_by: tuple[str, ...] = ()
    ) -> PruneResult:
        result = super().__new__(cls, deleted)
        result.skipped = skipped
        result.referenced_by = referenced_by
        return result

    def __repr__(self) -> str:
        return (
            f"PruneResult({int(self)}, skipped={self.skipped}, "
            f"referenced_by={self.referenced_by!r})"
        )


@dataclass(frozen=True, slots=True)
class PausedQueue:
    """A paused queue.

    Attributes:
        queue: Its name.
        paused_at: When it was paused (database clock).
        paused_by: Who paused it, as :func:`~sqlaq.ops.pause` was told (``sqlaq pause`` records
            ``user@host``); None when not told.
    """

    queue: str
    paused_at: datetime
    paused_by: str | None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker, as its last heartbeat recorded it.

    Attributes:
        worker_id: Its id: the ``locked_by`` of the jobs it claims.
        hostname: The host it runs on.
        pid: Its process id there.
        queues: The queues it serves.
        concurrency: How many jobs it runs at once.
        started_at: When it started (its first heartbeat).
        last_seen_at: Its latest heartbeat (once per maintenance interval).
        seen_ago: How long ago that was, on the database's clock.
    """

    worker_id: UUID
    hostname: str
    pid: int
    queues: tuple[str, ...]
    concurrency: int
    started_at: datetime
    last_seen_at: datetime
    seen_ago: timedelta


#: How much of a key a reason shows.
_KEY_SHOWN = 80


@dataclass(frozen=True, slots=True)
class SkippedRetry:
    """A job :func:`~sqlaq.ops.retry` left alone because another job holds its key.

    Queuing it again would have made two pending jobs of one ``dedupe_key`` (or two
    never-started queued jobs of one ``debounce_key``), which the unique indexes refuse.

    Attributes:
        job_id: The job left failed or cancelled.
        key: The value of its key that is taken.
        holder_id: The pending job holding that key: a job that was already pending, or
            one retried by the same call (of several jobs of one key in a call, the
            lowest id is retried). None when that job is not visible to the caller's
            transaction (it committed after the transaction's snapshot was taken).
        key_name: Which key: ``"dedupe_key"`` or ``"debounce_key"``.
    """

    job_id: int
    key: str
    holder_id: int | None
    key_name: Literal["dedupe_key", "debounce_key"] = "dedupe_key"

    @property
    def reason(self) -> str:
        """One line saying why the job was not retried, for people."""
        key = repr(self.key)
        if len(key) > _KEY_SHOWN:
            key = key[: _KEY_SHOWN - 3] + "..."
        which = "dedupe" if self.key_name == "dedupe_key" else "debounce"
        holder = "another pending job" if self.holder_id is None else f"job {self.holder_id}"
        return f"job {self.job_id} not retried: {holder} holds its {which} key {key}"


class RetryResult(list[int]):
    """What :func:`~sqlaq.ops.retry` did: a ``list`` of the ids queued again, as it always
    was, with the jobs it left alone for their keys.

    Attributes:
        skipped: A :class:`SkippedRetry` for each job left failed or cancelled because
            another job holds its dedupe or debounce key (in id order). Jobs left alone
            for their status (not failed or cancelled, or unknown) are in neither list.
    """

    skipped: list[SkippedRetry]

    def __init__(self, retried: Iterable[int] = (), skipped: Iterable[SkippedRetry] = ()) -> None:
        super().__init__(retried)
        self.skipped = list(skipped)

    def __repr__(self) -> str:
        return f"RetryResult({list(self)!r}, skipped={self.skipped!r})"


@dataclass(frozen=True, slots=True)
class Workflow:
    """The jobs a workflow shape enqueued (:func:`sqlaq.chain`, :func:`sqlaq.group`,
    :func:`sqlaq.chord`, :func:`sqlaq.batch`).

    Attributes:
        job_ids: The jobs given, in order (a chain's steps, a group's members).
        callback_id: A chord's or a batch's callback; None for a chain or a group.
    """

    job_ids: tuple[int, ...]
    callback_id: int | None = None


@dataclass(frozen=True, slots=True)
class WorkflowJob:
    """One job of a workflow, as :func:`sqlaq.read_workflow` reads it.

    Attributes:
        job_id: The job.
        kind: Its kind.
        queue: Its queue.
        status: Its status (a :class:`~sqlaq.JobStatus` value).
        parent_ids: Every parent it was enqueued to wait for, in the order given
            (empty for a root).
        waiting: Whether it is queued and still waits for a parent (held, not due).
        finished_at: When it finished, or None.
    """

    job_id: int
    kind: str
    queue: str
    status: str
    parent_ids: tuple[int, ...]
    waiting: bool
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class WorkflowJobs:
    """A workflow read from one of its jobs (:func:`sqlaq.read_workflow`).

    Attributes:
        job_id: The job it was read from.
        jobs: Its jobs in dependency order (by id: a parent before its children), at
            most the ``limit`` asked, the nearest to *job_id* first when cut; empty
            when no job has the id *job_id*.
        total: How many jobs the workflow has, counted up to a bound
            (:attr:`counted_all` says whether it was reached).
        counted_all: False when the count stopped at its bound: ``total`` is then
            "at least".
    """

    job_id: int
    jobs: tuple[WorkflowJob, ...]
    total: int
    counted_all: bool

    @property
    def more(self) -> int:
        """How many jobs of the workflow are not in :attr:`jobs` (at least, when not
        :attr:`counted_all`)."""
        return self.total - len(self.jobs)


@dataclass(frozen=True, slots=True)
class ParentResult:
    """One parent of a job, as :func:`sqlaq.parent_results` reads it.

    Attributes:
        job_id: The parent.
        status: Its status (a :class:`~sqlaq.JobStatus` value): ``done``, or ``failed``
            or ``cancelled`` for a batch's callback (or a child that runs anyway).
        result: Its handler's return value (JSON), None if it returned none or is not done.
    """

    job_id: int
    status: str
    result: Any
