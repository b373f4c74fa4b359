"""Queue operations over the caller's Connection or Session.

Each operation validates its input, runs statements from :mod:`sqlaq.queries` on the
connection it is given, and maps rows to small frozen dataclasses. None of them commits
or rolls back: the caller's ``with engine.begin()`` or ``session.commit()`` decides, so
a job enqueued beside an order commits or rolls back with it.

Fenced operations (:func:`extend_lease`, :func:`complete`, :func:`fail`) change a job
only while the given lease is still its current one. By default they raise
:class:`~sqlaq.errors.LeaseLostError` when a lease was lost; the caller's transaction
stays usable (nothing failed in the database), and any other lease of the same call was
applied. Pass ``raise_on_lost=False`` to learn the outcome from the return value instead.

Each operation is written once, as a plan (see :mod:`sqlaq.drive`): a generator that
validates, yields its statements and shapes their results. ``@operation`` makes the sync
function of this module from it (``enqueue(conn, ...)``), and :mod:`sqlaq.asyncio` the
``async`` twin (``await sqlaq.asyncio.enqueue(async_conn, ...)``) from the same plan.
Inside a plan, ``result = yield statement, params`` runs a statement on the caller's
connection.
"""

from __future__ import annotations

import enum
import logging
import operator
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import ColumnElement
from sqlalchemy.exc import DBAPIError

from sqlaq import queries, tracing
from sqlaq.bounds import clamp_duration
from sqlaq.drive import AUTOCOMMIT, Copy, Executor, Plan, Savepoint, operation
from sqlaq.encoding import (
    JobBatch,
    NewJob,
    check_dedupe_key,
    check_duration,
    check_name,
    slot_setters,
)
from sqlaq.errors import ConfigError, InvalidJobError, LeaseLostError, shown
from sqlaq.lease import Lease
from sqlaq.limits import Rate, allowance
from sqlaq.queries.columns import copy_row
from sqlaq.schema import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    FINISHED_STATUSES,
    JobStatus,
)
from sqlaq.schema import jobs as jobs_table

_log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_PRUNE_BATCH",
    "MAX_ERROR_LENGTH",
    "ClaimedJob",
    "EnqueueOutcome",
    "EnqueueResult",
    "Executor",
    "LimitedClaim",
    "PruneResult",
    "cancel",
    "cancelled_among",
    "claim",
    "claim_limited",
    "complete",
    "enqueue",
    "enqueue_copy",
    "enqueue_many",
    "extend_lease",
    "fail",
    "handback",
    "notify_queues",
    "prune",
    "retry",
    "snooze",
    "sweep",
]

DEFAULT_LEASE = timedelta(seconds=30)
DEFAULT_PRUNE_BATCH = 1000
#: ``last_error`` is cut to this many characters (a traceback summary, not a log).
MAX_ERROR_LENGTH = 8000
_INT4_MAX = 2_147_483_647
_INT8_MAX = 9_223_372_036_854_775_807
# A dedupe race (the pending twin finished between our INSERT and our SELECT) is retried
# this many times before giving up; each round sees a fresh snapshot in READ COMMITTED.
_DEDUPE_ROUNDS = 5


_NIL = UUID(int=0)
_NIL_LEASE = Lease(0, _NIL, _NIL, 0, datetime.min)
# Hot statements are built once, with placeholder values; each call passes its own
# values as execution parameters (queries.*_params), which override the built-in ones.
# Building a claim costs about 1 ms of Python; running the cached one costs nothing more.
_ENQUEUE = queries.enqueue_stmt(job=NewJob("_"))
_ENQUEUE_DEDUPE = queries.enqueue_stmt(job=NewJob("_", dedupe_key="_"))
_ENQUEUE_DEBOUNCE = queries.debounce_enqueue_stmt(
    job=NewJob("_"), debounce_key="_", debounce=DEFAULT_LEASE
)
_ENQUEUE_UNIQUE = queries.unique_enqueue_stmt(
    job=NewJob("_", dedupe_key="_"), unique_for=DEFAULT_LEASE
)
_CLAIM = queries.claim_stmt(queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE)
_CLAIM_KIND = queries.claim_stmt(queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, kind="_")
_LOCK_KIND = queries.lock_kind_stmt(kind="_")
_KIND_STATE = queries.kind_limit_state_stmt(kind="_", rate=None)
_RECORD_STARTS = queries.record_starts_stmt(kind="_", rate=Rate(1, DEFAULT_LEASE), started=1)
_CLAIM_EXCLUDING = queries.claim_stmt(
    queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, exclude_kinds=["_"]
)
_EXTEND = queries.extend_lease_stmt(leases=[], lease=DEFAULT_LEASE)
_COMPLETE = queries.complete_stmt(leases=[])
_FAIL = queries.fail_stmt(lease=_NIL_LEASE, error="", retry_in=None)


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


