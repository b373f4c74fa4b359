"""Settle: what the holder of a lease writes (extend, complete, fail, snooze, hand
back), each fenced to the claim's lease token."""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Integer,
    Interval,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import UserDefinedType

from sqlaq.lease import Lease
from sqlaq.queries._common import _NOW, _RUNNING, _status, c
from sqlaq.schema import (
    CHANNEL,
    JobStatus,
    jobs,
)


def fence_params(leases: Collection[Lease]) -> dict[str, Any]:
    """The bind values that fence :func:`complete_stmt` (and the others) to *leases*.

    The id and token lists travel as array literals in text (``'{1,2,3}'``), cast to
    ``bigint[]`` and ``uuid[]`` by the statement: psycopg adapts a list element by
    element in Python, which cost a completing worker a few percent of its time, while a
    joined string is one parameter.
    """
    return {
        "b_ids": "{" + ",".join([str(lease.job_id) for lease in leases]) + "}",
        "b_tokens": "{" + ",".join([str(lease.token) for lease in leases]) + "}",
    }


class _ArrayLiteral(UserDefinedType[str]):
    """A bind parameter holding an array literal in text (``'{1,2,3}'``), rendered with
    the array's cast (``%(b_ids)s::BIGINT[]``). psycopg sends a str untyped, so the
    server types the parameter as the array itself and parses it in C: the planner sees
    an array parameter, exactly as with a list (a ``CAST`` of a text parameter instead
    hides the array's size from it and can turn the primary-key lookup into a scan).

    asyncpg types every parameter from the prepared statement and wants a list for an
    array: on that driver the literal is split back into one (*element* converts each
    item), which costs what binding a list costs anyway."""

    cache_ok = True
    render_bind_cast = True

    def __init__(self, spec: str, element: Callable[[str], Any] = str) -> None:
        self.spec = spec
        self.element = element

    def get_col_spec(self, **_kw: Any) -> str:
        return self.spec

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        if dialect.driver != "asyncpg":
            return None
        element = self.element

        def as_list(value: Any) -> Any:
            if not isinstance(value, str):
                return value
            inner = value[1:-1]
            return [element(item) for item in inner.split(",")] if inner else []

        return as_list


_ID_LITERAL = _ArrayLiteral("BIGINT[]", int)

_UUID_LITERAL = _ArrayLiteral("UUID[]", UUID)


def _fence(leases: Collection[Lease]) -> ColumnElement[bool]:
    # The token is unique to one claim of one job, so "id = ANY AND token = ANY" can only
    # match a (job, token) pair that belongs together; id = ANY lets the primary key find
    # the rows.
    #
    # The status test sits inside the token's comparison (a token counts only on a
    # running row), not beside it: "status = 'running'" as a condition of its own lets
    # the planner read the partial running index (kind, run_at) WHERE status = 'running'
    # from end to end instead of probing the primary key. That index looks tiny to it
    # (its statistics count live rows), and is, until a snapshot held elsewhere keeps
    # the dead entry of every job that ever ran there: each complete of a drain then
    # walked all of them (5 ms per complete of 100 after 50,000 jobs, and growing).
    v = fence_params(leases)
    held_token = case((_RUNNING, c.lease_token))
    return and_(
        c.id == func.any(bindparam("b_ids", v["b_ids"], _ID_LITERAL)),
        held_token == func.any(bindparam("b_tokens", v["b_tokens"], _UUID_LITERAL)),
    )


def extend_lease_stmt(*, leases: Collection[Lease], lease: timedelta) -> Update:
    """Move the end of every still-held lease in *leases* to ``now() + lease``, never
    earlier than it is.

    Renders ``UPDATE sqlaq_jobs SET run_at = greatest(run_at, now() + :b_lease) WHERE
    id = ANY(:b_ids) AND lease_token = ANY(:b_tokens) AND status = 'running' RETURNING
    id, run_at``: one statement per heartbeat whatever the number of jobs in flight. A
    lease that was lost (reclaimed, cancelled, finished) returns no row. An extension
    never shortens a lease: a worker's heartbeat, computed with the length it knew when
    it started, may commit just after a handler asked for a longer one, and must not
    undo it.
    """
    return (
        update(jobs)
        .where(_fence(leases))
        .values(run_at=_extended_end(bindparam("b_lease", lease, Interval)))
        .returning(c.id, c.run_at)
    )


def _extended_end(length: ColumnElement[Any]) -> ColumnElement[Any]:
    """``greatest(run_at, now() + length)``: a renewed lease's end, never earlier than
    the end it had (shared by the Citus form)."""
    return func.greatest(c.run_at, _NOW + length)


def complete_stmt(*, leases: Collection[Lease]) -> Update:
    """Mark done every job in *leases* whose lease is still its current one.

    Renders ``UPDATE sqlaq_jobs SET status = 'done', finished_at = now(), lease_token =
    NULL WHERE <fence> RETURNING id``. Matches no row for a lease that is no longer the
    job's current one, so a worker whose job was reclaimed cannot finish the newer
    attempt.
    """
    return (
        update(jobs)
        .where(_fence(leases))
        .values(status=_status(JobStatus.DONE), finished_at=_NOW, lease_token=null())
        .returning(c.id)
    )


