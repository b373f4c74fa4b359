"""Operators: paused queues, the workers' heartbeat rows, and the wake channel
(``NOTIFY``/``LISTEN`` on ``sqlaq_jobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg.sql
from sqlalchemy import (
    Delete,
    Insert,
    Integer,
    Interval,
    Select,
    Text,
    bindparam,
    delete,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.sql.dml import ReturningDelete

from sqlaq.queries._common import _NOW
from sqlaq.schema import (
    CHANNEL,
    paused_queues,
    workers,
)

_WAKE_CHANNEL = literal_column(f"'{CHANNEL}'", Text)


def pause_stmt(*, queue: str, paused_by: str | None = None) -> Insert:
    """Pause *queue*: no claim takes its jobs until :func:`resume_stmt`.

    Renders ``INSERT INTO sqlaq_paused_queues (queue, paused_by) VALUES (:b_queue,
    :b_by) ON CONFLICT (queue) DO NOTHING RETURNING queue``: no row when the queue was
    paused already (its row is kept as it was). Every claim probes this table (see
    :func:`claim_stmt`), so the pause holds for every claim that starts after the
    commit, on every worker, with nothing to notify: running jobs are left alone.
    """
    return (
        insert(paused_queues)
        .values(
            queue=bindparam("b_queue", queue, Text),
            paused_by=bindparam("b_by", paused_by, Text),
        )
        .on_conflict_do_nothing(index_elements=[paused_queues.c.queue])
        .returning(paused_queues.c.queue)
    )


def resume_stmt(*, queue: str) -> Select[Any]:
    """Resume *queue*, and wake its workers on commit.

    Renders::

        WITH resumed AS (
            DELETE FROM sqlaq_paused_queues WHERE queue = :b_queue RETURNING queue)
        SELECT resumed.queue, pg_notify('sqlaq_jobs', resumed.queue) FROM resumed

    No row: the queue was not paused. The notification (the insert trigger's, on the
    same channel) makes idle workers of the queue claim at once instead of at their
    next poll.
    """
    resumed = (
        delete(paused_queues)
        .where(paused_queues.c.queue == bindparam("b_queue", queue, Text))
        .returning(paused_queues.c.queue)
        .cte("resumed")
    )
    return select(resumed.c.queue, func.pg_notify(_WAKE_CHANNEL, resumed.c.queue))


def paused_queues_stmt(*, queue: str | None = None) -> Select[Any]:
    """Select the paused queues (or *queue*, if paused): ``queue, paused_at,
    paused_by``, by name."""
    stmt = select(
        paused_queues.c.queue, paused_queues.c.paused_at, paused_queues.c.paused_by
    ).order_by(paused_queues.c.queue)
    if queue is not None:
        stmt = stmt.where(paused_queues.c.queue == bindparam("b_queue", queue, Text))
    return stmt


def heartbeat_stmt(
    *, worker_id: UUID, hostname: str, pid: int, queues: Sequence[str], concurrency: int
) -> Insert:
    """Record that a worker is alive: insert its row, or move its ``last_seen_at`` to
    ``now()``.

    Renders ``INSERT INTO sqlaq_workers (worker_id, hostname, pid, queues, concurrency)
    VALUES (...) ON CONFLICT (worker_id) DO UPDATE SET last_seen_at = now()``; the first
    one sets ``started_at`` too (its default). A row pruned meanwhile (the worker stalled
    for longer than :func:`prune_workers_stmt` allows) comes back as new.
    """
    stmt = insert(workers).values(
        worker_id=bindparam("b_worker", worker_id, PG_UUID(as_uuid=True)),
        hostname=bindparam("b_hostname", hostname, Text),
        pid=bindparam("b_pid", pid, Integer),
        queues=bindparam("b_queues", list(queues), ARRAY(Text)),
        concurrency=bindparam("b_concurrency", concurrency, Integer),
    )
    return stmt.on_conflict_do_update(
        index_elements=[workers.c.worker_id], set_={"last_seen_at": _NOW}
    )


def forget_worker_stmt(*, worker_id: UUID) -> Delete:
    """``DELETE FROM sqlaq_workers WHERE worker_id = :b_worker``: a worker that stops."""
    return delete(workers).where(
        workers.c.worker_id == bindparam("b_worker", worker_id, PG_UUID(as_uuid=True))
    )


def prune_workers_stmt(*, older_than: timedelta) -> ReturningDelete[Any]:
    """Delete the rows of workers not seen for *older_than* (killed, or lost the
    database): ``DELETE FROM sqlaq_workers WHERE last_seen_at < now() - :b_older_than
    RETURNING worker_id``."""
    return (
        delete(workers)
        .where(workers.c.last_seen_at < _NOW - bindparam("b_older_than", older_than, Interval))
        .returning(workers.c.worker_id)
    )


def workers_stmt(*, worker_id: UUID | None = None) -> Select[Any]:
    """Select the workers' rows (or *worker_id*'s): ``worker_id, hostname, pid, queues,
    concurrency, started_at, last_seen_at`` and ``seen_ago`` (``now() -
    last_seen_at``), oldest first."""
    stmt = select(*workers.c, (_NOW - workers.c.last_seen_at).label("seen_ago")).order_by(
        workers.c.started_at, workers.c.worker_id
    )
    if worker_id is not None:
        stmt = stmt.where(
            workers.c.worker_id == bindparam("b_worker", worker_id, PG_UUID(as_uuid=True))
        )
    return stmt


def serving_workers_stmt(*, queue: str, within: timedelta) -> Select[int, Any]:
    """Select how many workers that serve *queue* were seen within *within* of
    ``now()`` (``recent``), and when one was seen last (``last_seen``, NULL if none
    ever was): ``SELECT count(*) FILTER (WHERE last_seen_at > now() - :b_within),
    max(last_seen_at) FROM sqlaq_workers WHERE :b_queue = ANY(queues)``."""
    seen = workers.c.last_seen_at
    return select(
        func.count().filter(seen > _NOW - bindparam("b_within", within, Interval)).label("recent"),
        func.max(seen).label("last_seen"),
    ).where(bindparam("b_queue", queue, Text) == func.any(workers.c.queues))


def notify_queues_stmt(*, queues: Sequence[str]) -> Select[Any]:
    """``SELECT pg_notify('sqlaq_jobs', q) FROM unnest(:b_queues) AS q``: wake the
    workers of *queues* (on commit), as the insert trigger does for new jobs."""
    names = (
        func.unnest(bindparam("b_queues", list(queues), ARRAY(Text)))
        .table_valued("q")
        .render_derived(name="woken")
    )
    channel = literal_column(f"'{CHANNEL}'", Text)
    return select(func.pg_notify(channel, names.c.q)).select_from(names)


def listen_stmt(*, channel: str | Sequence[str] = CHANNEL) -> psycopg.sql.Composed:
    """``LISTEN "<channel>"`` (one ``LISTEN`` per channel given), for the worker's
    dedicated psycopg connection.

    A psycopg statement rather than a SQLAlchemy one: LISTEN must run on a raw autocommit
    connection that stays outside the pool (see :mod:`sqlaq.worker.listener`).
    """
    channels = [channel] if isinstance(channel, str) else list(channel)
    return psycopg.sql.SQL("; ").join(
        psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(name)) for name in channels
    )