@operation
def enqueue(
    kind: str,
    payload: Mapping[str, Any] | None = None,
    *,
    queue: str = DEFAULT_QUEUE,
    priority: int = 0,
    delay: timedelta = timedelta(0),
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    dedupe_key: str | None = None,
    run_at: datetime | None = None,
    timeout: timedelta | None = None,
    unique_for: timedelta | None = None,
    debounce_key: str | None = None,
    debounce: timedelta | None = None,
    max_wait: timedelta | None = None,
) -> Plan[EnqueueResult]:
    """Insert one job in the caller's transaction.

    The job exists, and workers are woken, only once the caller commits. With a
    *dedupe_key*, enqueueing while a job of the same kind and key is queued or running
    inserts nothing and reports the existing job (``duplicate=True``); no exception is
    raised and the transaction stays usable. So do *unique_for* and *debounce*, whose
    outcome :attr:`EnqueueResult.outcome` names.

    Args:
        conn: The caller's Connection or Session.
        kind: Which handler runs the job.
        payload: The handler's argument, a JSON object (default ``{}``).
        queue: The queue to put it on.
        priority: Higher runs first among due jobs.
        delay: Run no sooner than ``now() + delay``.
        max_attempts: How many times it may be claimed.
        dedupe_key: At most one pending job per ``(kind, dedupe_key)``.
        run_at: Run no sooner than this aware ``datetime`` (instead of *delay*; a naive
            one is refused).
        timeout: This job's attempt timeout, over its handler's ``timeout=``.
        unique_for: With *dedupe_key*: no second job of ``(kind, dedupe_key)`` within
            this long after this one's enqueue, whatever its status by then (done,
            failed, cancelled included); a refused enqueue is ``HELD`` and reports the
            holder.
        debounce_key: With *debounce*: the key whose never-started queued job a later
            enqueue updates instead of inserting a second one.
        debounce: Run at ``now() + debounce``; an enqueue of the same ``(kind,
            debounce_key)`` while the job is still queued and never started replaces its
            payload (and priority, max_attempts, timeout) and pushes its ``run_at`` to
            the new ``now() + debounce`` (``DEBOUNCED``). Not with *dedupe_key*,
            *delay* or *run_at*.
        max_wait: With *debounce*: the debounced job runs no later than its first
            enqueue (``created_at``) plus *max_wait*, however often it is pushed back;
            at least *debounce*. None: no cap.

    Returns:
        The job's id and what happened (:class:`EnqueueResult`).

    Raises:
        InvalidJobError: bad input; nothing was written.
    """
    job = NewJob(
        kind=kind,
        payload={} if payload is None else payload,
        queue=queue,
        priority=priority,
        delay=delay,
        max_attempts=max_attempts,
        dedupe_key=dedupe_key,
        run_at=run_at,
        timeout=timeout,
    )
    debounced = debounce is not None or debounce_key is not None or max_wait is not None
    if debounced:
        _check_debounce(job, debounce_key, debounce, max_wait, unique_for)
    elif unique_for is not None:
        check_duration("unique_for", unique_for, allow_zero=False)
        if job.dedupe_key is None:
            raise InvalidJobError("unique_for needs a dedupe_key: the key it holds")
    # The enqueuer's trace context (sqlaq[otel]), linked from each attempt's span.
    params = queries.enqueue_params(job, headers=tracing.capture())
    if debounced:
        params |= {"b_debounce_key": debounce_key, "b_debounce": debounce, "b_max_wait": max_wait}
        job_id, updated = (yield _ENQUEUE_DEBOUNCE, params).one()
        return EnqueueResult(
            job_id, outcome=EnqueueOutcome.DEBOUNCED if updated else EnqueueOutcome.INSERTED
        )
    if job.dedupe_key is None:
        inserted = yield _ENQUEUE, params
        return EnqueueResult(inserted.scalar_one())
    if unique_for is not None:
        return (yield from _enqueue_unique(job.kind, job.dedupe_key, params, unique_for))
    for _ in range(_DEDUPE_ROUNDS):
        inserted = yield _ENQUEUE_DEDUPE, params
        job_id = inserted.scalar_one_or_none()
        if job_id is not None:
            return EnqueueResult(job_id)
        find = queries.find_pending_duplicate_stmt(kind=job.kind, dedupe_key=job.dedupe_key)
        twin = (yield find, None).scalar_one_or_none()
        if twin is not None:
            return EnqueueResult(twin, duplicate=True)
    raise RuntimeError(  # pragma: no cover - needs a pathological race to reach
        f"could not enqueue {kind!r} with dedupe_key {dedupe_key!r}: its pending twin kept "
        "changing; try again"
    )


def _check_debounce(
    job: NewJob,
    key: str | None,
    debounce: timedelta | None,
    max_wait: timedelta | None,
    unique_for: timedelta | None,
) -> None:
    if debounce is None:
        raise InvalidJobError(
            "debounce_key and max_wait go with debounce=timedelta(...): how long to wait "
            "for a quieter moment"
        )
    check_duration("debounce", debounce, allow_zero=False)
    if key is None:
        raise InvalidJobError("debounce needs a debounce_key: which enqueues fold into one job")
    check_dedupe_key(key, "debounce_key")
    if max_wait is not None:
        check_duration("max_wait", max_wait, allow_zero=False)
        if max_wait < debounce:
            raise InvalidJobError(
                f"max_wait ({max_wait}) must be at least debounce ({debounce}): the cap "
                "cannot come before the first run"
            )
    if job.dedupe_key is not None or unique_for is not None:
        raise InvalidJobError(
            "debounce does not go with dedupe_key or unique_for: a debounced job is keyed "
            "by its debounce_key"
        )
    if job.delay or job.run_at is not None:
        raise InvalidJobError("debounce sets run_at (now() + debounce): drop delay and run_at")


