"""What the dashboard's buttons do: the operations of ``sqlaq retry``, ``sqlaq cancel``,
``sqlaq prune``, ``sqlaq pause`` and ``sqlaq resume``, run through :mod:`sqlaq.ops` and
:mod:`sqlaq.control` on the dashboard's engine.

Bulk work goes in batches of :data:`BATCH_SIZE` rows, one short transaction each, as the
command does (``sqlaq.admin`` sits above this package, so the loops are its, restated
in a few lines). No SQL of its own, and no web framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import Engine

from sqlaq import control, ops, queries
from sqlaq.schema import JobStatus

__all__ = [
    "BATCH_SIZE",
    "Done",
    "cancel_job",
    "count_prunable",
    "pause_queue",
    "prune",
    "resume_queue",
    "retry_group",
    "retry_job",
]

#: Rows per transaction of a bulk action (as ``sqlaq retry --failed`` and ``sqlaq prune``).
BATCH_SIZE = 1000


@dataclass(frozen=True)
class Done:
    """What a bulk action did: *changed* of the *seen* jobs it looked at, and the jobs a
    retry left alone because another job holds their key (*skipped*)."""

    changed: int
    seen: int
    skipped: tuple[ops.SkippedRetry, ...] = ()


def retry_job(engine: Engine, job_id: int) -> ops.RetryResult:
    """Queue failed or cancelled job *job_id* again (:func:`sqlaq.retry`): a list holding
    its id if it was, with its :class:`~sqlaq.ops.SkippedRetry` if its key is taken."""
    with engine.begin() as conn:
        return ops.retry(conn, [job_id])


def cancel_job(engine: Engine, job_id: int) -> bool:
    """Cancel queued or running job *job_id* (:func:`sqlaq.cancel`); whether it was."""
    with engine.begin() as conn:
        return bool(ops.cancel(conn, [job_id]))


def pause_queue(engine: Engine, queue: str, *, by: str) -> bool:
    """Pause *queue* (:func:`sqlaq.control.pause`, as ``sqlaq pause``); whether it was
    not paused already."""
    with engine.begin() as conn:
        return control.pause(conn, queue, by=by)


def resume_queue(engine: Engine, queue: str) -> bool:
    """Resume *queue* (:func:`sqlaq.control.resume`); whether it was paused."""
    with engine.begin() as conn:
        return control.resume(conn, queue)


def retry_group(engine: Engine, *, kind: str, error: str, since: timedelta | None) -> Done:
    """Retry every failed job of *kind* whose ``last_error`` starts with the line
    *error* (and, with *since*, that failed within it), in batches by id; a job whose
    key another job holds is left failed and listed in :attr:`Done.skipped`."""
    changed = seen = after = 0
    skipped: list[ops.SkippedRetry] = []
    with engine.connect() as conn:
        while True:
            stmt = queries.failure_group_ids_stmt(
                kind=kind, error=error, since=since, after_id=after, limit=BATCH_SIZE
            )
            ids = list(conn.execute(stmt).scalars())
            if not ids:
                break
            seen += len(ids)
            retried = ops.retry(conn, ids)
            changed += len(retried)
            skipped.extend(retried.skipped)
            conn.commit()
            after = ids[-1]
    return Done(changed, seen, tuple(skipped))


def count_prunable(engine: Engine, ages: Mapping[JobStatus, timedelta]) -> dict[JobStatus, int]:
    """How many jobs :func:`prune` would delete now, per status."""
    with engine.connect() as conn:
        return {
            status: ops.count_prunable(conn, older_than=age, statuses=[status])
            for status, age in ages.items()
        }


def prune(engine: Engine, ages: Mapping[JobStatus, timedelta]) -> Done:
    """Delete the finished jobs of each status older than its age (:func:`sqlaq.prune`),
    in batches committed one by one; ``seen`` is the count before it started."""
    expected = sum(count_prunable(engine, ages).values())
    total = 0
    with engine.connect() as conn:
        for status, age in sorted(ages.items()):
            while True:
                deleted = ops.prune(conn, older_than=age, statuses=[status], limit=BATCH_SIZE)
                conn.commit()
                total += deleted
                if deleted < BATCH_SIZE:
                    break
    return Done(total, expected)
