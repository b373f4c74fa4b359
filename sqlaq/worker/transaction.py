"""Transactional handlers: the handler's writes and the job's completion in one
transaction. No scheduling, no threads of its own: the runner (and the test kit) call
these in the thread or task that runs the handler.

A transactional handler gets a session whose transaction also completes its job: after
the handler returns, the fenced completion runs in that transaction, then it commits.
If the lease is gone (the job was claimed again elsewhere, or cancelled), the
completion matches no row and the whole transaction rolls back: nothing of a stale
attempt is ever committed. A handler that raises rolls its writes back; its failure is
written afterwards, like any handler's, by the worker's writer.

The guarantee: for effects in the same database, exactly once (the writes commit with
the job's ``done``, once); for effects elsewhere, still at least once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import timedelta
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from sqlalchemy import Engine

from sqlaq import ops, queries
from sqlaq.config import DEFAULT_CONCURRENCY
from sqlaq.context import bind, unbind
from sqlaq.errors import ConfigError
from sqlaq.outcome import LOST, Outcome, Verdict, decide
from sqlaq.registry import Registry
from sqlaq.results import complete_with_result
from sqlaq.schema import JobStatus
from sqlaq.transient import describe, is_transient
from sqlaq.worker import pool
from sqlaq.worker.run import Finished, Run, bounded, timed_out

if TYPE_CHECKING:  # imported where a transactional handler needs it: a worker without
    from sqlalchemy.orm import Session  # one never loads sqlalchemy.orm

__all__ = [
    "HANDED_BACK",
    "AsyncSessionFactory",
    "SessionFactory",
    "Sessions",
    "check_connection",
    "run_async",
    "run_sync",
]

#: Makes the session of one job's transaction: a ``sessionmaker`` (or any callable
#: returning a Session usable as a context manager).
SessionFactory: TypeAlias = "Callable[[], AbstractContextManager[Session]]"
#: Makes the session of one async job's transaction: an ``async_sessionmaker`` (or any
#: callable returning an AsyncSession usable as an async context manager).
AsyncSessionFactory = Callable[[], AbstractAsyncContextManager[Any]]


_log = logging.getLogger(__name__)

#: How long a stopping worker waits for its AsyncEngine's connections to close.
CLOSE_SECONDS = 5.0


class _LeaseGone(Exception):
    """Rolls a transactional attempt back: its completion matched no row."""


class _ConnectionLost(Exception):
    """The session's connection was found dead before the handler ran."""


#: A run whose session's connection was lost before its handler ran: back to the queue,
#: due now, its attempt refunded (the handler never ran: not its failure).
HANDED_BACK = Outcome(Verdict.SNOOZED, delay=timedelta(0))


def check_connection(session: Session) -> None:
    """Ping the connection *session*'s transaction runs on, in that transaction, before
    the handler runs (what ``pool_pre_ping`` does at checkout, for a pool the host made
    without it): once it answers, the transaction is open and what follows is the
    handler's.

    Only a connection the session took from an engine's pool, before anything ran on
    it: a session joined to a caller's connection (a test's drain) is left alone.

    Raises:
        _ConnectionLost: the connection is gone (invalidated: the pool replaces it).
    """
    if not isinstance(session.get_bind(), Engine):
        return
    connection = session.connection()
    try:
        connection.execute(queries.ping_stmt())
    except Exception as exc:
        if not is_transient(exc):
            raise
        if not connection.invalidated:
            connection.invalidate(exc)
        raise _ConnectionLost(describe(exc)) from exc


def _handed_back(run: Run, error: _ConnectionLost, started: float) -> Finished:
    _log.warning(
        "job handed back: its session's connection was lost before the handler ran (%s)",
        error,
        extra=run.log_extra(),
    )
    return Finished(run, HANDED_BACK, perf_counter() - started)