def _enqueue_unique(
    kind: str, key: str, params: dict[str, Any], unique_for: timedelta
) -> Plan[EnqueueResult]:
    """The unique_for enqueue of the job of *params*, holding ``(kind, key)`` (see
    :func:`sqlaq.queries.unique_enqueue_stmt`)."""
    params["b_unique_for"] = unique_for
    for _ in range(_DEDUPE_ROUNDS):
        taken, inserted = (yield _ENQUEUE_UNIQUE, params).one()
        if inserted is not None:
            return EnqueueResult(inserted)
        if taken is None:  # held: this transaction now waits on nobody for the row
            holder = yield queries.unique_holder_stmt(kind=kind, key=key), None
            holder_id = holder.scalar_one_or_none()
            if holder_id is not None:
                return EnqueueResult(holder_id, outcome=EnqueueOutcome.HELD)
            continue  # pragma: no cover - the hold was deleted meanwhile: take it
        # The hold is ours, but a pending job holds the dedupe key: the hold follows it.
        for _ in range(_DEDUPE_ROUNDS):
            find = queries.find_pending_duplicate_stmt(kind=kind, dedupe_key=key)
            twin = (yield find, None).scalar_one_or_none()
            result = EnqueueResult(twin, duplicate=True) if twin is not None else None
            if result is None:  # it finished meanwhile: insert ours after all
                job_id = (yield _ENQUEUE_DEDUPE, params).scalar_one_or_none()
                result = EnqueueResult(job_id) if job_id is not None else None
            if result is not None:
                retarget = queries.retarget_hold_stmt(
                    kind=kind, key=key, job_id=result.job_id, unique_for=unique_for
                )
                yield retarget, None
                return result
    raise RuntimeError(  # pragma: no cover - needs a pathological race to reach
        f"could not enqueue {kind!r} with dedupe_key {key!r}: its holder kept changing; try again"
    )


# What jobs of enqueue_many's common batch share: all but the payload (no dedupe key).
_SHAPE = operator.attrgetter(
    "queue", "kind", "priority", "delay", "max_attempts", "dedupe_key", "run_at", "timeout"
)
_SHAPE_DEDUPE_KEY = 5


_RESULT_SETTERS = slot_setters(EnqueueResult)


def _inserted(ids: Iterable[int]) -> list[EnqueueResult]:
    """``[EnqueueResult(job_id) for job_id in ids]``, faster."""
    set_id, set_duplicate, set_outcome = _RESULT_SETTERS
    new, inserted = object.__new__, EnqueueOutcome.INSERTED
    results = []
    for job_id in ids:
        result = new(EnqueueResult)
        set_id(result, job_id)
        set_duplicate(result, False)
        set_outcome(result, inserted)
        results.append(result)
    return results


@operation
def enqueue_many(jobs: Iterable[NewJob]) -> Plan[list[EnqueueResult]]:
    """Insert many jobs with one statement, in the caller's transaction.

    Every job is validated before anything is sent. Jobs whose dedupe key is already
    held by a pending job (or by an earlier job of the same call) are not inserted and
    report that job's id with ``duplicate=True``.

    *jobs* may be a :class:`~sqlaq.JobBatch` (``NewJob(kind).with_payloads(payloads)``:
    one job per payload, every other field shared), the fastest way to enqueue many
    jobs with their ids back: its payloads were checked and encoded when it was made,
    and no ``NewJob`` is built for it.

    Returns:
        One result per input job, in input order.

    Raises:
        InvalidJobError: an item is not a :class:`~sqlaq.NewJob`; nothing was written.
    """
    if type(jobs) is JobBatch:
        # Checked and encoded when it was made: one statement, no NewJob built.
        if not jobs:
            return []
        return (yield from _enqueue_uniform(jobs.template, jobs.payloads_json, len(jobs)))
    batch = list(jobs)
    for index, job in enumerate(batch):
        if not isinstance(job, NewJob):
            raise InvalidJobError(f"jobs[{index}] must be a sqlaq.NewJob, got {type(job).__name__}")
    if not batch:
        return []
    shape = _SHAPE(batch[0])
    if shape[_SHAPE_DEDUPE_KEY] is None and all(map(shape.__eq__, map(_SHAPE, batch))):
        # The common batch: jobs that differ only in their payload, none with a dedupe
        # key; one statement with one JSON array of payloads (enqueue_uniform_stmt).
        payloads_json = f"[{','.join([job.payload_json for job in batch])}]"
        return (yield from _enqueue_uniform(batch[0], payloads_json, len(batch)))
    headers = tracing.capture()
    # Identity values are drawn in input order, so sorted ids line up with the input.
    inserted = yield queries.enqueue_many_stmt(jobs_=batch, headers=headers), None
    rows = sorted(inserted.all(), key=lambda r: r[0])
    inserted = iter(rows)
    results: list[EnqueueResult | None] = []
    next_row = next(inserted, None)
    for job in batch:
        if next_row is not None and (next_row[1], next_row[2]) == (job.kind, job.dedupe_key):
            results.append(EnqueueResult(next_row[0]))
            next_row = next(inserted, None)
        else:
            results.append(None)  # skipped as a duplicate; resolved below
    missing = {(j.kind, j.dedupe_key) for j, r in zip(batch, results, strict=True) if r is None}
    if missing:
        kinds, keys = zip(*missing, strict=True)
        found = yield queries.find_pending_duplicates_stmt(kinds=kinds, dedupe_keys=keys), None
        twins = {(row[1], row[2]): row[0] for row in found.all()}
        for index, (job, result) in enumerate(zip(batch, results, strict=True)):
            if result is None:
                results[index] = EnqueueResult(twins[(job.kind, job.dedupe_key)], duplicate=True)
    return results  # type: ignore[return-value]


