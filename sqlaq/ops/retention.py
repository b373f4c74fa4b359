"""Retention: retry, cancel, sweep expired leases, prune finished jobs."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import DBAPIError

from sqlaq import queries
from sqlaq.drive import Plan, Savepoint, operation
from sqlaq.encoding import (
    check_duration,
)
from sqlaq.errors import ConfigError, shown
from sqlaq.ops._citus import DISTRIBUTED, tell_waiters
from sqlaq.ops._common import DEFAULT_PRUNE_BATCH, _check_positive, _ids, on_first_use
from sqlaq.queries import citus as citus_queries
from sqlaq.records import PruneResult, RetryResult, SkippedRetry
from sqlaq.schema import (
    FINISHED_STATUSES,
    JobStatus,
)

# The package's logger, as before the operations were split into modules.
_log = logging.getLogger("sqlaq.ops")


@operation
def retry(job_ids: int | Iterable[int]) -> Plan[RetryResult]:
    """Queue failed or cancelled jobs again, due now, with a fresh set of attempts.

    Jobs in any other status are left alone. So is a job whose key another job holds:
    its dedupe key held by a pending (queued or running) job, or, for a job that never
    started, its debounce key held by a never-started queued job. Of several jobs of
    one key in a call, the lowest id is queued again and the others are left. Each job
    left for its key is reported in :attr:`RetryResult.skipped`, never as an error: the
    rest of the call is retried. ``last_error`` is kept.

    The statement runs in a savepoint. A job enqueued with one of the keys while it runs
    (which it cannot see) makes PostgreSQL refuse it with a unique violation; then the
    savepoint is rolled back and the jobs are retried one at a time, each in its own
    savepoint, so only the job whose key was taken is skipped, and the caller's
    transaction stays usable.

    Returns:
        The ids of the jobs queued again (a :class:`RetryResult`, a ``list`` that also
        carries what was skipped and why).
    """
    ids = _ids(job_ids)
    if not ids:
        return RetryResult()
    if (yield DISTRIBUTED):
        # Queue by queue: find each job's queue (every shard, no lock), then retry.
        found = yield _citus_locate_finished_stmt(), {"b_ids": ids}
        by_queue: dict[str, list[int]] = {}
        for job_id, queue in found.all():
            by_queue.setdefault(queue, []).append(job_id)
        retried: list[int] = []
        skipped: list[SkippedRetry] = []
        for queue, queued_ids in by_queue.items():
            one = yield from _retry(queued_ids, queue)
            retried.extend(one)
            skipped.extend(one.skipped)
        return RetryResult(sorted(retried), sorted(skipped, key=lambda s: s.job_id))
    return (yield from _retry(ids, None))


def _retry(ids: list[int], queue: str | None) -> Plan[RetryResult]:
    """retry of *ids* (of *queue* only, on Citus)."""
    outcome = yield Savepoint(queries.retry_stmt(job_ids=ids, queue=queue))
    if not isinstance(outcome, DBAPIError):
        return _retried(outcome)
    if _sqlstate(outcome) != _UNIQUE_VIOLATION:
        raise outcome
    retried: list[int] = []
    skipped: list[SkippedRetry] = []
    for job_id in sorted(set(ids)):
        one = yield from _retry_one(job_id, queue)
        retried.extend(one)
        skipped.extend(one.skipped)
    return RetryResult(retried, skipped)


# A job whose key is taken again between a statement's snapshot and its write is tried
# this many times (each try sees the jobs committed before it) before it is skipped.
_RETRY_ROUNDS = 3


def _retry_one(job_id: int, queue: str | None) -> Plan[RetryResult]:
    """Retry one job in a savepoint; skip it if its key stays taken by jobs enqueued
    meanwhile (or by a job this transaction's snapshot cannot see)."""
    for _ in range(_RETRY_ROUNDS):
        outcome = yield Savepoint(queries.retry_stmt(job_ids=[job_id], queue=queue))
        if not isinstance(outcome, DBAPIError):
            return _retried(outcome)
        if _sqlstate(outcome) != _UNIQUE_VIOLATION:
            raise outcome
    row = (yield queries.get_job_stmt(job_id=job_id), None).first()
    if row is None:  # deleted meanwhile
        return RetryResult()
    if row.dedupe_key is not None:
        skip = SkippedRetry(job_id, row.dedupe_key, None, "dedupe_key")
    else:
        skip = SkippedRetry(job_id, row.debounce_key, None, "debounce_key")
    return RetryResult((), [skip])


def _retried(result: Any) -> RetryResult:
    """A :class:`RetryResult` from the rows of :func:`~sqlaq.queries.retry_stmt`."""
    retried: list[int] = []
    skipped: list[SkippedRetry] = []
    for row in result:
        if row.retried:
            retried.append(row.id)
        elif row.dedupe_holder is not None:
            skipped.append(SkippedRetry(row.id, row.dedupe_key, row.dedupe_holder, "dedupe_key"))
        else:
            skipped.append(
                SkippedRetry(row.id, row.debounce_key, row.debounce_holder, "debounce_key")
            )
    return RetryResult(retried, skipped)


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
    if (yield DISTRIBUTED):
        return (yield from _citus_cancel(ids))
    return list((yield queries.cancel_stmt(job_ids=ids), None).scalars())


def _citus_cancel(ids: list[int]) -> Plan[list[int]]:
    """cancel on Citus: find each pending job's queue (every shard, no lock), cancel them
    queue by queue (a router statement that locks and checks again), then tell the
    workers of the running ones from the coordinator."""
    found = (yield citus_queries.citus_locate_stmt(), {"b_ids": ids}).all()
    by_queue: dict[str, list[int]] = {}
    for job_id, queue in found:
        by_queue.setdefault(queue, []).append(job_id)
    cancelled: list[int] = []
    running: list[str] = []
    awaited: list[int] = []
    for queue, queued_ids in by_queue.items():
        rows = yield _citus_cancel_stmt(), {"b_queue": queue, "b_ids": queued_ids}
        for job_id, was, waited_for in rows.all():
            cancelled.append(job_id)
            if was == JobStatus.RUNNING:
                running.append(str(job_id))
            if waited_for:
                awaited.append(job_id)
    if running:
        (yield _citus_notify_cancel_stmt(), {"b_ids": running}).all()
    yield from tell_waiters(awaited)
    return sorted(cancelled)


@operation
def cancelled_among(job_ids: Iterable[int]) -> Plan[list[int]]:
    """Which of *job_ids* are cancelled (for a worker that lost their leases)."""
    ids = _ids(job_ids)
    if not ids:
        return []
    return list((yield queries.cancelled_among_stmt(job_ids=ids), None).scalars())


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
    if (yield DISTRIBUTED):
        found = yield citus_queries.citus_expired_stmt(), {"b_limit": limit}
        swept = yield from _per_queue(found.all(), _citus_sweep_stmt(), {})
        yield from tell_waiters([r.id for r in swept if r.awaited and r.status == "failed"])
        return len(swept)
    return len((yield queries.sweep_stmt(limit=limit), None).all())


def _per_queue(found: Any, stmt: Any, params: dict[str, Any]) -> Plan[list[Any]]:
    """Run *stmt* (bound by ``b_queue`` and ``b_ids``) for the ``(id, queue)`` rows
    *found*, one queue at a time (a router statement each, on Citus); the rows it
    returned."""
    by_queue: dict[str, list[int]] = {}
    for job_id, queue in found:
        by_queue.setdefault(queue, []).append(job_id)
    changed: list[Any] = []
    for queue, ids in by_queue.items():
        changed += (yield stmt, params | {"b_queue": queue, "b_ids": ids}).all()
    return changed


# On Citus (sqlaq_jobs distributed by queue): one queue at a time.
_citus_cancel_stmt = on_first_use(citus_queries.citus_cancel_stmt)

_citus_locate_finished_stmt = on_first_use(citus_queries.citus_locate_stmt, pending=False)

_citus_notify_cancel_stmt = on_first_use(citus_queries.citus_notify_cancel_stmt)

_citus_sweep_stmt = on_first_use(citus_queries.citus_sweep_stmt)

_citus_prune_stmt = on_first_use(citus_queries.citus_prune_stmt)

# A reference committed after a prune's snapshot can still fail its foreign-key check
# (which looks at the latest rows); the batch is then tried again, this many times.
_PRUNE_ROUNDS = 3


@operation
def count_prunable(*, older_than: timedelta, statuses: Iterable[JobStatus | str]) -> Plan[int]:
    """How many finished jobs of *statuses* :func:`prune` would delete now (those that
    finished more than *older_than* ago): for a progress bar or a confirmation.

    Raises:
        ConfigError: a status is not a finished one.
        InvalidJobError: *older_than* is not a timedelta from zero to 100 years.
    """
    check_duration("older_than", older_than)
    wanted = _finished(statuses)
    citus = yield DISTRIBUTED
    stmt = queries.count_prunable_stmt(older_than=older_than, statuses=wanted, workflows=not citus)
    if citus:
        return int((yield stmt, None).scalar_one())
    # The workflows' walk: JIT off (see prune).
    was = (yield queries.set_setting_stmt(name="jit", value="off"), None).scalar_one()
    count = int((yield stmt, None).scalar_one())
    yield queries.set_setting_stmt(name="jit", value=was), None
    return count


def _finished(statuses: Iterable[JobStatus | str]) -> set[JobStatus]:
    """*statuses* as finished statuses; a ConfigError naming one that is not."""
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
    return wanted


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
    wanted = _finished(statuses)
    _check_positive("limit", limit)
    if (yield DISTRIBUTED):
        # No host foreign key references a distributed table: nothing to spare.
        which = {"b_older_than": older_than, "b_statuses": sorted(wanted)}
        found = yield citus_queries.citus_prunable_stmt(), which | {"b_limit": limit}
        return PruneResult(len((yield from _per_queue(found.all(), _citus_prune_stmt(), which))))
    keys = yield queries.blocking_references_stmt(), None
    spare = [queries.Reference(*row) for row in keys]
    stmt = queries.prune_stmt(older_than=older_than, statuses=wanted, limit=limit, spare=spare)
    # The statement spares an unfinished workflow's jobs through a recursive walk whose
    # estimate (never its cost: it runs only when a workflow job is met) would make
    # PostgreSQL JIT-compile every batch (30 ms to 0.3 s): JIT off, then back (after the
    # count of referenced jobs, which spares them too).
    was = (yield queries.set_setting_stmt(name="jit", value="off"), None).scalar_one()
    if not spare:
        deleted = _rowcount((yield stmt, None))
        yield queries.set_setting_stmt(name="jit", value=was), None
        return PruneResult(deleted)
    deleted = yield from _delete_around_references(stmt)
    if deleted >= limit:
        yield queries.set_setting_stmt(name="jit", value=was), None
        return PruneResult(deleted)
    count = queries.count_referenced_stmt(
        older_than=older_than, statuses=wanted, references=spare, limit=limit
    )
    skipped = int((yield count, None).scalar_one())
    yield queries.set_setting_stmt(name="jit", value=was), None
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
    foreign-key tests in tests/process/test_prune_fk.py), and the batch is tried again."""
    attempt = 1
    while True:
        outcome = yield Savepoint(stmt)
        if not isinstance(outcome, DBAPIError):
            return _rowcount(outcome)
        if _sqlstate(outcome) != _FOREIGN_KEY_VIOLATION or attempt == _PRUNE_ROUNDS:
            raise outcome
        attempt += 1


_FOREIGN_KEY_VIOLATION = "23503"
_UNIQUE_VIOLATION = "23505"


def _sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error: psycopg's ``sqlstate``, asyncpg's ``pgcode``."""
    orig = exc.orig
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
