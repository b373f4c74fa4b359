"""Operators: pause and resume queues, list the workers, wake the workers of queues.

A pause lives in the database (``sqlaq_paused_queues``), not in any worker: every
claim looks its queue up there (see :func:`sqlaq.queries.claim_stmt`), so once the
pause commits no worker claims a job of the queue, whatever its version of the
registry and however many there are. Jobs already running finish as usual;
enqueueing into a paused queue still works (the jobs wait). A resume notifies the
queue's workers, so idle ones claim at once rather than at their next poll.
The workers' heartbeat rows (``sqlaq_workers``) are kept up to date by each worker's
maintenance thread (:mod:`sqlaq.maintenance`).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlaq import queries
from sqlaq.drive import Plan, operation
from sqlaq.encoding import check_name, check_text
from sqlaq.records import PausedQueue, WorkerInfo


@operation
def notify_queues(queues: Sequence[str]) -> Plan[None]:
    """Wake the workers of *queues* when the caller commits (NOTIFY ``sqlaq_jobs``)."""
    if queues:
        (yield queries.notify_queues_stmt(queues=queues), None).all()


@operation
def pause(queue: str, *, by: str | None = None) -> Plan[bool]:
    """Pause *queue* in the caller's transaction: no worker claims its jobs once it
    commits, until :func:`resume`.

    Running jobs are not disturbed, and enqueueing into the queue still works: the
    jobs wait, due, until the queue is resumed. A job of the queue whose lease expires
    meanwhile is put back in the queue by the maintenance leader's sweep.

    Args:
        queue: The queue to pause (it need not have any job yet).
        by: Who pauses it, kept for ``sqlaq stats`` and :func:`paused_queues`.

    Returns:
        True if this call paused it; False if it was paused already (the first pause's
        time and author are kept).

    Raises:
        InvalidJobError: *queue* is not a usable queue name, or *by* not storable text.
    """
    check_name("queue", queue)
    if by is not None:
        check_text("by", by)
    paused = yield queries.pause_stmt(queue=queue, paused_by=by), None
    return paused.first() is not None


@operation
def resume(queue: str) -> Plan[bool]:
    """Resume *queue* in the caller's transaction; its workers are woken on commit.

    Returns:
        True if it was paused; False if it was not (nothing changes).

    Raises:
        InvalidJobError: *queue* is not a usable queue name.
    """
    check_name("queue", queue)
    resumed = yield queries.resume_stmt(queue=queue), None
    return resumed.first() is not None


@operation
def paused_queues() -> Plan[list[PausedQueue]]:
    """The paused queues, by name."""
    rows = yield queries.paused_queues_stmt(), None
    return [PausedQueue(row.queue, row.paused_at, row.paused_by) for row in rows]


@operation
def list_workers() -> Plan[list[WorkerInfo]]:
    """The workers that keep a heartbeat row, oldest first.

    A worker writes its row when it starts and once per maintenance interval, and
    deletes it when it stops cleanly; the maintenance leader deletes the rows of
    workers not seen for ten intervals (killed ones). A ``--burst`` worker keeps none.
    """
    rows = yield queries.workers_stmt(), None
    return [
        WorkerInfo(
            row.worker_id,
            row.hostname,
            row.pid,
            tuple(row.queues),
            row.concurrency,
            row.started_at,
            row.last_seen_at,
            row.seen_ago,
        )
        for row in rows
    ]
