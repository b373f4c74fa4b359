"""Enqueue: one job (with dedupe, debounce, ``unique_for``), many, and COPY."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlaq import queries, tracing
from sqlaq.drive import Copy, Plan, operation
from sqlaq.encoding import (
    JobBatch,
    NewJob,
    check_dedupe_key,
    check_duration,
    slot_setters,
)
from sqlaq.errors import ConfigError, InvalidJobError
from sqlaq.ops._citus import DISTRIBUTED
from sqlaq.ops._common import DEFAULT_LEASE, on_first_use
from sqlaq.ops._links import check_after, check_policy, link, mark_parents
from sqlaq.queries import citus as citus_queries
from sqlaq.queries.columns import copy_row
from sqlaq.records import EnqueueOutcome, EnqueueResult
from sqlaq.schema import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
)
from sqlaq.schema import jobs as jobs_table

# A dedupe race (the pending twin finished between our INSERT and our SELECT) is retried
# this many times before giving up; each round sees a fresh snapshot in READ COMMITTED.
_DEDUPE_ROUNDS = 5

# Hot statements are built once, with placeholder values; each call passes its own
# values as execution parameters (queries.*_params), which override the built-in ones.
# Building a claim costs about 1 ms of Python; running the cached one costs nothing more.
_ENQUEUE = queries.enqueue_stmt(job=NewJob("_"))

_ENQUEUE_DEDUPE = queries.enqueue_stmt(job=NewJob("_", dedupe_key="_"))

# On Citus: ON CONFLICT names the per-queue dedupe index; the twin is looked up in the
# job's queue. These, debounce's and unique_for's are built on first use.
_citus_enqueue_dedupe_stmt = on_first_use(
    queries.enqueue_stmt, job=NewJob("_", dedupe_key="_"), per_queue=True
)

_citus_find_twin_stmt = on_first_use(citus_queries.citus_find_pending_duplicate_stmt)

_citus_enqueue_debounce_stmt = on_first_use(
    queries.debounce_enqueue_stmt,
    job=NewJob("_"),
    debounce_key="_",
    debounce=DEFAULT_LEASE,
    per_queue=True,
)

_enqueue_debounce_stmt = on_first_use(
    queries.debounce_enqueue_stmt, job=NewJob("_"), debounce_key="_", debounce=DEFAULT_LEASE
)

_enqueue_unique_stmt = on_first_use(
    queries.unique_enqueue_stmt, job=NewJob("_", dedupe_key="_"), unique_for=DEFAULT_LEASE
)


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
    key: str | None = None,
    unique_for: timedelta | None = None,
    debounce_key: str | None = None,
    debounce: timedelta | None = None,
    max_wait: timedelta | None = None,
    after: Iterable[int] | None = None,
    on_parent_failure: str = "cancel",
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
        key: The job's key (a tenant, an account, a resource): what its handler's
            ``key_concurrency`` and ``ordered`` count over (1 to 255 characters).
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
        after: Job ids this job waits for (its parents): it is not claimable until
            every one has finished. Not with *dedupe_key* or *debounce*. Each parent's
            row stays locked until the caller's transaction ends.
        on_parent_failure: What this job does when a parent fails (for good) or is
            cancelled: ``"cancel"`` (the default: it is cancelled, and so its own
            children), ``"run"`` (it runs anyway once every parent has finished) or
            ``"fail"`` (it fails, its ``last_error`` naming the parent).

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
        key=key,
    )
    debounced = debounce is not None or debounce_key is not None or max_wait is not None
    if debounced:
        _check_debounce(job, debounce_key, debounce, max_wait, unique_for)
    elif unique_for is not None:
        check_duration("unique_for", unique_for, allow_zero=False)
        if job.dedupe_key is None:
            raise InvalidJobError("unique_for needs a dedupe_key: the key it holds")
    citus = yield DISTRIBUTED
    if citus:
        _citus_check(unique_for=unique_for, after=after)
        if max_wait is not None:
            raise ConfigError(
                "enqueue(max_wait=...) is not supported on Citus (sqlaq_jobs is distributed): "
                "the cap reads the queued job's created_at in ON CONFLICT ... DO UPDATE, where "
                "Citus takes only IMMUTABLE functions; debounce without max_wait works"
            )
    if after is not None:
        return (yield from _enqueue_after(job, after, on_parent_failure, debounced, unique_for))
    # The enqueuer's trace context (sqlaq[otel]), linked from each attempt's span.
    params = queries.enqueue_params(job, headers=tracing.capture())
    if debounced:
        params |= {"b_debounce_key": debounce_key, "b_debounce": debounce, "b_max_wait": max_wait}
        upsert = _citus_enqueue_debounce_stmt() if citus else _enqueue_debounce_stmt()
        job_id, updated = (yield upsert, params).one()
        return EnqueueResult(
            job_id, outcome=EnqueueOutcome.DEBOUNCED if updated else EnqueueOutcome.INSERTED
        )
    if job.dedupe_key is None:
        inserted = yield _ENQUEUE, params
        if citus:
            yield from _citus_wake([job])
        return EnqueueResult(inserted.scalar_one())
    if unique_for is not None:
        return (yield from _enqueue_unique(job.kind, job.dedupe_key, params, unique_for))
    for _ in range(_DEDUPE_ROUNDS):
        inserted = yield (_citus_enqueue_dedupe_stmt() if citus else _ENQUEUE_DEDUPE), params
        job_id = inserted.scalar_one_or_none()
        if job_id is not None:
            if citus:
                yield from _citus_wake([job])
            return EnqueueResult(job_id)
        if citus:
            find, values = (
                _citus_find_twin_stmt(),
                {"b_queue": job.queue, "b_kind": job.kind, "b_dedupe_key": job.dedupe_key},
            )
        else:
            find = queries.find_pending_duplicate_stmt(kind=job.kind, dedupe_key=job.dedupe_key)
            values = None
        twin = (yield find, values).scalar_one_or_none()
        if twin is not None:
            return EnqueueResult(twin, duplicate=True)
    raise RuntimeError(  # pragma: no cover - needs a pathological race to reach
        f"could not enqueue {kind!r} with dedupe_key {dedupe_key!r}: its pending twin kept "
        "changing; try again"
    )


def _citus_check(*, unique_for: timedelta | None, after: object) -> None:
    """Refuse, on a job table distributed on Citus, what enqueue cannot do there yet."""
    what = why = None
    if unique_for is not None:
        what, why = "unique_for", "its hold lives in sqlaq_unique_holds, a coordinator table"
    elif after is not None:
        what, why = "after", "workflows need the dependency trigger, refused on a distributed table"
    if why is not None:
        raise ConfigError(
            f"enqueue({what}=...) is not supported on Citus (sqlaq_jobs is distributed): {why}"
        )


def _citus_wake(jobs: Iterable[NewJob]) -> Plan[None]:
    """Wake the workers of the queues of *jobs* due now, on Citus, where no trigger does:
    a NOTIFY statement of its own, on the coordinator, sent when the caller commits."""
    queues = sorted({job.queue for job in jobs if not job.delay and job.run_at is None})
    if queues:
        (yield queries.notify_queues_stmt(queues=queues), None).all()


def _enqueue_after(
    job: NewJob,
    after: Iterable[int],
    on_parent_failure: str,
    debounced: bool,
    unique_for: timedelta | None,
) -> Plan[EnqueueResult]:
    """Enqueue *job* to wait for the jobs of *after* (its parents)."""
    policy = check_policy(on_parent_failure)
    if job.dedupe_key is not None or debounced or unique_for is not None:
        raise InvalidJobError(
            "after does not go with dedupe_key, unique_for or debounce: a job that waits "
            "for others is always a new job"
        )
    parents = check_after(after)
    statuses = yield from mark_parents(parents)  # before the insert: a bad id writes nothing
    params = queries.enqueue_params(job, headers=tracing.capture())
    job_id = (yield _ENQUEUE, params).scalar_one()
    yield from link([(parent, job_id) for parent in parents], statuses, policy)
    return EnqueueResult(job_id)


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
        taken, inserted = (yield _enqueue_unique_stmt(), params).one()
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
    "queue", "kind", "priority", "delay", "max_attempts", "dedupe_key", "run_at", "timeout", "key"
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
        done = yield from _enqueue_uniform(jobs.template, jobs.payloads_json, len(jobs))
        if (yield DISTRIBUTED):
            yield from _citus_wake([jobs.template])
        return done
    batch = list(jobs)
    for index, job in enumerate(batch):
        if not isinstance(job, NewJob):
            raise InvalidJobError(f"jobs[{index}] must be a sqlaq.NewJob, got {type(job).__name__}")
    if not batch:
        return []
    if (yield DISTRIBUTED):
        done = yield from _enqueue_many(batch, per_queue=True)
        yield from _citus_wake(batch)
        return done
    return (yield from _enqueue_many(batch))


def _enqueue_many(batch: list[NewJob], *, per_queue: bool = False) -> Plan[list[EnqueueResult]]:
    """enqueue_many's insert of checked, non-empty *batch* (*per_queue*: on Citus, where
    a dedupe key is held per queue: duplicates are matched by queue, kind and key)."""
    shape = _SHAPE(batch[0])
    if shape[_SHAPE_DEDUPE_KEY] is None and all(map(shape.__eq__, map(_SHAPE, batch))):
        # The common batch: jobs that differ only in their payload, none with a dedupe
        # key; one statement with one JSON array of payloads (enqueue_uniform_stmt).
        payloads_json = f"[{','.join([job.payload_json for job in batch])}]"
        return (yield from _enqueue_uniform(batch[0], payloads_json, len(batch)))
    headers = tracing.capture()
    # Identity values are drawn in input order, so sorted ids line up with the input.
    stmt = queries.enqueue_many_stmt(jobs_=batch, headers=headers, per_queue=per_queue)
    inserted = yield stmt, None
    rows = sorted(inserted.all(), key=lambda r: r[0])
    inserted = iter(rows)
    results: list[EnqueueResult | None] = []
    next_row = next(inserted, None)

    def held(job: NewJob) -> tuple[str | None, ...]:
        return (job.kind, job.dedupe_key, job.queue) if per_queue else (job.kind, job.dedupe_key)

    for job in batch:
        if next_row is not None and tuple(next_row[1:]) == held(job):
            results.append(EnqueueResult(next_row[0]))
            next_row = next(inserted, None)
        else:
            results.append(None)  # skipped as a duplicate; resolved below
    missing = {held(j) for j, r in zip(batch, results, strict=True) if r is None}
    if missing:
        columns = list(zip(*missing, strict=True))
        stmt = queries.find_pending_duplicates_stmt(
            kinds=columns[0],
            dedupe_keys=columns[1],
            queues=columns[2] if per_queue else None,
        )
        twins = {tuple(row[1:]): row[0] for row in (yield stmt, None).all()}
        for index, (job, result) in enumerate(zip(batch, results, strict=True)):
            if result is None:
                results[index] = EnqueueResult(twins[held(job)], duplicate=True)
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
    if (yield DISTRIBUTED):
        yield from _citus_wake(batch)
    return written
