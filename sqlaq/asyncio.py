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
(psycopg's ``copy``, asyncpg's ``copy_records_to_table``). The twins of
:mod:`sqlaq.testing`'s helpers (:func:`travel`, :func:`enqueued_jobs`,
:func:`assert_enqueued`) are made on first use, so importing this module imports
neither the test helpers nor the worker; nor does it import SQLAlchemy's asyncio (and
with it the ORM) itself: the caller's objects are told apart by
:func:`sqlaq.drive.kind_of`.

Given a sync Connection, Session or Engine, each function here raises
:class:`~sqlaq.errors.ConfigError` naming the sync function to use; on a database
without sqlaq's schema, :class:`~sqlaq.errors.SchemaOutOfDateError` naming the fix.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from collections.abc import Callable, Coroutine
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeAlias, TypeGuard, TypeVar

import psycopg
import tenacity
from sqlalchemy.exc import DBAPIError

from sqlaq import ops, periodic, queries, results
from sqlaq.drive import (
    ASYNC_ENGINE,
    AUTOCOMMIT,
    Copy,
    Executor,
    PerEngine,
    Plan,
    Savepoint,
    kind_of,
    plan_of,
    public_name,
    schema_error,
    with_conn,
    wrong_kind,
)
from sqlaq.dsn import connection_params
from sqlaq.errors import ConfigError
from sqlaq.explain import explain as _sync_explain
from sqlaq.results import JobOutcome
from sqlaq.schema import FINISH_CHANNEL
from sqlaq.transient import describe

if TYPE_CHECKING:
    # Not at run time: SQLAlchemy's asyncio imports the ORM, and an object of theirs
    # exists only once the caller has imported them (sqlaq.drive.kind_of looks them up).
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    from sqlaq import testing

__all__ = [
    "AsyncExecutor",
    "assert_enqueued",
    "asynchronous",
    "batch",
    "cancel",
    "cancel_workflow",
    "cancelled_among",
    "chain",
    "chord",
    "claim",
    "claim_limited",
    "complete",
    "complete_with_result",
    "enqueue",
    "enqueue_copy",
    "enqueue_many",
    "enqueue_periodic",
    "enqueued_jobs",
    "explain",
    "extend_lease",
    "fail",
    "group",
    "handback",
    "list_workers",
    "notify_queues",
    "parent_results",
    "pause",
    "paused_queues",
    "prune",
    "read_workflow",
    "release_waiting",
    "result",
    "resume",
    "retry",
    "snooze",
    "sweep",
    "travel",
    "wait",
]

P = ParamSpec("P")
R = TypeVar("R")

#: What an async operation runs on: an AsyncConnection or an AsyncSession.
AsyncExecutor: TypeAlias = "AsyncConnection | AsyncSession"
# The types the async driver takes without a second look (each joins on first use).
_ASYNC_TYPES: set[type] = set()


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
    except Exception as exc:
        error = schema_error(exc)
        if error is None:
            raise
        raise error from exc


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
    if isinstance(step, PerEngine):
        return await _per_engine(conn, step)
    raise TypeError(f"a plan yielded {step!r}, which is not a step")  # pragma: no cover


async def _per_engine(conn: AsyncExecutor, step: PerEngine) -> Any:
    """The answer to *step* for *conn*'s engine (see :class:`sqlaq.drive.PerEngine`)."""
    connection = conn if _is_connection(conn) else await conn.connection()
    engine = connection.sync_engine
    if engine in step.cache:
        return step.cache[engine]
    value = await _run(conn, step.plan())
    step.cache[engine] = value
    return value


async def _autocommit(conn: AsyncExecutor) -> bool:
    if not _is_connection(conn):
        return False  # an AsyncSession (or a scoped one): its transaction is a real one
    raw = await conn.get_raw_connection()
    return bool(getattr(raw.dbapi_connection, "autocommit", False))


async def _copy(conn: AsyncExecutor, step: Copy) -> int:
    connection = conn if _is_connection(conn) else await conn.connection()
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


def _is_connection(conn: object) -> TypeGuard[AsyncConnection]:
    """Whether *conn* is an AsyncConnection (not a session)."""
    aio = sys.modules.get("sqlalchemy.ext.asyncio")  # imported if conn is one of its
    return aio is not None and isinstance(conn, aio.AsyncConnection)


def _check_async(conn: object, name: str, module: str) -> None:
    """Refuse, before any SQL, what an async operation cannot run on (see
    :func:`sqlaq.drive.wrong_kind`)."""
    error = wrong_kind(conn, name, module, awaited=True)
    if error is not None:
        raise error
    aio = sys.modules.get("sqlalchemy.ext.asyncio")
    if aio is not None and type(conn) in (aio.AsyncConnection, aio.AsyncSession):
        _ASYNC_TYPES.add(type(conn))  # no second look next time


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
pause = asynchronous(ops.pause)
resume = asynchronous(ops.resume)
paused_queues = asynchronous(ops.paused_queues)
list_workers = asynchronous(ops.list_workers)
enqueue_periodic = asynchronous(periodic.enqueue_periodic)
result = asynchronous(results.result)
complete_with_result = asynchronous(results.complete_with_result)
chain = asynchronous(ops.chain)
group = asynchronous(ops.group)
chord = asynchronous(ops.chord)
batch = asynchronous(ops.batch)
parent_results = asynchronous(ops.parent_results)
release_waiting = asynchronous(ops.release_waiting)
read_workflow = asynchronous(ops.read_workflow)
cancel_workflow = asynchronous(ops.cancel_workflow)
explain = asynchronous(_sync_explain)  # (sqlaq.explain, the module, is the function)