class _NotStored(Exception):
    """Rolls a transactional attempt back: its outcome is not done (a return value
    that cannot be stored)."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome


def complete_in(session: Session, run: Run, outcome: Outcome) -> bool:
    """Run the fenced completion of *run* in *session*'s transaction (with the handler's
    result, if any); False when the lease is gone."""
    lease = run.context.lease
    if outcome.result is None:
        return bool(ops.complete(session, lease, raise_on_lost=False))
    return complete_with_result(session, lease, outcome.result, raise_on_lost=False)


def _settled(run: Run, outcome: Outcome, started: float, completed: bool) -> Finished:
    duration = perf_counter() - started
    if completed:
        return Finished(run, outcome, duration, committed=True, status=JobStatus.DONE)
    return Finished(run, LOST, duration, committed=True, status=None)


def _failed(run: Run, error: BaseException, started: float) -> Finished:
    if isinstance(error, _NotStored):
        return Finished(run, error.outcome, perf_counter() - started)
    return Finished(run, decide(run.handler, run.job, error), perf_counter() - started)


def _call(run: Run, session: Any) -> object:
    handler = run.handler
    if handler is None:  # pragma: no cover - only handled kinds are submitted
        raise RuntimeError(f"no handler for kind {run.job.kind!r}")
    if handler.takes_session:
        return handler.func(run.job.payload, session=session)  # type: ignore[call-arg]
    return handler.func(run.job.payload)


def _judge(run: Run, returned: object) -> Outcome:
    outcome = decide(run.handler, run.job, None, returned)
    if outcome.verdict is not Verdict.DONE:
        raise _NotStored(outcome)
    return outcome


def run_sync(run: Run, sessions: SessionFactory, deadline: float | None = None) -> Finished:
    """Run *run*'s sync handler in a transaction of its own and complete it there; a
    handler that returns past *deadline* (``time.monotonic``) is rolled back as timed
    out."""
    context = run.context
    token = bind(context)
    started = perf_counter()
    try:
        with sessions() as session, session.begin():
            check_connection(session)
            context._set_session(session)
            returned = _call(run, session)
            if deadline is not None and monotonic() >= deadline and run.timeout is not None:
                raise timed_out(run.timeout)
            outcome = _judge(run, returned)
            if not complete_in(session, run, outcome):
                raise _LeaseGone
    except _LeaseGone:
        return _settled(run, LOST, started, completed=False)
    except _ConnectionLost as exc:
        return _handed_back(run, exc, started)
    except BaseException as exc:  # the transaction rolled back; the failure is written later
        return _failed(run, exc, started)
    finally:
        context._set_session(None)
        unbind(token)
    return _settled(run, outcome, started, completed=True)


async def run_async(run: Run, sessions: AsyncSessionFactory) -> Finished:
    """Run *run*'s async handler in a transaction of its own (an ``AsyncSession``) and
    complete it there; the completion is the same sync statement, run through
    ``AsyncSession.run_sync``."""
    context = run.context
    bind(context)  # the task's own copy of the context
    started = perf_counter()
    try:
        async with sessions() as session, session.begin():
            await session.run_sync(check_connection)
            context._set_session(session)
            returned = await bounded(cast(Any, _call(run, session)), run.timeout)
            outcome = _judge(run, returned)
            if not await session.run_sync(complete_in, run, outcome):
                raise _LeaseGone
    except _LeaseGone:
        return _settled(run, LOST, started, completed=False)
    except _ConnectionLost as exc:
        return _handed_back(run, exc, started)
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the worker is closing: its job was handed back
        return _failed(run, exc, started)
    except BaseException as exc:
        return _failed(run, exc, started)
    finally:
        context._set_session(None)
    return _settled(run, outcome, started, completed=True)


class Sessions:
    """The session factories of one worker's transactional handlers.

    Args:
        engine: The worker's Engine.
        registry: Its handlers (which are transactional, sync or async).
        concurrency: The worker's concurrency (each transactional handler holds a
            connection while it runs).
        sessionmaker: The host's ``sessionmaker`` or ``async_sessionmaker``, or None.

    Raises:
        ConfigError: the pool cannot hold a connection per transactional handler, or
            async transactional handlers need what is not installed.
    """

    def __init__(
        self,
        engine: Engine,
        registry: Registry,
        concurrency: int,
        sessionmaker: Any,
        parts: pool.PoolNeeds | None = None,
    ) -> None:
        self.sync: SessionFactory | None = None
        self.async_: AsyncSessionFactory | None = None
        #: The worker's concurrency, lowered to what the pool holds when it was the
        #: default (an explicit one the pool cannot hold is refused).
        self.concurrency = concurrency
        #: The Engine the sync transactional sessions take connections from, if any.
        self.bind: Any = None
        self._async_engine: Any = None
        kinds = [h for h in registry if h.transaction]
        if not kinds:
            return
        given_async = sessionmaker is not None and _is_async_factory(sessionmaker)
        if any(not h.is_async for h in kinds):
            factory = sessionmaker if sessionmaker is not None and not given_async else None
            if factory is None:
                from sqlalchemy.orm import sessionmaker as orm_sessionmaker

                self.sync = orm_sessionmaker(bind=engine)
            else:
                self.sync = factory
            bind = getattr(factory, "kw", {}).get("bind", engine) if factory else engine
            self.bind = bind
            shared = (parts or {}) if bind is engine else {}
            self.concurrency = _fit_pool(bind, concurrency, shared)
        if any(h.is_async for h in kinds):
            if given_async:
                self.async_ = sessionmaker
                async_bind = getattr(sessionmaker, "kw", {}).get("bind")
                inner = getattr(async_bind, "sync_engine", None)
                if inner is not None:  # an AsyncEngine: its pool must hold the handlers,
                    # the default concurrency lowered to fit, as for sync handlers
                    self.concurrency = _fit_pool(inner, self.concurrency, {})
            else:
                self.async_ = self._default_async(engine, self.concurrency)

    def _default_async(self, engine: Engine, concurrency: int) -> AsyncSessionFactory:
        try:
            from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
        except ImportError as exc:
            raise ConfigError(
                f"async transactional handlers need the asyncio extra: {exc}; "
                "pip install 'sqlaq[asyncio]', or pass sessionmaker=async_sessionmaker(...)"
            ) from None
        url = engine.url.set(drivername="postgresql+psycopg_async")
        # A connection per handler running at once (each holds its AsyncSession's).
        self._async_engine = create_async_engine(
            url, pool_pre_ping=True, pool_size=concurrency, max_overflow=0
        )
        return cast(AsyncSessionFactory, async_sessionmaker(self._async_engine))

    def close(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Dispose of the AsyncEngine made here, if any, on *loop* (the one its
        connections were used on: closing them elsewhere fails), waiting a few seconds."""
        engine, self._async_engine = self._async_engine, None
        if engine is None:
            return
        if loop is not None and loop.is_running() and not loop.is_closed():
            future = asyncio.run_coroutine_threadsafe(engine.dispose(), loop)
            try:
                future.result(timeout=CLOSE_SECONDS)
            except Exception:
                _log.debug("disposing of the async engine failed", exc_info=True)
            return
        engine.sync_engine.dispose()  # no loop ran a connection: nothing to close there


def _is_async_factory(factory: object) -> bool:
    return type(factory).__name__ == "async_sessionmaker"


def _fit_pool(engine: Any, concurrency: int, parts: pool.PoolNeeds) -> int:
    """*concurrency*, if the engine's pool holds a connection per transactional handler
    plus *parts* (the worker's own, when they share the engine); the default
    concurrency is lowered to fit.

    Raises:
        ConfigError: an explicit concurrency the pool cannot hold.
    """
    capacity = pool.capacity(engine)
    others = sum(parts.values())
    if capacity is None or capacity >= concurrency + others:
        return concurrency
    if concurrency == DEFAULT_CONCURRENCY and capacity > others:
        _log.info(
            "transactional handlers: concurrency %d (the engine's pool holds %d "
            "connections, %d of them the worker's own; pass concurrency= and a larger "
            "pool for more)",
            capacity - others,
            capacity,
            others,
        )
        return capacity - others
    pool.check(engine, {**parts, "transactional handlers": concurrency})
    return concurrency  # pragma: no cover - check raised
