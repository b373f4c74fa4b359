"""Operators' controls: pausing a queue, and the workers' heartbeat rows.

This module owns the operations over the tables of revision ``sqlaq_0004`` that
operators use (the ``sqlaq pause``, ``resume`` and ``workers`` commands call them):

* :func:`pause` and :func:`resume` write ``sqlaq_paused_queues``. The pause lives in
  the database, not in any worker: every claim looks its queue up there (see
  :func:`sqlaq.queries.claim_stmt`), so once the pause commits no worker claims a job of
  the queue, whatever its version of the registry and however many there are. Jobs
  already running finish as usual; enqueueing into a paused queue still works (the
  jobs wait). A resume notifies the queue's workers, so idle ones claim at once rather
  than at their next poll.
* :func:`list_workers` reads ``sqlaq_workers``, where each worker's maintenance thread
  keeps a row up to date (:mod:`sqlaq.maintenance`).

Like :mod:`sqlaq.ops`, every function runs on the caller's Connection or Session and
never commits: a pause takes effect when the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeAlias
from uuid import UUID

from sqlalchemy import Connection

from sqlaq import queries
from sqlaq.encoding import check_name, check_text

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["PausedQueue", "WorkerInfo", "list_workers", "pause", "paused_queues", "resume"]

#: What the operations of this module run on.
# A string: sqlalchemy.orm is imported for type checkers only (a worker does without it).
Executor: TypeAlias = "Connection | Session"


@dataclass(frozen=True, slots=True)
class PausedQueue:
    """A paused queue.

    Attributes:
        queue: Its name.
        paused_at: When it was paused (database clock).
        paused_by: Who paused it, as :func:`pause` was told (``sqlaq pause`` records
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


def pause(conn: Executor, queue: str, *, by: str | None = None) -> bool:
    """Pause *queue* in the caller's transaction: no worker claims its jobs once it
    commits, until :func:`resume`.

    Running jobs are not disturbed, and enqueueing into the queue still works: the
    jobs wait, due, until the queue is resumed. A job of the queue whose lease expires
    meanwhile is put back in the queue by the maintenance leader's sweep.

    Args:
        conn: The caller's Connection or Session.
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
    paused = conn.execute(queries.pause_stmt(queue=queue, paused_by=by))
    return paused.first() is not None


def resume(conn: Executor, queue: str) -> bool:
    """Resume *queue* in the caller's transaction; its workers are woken on commit.

    Returns:
        True if it was paused; False if it was not (nothing changes).

    Raises:
        InvalidJobError: *queue* is not a usable queue name.
    """
    check_name("queue", queue)
    return conn.execute(queries.resume_stmt(queue=queue)).first() is not None


def paused_queues(conn: Executor) -> list[PausedQueue]:
    """The paused queues, by name."""
    rows = conn.execute(queries.paused_queues_stmt())
    return [PausedQueue(row.queue, row.paused_at, row.paused_by) for row in rows]


def list_workers(conn: Executor) -> list[WorkerInfo]:
    """The workers that keep a heartbeat row, oldest first.

    A worker writes its row when it starts and once per maintenance interval, and
    deletes it when it stops cleanly; the maintenance leader deletes the rows of
    workers not seen for ten intervals (killed ones). A ``--burst`` worker keeps none.
    """
    rows = conn.execute(queries.workers_stmt())
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
