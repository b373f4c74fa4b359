"""Helpers for testing code that enqueues and handles sqlaq jobs.

Everything here runs the real statements on the caller's Connection or Session, inside
the test's own transaction: no in-memory fake, nothing committed, so a test that rolls
back leaves nothing behind. Never imported by sqlaq's runtime modules, and it imports
no test framework (failures raise ``AssertionError``, which pytest reports as usual).

Example (pytest)::

    from sqlaq.testing import assert_enqueued, drain

    def test_signup_sends_welcome_email(session):
        signup(session, email="a@example.com")          # enqueues in the session
        job = assert_enqueued(session, "send_email", payload={"template": "welcome"})
        (result,) = drain(session, registry)           # runs it inline
        assert result.status == "done"
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from time import perf_counter
from typing import Any, TypeVar
from uuid import UUID

from sqlalchemy import Connection, Row
from sqlalchemy.orm import Session

from sqlaq import ops, queries
from sqlaq.context import JobContext, bind, unbind
from sqlaq.drive import Plan, operation, plan_of
from sqlaq.encoding import check_duration
from sqlaq.errors import ConfigError
from sqlaq.lease import Lease
from sqlaq.outcome import decide
from sqlaq.registry import Registry
from sqlaq.schema import JobStatus
from sqlaq.worker import transaction
from sqlaq.worker.run import Finished, Run
from sqlaq.worker.transaction import AsyncSessionFactory, SessionFactory
from sqlaq.worker.writer import write_outcomes

__all__ = [
    "DrainedJob",
    "assert_enqueued",
    "drain",
    "drain_async",
    "enqueued_jobs",
    "travel",
]

T = TypeVar("T")

#: The lease drain's claims hold (nothing else runs in the test's transaction).
DRAIN_LEASE = timedelta(minutes=5)
#: The worker id drain claims with, so the rows it touched are recognisable.
DRAIN_WORKER_ID = UUID("00000000-0000-0000-0000-00000000d1a1")


@dataclass(frozen=True, slots=True)
class DrainedJob:
    """What :func:`drain` did with one job.

    Attributes:
        id: The job.
        kind: Its kind.
        payload: The payload its handler got.
        attempt: The attempt that ran.
        status: What was written: ``done``, ``queued`` (a retry, due after its backoff)
            or ``failed``.
        error: The failure summary written to ``last_error``, if it failed.
        exception: The exception the handler raised, if any, for the test to inspect.
    """

    id: int
    kind: str
    payload: dict[str, Any]
    attempt: int
    status: JobStatus
    error: str | None = None
    exception: BaseException | None = None


def drain(
    conn: ops.Executor,
    registry: Registry,
    *,
    queues: Sequence[str] | None = None,
    max_jobs: int = 1000,
    sessionmaker: SessionFactory | None = None,
    _async_sessions: AsyncSessionFactory | None = None,
) -> list[DrainedJob]:
    """Run every due job inline, one at a time, and write each outcome.

    Claims with the real claim statement, calls the handler (``async`` ones with
    ``asyncio.run``; ``current_job()`` works inside), then completes or fails the job
    with the real statements and the handler's retry policy, all in the caller's
    transaction. It loops until nothing is due. Within one transaction ``now()`` does
    not move, so a job retried with a backoff stays queued and is not run again (move
    the queue's clock with :func:`travel`).

    A transactional handler (a ``session`` parameter, or ``transaction=True``) runs in
    a SAVEPOINT of the test's own transaction, with a ``Session`` on the test's
    connection: the test sees its writes, a handler that raises leaves none, and it can
    never wait on a lock the test holds.

    Args:
        conn: The test's Connection or Session.
        registry: The handlers; a job whose kind has none fails, as at a worker.
        queues: The queues to drain; default every queue with a due job.
        max_jobs: Stop after this many runs (a guard against a handler that keeps
            enqueueing due jobs).
        sessionmaker: Makes the sessions of transactional handlers; default a Session
            on the test's connection that joins its transaction with a SAVEPOINT
            (``join_transaction_mode="create_savepoint"``). Pass your own to keep your
            Session options: bind it to the same connection.

    Returns:
        One :class:`DrainedJob` per run, in the order they ran.
    """
    results: list[DrainedJob] = []
    while len(results) < max_jobs:
        names = list(queues) if queues is not None else _due_queues(conn)
        claimed = [
            job
            for queue in names
            for job in ops.claim(conn, worker_id=DRAIN_WORKER_ID, queue=queue, lease=DRAIN_LEASE)
        ]
        if not claimed:
            break
        connection = conn.connection() if isinstance(conn, Session) else conn
        sessions = sessionmaker or _savepoint_sessions(connection)
        for job in claimed:
            results.append(_run(connection, registry, job, sessions, _async_sessions))
    return results


async def drain_async(
    conn: Any,
    registry: Registry,
    *,
    queues: Sequence[str] | None = None,
    max_jobs: int = 1000,
) -> list[DrainedJob]:
    """:func:`drain` for async tests: on the test's ``AsyncConnection`` or
    ``AsyncSession``, inside its transaction.

    The same drain runs through ``run_sync``; ``async`` handlers are awaited on the
    test's own event loop (not a loop of their own), and an ``async`` transactional
    handler gets an ``AsyncSession`` on the test's connection, in a SAVEPOINT of its
    transaction.
    """
    from sqlalchemy.ext.asyncio import AsyncSession

    async_conn = await conn.connection() if isinstance(conn, AsyncSession) else conn

    def async_sessions() -> Any:
        return AsyncSession(bind=async_conn, join_transaction_mode="create_savepoint")

    def run(sync_conn: Connection) -> list[DrainedJob]:
        return drain(
            sync_conn, registry, queues=queues, max_jobs=max_jobs, _async_sessions=async_sessions
        )

    result: list[DrainedJob] = await async_conn.run_sync(run)
    return result


def _savepoint_sessions(connection: Connection) -> SessionFactory:
    def session() -> Session:
        return Session(bind=connection, join_transaction_mode="create_savepoint")

    return session


def _due_queues(conn: ops.Executor) -> list[str]:
    return list(conn.execute(queries.due_queues_stmt()).scalars())


def _run(
    conn: Connection,
    registry: Registry,
    job: ops.ClaimedJob,
    sessions: SessionFactory,
    async_sessions: AsyncSessionFactory | None,
) -> DrainedJob:
    """Run *job*'s handler, decide its outcome and write it, as a worker would."""
    handler = registry.get(job.kind)

    def renew(context: JobContext, length: timedelta) -> Lease:
        (lease,) = ops.extend_lease(conn, context.lease, length=length)
        return lease

    run = Run.of(job, handler, DRAIN_LEASE, renew)
    if handler is not None and handler.transaction and handler.is_async:
        if async_sessions is None:
            raise ConfigError(
                f"the handler of {job.kind!r} is an async transactional handler: drain it "
                "with sqlaq.testing.drain_async on the test's AsyncConnection or AsyncSession"
            )
        finished = _run_coroutine(transaction.run_async(run, async_sessions))
    elif handler is not None and handler.transaction:
        finished = transaction.run_sync(run, sessions)
    else:
        error: BaseException | None = None
        returned: object = None
        started = perf_counter()
        if handler is not None:
            token = bind(run.context)
            try:
                returned = handler.func(job.payload)
                if inspect.isawaitable(returned):
                    returned = _run_coroutine(_await(returned, run.context))
            except Exception as exc:
                error = exc
            finally:
                unbind(token)
        outcome = decide(handler, job, error, returned)
        finished = Finished(run, outcome, perf_counter() - started)
    outcome = finished.outcome
    if finished.committed:
        status = finished.status
    else:
        # The worker's writer's statements, on the test's connection.
        ((_, _, status),) = write_outcomes(conn, [(finished, outcome)])
    return DrainedJob(
        job.id,
        job.kind,
        job.payload,
        job.attempt,
        status or JobStatus.FAILED,
        outcome.error,
        outcome.exception if outcome.error is not None else None,
    )


def _run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run *coroutine* to its end: on the test's event loop when drain runs inside
    ``run_sync`` (:func:`drain_async`), else on a loop of its own."""
    from sqlalchemy.util.concurrency import await_only, in_greenlet

    if in_greenlet():
        return await_only(coroutine)
    return asyncio.run(coroutine)


async def _await(awaitable: Any, context: JobContext) -> Any:
    token = bind(context)  # current_job() in the handler, whichever loop runs it
    try:
        return await awaitable
    finally:
        unbind(token)


@operation
def travel(by: timedelta) -> Plan[None]:
    """Move the queue's clock forward by *by*, in the test's transaction, without waiting.

    PostgreSQL's ``now()`` is the queue's only clock and does not move within a
    transaction, so instead every time the queue stores moves *by* into the past: due
    times (a retry's backoff, a snooze, a delay, a lease), creation and finish times
    (retention), the start log of rate limits, the last slot of periodic schedules and
    the expiry of ``unique_for`` holds.
    Everything sqlaq compares with ``now()`` then behaves as if *by* had passed; a
    periodic schedule's slots are named after the shifted times.

    Example: ``drain(conn, registry)`` fails a job with a one-hour backoff; then
    ``travel(conn, timedelta(hours=1))`` and ``drain(conn, registry)`` runs it again.

    Raises:
        InvalidJobError: *by* is not a non-negative timedelta of at most 100 years.
    """
    check_duration("by", by)
    for statement in queries.travel_stmts(by=by):
        yield statement, None


@operation
def enqueued_jobs(
    kind: str | None = None,
    *,
    payload: Mapping[str, Any] | None = None,
    queue: str | None = None,
) -> Plan[list[Row[Any]]]:
    """The queued jobs, oldest first, optionally of *kind*, on *queue*, and whose payload
    contains *payload* (JSON containment: those keys with those values).

    Returns:
        Rows of ``sqlaq_jobs`` with every column as an attribute (``row.id``,
        ``row.payload``, ``row.run_at``, ...).
    """
    stmt = queries.enqueued_jobs_stmt(kind=kind, payload=payload, queue=queue)
    return list((yield stmt, None).all())


@operation
def assert_enqueued(
    kind: str,
    *,
    payload: Mapping[str, Any] | None = None,
    queue: str | None = None,
    count: int | None = None,
) -> Plan[Row[Any]]:
    """Assert that a job of *kind* (with a payload containing *payload*) is queued.

    Args:
        kind: The job kind.
        payload: Keys and values the payload must contain (not its whole content).
        queue: The queue it must be on.
        count: Exactly this many such jobs, if given.

    Returns:
        The first (oldest) matching job's row.

    Raises:
        AssertionError: no such job, or not *count* of them; the message lists what is
            queued instead.
    """
    found = yield from plan_of(enqueued_jobs)(kind, payload=payload, queue=queue)
    if found and (count is None or len(found) == count):
        return found[0]
    queued = [(j.kind, j.payload) for j in (yield from plan_of(enqueued_jobs)())][:20]
    wanted = f"{count} " if count is not None else ""
    raise AssertionError(
        f"expected {wanted}queued job(s) of kind {kind!r}"
        + (f" with payload containing {dict(payload)!r}" if payload else "")
        + (f" on queue {queue!r}" if queue else "")
        + f", found {len(found)}; queued jobs: {queued}"
    )