def _enqueue_uniform(job: NewJob, payloads_json: str, count: int) -> Plan[list[EnqueueResult]]:
    """Insert *count* jobs that are *job* but for their payloads (*payloads_json*, one
    JSON array): one statement (:func:`~sqlaq.queries.enqueue_uniform_stmt`)."""
    params = queries.enqueue_uniform_params(job, payloads_json, headers=tracing.capture())
    ids = (yield queries.enqueue_uniform_stmt(), params).scalars().all()
    if len(ids) != count:  # pragma: no cover - nothing can conflict
        raise RuntimeError(f"enqueue_many inserted {len(ids)} of {count} jobs")
    ids.sort()  # identity values are drawn in input order
    return _inserted(ids)


@operation
def enqueue_copy(jobs: Iterable[NewJob]) -> Plan[int]:
    """Insert many jobs with ``COPY``, in the caller's transaction: the fastest path.

    About one and a half times the rate of :func:`enqueue_many` (``bench/RESULTS.md``),
    for jobs that need neither ids back nor the other things COPY cannot do: every job
    must be due now (no ``delay``) and have no ``dedupe_key``. Workers are notified on
    commit, as for any enqueue. Runs on the driver connection under *conn* (psycopg's COPY;
    asyncpg's ``copy_records_to_table`` from :mod:`sqlaq.asyncio`), inside the
    transaction *conn* has begun (or begins, as any operation would).

    Returns:
        How many jobs were written.

    Raises:
        InvalidJobError: an item is not a :class:`~sqlaq.NewJob`, or has a dedupe key,
            a delay or a timeout; nothing was written.
        ConfigError: the connection's driver cannot run COPY here (the message names
            the driver or function to use).
    """
    batch = list(jobs)
    for index, job in enumerate(batch):
        if not isinstance(job, NewJob):
            raise InvalidJobError(f"jobs[{index}] must be a sqlaq.NewJob, got {type(job).__name__}")
        if job.dedupe_key is not None:
            raise InvalidJobError(
                f"jobs[{index}] has a dedupe_key; COPY cannot skip duplicates: "
                "use sqlaq.enqueue_many for jobs with dedupe keys"
            )
        if job.delay or job.run_at is not None:
            raise InvalidJobError(
                f"jobs[{index}] has a delay or run_at; COPY writes run_at = now(): "
                "use sqlaq.enqueue_many for delayed jobs"
            )
        if job.timeout is not None:
            raise InvalidJobError(
                f"jobs[{index}] has a timeout; COPY writes the handler's: "
                "use sqlaq.enqueue_many for jobs with their own timeout"
            )
    if not batch:
        return 0
    rows = [copy_row(j) for j in batch]
    copy = Copy(
        queries.enqueue_copy_stmt(), jobs_table.name, queries.COPY_COLUMNS, rows, "enqueue_copy"
    )
    written: int = yield copy
    return written


@operation
def claim(
    *,
    worker_id: UUID,
    queue: str = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta = DEFAULT_LEASE,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Plan[list[ClaimedJob]]:
    """Claim up to *limit* due jobs of *queue* for *worker_id*, highest priority first.

    Due jobs are queued jobs with ``run_at <= now()`` and running jobs whose lease
    expired. Each claimed job gets ``status = 'running'``, one more attempt, and a lease
    ending at ``now() + lease``. A job whose lease expired on its last attempt is marked
    failed by the same statement and not returned, so fewer than *limit* jobs may come
    back even when more are due.

    The claim takes effect when the caller commits; keep that transaction short.

    Args:
        exclude_kinds: Kinds not to claim: the limited kinds, which only
            :func:`claim_limited` may claim.
        where: Claim only jobs matching this boolean clause (or every clause of a
            sequence) over :data:`sqlaq.jobs` columns, for worker affinity:
            ``sqlaq.jobs.c.payload["region"].astext == "eu"``. It is applied inside the
            claim's locking subquery, so non-matching jobs are neither claimed nor
            locked (see :func:`sqlaq.queries.claim_stmt`). Pass the same clause object
            on every call: the claim statement built around it is cached by its
            identity (a new clause object costs about a millisecond to build around).

    Raises:
        ConfigError: *limit* is not a positive int, *worker_id* not a UUID, or *where*
            not a clause over ``sqlaq.jobs``.
        InvalidJobError: *lease* is not a positive timedelta of at most 100 years, or
            *queue* is not a name.
    """
    _check_claim(worker_id, queue, limit, lease)
    kinds = _check_kinds(exclude_kinds) if exclude_kinds else []
    params = queries.claim_params(
        queue=queue, worker_id=worker_id, limit=limit, lease=lease, exclude_kinds=kinds
    )
    if where is not None and not (isinstance(where, Sequence) and not where):
        stmt = _narrowed_claim(where, bool(kinds))
    else:
        stmt = _CLAIM_EXCLUDING if kinds else _CLAIM
    claimed = yield stmt, params
    return _claimed(claimed.all(), worker_id, lease)


# Narrowed claims, by the identity of their clause(s) and whether they exclude kinds.
# Each entry keeps its clauses alive, so an id cannot be reused while it is cached.
_NARROWED: dict[tuple[tuple[int, ...], bool], tuple[tuple[object, ...], Any]] = {}
_NARROWED_MAX = 64


_NARROWED_LOCK = threading.Lock()


def _narrowed_claim(where: Any, excluding: bool) -> Any:
    clauses = tuple(where) if isinstance(where, Sequence) else (where,)
    key = (tuple(map(id, clauses)), excluding)
    cached = _NARROWED.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], clauses, strict=True)):
        return cached[1]
    stmt = queries.claim_stmt(
        queue="_",
        worker_id=_NIL,
        limit=1,
        lease=DEFAULT_LEASE,
        exclude_kinds=["_"] if excluding else (),
        where=list(clauses),
    )
    with _NARROWED_LOCK:  # worker threads claim at once
        if len(_NARROWED) >= _NARROWED_MAX:
            _NARROWED.pop(next(iter(_NARROWED)))  # the oldest entry
        _NARROWED[key] = (clauses, stmt)
    return stmt


