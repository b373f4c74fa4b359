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
from sqlaq.ops._common import DEFAULT_PRUNE_BATCH, _check_positive, _ids
from sqlaq.records import PruneResult
from sqlaq.schema import (
    FINISHED_STATUSES,
    JobStatus,
)

# The package's logger, as before the operations were split into modules.
_log = logging.getLogger("sqlaq.ops")


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


def _sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error: psycopg's ``sqlstate``, asyncpg's ``pgcode``."""
    orig = exc.orig
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