# -- the test helpers of sqlaq.testing: made on first use ---------------------------------

#: The async twins made on first use, and the module of each one's original: importing
#: it (sqlaq.testing imports the worker and the ORM) waits until a twin is asked for.
_LAZY: dict[str, str] = dict.fromkeys(
    ("assert_enqueued", "enqueued_jobs", "travel"), "sqlaq.testing"
)

if TYPE_CHECKING:
    assert_enqueued = asynchronous(testing.assert_enqueued)
    enqueued_jobs = asynchronous(testing.enqueued_jobs)
    travel = asynchronous(testing.travel)
else:

    def __getattr__(name: str) -> Any:
        """Make a twin of :data:`_LAZY` on first use (then it is an ordinary attribute)."""
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        twin = globals()[name] = asynchronous(getattr(importlib.import_module(module), name))
        return twin


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# -- waiting for a job: sqlaq.results.waiting's steps, with async I/O -----------------------

_log = logging.getLogger("sqlaq.results")


async def wait(
    conn_or_engine: AsyncEngine | AsyncConnection | AsyncSession,
    job_id: int,
    *,
    timeout: timedelta | float,
    poll_interval: timedelta | float = results.DEFAULT_POLL_INTERVAL,
) -> JobOutcome:
    """Awaitable :func:`sqlaq.wait`: wait until job *job_id* is done, failed or
    cancelled, and return its outcome, without blocking the event loop.

    The same waiting as :func:`sqlaq.wait` (:func:`sqlaq.results.waiting`: LISTEN, mark
    the job ``awaited``, read it, then read again when its id is notified or every
    *poll_interval*), on psycopg's async connection for the LISTEN (outside the pool,
    made from the engine's URL, whichever async driver it names) and on connections of
    the AsyncEngine's pool for the reads. The job must be committed.

    Args:
        conn_or_engine: An AsyncEngine, or an AsyncConnection or AsyncSession bound to
            one (their transaction is left alone).
        job_id: The job to wait for.
        timeout: How long to wait at most (a timedelta, or seconds).
        poll_interval: How often to read the job without a notification.

    Raises:
        WaitTimeoutError: the job did not finish in time (a :class:`TimeoutError`).
        JobNotFoundError: no job has this id, or it is not committed yet.
        InvalidJobError: *timeout* or *poll_interval* is not a usable duration.
        ConfigError: *conn_or_engine* is not an async engine, connection or session.
        sqlalchemy.exc.OperationalError: the database stayed unavailable for all of
            *timeout* (each read is retried until then, as :func:`sqlaq.wait` does).
    """
    engine = _async_engine_of(conn_or_engine)
    steps = results.waiting(job_id, timeout=timeout, poll_interval=poll_interval)
    retrying = results.read_retrying(timeout)
    async with _FinishListener(engine) as listener:
        value: Any = None
        while True:
            try:
                step = steps.send(value)
            except StopIteration as done:
                outcome: JobOutcome = done.value
                return outcome
            if isinstance(step, float):
                value = await listener.wait_for(job_id, step)
                continue
            async for attempt in tenacity.AsyncRetrying(**retrying):
                with attempt:
                    async with engine.connect() as conn:
                        await conn.execution_options(isolation_level=results.READ_COMMITTED)
                        value = await _run(conn, step())
                        await conn.commit()


def _async_engine_of(target: object) -> AsyncEngine:
    error = wrong_kind(target, "wait", "sqlaq.results", awaited=True, engines=True)
    if error is not None:
        raise error
    bind: Any = target if _is_connection(target) else getattr(target, "bind", target)
    if _is_connection(bind):
        bind = bind.engine
    if kind_of(bind) != ASYNC_ENGINE:
        raise ConfigError(
            f"sqlaq.asyncio.wait() needs an AsyncEngine, or an AsyncConnection or "
            f"AsyncSession bound to one, got {type(target).__name__}"
        )
    engine: AsyncEngine = bind
    return engine


class _FinishListener:
    """The async twin of :class:`sqlaq.results._FinishListener`'s I/O: a psycopg
    ``AsyncConnection`` in autocommit LISTENing on ``sqlaq_finished``, outside the
    engine's pool. A lost connection is not an error: :meth:`wait_for` then sleeps (the
    caller reads the job after each wait anyway) and reconnects on its next call."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._params = connection_params(engine.url, results.APPLICATION_NAME)
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def __aenter__(self) -> _FinishListener:
        await self._connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._close()

    async def wait_for(self, job_id: int, seconds: float) -> bool:
        """Wait up to *seconds* for *job_id*'s notification; True if it came (False at
        once after reconnecting: what was notified meanwhile is lost)."""
        if self._conn is None:
            if await self._connect():
                return False
            await asyncio.sleep(seconds)  # no listening connection: poll
            return False
        wanted = str(job_id)
        try:
            async for notify in self._conn.notifies(timeout=seconds):
                if notify.payload == wanted:
                    return True
        except psycopg.Error as exc:
            _log.warning("wait: listening connection lost, polling: %s", describe(exc))
            await self._close()
        return False

    async def _connect(self) -> bool:
        try:
            conn = await psycopg.AsyncConnection.connect(**self._params, autocommit=True)
        except psycopg.Error as exc:
            _log.warning("wait: cannot listen for notifications, polling: %s", describe(exc))
            return False
        try:
            await conn.execute(queries.listen_stmt(channel=FINISH_CHANNEL))
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        return True

    async def _close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()
