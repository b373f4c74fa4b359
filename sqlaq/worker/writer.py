"""The writer: a thread that writes finished outcomes and renews leases, in batches.

This module owns how outcomes reach the table. The run thread hands it one
:class:`Batch` at a time (the finished runs, each with the outcome to write, and the
runs whose leases are due for renewal); the writer writes it and sets ``batch.done``.
It never touches the worker's state: the run thread settles each batch.

**Blast radius of one.** A batch is written in one transaction (the common batch,
successes only, in one statement on a connection in autocommit). If that fails for a
reason other than the connection (a value the server refuses, a trigger of the host's
that raises, anything that is not :func:`sqlaq.transient.is_transient`), the batch is
written again row by row, each outcome in a transaction of its own: every outcome that
can be written lands; the one that cannot is written as ``failed`` with a
``last_error`` that names the refusal (:func:`sqlaq.outcome.unwritable`); if even that
is refused, it is left to its lease (it runs again once the lease ends) and logged.
The writer itself never stops for a row, and nothing a row does fails another's
outcome. A connection fault ends the batch with ``batch.error``: the run thread backs
off and hands the unwritten rest again once the database is back.

**One connection, held.** The writer connects when it starts and keeps its connection
(in autocommit; a batch that needs a transaction takes it out of autocommit for its
span): every outcome and every lease renewal goes through it. :attr:`Writer.connected`
tells the run thread whether it may claim: a worker that could not write the outcome of
a job, or renew its lease, must not claim it (a server at ``max_connections``, say: its
claimed jobs would sit until their leases ran out, then run again elsewhere). While it
has no connection the writer tries again after a backoff, and wakes the run thread once
it has one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import Connection, Engine

from sqlaq import ops
from sqlaq.drive import plan_of
from sqlaq.outcome import Outcome, Verdict, unwritable
from sqlaq.results import complete_with_result
from sqlaq.schema import JobStatus
from sqlaq.transient import DATABASE_BACKOFF, describe, is_transient
from sqlaq.worker.leases import Leases, Renewed
from sqlaq.worker.precompiled import Precompiled
from sqlaq.worker.run import Finished, Run

__all__ = ["Batch", "Writer", "Written", "write_outcomes"]

_log = logging.getLogger(__name__)

#: One written outcome: the finished run, the outcome as written, the status it left
#: (None: the lease was lost, nothing written).
Written = tuple[Finished, Outcome, JobStatus | None]

_COMPLETE = plan_of(ops.complete)


@dataclass(eq=False)
class Batch:
    """What the writer writes in one go, and what came of it.

    Attributes:
        items: Finished runs and the outcome to write for each (LOST and CANCELLED
            ones are reported as they are: nothing is written for them).
        renewing: Running runs whose leases are due, or None.
        done: Set once the writer is through with the batch.
        written: The items written (or found lost), in order.
        renewed: What the renewal found (see :class:`~sqlaq.worker.leases.Leases`).
        error: A connection-level fault that stopped the batch; the items not in
            *written* are to be written again.
    """

    items: list[tuple[Finished, Outcome]]
    renewing: list[Run] | None
    done: threading.Event = field(default_factory=threading.Event)
    written: list[Written] = field(default_factory=list)
    renewed: Renewed = field(default_factory=dict)
    error: BaseException | None = None

    def unwritten(self) -> list[tuple[Finished, Outcome]]:
        """The items not written (after a connection fault)."""
        seen = {id(w[0]) for w in self.written}
        return [item for item in self.items if id(item[0]) not in seen]


def write_outcomes(
    conn: Connection,
    items: Sequence[tuple[Finished, Outcome]],
    precompiled: Precompiled | None = None,
) -> list[Written]:
    """Write *items*' outcomes on *conn* (in the caller's transaction): one complete for
    every success, one statement per other outcome, fenced by each run's lease.

    A lease lost since is found by the fence (the statement matches no row) and reported
    with status None. A job of a concurrency-limited or keyed kind that ended wakes the
    workers of its queue (NOTIFY on commit), so the freed slot (or the next job of its
    key) is taken at once. With *precompiled* (*conn* in autocommit) the complete runs
    on the driver's cursor.
    """
    done_verdict = Verdict.DONE
    successes = [i for i in items if i[1].verdict is done_verdict and i[1].result is None]
    written: list[Written] = []
    if successes:
        leases = [f.run.context.lease for f, _ in successes]
        if precompiled is None:
            done = set(ops.complete(conn, leases, raise_on_lost=False))
        else:
            done = set(precompiled.run(conn, _COMPLETE(leases, raise_on_lost=False)))
        status = JobStatus.DONE
        written = [(f, o, status if f.run.job.id in done else None) for f, o in successes]
    if len(successes) < len(items):
        written += _write_others(conn, items)
    freed = {
        f.run.job.queue
        for f, _ in items
        if f.run.handler is not None and (f.run.handler.concurrency or f.run.handler.keyed)
    }
    if freed:
        ops.notify_queues(conn, sorted(freed))
    return written


def _write_others(conn: Connection, items: Sequence[tuple[Finished, Outcome]]) -> list[Written]:
    """Write the outcomes of *items* but the plain successes: one statement each."""
    written: list[Written] = []
    for finished, outcome in items:
        verdict = outcome.verdict
        lease = finished.run.context.lease
        status: JobStatus | None
        if verdict is Verdict.DONE:
            if outcome.result is None:
                continue  # completed with the others
            stored = complete_with_result(conn, lease, outcome.result, raise_on_lost=False)
            status = JobStatus.DONE if stored else None
        elif not outcome.writes:
            status = outcome.status  # lost or cancelled: nothing to write
        elif verdict is Verdict.SNOOZED:
            delay = outcome.delay or timedelta(0)
            snoozed = ops.snooze(conn, lease, delay, raise_on_lost=False)
            status = JobStatus.QUEUED if snoozed else None
        else:
            retry_in = outcome.delay if verdict is Verdict.RETRY else None
            error = outcome.error or ""
            status = ops.fail(conn, lease, error, retry_in=retry_in, raise_on_lost=False)
        written.append((finished, outcome, status))
    return written


class Writer:
    """The writer thread of one worker.

    Args:
        engine: The queue's database.
        on_done: Called (from the writer's thread) after each batch; the run thread's
            wake-up.
    """

    def __init__(self, engine: Engine, on_done: Callable[[], None]) -> None:
        self._engine = engine
        self._on_done = on_done
        self._inbox: deque[Batch | None] = deque()
        self._wake = threading.Event()
        self._conn: Connection | None = None
        self._connected = threading.Event()
        self._connect_failures = 0
        self._precompiled = Precompiled()  # the complete of a batch of successes
        # A daemon, like the handler threads: a writer stuck on a dead connection must
        # not keep the process alive once the worker has returned.
        self._thread = threading.Thread(target=self._loop, name="sqlaq-writer", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    @property
    def connected(self) -> bool:
        """True once the writer holds its connection, until an attempt to get one back
        fails (a lost connection is replaced at once when the server lets it): the
        worker claims only while this holds. Safe from any thread."""
        return self._connected.is_set()

    def submit(self, batch: Batch) -> None:
        """Write *batch* next (from the run thread)."""
        self._inbox.append(batch)
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Stop after the batches handed so far; wait up to *timeout* seconds."""
        self._inbox.append(None)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                retry_in = None
                if self._conn is None and not self._inbox and not self._try_connect():
                    retry_in = DATABASE_BACKOFF(self._connect_failures).total_seconds()
                self._wake.wait(retry_in)
                self._wake.clear()
                while self._inbox:
                    batch = self._inbox.popleft()
                    if batch is None:
                        return
                    try:
                        self._write(batch)
                    except BaseException as exc:  # the run thread decides what it means
                        batch.error = exc
                    batch.done.set()
                    self._on_done()
        finally:
            self._drop_connection()

    def _write(self, batch: Batch) -> None:
        """Write *batch*: whole, or, when the server refuses part of it, row by row."""
        try:
            self._write_whole(batch)
        except Exception as exc:
            if is_transient(exc):
                raise
            _log.warning(
                "writing %d outcome(s) in one transaction failed (%s); writing them one by one",
                len(batch.items),
                describe(exc),
            )
            self._write_each(batch)

    def _write_whole(self, batch: Batch) -> None:
        """One transaction. The common batch, successes only, is one complete statement
        on a connection held in autocommit (no BEGIN or COMMIT round trip), run on the
        driver's cursor (:class:`~sqlaq.worker.precompiled.Precompiled`)."""
        if batch.renewing is None and all(o.verdict is Verdict.DONE for _, o in batch.items):
            try:
                conn = self._connection()
                batch.written = write_outcomes(conn, batch.items, self._precompiled)
                conn.commit()  # ends SQLAlchemy's own transaction; nothing is sent
            except BaseException:
                self._drop_connection()
                raise
            return
        with self._transaction() as conn:
            written = write_outcomes(conn, batch.items)
            renewed = Leases.extend(conn, batch.renewing) if batch.renewing else {}
        batch.written, batch.renewed = written, renewed

    def _write_each(self, batch: Batch) -> None:
        """Each outcome in a transaction of its own; a refused one is written as failed
        with the refusal as its error. Connection faults still end the batch."""
        for item in batch.items:
            batch.written += self._write_one(item)
        if batch.renewing:
            try:
                with self._transaction() as conn:
                    batch.renewed = Leases.extend(conn, batch.renewing)
            except Exception as exc:
                if is_transient(exc):
                    raise
                # Not a verdict on any lease: renew again at the next heartbeat.
                _log.error("renewing leases failed: %s", describe(exc))
                batch.renewing = None

    def _write_one(self, item: tuple[Finished, Outcome]) -> list[Written]:
        finished, outcome = item
        try:
            with self._transaction() as conn:
                return write_outcomes(conn, [item])
        except Exception as exc:
            if is_transient(exc):
                raise
            cause = describe(exc)
        _log.error(
            "job outcome refused by the database; failing the job instead: %s",
            cause,
            extra=finished.run.log_extra(),
        )
        replacement = unwritable(outcome, cause)
        try:
            with self._transaction() as conn:
                return write_outcomes(conn, [(finished, replacement)])
        except Exception as exc:
            if is_transient(exc):
                raise
            _log.error(
                "could not write the job's failure either (%s); it runs again when its lease ends",
                describe(exc),
                extra=finished.run.log_extra(),
            )
            return [(finished, replacement, None)]

    def _try_connect(self) -> bool:
        """Connect if the server lets us; True on success (the run thread is woken: it
        may claim now)."""
        try:
            self._connection()
        except Exception as exc:
            self._connect_failures += 1
            _log.warning(
                "the writer has no connection (attempt %d), retrying in %.2fs;"
                " claiming nothing meanwhile: %s",
                self._connect_failures,
                DATABASE_BACKOFF(self._connect_failures).total_seconds(),
                describe(exc),
            )
            return False
        if self._connect_failures:
            _log.info("the writer has its connection again")
            self._connect_failures = 0
        self._on_done()
        return True

    def _connection(self) -> Connection:
        if self._conn is None:
            try:
                conn = self._engine.connect()
            except BaseException:
                self._connected.clear()  # claim nothing until a connection is had
                raise
            self._conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            self._connected.set()
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """A transaction on the writer's connection, out of autocommit for its span."""
        conn = self._connection()
        conn.execution_options(isolation_level=conn.default_isolation_level)
        try:
            with conn.begin():
                yield conn
        except Exception as exc:
            if is_transient(exc) or conn.invalidated:
                self._drop_connection()
            else:  # a refused statement, rolled back: the connection is fine
                conn.execution_options(isolation_level="AUTOCOMMIT")
            raise
        except BaseException:
            self._drop_connection()
            raise
        conn.execution_options(isolation_level="AUTOCOMMIT")

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                _log.debug("closing the writer's connection failed", exc_info=True)