@dataclass(frozen=True, slots=True)
class LimitedClaim:
    """What :func:`claim_limited` claimed, and what held it back.

    Attributes:
        jobs: The claimed jobs.
        full: The kind's concurrency limit is reached: claim it again once a job of
            it ends (or at the next poll, for jobs other workers run).
        rate_wait: The rate may be holding jobs back: how long until it lets the next
            one start. None when the rate is not what stopped the claim.

    Both are False/None when the claim took fewer jobs than the limits allowed: then
    nothing more of the kind was due.
    """

    jobs: list[ClaimedJob]
    full: bool = False
    rate_wait: timedelta | None = None


@operation
def claim_limited(
    *,
    worker_id: UUID,
    kind: str,
    queue: str = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta = DEFAULT_LEASE,
    concurrency: int | None = None,
    rate: Rate | str | None = None,
) -> Plan[LimitedClaim]:
    """Claim due jobs of one *kind* of *queue* within the kind's global limits.

    At most *concurrency* jobs of *kind* hold a live lease at once, and at most
    ``rate.count`` start in any window of ``rate.period``, whatever the number of
    workers: the claim takes the kind's advisory lock, reads its live leases and its
    start log, claims what the limits allow (up to *limit*), and logs the new starts
    (see :mod:`sqlaq.limits`). Jobs held back stay queued and keep their attempts.

    It must run in a transaction (not in autocommit): the lock is held until the caller
    commits, and the next claim of the kind waits for it. Commit at once.

    Raises:
        ConfigError: *limit* or *concurrency* is not a positive int, or *rate* is not
            a rate.
        InvalidJobError: *lease* is not a positive timedelta of at most 100 years, or
            *queue* or *kind* is not a name.
    """
    _check_claim(worker_id, queue, limit, lease)
    check_name("kind", kind)
    if (yield AUTOCOMMIT):
        raise ConfigError(
            "claim_limited needs a transaction (its lock lasts until commit); "
            "this connection is in autocommit"
        )
    if concurrency is not None:
        _check_positive("concurrency", concurrency)
    if isinstance(rate, str):
        rate = Rate.parse(rate)
    yield _LOCK_KIND, {"b_kind": kind}
    state = yield _KIND_STATE, queries.kind_limit_state_params(kind=kind, rate=rate)
    running, recent, pivot, now = state.one()
    allowed = allowance(
        limit,
        concurrency=concurrency,
        running=running,
        rate=rate,
        recent=recent if rate is not None else 0,
        pivot=pivot,
        now=now,
    )
    jobs: list[ClaimedJob] = []
    if allowed.count:
        params = queries.claim_params(
            queue=queue, worker_id=worker_id, limit=allowed.count, lease=lease, kind=kind
        )
        claimed_rows = yield _CLAIM_KIND, params
        jobs = _claimed(claimed_rows.all(), worker_id, lease)
    if rate is not None and jobs:
        yield _RECORD_STARTS, queries.record_starts_params(kind=kind, rate=rate, started=len(jobs))
    if len(jobs) < allowed.count:
        return LimitedClaim(jobs)  # nothing more is due: no limit held anything back
    return LimitedClaim(jobs, allowed.full, allowed.rate_wait)


def _check_positive(name: str, value: object) -> None:
    # Bound to PostgreSQL's integer: a larger one fails in the database, not here.
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT4_MAX:
        raise ConfigError(f"{name} must be a positive int (up to {_INT4_MAX}), got {shown(value)}")


def _check_claim(worker_id: UUID, queue: str, limit: int, lease: timedelta) -> None:
    if not isinstance(worker_id, UUID):
        raise ConfigError(f"worker_id must be a uuid.UUID, got {type(worker_id).__name__}")
    _check_positive("limit", limit)
    check_duration("lease", lease, allow_zero=False)
    check_name("queue", queue)


def _check_kinds(kinds: Collection[str]) -> list[str]:
    if isinstance(kinds, str):
        raise InvalidJobError(f"kinds must be a collection of names, not a str: {shown(kinds)}")
    for kind in kinds:
        check_name("kind", kind)
    return sorted(kinds)


