"""The worker's maintenance thread: heartbeat and periodic jobs on every worker, upkeep
on one.

This module owns one daemon thread per worker and what it does each round:

* **The heartbeat, on every worker** (even with maintenance off: then it is all the
  thread does). The worker's row in ``sqlaq_workers`` (host, pid, queues, concurrency)
  is written at start and its ``last_seen_at`` moved once per interval; the row is
  deleted when the thread stops (the worker stops cleanly). ``sqlaq workers`` lists
  the rows and ``sqlaq explain`` reads them (no worker serves a job's queue).
* **Periodic jobs, on every worker.** :func:`sqlaq.periodic.enqueue_periodic` in a short
  transaction of its own; the database makes each slot enqueue once, so every worker may
  try. Rounds are timed to each slot boundary as well as to the interval, so a job is
  enqueued within moments of its slot.
* **Upkeep, on the leader only.** The leader is the worker whose maintenance connection
  holds a session advisory lock (``pg_try_advisory_lock``, see
  :func:`sqlaq.queries.try_lead_stmt`). Every worker tries to take it once per interval;
  the holder keeps it while its connection lives, so when the leader's process dies
  (even by SIGKILL) PostgreSQL ends its session, frees the lock, and the next worker to
  try becomes leader: at most one interval later. The leader, once per interval:
  deletes done and cancelled jobs finished more than ``retain_done`` ago and failed
  jobs more than ``retain_failed`` ago (in batches, each committed on its own), and
  sweeps expired leases (a last attempt fails, others are queued again), so a crashed
  worker's jobs end even in a queue nobody claims from; and deletes the heartbeat rows
  of workers not seen for :data:`STALE_INTERVALS` intervals (killed ones).

The leader runs its upkeep on the very connection that holds the lock: if that
connection is lost, its statements fail and it stops leading before anyone else can
start, so two leaders never work at once. Database errors are logged and retried next
round; the thread never takes the worker down.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from time import monotonic
from typing import TypeVar
from uuid import UUID

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from sqlaq import ops, queries
from sqlaq.config import WorkerConfig
from sqlaq.option import PrepareThreshold
from sqlaq.periodic import Periodic, enqueue_periodic
from sqlaq.schema import JobStatus
from sqlaq.transient import describe, is_transient

__all__ = ["LEADER_APPLICATION_NAME", "Maintenance", "direct_engine"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

#: Rows per retention or sweep statement; each batch commits on its own.
BATCH = 1000
#: At most this many batches of each kind per round, so one round stays short; the rest
#: waits for the next round.
MAX_BATCHES = 100
#: The leader deletes the heartbeat rows of workers not seen for this many intervals.
STALE_INTERVALS = 10
#: How long after a slot boundary the round that enqueues it runs (the database's clock
#: and this host's may differ a little; a round that is early enqueues nothing).
_SLOT_MARGIN = 0.05
#: The leader's connection when it comes from ``listen_url`` (see :func:`direct_engine`).
LEADER_APPLICATION_NAME = "sqlaq-leader"


def direct_engine(url: str, application_name: str) -> Engine:
    """An engine on *url* (a worker's ``listen_url``: PostgreSQL reached directly, not
    through a pooler) with the psycopg driver and no pool: each connection it gives is
    a session of its own, which LISTEN and a session advisory lock need.

    A ``prepare_threshold`` in the URL's query is read as psycopg's connect argument
    (``none``: off), as the commands do; the URL's ``application_name`` wins over
    *application_name*. Connects to nothing until used.
    """
    parsed = make_url(url).set(drivername="postgresql+psycopg")
    args: dict[str, object] = {"connect_timeout": 10, "application_name": application_name}
    threshold = parsed.query.get("prepare_threshold")
    if isinstance(threshold, str):  # checked by WorkerConfig already
        args["prepare_threshold"] = PrepareThreshold().parse(threshold, "prepare_threshold")
        parsed = parsed.difference_update_query(["prepare_threshold"])
    if "application_name" in parsed.query:
        del args["application_name"]
    return create_engine(parsed, poolclass=NullPool, connect_args=args)


class Maintenance:
    """The maintenance thread of one worker (see the module docstring).

    Args:
        engine: The queue's database.
        periodics: The periodic jobs to enqueue.
        config: The worker's options (``maintenance``, ``maintenance_interval``,
            ``retain_done``, ``retain_failed``, ``listen_url``, and ``queues`` and
            ``concurrency`` for the heartbeat row). With ``maintenance`` off, the thread
            keeps the heartbeat only: no periodic jobs, no election.
        name: Who this is, in log lines (the worker's id).
        worker_id: The worker whose heartbeat row to keep; None keeps none.

    Attributes:
        leading: Set while this worker is the leader.
    """

    def __init__(
        self,
        engine: Engine,
        periodics: Sequence[Periodic],
        config: WorkerConfig,
        name: str,
        *,
        worker_id: UUID | None = None,
    ) -> None:
        self._engine = engine
        self._upkeeping = config.maintenance
        self._worker_id = worker_id
        self._heartbeat_stmt = (
            None
            if worker_id is None
            else queries.heartbeat_stmt(
                worker_id=worker_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                queues=config.queues,
                concurrency=config.concurrency,
            )
        )
        self._beating = False  # its row was written (and not deleted since)
        # The leader's lock needs a session that stays on one server connection: with
        # listen_url, a direct one (a pooler in transaction mode would move it).
        self._lead_engine = (
            direct_engine(config.listen_url, LEADER_APPLICATION_NAME)
            if config.listen_url
            else engine
        )
        self._periodics = list(periodics) if config.maintenance else []
        self._interval = config.maintenance_interval.total_seconds()
        self._retain_done = config.retain_done
        self._retain_failed = config.retain_failed
        self._name = name
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqlaq-maintenance", daemon=True)
        self._lead_conn: Connection | None = None
        self._next_upkeep = 0.0
        self.leading = threading.Event()
        #: Rounds completed (for tests and metrics).
        self.rounds = 0

    def start(self) -> None:
        """Start the thread; its first round runs at once."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, giving leadership up (waits up to *timeout* seconds)."""
        self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                wait = self._round()
                self.rounds += 1
                self._stopping.wait(wait)
        finally:
            self._resign()
            self._forget()

    def _round(self) -> float:
        """One round; returns how long to wait before the next."""
        now = None
        if self._periodics:
            now = self._guarded("periodic jobs", self._enqueue_periodic)
        if monotonic() >= self._next_upkeep:
            self._next_upkeep = monotonic() + self._interval
            if self._heartbeat_stmt is not None:
                self._guarded("heartbeat", self._heartbeat)
            if self._upkeeping:
                self._guarded("maintenance", self._upkeep)
        wait = max(0.0, self._next_upkeep - monotonic())
        if now is not None:
            wait = min(wait, self._until_next_slot(now))
        return wait

    def _guarded(self, what: str, step: Callable[[], T]) -> T | None:
        try:
            return step()
        except Exception as exc:
            if is_transient(exc):
                _log.warning(
                    "%s: database unavailable, retrying next round: %s", what, describe(exc)
                )
            else:
                _log.exception("%s failed; retrying next round", what)
            return None

    # -- the heartbeat (every worker) --------------------------------------------------

    def _heartbeat(self) -> None:
        stmt = self._heartbeat_stmt
        if stmt is None:
            return
        with self._engine.begin() as conn:
            conn.execute(stmt)
        self._beating = True

    def _forget(self) -> None:
        """Delete this worker's heartbeat row (the worker stops)."""
        if not self._beating or self._worker_id is None:
            return
        self._beating = False
        try:
            with self._engine.begin() as conn:
                conn.execute(queries.forget_worker_stmt(worker_id=self._worker_id))
        except Exception as exc:
            # The leader deletes it later (STALE_INTERVALS); stopping goes on.
            _log.warning("could not delete the worker's heartbeat row: %s", describe(exc))

    # -- periodic jobs (every worker) ------------------------------------------------

    def _enqueue_periodic(self) -> datetime:
        with self._engine.begin() as conn:
            now: datetime = conn.execute(queries.clock_stmt()).scalar_one()
            enqueued = enqueue_periodic(conn, self._periodics, now=now)
        for job in enqueued:
            _log.info(
                "periodic job enqueued",
                extra={"periodic": job.name, "slot": job.slot.isoformat(), "job_id": job.job_id},
            )
        return now

    def _until_next_slot(self, now: datetime) -> float:
        """Seconds from *now* (database clock) to just after the next slot of any
        periodic job."""
        slots = [p.schedule.next_after(now) for p in self._periodics]
        upcoming = [s for s in slots if s is not None]
        if not upcoming:
            return self._interval
        return max(0.0, (min(upcoming) - now).total_seconds()) + _SLOT_MARGIN

    # -- upkeep (the leader) ------------------------------------------------------------

    def _upkeep(self) -> None:
        conn = self._lead()
        if conn is None:
            return
        try:
            swept = self._in_batches(conn, lambda: ops.sweep(conn, limit=BATCH))
            # Waiting jobs whose parents all finished but no check released (a crash
            # between a parent's commit and its check, a lost notification).
            swept += self._in_batches(conn, lambda: len(ops.release_waiting(conn, limit=BATCH)))
            pruned = self._prune(conn, self._retain_done, {JobStatus.DONE, JobStatus.CANCELLED})
            pruned += self._prune(conn, self._retain_failed, {JobStatus.FAILED})
            stale = timedelta(seconds=STALE_INTERVALS * self._interval)
            gone = conn.execute(queries.prune_workers_stmt(older_than=stale)).all()
            conn.commit()
            # Expired unique_for holds (enqueue takes an expired one over anyway).
            self._in_batches(
                conn, lambda: len(conn.execute(queries.prune_unique_holds_stmt(limit=BATCH)).all())
            )
        except Exception:
            self._resign()  # the lock's connection is suspect: let someone else lead
            raise
        # INFO only when it changed something: an idle queue logs nothing every round.
        _log.log(
            logging.INFO if pruned or swept else logging.DEBUG,
            "maintenance ran",
            extra={"worker_id": self._name, "pruned": pruned, "swept": swept},
        )
        for (worker_id,) in gone:
            _log.info("stale worker row deleted", extra={"stale_worker_id": str(worker_id)})

    def _prune(
        self, conn: Connection, older_than: timedelta | None, statuses: set[JobStatus]
    ) -> int:
        if older_than is None:  # kept for ever
            return 0
        return self._in_batches(
            conn,
            lambda: ops.prune(conn, older_than=older_than, statuses=statuses, limit=BATCH),
        )

    def _in_batches(self, conn: Connection, step: Callable[[], int]) -> int:
        total = 0
        for _ in range(MAX_BATCHES):
            done = step()
            conn.commit()
            total += done
            if done < BATCH:
                break
        return total

    def _lead(self) -> Connection | None:
        """The lock's connection while this worker leads; None while another does."""
        if self._lead_conn is not None:
            return self._lead_conn
        conn = self._lead_engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            leading = bool(conn.execute(queries.try_lead_stmt()).scalar_one())
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        if not leading:
            conn.close()
            return None
        self._lead_conn = conn
        self.leading.set()
        _log.info("maintenance leader elected", extra={"worker_id": self._name})
        return conn

    def _resign(self) -> None:
        """Give leadership up: unlock, and close the connection for good (closing a
        session ends its locks even when the unlock cannot be sent)."""
        conn, self._lead_conn = self._lead_conn, None
        if conn is None:
            return
        self.leading.clear()
        try:
            conn.execute(queries.resign_stmt())
        except Exception:
            _log.debug("could not unlock the leader lock", exc_info=True)
        finally:
            # Never back to the pool holding the lock: discard the connection.
            conn.invalidate()
            conn.close()
        _log.info("maintenance leader stepped down", extra={"worker_id": self._name})
