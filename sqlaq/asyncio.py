"""sqlaq's operations for asyncio applications: ``await`` them on an AsyncConnection or
AsyncSession.

Mirrors :mod:`sqlalchemy.ext.asyncio`: the same names and signatures as ``sqlaq.*``,
awaited, on the async objects::

    from sqlaq.asyncio import enqueue

    async with async_session.begin():
        async_session.add(order)
        await enqueue(async_session, "ship_order", {"order_id": order.id})

Works on both async drivers of SQLAlchemy, ``postgresql+psycopg://`` (psycopg's
``AsyncConnection``) and ``postgresql+asyncpg://``, and needs ``greenlet``, as all of
SQLAlchemy's asyncio does (``pip install 'sqlaq[asyncio]'``).

This module writes no operation of its own. Every operation's logic lives once, as a
plan, in :mod:`sqlaq.ops` (or :mod:`sqlaq.periodic`), and :func:`asynchronous` makes
each function here from the plan of its sync original (see :mod:`sqlaq.drive`); what is
here is the async driver, which only runs a plan's steps: ``await conn.execute(...)``,
a savepoint, an autocommit check, a COPY through the driver's own connection
(psycopg's ``copy``, asyncpg's ``copy_records_to_table``). The read-only test helpers
:func:`enqueued_jobs` and :func:`assert_enqueued` run their sync originals through
``run_sync``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Concatenate, ParamSpec, TypeAlias, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session, scoped_session

from sqlaq import ops, periodic, queries, testing
from sqlaq.drive import AUTOCOMMIT, Copy, Executor, Plan, Savepoint, plan_of, public_name, with_conn
from sqlaq.errors import ConfigError

__all__ = [
    "AsyncExecutor",
    "assert_enqueued",
    "asynchronous",
    "cancel",
    "cancelled_among",
    "claim",
    "claim_limited",
    "complete",
    "enqueue",
    "enqueue_copy",
    "enqueue_many",
    "enqueue_periodic",
    "enqueued_jobs",
    "extend_lease",
    "fail",
    "handback",
    "notify_queues",
    "prune",
    "retry",
    "snooze",
    "sweep",
]

P = ParamSpec("P")
R = TypeVar("R")

#: What an async operation runs on: an AsyncConnection or an AsyncSession.
AsyncExecutor: TypeAlias = AsyncConnection | AsyncSession
_ASYNC_TYPES = frozenset({AsyncConnection, AsyncSession})


def asynchronous(
    op: Callable[Concatenate[Executor, P], R],
) -> Callable[Concatenate[AsyncExecutor, P], Coroutine[Any, Any, R]]:
    """The ``async`` twin of the sync operation *op*: the same plan, run by the async
    driver on an AsyncConnection or AsyncSession."""
    plan = plan_of(op)
    name = op.__name__

    async def twin(conn: AsyncExecutor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if type(conn) not in _ASYNC_TYPES:
            _check_async(conn, name, op.__module__)
        return await _run(conn, plan(*args, **kwargs))

    twin.__name__ = name
    twin.__qualname__ = name
    twin.__module__ = __name__
    twin.__doc__ = (
        f"Awaitable :func:`{public_name(name, op.__module__)}`, on an AsyncConnection or "
        f"AsyncSession.\n\n{op.__doc__ or ''}"
    )
    twin.__signature__ = with_conn(plan, "AsyncConnection | AsyncSession")  # type: ignore[attr-defined]
    return twin


async def _run(conn: AsyncExecutor, plan: Plan[R]) -> R:
    """Run *plan* on *conn*, step by step; return what it returns."""
    try:
        step = plan.send(None)
        while True:
            if type(step) is tuple:
                step = plan.send(await conn.execute(step[0], step[1]))
            else:
                step = plan.send(await _special(conn, step))
    except StopIteration as done:
        value: R = done.value
        return value


async def _special(conn: AsyncExecutor, step: Any) -> Any:
    if isinstance(step, Savepoint):
        try:
            if await _autocommit(conn):
                return await conn.execute(step.statement, step.params)
            async with conn.begin_nested():
                return await conn.execute(step.statement, step.params)
        except DBAPIError as exc:
            return exc
    if step is AUTOCOMMIT:
        return await _autocommit(conn)
    if isinstance(step, Copy):
        return await _copy(conn, step)
    raise TypeError(f"a plan yielded {step!r}, which is not a step")  # pragma: no cover


async def _autocommit(conn: AsyncExecutor) -> bool:
    if not isinstance(conn, AsyncConnection):
        return False  # an AsyncSession (or a scoped one): its transaction is a real one
    raw = await conn.get_raw_connection()
    return bool(getattr(raw.dbapi_connection, "autocommit", False))


async def _copy(conn: AsyncExecutor, step: Copy) -> int:
    connection = conn if isinstance(conn, AsyncConnection) else await conn.connection()
    if not connection.in_transaction():
        await connection.begin()  # what executing a statement would do: the caller commits
    raw = await connection.get_raw_connection()
    driver: Any = raw.driver_connection
    if isinstance(driver, psycopg.AsyncConnection):
        async with driver.cursor() as cursor, cursor.copy(step.statement) as copy:
            for row in step.rows:
                await copy.write_row(row)
        return len(step.rows)
    if hasattr(driver, "copy_records_to_table"):  # asyncpg
        # SQLAlchemy starts asyncpg's transaction at the first statement, not at begin():
        # run one, so that the COPY is inside the caller's transaction.
        await connection.execute(queries.clock_stmt())
        await driver.copy_records_to_table(step.table, records=step.rows, columns=step.columns)
        return len(step.rows)
    raise ConfigError(
        f"{step.operation} needs COPY, which {driver!r} cannot run: use the psycopg "
        "(postgresql+psycopg://) or asyncpg (postgresql+asyncpg://) driver"
    )


def _check_async(conn: object, name: str, module: str) -> None:
    """Refuse, before any SQL, what an async operation cannot run on."""
    if isinstance(conn, AsyncConnection | AsyncSession):
        return  # a subclass
    kind = type(conn).__name__
    if isinstance(conn, Connection | Session | scoped_session):
        raise ConfigError(
            f"sqlaq.asyncio.{name} takes an AsyncConnection or AsyncSession, not a {kind}: "
            f"use '{public_name(name, module)}(...)', not awaited, on a {kind}"
        )
    if hasattr(conn, "execute") and not isinstance(conn, Engine):
        return  # given a chance, like the sync driver does (an async_scoped_session)
    raise ConfigError(
        f"sqlaq.asyncio.{name} takes an AsyncConnection or AsyncSession (it runs in your "
        f"transaction), not {kind}: e.g. 'async with async_engine.begin() as conn: "
        f"await sqlaq.asyncio.{name}(conn, ...)'"
    )


# -- the operations: each the async twin of the sync one -----------------------------------

enqueue = asynchronous(ops.enqueue)
enqueue_many = asynchronous(ops.enqueue_many)
enqueue_copy = asynchronous(ops.enqueue_copy)
claim = asynchronous(ops.claim)
claim_limited = asynchronous(ops.claim_limited)
extend_lease = asynchronous(ops.extend_lease)
complete = asynchronous(ops.complete)
fail = asynchronous(ops.fail)
retry = asynchronous(ops.retry)
cancel = asynchronous(ops.cancel)
cancelled_among = asynchronous(ops.cancelled_among)
notify_queues = asynchronous(ops.notify_queues)
sweep = asynchronous(ops.sweep)
prune = asynchronous(ops.prune)
snooze = asynchronous(ops.snooze)
handback = asynchronous(ops.handback)
enqueue_periodic = asynchronous(periodic.enqueue_periodic)


# -- read-only test helpers: their sync originals, through run_sync -----------------------


async def enqueued_jobs(
    conn: AsyncExecutor,
    kind: str | None = None,
    *,
    payload: Mapping[str, Any] | None = None,
    queue: str | None = None,
) -> list[Row[Any]]:
    """Awaitable :func:`sqlaq.testing.enqueued_jobs`: the queued jobs, oldest first."""
    if type(conn) not in _ASYNC_TYPES:
        _check_async(conn, "enqueued_jobs", "sqlaq.testing")
    return await conn.run_sync(testing.enqueued_jobs, kind, payload=payload, queue=queue)


async def assert_enqueued(
    conn: AsyncExecutor,
    kind: str,
    *,
    payload: Mapping[str, Any] | None = None,
    queue: str | None = None,
    count: int | None = None,
) -> Row[Any]:
    """Awaitable :func:`sqlaq.testing.assert_enqueued`: the first matching queued job.

    Raises:
        AssertionError: no such job, or not *count* of them.
    """
    if type(conn) not in _ASYNC_TYPES:
        _check_async(conn, "assert_enqueued", "sqlaq.testing")
    return await conn.run_sync(
        testing.assert_enqueued, kind, payload=payload, queue=queue, count=count
    )