def _claimed(rows: Sequence[Any], worker_id: UUID, lease: timedelta) -> list[ClaimedJob]:
    """Claimed rows (in queries.CLAIM_COLUMNS order) as ClaimedJobs, in claim order.

    A row the claim marked failed (its lease expired on the last attempt) is left out.
    ``attempted_at`` is not read back: the claim wrote ``run_at = now() + lease`` and
    ``attempted_at = now()``, so it is ``run_at - lease``, exactly (a subtraction costs
    less than decoding one more timestamp per row).
    """
    # Positional unpacking: attribute access by name on Row costs several times more,
    # and a worker claims thousands of rows a second; the dataclasses are built without
    # their __init__ (encoding.slot_setters), half the cost.
    new_job, new_lease = _new_claimed_job, _new_lease
    claimed = [
        new_job(
            job_id,
            queue_,
            kind,
            payload,
            priority,
            attempts,
            max_attempts,
            created_at,
            new_lease(job_id, worker_id, token, attempts, run_at),
            run_at - lease,
            headers,
            timeout,
        )
        for (
            job_id,
            queue_,
            kind,
            payload,
            priority,
            status,
            attempts,
            max_attempts,
            token,
            run_at,
            created_at,
            headers,
            timeout,
        ) in rows
        if status == "running"
    ]
    # UPDATE ... RETURNING has no order; hand jobs out in claim order as far as known:
    # by id, then (stable) by priority, highest first; two sorts by a key in C cost a
    # third of one by a key made in Python.
    claimed.sort(key=_BY_ID)
    claimed.sort(key=_BY_PRIORITY, reverse=True)
    return claimed


_BY_ID = operator.attrgetter("id")
_BY_PRIORITY = operator.attrgetter("priority")
_CLAIMED_SETTERS = slot_setters(ClaimedJob)
_LEASE_SETTERS = slot_setters(Lease)


def _new_lease(job_id: int, worker_id: UUID, token: UUID, attempt: int, expires: Any) -> Lease:
    """``Lease(...)``, faster (see :func:`~sqlaq.encoding.slot_setters`)."""
    set_id, set_worker, set_token, set_attempt, set_expires = _LEASE_SETTERS
    lease = object.__new__(Lease)
    set_id(lease, job_id)
    set_worker(lease, worker_id)
    set_token(lease, token)
    set_attempt(lease, attempt)
    set_expires(lease, expires)
    return lease


def _new_claimed_job(
    job_id: int,
    queue: str,
    kind: str,
    payload: dict[str, Any],
    priority: int,
    attempt: int,
    max_attempts: int,
    created_at: datetime,
    lease: Lease,
    attempted_at: datetime | None,
    headers: dict[str, Any] | None,
    timeout: timedelta | None,
) -> ClaimedJob:
    """``ClaimedJob(...)`` with every field given, faster (see
    :func:`~sqlaq.encoding.slot_setters`)."""
    (
        set_id,
        set_queue,
        set_kind,
        set_payload,
        set_priority,
        set_attempt,
        set_max_attempts,
        set_created_at,
        set_lease,
        set_attempted_at,
        set_headers,
        set_timeout,
    ) = _CLAIMED_SETTERS
    job = object.__new__(ClaimedJob)
    set_id(job, job_id)
    set_queue(job, queue)
    set_kind(job, kind)
    set_payload(job, payload)
    set_priority(job, priority)
    set_attempt(job, attempt)
    set_max_attempts(job, max_attempts)
    set_created_at(job, created_at)
    set_lease(job, lease)
    set_attempted_at(job, attempted_at)
    set_headers(job, headers)
    set_timeout(job, timeout)
    return job


def _as_leases(leases: Lease | Iterable[Lease]) -> list[Lease]:
    return [leases] if isinstance(leases, Lease) else list(leases)


def _check_lost(requested: Sequence[Lease], changed: Collection[int], raise_on_lost: bool) -> None:
    if raise_on_lost:
        lost = [lease.job_id for lease in requested if lease.job_id not in changed]
        if lost:
            raise LeaseLostError(lost)


@operation
def extend_lease(
    leases: Lease | Iterable[Lease],
    *,
    lease: timedelta = DEFAULT_LEASE,
    raise_on_lost: bool = True,
) -> Plan[list[Lease]]:
    """Move the end of each still-held lease to ``now() + lease``, in one statement.

    Returns:
        The renewed leases (with their new ``expires_at``); a lost one is absent.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true.
        InvalidJobError: *lease* is not a positive timedelta of at most 100 years.
    """
    check_duration("lease", lease, allow_zero=False)
    held = _as_leases(leases)
    if not held:
        return []
    params = queries.fence_params(held) | {"b_lease": lease}
    extended = yield _EXTEND, params
    ends: dict[int, datetime] = dict(extended.all())
    _check_lost(held, ends, raise_on_lost)
    return [
        Lease(h.job_id, h.worker_id, h.token, h.attempt, ends[h.job_id])
        for h in held
        if h.job_id in ends
    ]


@operation
def complete(leases: Lease | Iterable[Lease], *, raise_on_lost: bool = True) -> Plan[list[int]]:
    """Mark done every job whose lease is still held, in one statement.

    Returns:
        The ids of the jobs marked done.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true; the other jobs of
            the call were marked done all the same.
    """
    return (yield from _fenced(_COMPLETE, leases, raise_on_lost))