def complete_result_params(*, lease: Lease, result_json: str) -> dict[str, Any]:
    """The bind values of :func:`complete_result_stmt`."""
    return fence_params([lease]) | {"b_result": result_json}


def complete_result_stmt(*, lease: Lease, result_json: str) -> Update:
    """Mark the job held by *lease* done and store *result_json* (JSON text) with it.

    Renders ``UPDATE sqlaq_jobs SET status = 'done', finished_at = now(), lease_token =
    NULL, result = CAST(:b_result AS JSONB) WHERE <fence> RETURNING id``: what
    :func:`complete_stmt` does for one lease, plus the handler's return value. No row
    when the lease was lost, so a stale holder stores no result either.
    """
    v = complete_result_params(lease=lease, result_json=result_json)
    return (
        update(jobs)
        .where(_fence([lease]))
        .values(
            status=_status(JobStatus.DONE),
            finished_at=_NOW,
            lease_token=null(),
            result=cast(bindparam("b_result", v["b_result"], Text), JSONB),
        )
        .returning(c.id)
    )


def fail_params(*, lease: Lease, error: str, retry_in: timedelta | None) -> dict[str, Any]:
    """The bind values of :func:`fail_stmt`."""
    return fence_params([lease]) | {
        "b_retry": retry_in is not None,
        "b_retry_in": retry_in or timedelta(0),
        "b_error": error,
    }


def fail_stmt(*, lease: Lease, error: str, retry_in: timedelta | None) -> Update:
    """Record a failed attempt of the job held by *lease*.

    With *retry_in* and attempts left: ``status = 'queued', run_at = now() + retry_in``.
    Otherwise ``status = 'failed', finished_at = now()``. Either way ``last_error =
    error`` and the lease is released. ``RETURNING id, status, run_at``; no row when the
    lease was lost.
    """
    v = fail_params(lease=lease, error=error, retry_in=retry_in)
    retry = and_(bindparam("b_retry", v["b_retry"], Boolean), c.attempts < c.max_attempts)
    return (
        update(jobs)
        .where(_fence([lease]))
        .values(
            status=case((retry, _status(JobStatus.QUEUED)), else_=_status(JobStatus.FAILED)),
            run_at=case(
                (retry, _NOW + bindparam("b_retry_in", v["b_retry_in"], Interval)),
                else_=c.run_at,
            ),
            finished_at=case((retry, null()), else_=_NOW),
            last_error=bindparam("b_error", v["b_error"], Text),
            locked_by=null(),
            lease_token=null(),
        )
        .returning(c.id, c.status, c.run_at)
    )


def _requeued(run_at: ColumnElement[Any]) -> dict[str, Any]:
    # Back to queued without counting the attempt: for hand-back and snooze.
    return {
        "status": _status(JobStatus.QUEUED),
        "run_at": run_at,
        "attempts": func.greatest(
            c.attempts - literal_column("1", Integer), literal_column("0", Integer)
        ),
        "locked_by": null(),
        "lease_token": null(),
    }


def snooze_stmt(*, leases: Collection[Lease], delay: timedelta) -> Update:
    """Queue held jobs again at ``now() + delay`` without counting the attempt.

    Renders ``UPDATE sqlaq_jobs SET status = 'queued', run_at = now() + :b_delay,
    attempts = greatest(attempts - 1, 0), locked_by = NULL, lease_token = NULL WHERE
    <fence> RETURNING id``: what a handler's ``raise sqlaq.Snooze(delay)`` writes.
    """
    return (
        update(jobs)
        .where(_fence(leases))
        .values(_requeued(_NOW + bindparam("b_delay", delay, Interval)))
        .returning(c.id)
    )


def handback_stmt(*, leases: Collection[Lease]) -> Select[int, Any]:
    """Give running jobs back to their queue, due now, with the attempt refunded.

    For a worker that stops before its jobs finish: a deploy is not a failure, so the
    attempt the claim counted is taken back and another worker may start the job at
    once. Renders::

        WITH handed AS (
            UPDATE sqlaq_jobs SET status = 'queued', run_at = now(),
                attempts = greatest(attempts - 1, 0), locked_by = NULL, lease_token = NULL
            WHERE <fence> RETURNING id, queue)
        SELECT handed.id, pg_notify('sqlaq_jobs', handed.queue) FROM handed

    Fenced like complete: a lease already lost changes nothing. The notification (sent
    on commit, one per queue) wakes idle workers instead of leaving the jobs to a poll.
    ``last_error`` is kept.
    """
    handed = (
        update(jobs)
        .where(_fence(leases))
        .values(_requeued(_NOW))
        .returning(c.id, c.queue)
        .cte("handed")
    )
    # The channel is a constant of schema.py, inlined like the status literals.
    channel = literal_column(f"'{CHANNEL}'", Text)
    return select(handed.c.id, func.pg_notify(channel, handed.c.queue))
