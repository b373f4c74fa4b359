"""Job results: a handler's return value stored with its job, read back, and waited for.

This module owns the ``result`` and ``awaited`` columns' operations (revision
``sqlaq_0003``):

* :func:`encode_result` turns a handler's return value into JSON text, or refuses it
  with a message naming what is wrong (the worker fails the job with that message);
* :func:`complete_with_result` is the fenced completion that also stores it;
* :func:`result` reads a job's outcome on the caller's connection;
* :func:`wait` blocks until a job finishes, woken by a notification rather than by
  polling: it LISTENs on ``sqlaq_finished`` on a connection of its own, marks the job
  ``awaited`` (only awaited jobs notify: the finish trigger's ``WHEN`` clause keeps
  every other job's completion free of it), reads the job once (it may have finished
  already), then waits for its id to arrive, reading again every ``poll_interval`` in
  case a notification was lost with the listening connection;
* :func:`waiting` is that wait without its I/O, the steps both :func:`wait` and
  :func:`sqlaq.asyncio.wait` run, each with its own connections.

Like :mod:`sqlaq.ops`, :func:`complete_with_result` and :func:`result` run on the
caller's Connection or Session and never commit. :func:`wait` is the exception by
nature: it must see other transactions' commits and make its own flag visible, so it
works on connections of its own, taken from the engine of what it is given, and
leaves the caller's transaction alone.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias
from uuid import UUID

import psycopg
import tenacity
from sqlalchemy import Connection, Engine

from sqlaq import queries
from sqlaq.bounds import MAX_DURATION
from sqlaq.drive import Plan, operation, run, wrong_kind
from sqlaq.dsn import connection_params
from sqlaq.encoding import check_duration, encode_value
from sqlaq.errors import (
    ConfigError,
    InvalidJobError,
    LeaseLostError,
    SqlaqError,
    one_line,
    shown,
)
from sqlaq.lease import Lease
from sqlaq.ops._citus import DISTRIBUTED, by_queue, tell_waiters
from sqlaq.ops._common import check_job_id, on_first_use
from sqlaq.queries import citus as citus_queries
from sqlaq.schema import FINISH_CHANNEL, FINISHED_STATUSES, JobStatus
from sqlaq.transient import DATABASE_BACKOFF, describe, is_transient

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = [
    "APPLICATION_NAME",
    "DEFAULT_POLL_INTERVAL",
    "JobNotFoundError",
    "JobOutcome",
    "WaitTimeoutError",
    "complete_with_result",
    "encode_result",
    "read_retrying",
    "result",
    "wait",
    "waiting",
]

_log = logging.getLogger(__name__)

#: What :func:`complete_with_result` and :func:`result` run on.
# A string: sqlalchemy.orm is imported for type checkers only (a worker does without it).
Executor: TypeAlias = "Connection | Session"

#: How often :func:`wait` reads the job even without a notification: the bound on how
#: late it notices a finish whose notification was lost (the listening connection
#: dropped and came back).
DEFAULT_POLL_INTERVAL = timedelta(seconds=5)
#: The ``application_name`` of :func:`wait`'s listening connection (unless the URL
#: names one), so it is easy to find in ``pg_stat_activity``.
APPLICATION_NAME = "sqlaq-wait"

_NIL = Lease(0, UUID(int=0), UUID(int=0), 0, datetime.min)
# Built once; each call passes its own values as execution parameters (the rule of hot
# statements in sqlaq.queries).
_COMPLETE_RESULT = queries.complete_result_stmt(lease=_NIL, result_json="null")

_citus_complete_result_stmt = on_first_use(citus_queries.citus_complete_result_stmt)
_OUTCOME = queries.job_outcome_stmt(job_id=0)
_WATCH = queries.watch_job_stmt(job_id=0)


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """What became of a job, as stored: its status, its result or its error.

    Not to be confused with the worker's :class:`~sqlaq.JobResult` (the report of one
    attempt in one worker): this is the job's row, read from the database.

    Attributes:
        job_id: The job.
        status: Its status when read; ``done``, ``failed`` or ``cancelled`` once it
            finished (:attr:`finished`).
        result: The handler's return value, decoded from JSON (a ``dict``, ``list``,
            ``str``, ``int``, ``float`` or ``bool``); None when the handler returned
            None, or the job is not done.
        error: The job's ``last_error``: why its last attempt failed, if one did.
        finished_at: When it finished (database clock), or None while pending.
    """

    job_id: int
    status: JobStatus
    result: Any
    error: str | None
    finished_at: datetime | None

    @property
    def finished(self) -> bool:
        """Whether the job is done, failed or cancelled."""
        return self.status in FINISHED_STATUSES


class JobNotFoundError(SqlaqError, LookupError):
    """No job has this id: it never existed, was pruned, or is not committed yet."""

    def __init__(self, job_id: int, hint: str = "") -> None:
        self.job_id = job_id
        super().__init__(f"no job {job_id}: it does not exist or was pruned{hint}")


class WaitTimeoutError(SqlaqError, TimeoutError):
    """:func:`wait` ran out of time before the job finished (a :class:`TimeoutError`).

    Attributes:
        job_id: The job waited for.
        outcome: The job as last read (still queued or running).
    """

    def __init__(self, outcome: JobOutcome, timeout: timedelta) -> None:
        self.job_id = outcome.job_id
        self.outcome = outcome
        super().__init__(
            f"job {outcome.job_id} did not finish within {timeout}: it is still {outcome.status}"
        )


def encode_result(value: object) -> str | None:
    """A handler's return value as JSON text for :func:`complete_with_result`.

    Returns:
        None for None (no result is stored); else compact JSON text of *value*, which
        may be any JSON value: a dict (any ``Mapping``), list or tuple, str, int, float
        or bool, checked with the payload's rules (no NaN or Infinity, no NUL or lone
        surrogate, at most 500 levels deep, ints of at most 4,300 digits).

    Raises:
        InvalidJobError: *value* cannot be stored; the message names the bad element
            (``result['rows'][3] is a set``) and the fix.
    """
    if value is None:
        return None
    # The worker prefixes the message ("the handler's return value cannot be stored: ")
    # when it writes it to last_error.
    return encode_value(value, "result")


@operation
def complete_with_result(
    lease: Lease, result_json: str, *, raise_on_lost: bool = True
) -> Plan[bool]:
    """Mark the job held by *lease* done and store *result_json* as its result, inside
    the caller's transaction (not committed here).

    Args:
        lease: The claim's lease: nothing is written once it is lost.
        result_json: JSON text, as :func:`encode_result` returns it.
        raise_on_lost: Raise when the lease was lost, rather than return False.

    Returns:
        True when the job was marked done; False when the lease was lost and
        *raise_on_lost* is false.

    Raises:
        LeaseLostError: the lease was lost (the job was claimed again, cancelled or
            finished) and *raise_on_lost* is true; nothing was written.
    """
    if not isinstance(result_json, str):
        raise InvalidJobError(
            f"result_json must be JSON text (a str from encode_result), got "
            f"{type(result_json).__name__}"
        )
    params = queries.complete_result_params(lease=lease, result_json=result_json)
    stmt = _COMPLETE_RESULT
    if citus := (yield DISTRIBUTED):
        (queue,) = by_queue([lease], "complete_with_result")
        stmt, params = _citus_complete_result_stmt(), params | {"b_queue": queue}
    if (row := (yield stmt, params).first()) is not None:
        if citus and row.awaited:
            yield from tell_waiters([row.id])
        return True
    if raise_on_lost:
        raise LeaseLostError([lease.job_id])
    return False


@operation
def result(job_id: int) -> Plan[JobOutcome]:
    """Read job *job_id*'s status, result and error on the caller's connection.

    The job need not have finished: a pending job comes back with its status and no
    result (see :func:`wait` to wait for it).

    Raises:
        JobNotFoundError: no job has this id.
        ConfigError: *job_id* is not a bigint.
    """
    check_job_id(job_id)
    row = (yield _OUTCOME, {"b_id": job_id}).first()
    if row is None:
        raise JobNotFoundError(job_id)
    return _outcome(row)


def wait(
    conn_or_engine: Engine | Connection | Session,
    job_id: int,
    *,
    timeout: timedelta | float,
    poll_interval: timedelta | float = DEFAULT_POLL_INTERVAL,
) -> JobOutcome:
    """Block until job *job_id* is done, failed or cancelled, and return its outcome.

    Woken by a notification, not by polling: a dedicated connection LISTENs on
    ``sqlaq_finished`` before the job is marked ``awaited``, and the job is read once
    after that (it may have finished already) and again whenever its id arrives, or
    every *poll_interval* in case a notification was lost.

    The job must be committed: :func:`wait` works on connections of its own, taken from
    the engine of *conn_or_engine* (a Connection's or Session's is used, their
    transaction untouched). The listening connection is opened from the engine's URL
    (settings given as ``connect_args`` are not seen: put them in the URL) and is
    closed on return, on timeout and on error. In an asyncio application, await
    :func:`sqlaq.asyncio.wait` instead: this one blocks its thread.

    Args:
        conn_or_engine: An Engine, or a Connection or Session bound to one.
        job_id: The job to wait for.
        timeout: How long to wait at most (a timedelta, or seconds).
        poll_interval: How often to read the job without a notification.

    Returns:
        The finished job's :class:`JobOutcome`.

    Raises:
        WaitTimeoutError: the job did not finish in time (a :class:`TimeoutError`);
            its ``outcome`` is the job as last read.
        JobNotFoundError: no job has this id, or it is not committed yet.
        InvalidJobError: *timeout* or *poll_interval* is not a duration of at most 100
            years (zero is allowed for *timeout*: look once).
        sqlalchemy.exc.OperationalError: the database stayed unavailable (refused
            connections, "too many connections", a restart) for all of *timeout*: each
            read is retried until then (:func:`read_retrying`).
    """
    engine = _engine_of(conn_or_engine)
    steps = waiting(job_id, timeout=timeout, poll_interval=poll_interval)
    retrying = read_retrying(timeout)
    with _FinishListener(engine) as listener:
        value: Any = None
        while True:
            try:
                step = steps.send(value)
            except StopIteration as done:
                outcome: JobOutcome = done.value
                return outcome
            if isinstance(step, float):
                value = listener.wait_for(job_id, step)
                continue
            for attempt in tenacity.Retrying(**retrying):
                with attempt, engine.connect() as conn:
                    conn = conn.execution_options(isolation_level=READ_COMMITTED)
                    value = run(conn, step())
                    conn.commit()


#: What :func:`waiting` yields: what makes a plan to run on a connection of the waiter's
#: own (in READ COMMITTED, committed after it; called again for each retry of the read),
#: or how many seconds to listen for the job's id.
WaitStep: TypeAlias = "Callable[[], Plan[JobOutcome]] | float"
#: The isolation of the waiter's reads: each statement sees what committed before it.
READ_COMMITTED = "READ COMMITTED"


def waiting(
    job_id: int, *, timeout: timedelta | float, poll_interval: timedelta | float
) -> Generator[WaitStep, Any, JobOutcome]:
    """How :func:`wait` (and :func:`sqlaq.asyncio.wait`) waits, without its I/O.

    The arguments are checked now, before anything connects; the generator then yields
    the steps: what makes a plan (call it, run the plan, send back its
    :class:`JobOutcome`; a read retried calls it again), or seconds to
    listen (send back anything). It returns the finished outcome, or raises
    :class:`WaitTimeoutError` once *timeout* has passed.

    Raises:
        ConfigError: *job_id* is not a bigint.
        InvalidJobError: *timeout* or *poll_interval* is not a usable duration.
    """
    check_job_id(job_id)
    limit = _duration("timeout", timeout, allow_zero=True)
    every = _duration("poll_interval", poll_interval, allow_zero=False).total_seconds()
    return _waiting(job_id, limit, every)


def _waiting(job_id: int, limit: timedelta, every: float) -> Generator[WaitStep, Any, JobOutcome]:
    deadline = time.monotonic() + limit.total_seconds()
    # The driver listens before this first step: no notification is missed.
    outcome: JobOutcome = yield partial(_watch, job_id)
    while not outcome.finished:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeoutError(outcome, limit)
        yield float(min(every, remaining))
        outcome = yield partial(_read, job_id)
    return outcome


def _outcome(row: Any) -> JobOutcome:
    return JobOutcome(
        job_id=row.id,
        status=JobStatus(row.status),
        result=row.result,
        error=row.last_error,
        finished_at=row.finished_at,
    )


def read_retrying(timeout: timedelta | float) -> dict[str, Any]:
    """How :func:`wait` and :func:`sqlaq.asyncio.wait` retry each read: tenacity's
    arguments (``Retrying(**...)``, ``AsyncRetrying(**...)``). A transient fault
    (:func:`sqlaq.transient.is_transient`: a refused or dropped connection, "too many
    connections") is retried with the worker's backoff for up to *timeout*, each retry
    logged; anything else, or the fault still there after *timeout*, is raised as it is.
    A retried read is harmless: marking a job awaited twice changes nothing."""
    limit = _duration("timeout", timeout, allow_zero=True).total_seconds()
    return {
        "retry": tenacity.retry_if_exception(is_transient),
        "stop": tenacity.stop_after_delay(limit),
        "wait": lambda state: DATABASE_BACKOFF(state.attempt_number).total_seconds(),
        "before_sleep": _log_read_retry,
        "reraise": True,
    }


def _log_read_retry(state: tenacity.RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    _log.warning(
        "wait: database unavailable (attempt %d), reading again in %.2fs: %s",
        state.attempt_number,
        state.next_action.sleep if state.next_action else 0.0,
        describe(error) if error is not None else "",
    )


def _duration(name: str, value: object, *, allow_zero: bool) -> timedelta:
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or abs(value) > MAX_DURATION.total_seconds():
            raise InvalidJobError(
                f"{name} must be at most 100 years ({MAX_DURATION.total_seconds():.0f} s), "
                f"got {shown(value)}"
            )
        value = timedelta(seconds=value)
    return check_duration(name, value, allow_zero=allow_zero)


def _engine_of(target: object) -> Engine:
    error = wrong_kind(target, "wait", __name__, awaited=False, engines=True)
    if error is not None:
        raise error
    orm = sys.modules.get("sqlalchemy.orm")  # no Session exists unless it was imported
    if orm is not None and isinstance(target, orm.Session):
        target = target.get_bind()
    if isinstance(target, Connection):
        return target.engine
    if isinstance(target, Engine):
        return target
    raise ConfigError(
        f"sqlaq.wait() needs an Engine, or a Connection or Session bound to one, got "
        f"{type(target).__name__}"
    )


def _watch(job_id: int) -> Plan[JobOutcome]:
    """Mark the job awaited (if pending and not yet awaited) and read it. Run in READ
    COMMITTED and committed at once: the flag, until committed, locks the row against
    the completion it waits for; and the read after a no-op flag, a statement with a
    snapshot of its own, sees a completion that committed meanwhile."""
    params = {"b_id": job_id}
    row = (yield _WATCH, params).first()
    if row is None:
        row = (yield _OUTCOME, params).first()
    if row is None:
        raise JobNotFoundError(
            job_id, ", or is not committed yet (wait reads on connections of its own)"
        )
    return _outcome(row)


def _read(job_id: int) -> Plan[JobOutcome]:
    row = (yield _OUTCOME, {"b_id": job_id}).first()
    if row is None:  # deleted while we waited (a host's ON DELETE CASCADE, a manual DELETE)
        raise JobNotFoundError(job_id, ", or was deleted while being waited for")
    return _outcome(row)


class _FinishListener:
    """A raw autocommit psycopg connection LISTENing on ``sqlaq_finished``, outside the
    engine's pool (a pooled connection would carry the LISTEN to its next user).

    A lost connection is not an error: :meth:`wait_for` then sleeps instead (the caller
    reads the job after each wait anyway) and reconnects on its next call.
    """

    def __init__(self, engine: Engine) -> None:
        self._params = connection_params(engine, APPLICATION_NAME)
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> _FinishListener:
        self._connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._close()

    def wait_for(self, job_id: int, seconds: float) -> bool:
        """Wait up to *seconds* for *job_id*'s notification; True if it came.

        Returns False at once after reconnecting: what was notified while the
        connection was down is lost, so the caller should read the job now.
        """
        if self._conn is None:
            if self._connect():
                return False
            time.sleep(seconds)  # no listening connection: poll
            return False
        wanted = str(job_id)
        try:
            for notify in self._conn.notifies(timeout=seconds):
                if notify.payload == wanted:
                    return True
        except psycopg.Error as exc:
            _log.warning("wait: listening connection lost, polling: %s", one_line(exc))
            self._close()
        return False

    def _connect(self) -> bool:
        try:
            conn = psycopg.connect(**self._params, autocommit=True)
        except psycopg.Error as exc:
            _log.warning("wait: cannot listen for notifications, polling: %s", one_line(exc))
            return False
        try:
            conn.execute(queries.listen_stmt(channel=FINISH_CHANNEL))
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return True

    def _close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()