def _fenced(
    stmt: Any,
    leases: Lease | Iterable[Lease],
    raise_on_lost: bool,
    params: Mapping[str, Any] | None = None,
) -> Plan[list[int]]:
    """Run a fenced statement that returns the ids it changed, over *leases*."""
    held = _as_leases(leases)
    if not held:
        return []
    values = queries.fence_params(held) | dict(params or {})
    # Rows, not .scalars(): a ScalarResult rebuilds the result's metadata on each call.
    changed = {row[0] for row in (yield stmt, values)}
    _check_lost(held, changed, raise_on_lost)
    return [h.job_id for h in held if h.job_id in changed]


@operation
def fail(
    lease: Lease,
    error: str,
    *,
    retry_in: timedelta | None = None,
    raise_on_lost: bool = True,
) -> Plan[JobStatus | None]:
    """Record a failed attempt of the job held by *lease*.

    With *retry_in* and attempts left, the job is queued again to run at
    ``now() + retry_in`` (compute it with a :class:`~sqlaq.Backoff`); otherwise it
    ends ``failed``. *error* becomes ``last_error`` (cut to 8000 characters).

    Returns:
        ``JobStatus.QUEUED`` or ``JobStatus.FAILED``; None when the lease was lost and
        *raise_on_lost* is false.

    Raises:
        LeaseLostError: the lease was lost and *raise_on_lost* is true.
        InvalidJobError: *retry_in* is not a timedelta from zero to 100 years.
    """
    if retry_in is not None:
        check_duration("retry_in", retry_in)
    error = _clean_error(error)
    params = queries.fail_params(lease=lease, error=error, retry_in=retry_in)
    row = (yield _FAIL, params).first()
    if row is None:
        _check_lost([lease], (), raise_on_lost)
        return None
    return JobStatus(row.status)


def _clean_error(error: object) -> str:
    # What text cannot hold is spelt out instead: NUL, and lone surrogates (an error
    # message quoting undecodable bytes).
    text = str(error).replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode()
    if len(text) > MAX_ERROR_LENGTH:
        text = text[: MAX_ERROR_LENGTH - 20] + "\n... (truncated)"
    return text


def _ids(job_ids: int | Iterable[int]) -> list[int]:
    ids = [job_ids] if isinstance(job_ids, int) else list(job_ids)
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"job ids must be ints, got {shown(value)}")
        if not -_INT8_MAX - 1 <= value <= _INT8_MAX:
            raise ConfigError(f"job ids are bigints; {shown(value)} is out of range")
    return ids


@operation
def retry(job_ids: int | Iterable[int]) -> Plan[list[int]]:
    """Queue failed or cancelled jobs again, due now, with a fresh set of attempts.

    Jobs in any other status are left alone, and so is a job whose dedupe key is now
    held by another pending job. ``last_error`` is kept.

    Returns:
        The ids of the jobs queued again.
    """
    ids = _ids(job_ids)
    if not ids:
        return []
    return list((yield queries.retry_stmt(job_ids=ids), None).scalars())


@operation
def cancel(job_ids: int | Iterable[int]) -> Plan[list[int]]:
    """Cancel queued or running jobs.

    A running job's worker loses its lease: whatever its handler returns is not written
    over the cancel. The worker is told on commit (NOTIFY on ``sqlaq_cancel``, and its
    next lease renewal as the fallback), and the handler sees
    ``current_job().cancelled``. Finished jobs are left alone.

    Returns:
        The ids of the jobs cancelled.
    """
    ids = _ids(job_ids)
    if not ids:
        return []
    return list((yield queries.cancel_stmt(job_ids=ids), None).scalars())


@operation
def cancelled_among(job_ids: Iterable[int]) -> Plan[list[int]]:
    """Which of *job_ids* are cancelled (for a worker that lost their leases)."""
    ids = _ids(job_ids)
    if not ids:
        return []
    return list((yield queries.cancelled_among_stmt(job_ids=ids), None).scalars())


@operation
def notify_queues(queues: Sequence[str]) -> Plan[None]:
    """Wake the workers of *queues* when the caller commits (NOTIFY ``sqlaq_jobs``)."""
    if queues:
        (yield queries.notify_queues_stmt(queues=queues), None).all()


@operation
def sweep(*, limit: int = DEFAULT_PRUNE_BATCH) -> Plan[int]:
    """End up to *limit* expired leases: a job on its last attempt is marked failed,
    any other is queued again, due now (``last_error`` says the lease expired).

    What the maintenance leader runs, so that a crashed worker's jobs end even where no
    one claims. One bounded batch per call, like :func:`prune`.

    Returns:
        How many jobs were swept.

    Raises:
        ConfigError: *limit* is not a positive int.
    """
    _check_positive("limit", limit)
    return len((yield queries.sweep_stmt(limit=limit), None).all())


class PruneResult(int):
    """What :func:`prune` did: an ``int``, the number of jobs deleted, as it always was,
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


# A reference committed after a prune's snapshot can still fail its foreign-key check
# (which looks at the latest rows); the batch is then tried again, this many times.
_PRUNE_ROUNDS = 3


@operation
def prune(
    *,
    older_than: timedelta,
    statuses: Iterable[JobStatus | str] = FINISHED_STATUSES,
    limit: int = DEFAULT_PRUNE_BATCH,
) -> Plan[PruneResult]:
    """Delete up to *limit* finished jobs that finished more than *older_than* ago.

    One bounded batch per call: loop, committing between calls, until it returns less
    than *limit*. Queued and running jobs are never deleted.

    A job that a host table still references through a foreign key without ``ON
    DELETE`` (which would make PostgreSQL refuse the whole batch) is left in place and
    the rest is deleted; once a call runs out of jobs to delete, it reports them in
    :attr:`PruneResult.skipped` and logs one warning naming the tables and the fix:
    declare the key ``ForeignKey(sqlaq.jobs.c.id, ondelete="SET NULL")`` (or
    ``"CASCADE"``). Finding such keys reads ``pg_constraint`` (one small query per call),
    and leaving their jobs out needs ``SELECT`` on those tables.

    Returns:
        How many jobs were deleted (a :class:`PruneResult`, an ``int`` that also
        carries what was skipped).

    Raises:
        ConfigError: a status is not a finished one, or *limit* is not positive.
        InvalidJobError: *older_than* is not a timedelta from zero to 100 years.
    """
    check_duration("older_than", older_than)
    wanted = set()
    for status in statuses:
        try:
            value = JobStatus(status)
        except ValueError:
            value = None
        if value not in FINISHED_STATUSES:
            raise ConfigError(
                f"prune deletes finished jobs only; status {shown(status)} is not one of "
                "'done', 'failed', 'cancelled'"
            )
        wanted.add(value)
    _check_positive("limit", limit)
    keys = yield queries.blocking_references_stmt(), None
    spare = [queries.Reference(*row) for row in keys]
    stmt = queries.prune_stmt(older_than=older_than, statuses=wanted, limit=limit, spare=spare)
    if not spare:
        return PruneResult(_rowcount((yield stmt, None)))
    deleted = yield from _delete_around_references(stmt)
    if deleted >= limit:
        return PruneResult(deleted)
    count = queries.count_referenced_stmt(
        older_than=older_than, statuses=wanted, references=spare, limit=limit
    )
    skipped = int((yield count, None).scalar_one())
    if not skipped:
        return PruneResult(deleted)
    tables = tuple(dict.fromkeys(ref.qualified for ref in spare))
    _log.warning(
        "prune left %d finished job(s) that %s still reference(s) through a foreign key "
        'without ON DELETE; declare it ForeignKey(sqlaq.jobs.c.id, ondelete="SET NULL") '
        '(or ondelete="CASCADE") so that retention can delete them',
        skipped,
        " and ".join(tables),
        extra={"skipped": skipped, "tables": tables},
    )
    return PruneResult(deleted, skipped, tables)


def _rowcount(result: Any) -> int:
    return int(result.rowcount)


def _delete_around_references(stmt: Any) -> Plan[int]:
    """Run a prune that spares referenced jobs, in a savepoint: a reference committed
    meanwhile fails only the savepoint (never the caller's transaction; see the
    foreign-key tests in tests/test_prune_fk.py), and the batch is tried again."""
    attempt = 1
    while True:
        outcome = yield Savepoint(stmt)
        if not isinstance(outcome, DBAPIError):
            return _rowcount(outcome)
        if _sqlstate(outcome) != _FOREIGN_KEY_VIOLATION or attempt == _PRUNE_ROUNDS:
            raise outcome
        attempt += 1


_FOREIGN_KEY_VIOLATION = "23503"


def _sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error: psycopg's ``sqlstate``, asyncpg's ``pgcode``."""
    orig = exc.orig
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


# --- worker support ---

_HANDBACK = queries.handback_stmt(leases=[])
_SNOOZE = queries.snooze_stmt(leases=[], delay=timedelta(0))


@operation
def snooze(
    leases: Lease | Iterable[Lease],
    delay: timedelta,
    *,
    raise_on_lost: bool = True,
) -> Plan[list[int]]:
    """Queue still-held jobs again at ``now() + delay``, refunding the claim's attempt.

    What a handler's ``raise sqlaq.Snooze(delay)`` becomes.

    A *delay* longer than :data:`~sqlaq.bounds.MAX_DURATION` (100 years) is brought
    down to it, never refused: a job may snooze "for ever" (``Snooze(timedelta.max)``)
    and still be stored and read back.

    Returns:
        The ids of the jobs snoozed.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true.
        InvalidJobError: *delay* is negative or not a timedelta.
    """
    if not isinstance(delay, timedelta) or delay < timedelta(0):
        check_duration("delay", delay)  # raises, naming what was wrong
    delay = clamp_duration(delay)
    return (yield from _fenced(_SNOOZE, leases, raise_on_lost, {"b_delay": delay}))


@operation
def handback(leases: Lease | Iterable[Lease], *, raise_on_lost: bool = True) -> Plan[list[int]]:
    """Give still-held jobs back to their queue unfinished, in one statement.

    For a worker that stops before its jobs finish (a deploy, a scale-down): each job
    whose lease is still held goes back to ``queued``, due now, with its lease cleared
    and the attempt its claim counted refunded, since stopping a worker is not a failure
    of the job. Idle workers are notified on commit. Whatever the handler still does
    afterwards changes nothing: its lease is gone.

    Returns:
        The ids of the jobs handed back.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true; the other jobs of
            the call were handed back all the same.
    """
    return (yield from _fenced(_HANDBACK, leases, raise_on_lost))
