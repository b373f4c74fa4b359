"""The worker: claims due jobs, runs their handlers, writes their outcomes. No SQL.

This module owns the orchestration of one worker: free slots, fetching, dispatching,
renewing leases, writing outcomes, and shutting down. Statements come from
:mod:`sqlaq.ops`, handlers run in :mod:`sqlaq.runner`, wake-ups come from
:mod:`sqlaq.listener`, and :mod:`sqlaq.transient` says which database errors to wait
out. It must not configure logging, read the environment, or install signal handlers.

The thread that calls :meth:`Worker.run` owns every piece of state and does the
bookkeeping; its database work is split in two, so that claiming never waits for
writing (as River's completer does; bench/RESULTS.md has the before and after)::

    run thread      _fetch: one claim per due queue, limit = free slots (plus the
                    prefetch), each on a connection held in autocommit (a claim is one
                    statement: no BEGIN or COMMIT round trip), then _dispatch the
                    claimed jobs at once; before it, each limited kind is claimed in a
                    short transaction of its own under the kind's lock, for free slots
                    only (ops.claim_limited), and the plain claim skips those kinds
    writer thread   one batch at a time, in one transaction on a second connection:
                    _apply_outcomes (one complete for every success, one fail per
                    failure) and, when due, _extend_leases (one extend for all running
                    jobs not being written)

Two more threads of the worker's own: the listener (:mod:`sqlaq.listener`: new jobs,
and cancels of running ones) and the maintenance thread (:mod:`sqlaq.maintenance`:
periodic jobs, and, on the elected leader, the lease sweep and retention).

The writer only runs statements over the runs it is handed and reports back; the run
thread hands it the next batch once it has settled the last (logs, callbacks, state), so
a no-op job costs a share of two statements and two commits, never a round trip of its
own. When the database is away the failed step is retried after a backoff; finished
outcomes wait in memory and are written when it is back, fenced by lease (a job claimed
again meanwhile is left alone and the run is logged as lost).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from time import monotonic
from typing import Any
from uuid import UUID, uuid4

from sqlalchemy import Connection, Engine

from sqlaq import ops, queries
from sqlaq.config import WorkerConfig
from sqlaq.gates import KindGates
from sqlaq.heartbeat import Heartbeat
from sqlaq.lease import Lease
from sqlaq.listener import Listener, connection_params
from sqlaq.maintenance import Maintenance
from sqlaq.registry import Registry
from sqlaq.runner import JobResult, Run, Runner
from sqlaq.schema import CANCEL_CHANNEL, CHANNEL, JobStatus
from sqlaq.transient import DATABASE_BACKOFF, describe, is_transient

__all__ = ["JobResult", "Worker"]

_log = logging.getLogger(__name__)

#: After the grace period, how long to keep trying to write outcomes and hand jobs back.
FINAL_WRITE_SECONDS = 5.0
WORKER_APPLICATION_NAME = "sqlaq-worker"
LISTENER_APPLICATION_NAME = "sqlaq-listener"

_Written = list[tuple[Run, JobStatus | None]]


@dataclass(eq=False)
class _Batch:
    """What the writer thread writes in one transaction, and what came of it."""

    runs: list[Run]  # finished: their outcomes
    renewing: list[Run] | None  # running: their leases, when the heartbeat is due
    done: threading.Event = field(default_factory=threading.Event)
    written: _Written = field(default_factory=list)
    renewed: dict[int, Lease | None] = field(default_factory=dict)
    error: BaseException | None = None


class Worker:
    """Runs the handlers of *registry* for the due jobs of the configured queues.

    Args:
        engine: The queue's database. While :meth:`run` runs, the worker holds one
            connection (its claims) and uses a second for writing outcomes, plus one per
            handler calling ``current_job().extend_lease()``, plus a LISTEN connection
            of its own made from the engine's URL.
        registry: The handlers.
        config: The options; or pass them as keywords (``concurrency=8``), which
            override *config*'s.
        on_job_finished: Called with a :class:`JobResult` after each outcome is written
            (or found lost), in the thread running :meth:`run`; keep it quick.
        on_job_started: Called with each :class:`~sqlaq.ClaimedJob` as it is handed to
            its handler, in the thread running :meth:`run`; keep it quick.

    Attributes:
        worker_id: This worker's id, written to ``locked_by`` of the jobs it claims.
        started: Set once :meth:`run` is looking for jobs.
        idle: Set while nothing runs and the last look found nothing due.
        stopped: Set when :meth:`run` has returned.

    Raises:
        ConfigError: an option is unknown or unusable.
    """

    def __init__(
        self,
        engine: Engine,
        registry: Registry,
        config: WorkerConfig | None = None,
        *,
        on_job_finished: Callable[[JobResult], None] | None = None,
        on_job_started: Callable[[ops.ClaimedJob], None] | None = None,
        **options: Any,
    ) -> None:
        if options or config is None:
            config = WorkerConfig.from_options(config, **options)
        self.config = config
        self.worker_id: UUID = uuid4()
        self.started = threading.Event()
        self.idle = threading.Event()
        self.stopped = threading.Event()
        self._engine = engine
        self._registry = registry
        self._on_job_finished = on_job_finished
        self._on_job_started = on_job_started
        self._wake = threading.Event()  # an outcome, a written batch, a notification, a stop
        self._stopping = threading.Event()
        self._interrupt = threading.Event()  # cuts a database backoff short
        self._forced = False
        self._finished: deque[Run] = deque()  # appended by handler threads
        self._woken: deque[str | None] = deque()  # appended by the listener thread
        self._cancels: deque[int] = deque()  # job ids; appended by the listener thread
        self._held: dict[int, Run] = {}  # every lease held: running or not yet written
        self._unwritten: list[Run] = []  # finished; not yet handed to the writer
        self._writing: _Batch | None = None  # handed to the writer, not yet settled
        self._batches: deque[_Batch | None] = deque()  # the writer's inbox; None: stop
        self._writer_wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._claim_conn: Connection | None = None  # the run thread's
        self._write_conn: Connection | None = None  # the writer thread's
        self._busy = 0  # handed to the runner, not finished: running or prefetched
        self._due: set[str] = set()  # queues that may have due jobs
        self._turn = 0
        self._next_poll = 0.0
        leases = [config.lease, *(h.lease for h in registry if h.lease is not None)]
        self._heartbeat = Heartbeat(engine, leases)
        self._db_failures = 0
        sorts = {h.is_async for h in registry}
        self._runner = Runner(config.concurrency, self._handler_finished, mixed=len(sorts) > 1)
        self._capacity = config.concurrency + config.prefetch  # jobs held in hand at most
        self._refill = max(1, config.prefetch // 2)
        self._listener: Listener | None = None
        self._maintenance: Maintenance | None = None
        # Limited kinds (a concurrency limit or a rate) are claimed one kind at a time
        # under the kind's lock (ops.claim_limited); the plain claim skips them.
        self._gates = KindGates(registry)

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up."""
        return self._listener is not None and self._listener.listening.is_set()

    def run(self) -> None:
        """Run until :meth:`stop` (or, with ``burst``, until nothing is due). Blocks.

        On stop: claim nothing more, let running jobs finish within the grace period,
        write their outcomes, then hand the rest back to the queue.
        """
        self._start()
        try:
            while not self._stopping.is_set():
                self._step(claiming=True)
                if self.config.burst and self._quiet():
                    break
                self._sleep()
            self._shutdown()
        finally:
            self._close()
            self.stopped.set()

    def stop(self, *, now: bool = False) -> None:
        """Ask :meth:`run` to stop; safe from any thread.

        From a signal handler, only while :meth:`run` runs in another thread (as the
        ``sqlaq-worker`` command does): a handler interrupting :meth:`run` itself could
        wait forever on a lock that :meth:`run` holds.

        Args:
            now: Skip (or cut short) the grace period: hand running jobs back at once.
        """
        self._forced = self._forced or now
        self._stopping.set()
        self._interrupt.set()
        self._wake.set()

    # -- one turn ------------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        _log.info(
            "worker started",
            extra={"worker_id": str(self.worker_id), "queues": list(config.queues)},
        )
        if config.listen and not config.burst:
            params = connection_params(self._engine, LISTENER_APPLICATION_NAME)
            statement = queries.listen_stmt(channel=(CHANNEL, CANCEL_CHANNEL))
            self._listener = Listener(params, statement, self._notified)
            self._listener.start()
        if config.maintenance and not config.burst:
            self._maintenance = Maintenance(
                self._engine, self._registry.periodics, config, str(self.worker_id)
            )
            self._maintenance.start()
        # A daemon, like the handler threads: a writer stuck on a dead connection must
        # not keep the process alive once run() has returned.
        self._writer = threading.Thread(target=self._write_loop, name="sqlaq-writer", daemon=True)
        self._writer.start()
        self.started.set()

    def _step(self, *, claiming: bool) -> None:
        """One turn: settle what the writer wrote, hand it the next batch, claim."""
        self._wake.clear()  # before looking, so an event after the look is not missed
        self._collect()
        if self._writing is not None and self._writing.done.is_set():
            self._settle_batch()
        if self._writing is None:
            self._hand_to_writer()
        room = self._room() if claiming else 0
        if room > 0:
            for queue in self._due_queues():
                room -= self._fetch(queue, room)
                if room <= 0 or self._stopping.is_set():
                    break
        self._update_idle()

    def _room(self) -> int:
        """How many jobs to claim now: the free slots, plus the prefetch to refill.

        A prefetching worker whose slots are all busy tops its prefetch up only once
        half of it is used: one claim of many instead of a claim per freed slot (each
        claim costs about a millisecond of the GIL, whatever its size). Nothing is
        claimed while outcomes waiting for the writer reach twice the capacity.
        """
        busy, concurrency = self._busy, self.config.concurrency
        room = self._capacity - busy
        if busy >= concurrency and room < self._refill:
            return 0
        # Back-pressure: while the writer lags (a slow database), finished outcomes pile
        # up in memory with their leases held; stop claiming until it catches up.
        writing = self._writing
        pending = len(self._unwritten) + (len(writing.runs) if writing is not None else 0)
        if pending >= 2 * self._capacity:
            return 0
        return room

    def _collect(self) -> None:
        while self._finished:
            run = self._finished.popleft()
            self._unwritten.append(run)
            self._busy -= 1
            if self._gates and self._gates.finished(run.job.kind):
                self._due.add(run.job.queue)  # a slot of the kind is free: claim it now
        while self._woken:
            queue = self._woken.popleft()
            self._mark_due(self.config.queues if queue is None else (queue,))
        while self._cancels:
            self._cancelled(self._cancels.popleft())

    def _mark_due(self, queues: tuple[str, ...] | list[str]) -> None:
        self._due.update(queues)
        if self._gates:
            self._gates.woken(queues)

    def _cancelled(self, job_id: int) -> None:
        """A job was cancelled (NOTIFY): if it runs here, its result must not be written
        and its handler may see ``current_job().cancelled``."""
        run = self._held.get(job_id)
        if run is None or run.lost:
            return
        run.lost = True
        run.context._set_cancelled()
        _log.info("job cancelled while running", extra=run.log_extra())

    def _due_queues(self) -> list[str]:
        now = monotonic()
        if now >= self._next_poll:
            self._mark_due(self.config.queues)
            self._next_poll = now + self.config.poll_interval.total_seconds()
        if self._gates.blocked and self._gates.expire(now):
            self._due.update(self.config.queues)  # a rate window moved on, or a poll came
        # Round robin: each turn starts one queue further, so a queue that fills every
        # free slot cannot starve the others.
        queues = self.config.queues
        start = self._turn % len(queues)
        self._turn += 1
        return [q for q in queues[start:] + queues[:start] if q in self._due]

    def _fetch(self, queue: str, room: int) -> int:
        """Claim up to *room* jobs of *queue* and start them; return how many.

        Limited kinds first, each in a transaction of its own under its lock; then the
        other kinds in one statement on a connection in autocommit: it is committed
        when it returns, so its jobs may start at once (and a later queue's failure
        cannot undo it).
        """
        # A limited kind is claimed only for a slot free now: a job of it never waits in
        # memory, so its claim is its start (what its limits count).
        free = min(room, self.config.concurrency - self._busy)
        taken = self._fetch_limited(queue, free) if self._gates and free > 0 else 0
        if taken >= room:
            return taken
        try:
            conn = self._claim_connection()
            jobs = ops.claim(
                conn,
                worker_id=self.worker_id,
                queue=queue,
                limit=room - taken,
                lease=self.config.lease,
                exclude_kinds=self._gates.kinds,
            )
            conn.commit()  # ends SQLAlchemy's own transaction; nothing is sent
        except Exception as exc:
            self._drop_claim_connection()
            if not is_transient(exc):
                raise
            self._back_off(exc)
            return taken
        self._recovered()
        if not jobs:
            self._due.discard(queue)
        self._dispatch(jobs)
        return taken + len(jobs)

    def _fetch_limited(self, queue: str, room: int) -> int:
        """Claim the limited kinds' due jobs of *queue* within their limits."""
        taken = 0
        for handler in self._gates.open(queue, monotonic()):
            kind = handler.kind
            if taken >= room or self._stopping.is_set():
                break
            try:
                with self._engine.begin() as conn:
                    claimed = ops.claim_limited(
                        conn,
                        worker_id=self.worker_id,
                        kind=kind,
                        queue=queue,
                        limit=room - taken,
                        lease=handler.lease or self.config.lease,
                        concurrency=handler.concurrency,
                        rate=handler.rate,
                    )
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._back_off(exc)
                return taken
            self._recovered()
            self._gates.record(
                queue, kind, claimed, room - taken, now=monotonic(), poll=self._next_poll
            )
            self._dispatch(claimed.jobs)
            taken += len(claimed.jobs)
        return taken

    def _claim_connection(self) -> Connection:
        if self._claim_conn is None:
            self._claim_conn = _autocommit(self._engine)
        return self._claim_conn

    def _drop_claim_connection(self) -> None:
        conn, self._claim_conn = self._claim_conn, None
        _close_quietly(conn)

    def _write_connection(self) -> Connection:
        if self._write_conn is None:
            self._write_conn = _autocommit(self._engine)
        return self._write_conn

    def _drop_write_connection(self) -> None:
        conn, self._write_conn = self._write_conn, None
        _close_quietly(conn)

    def _dispatch(self, claimed: list[ops.ClaimedJob]) -> None:
        """Hand claimed jobs to the runner; a kind without a handler fails at once."""
        runs: list[Run] = []
        log = _log.isEnabledFor(logging.INFO)
        get_handler = self._registry.get
        default_lease = self.config.lease
        renew = self._heartbeat.renew_now
        for job in claimed:
            handler = get_handler(job.kind)
            length = (handler.lease if handler else None) or default_lease
            run = Run.of(job, handler, length, renew)
            self._held[job.id] = run
            if log:
                _log.info("job started", extra=run.log_extra())
            if self._on_job_started is not None:
                try:
                    self._on_job_started(job)
                except Exception:
                    _log.exception("on_job_started callback raised")
            if handler is None:
                kinds = ", ".join(map(repr, self._registry.kinds)) or "none"
                run.error = f"no handler for kind {job.kind!r} in this worker (it has: {kinds})"
                self._unwritten.append(run)  # written as failed, without retry, next turn
            else:
                runs.append(run)
        if runs:
            self._busy += len(runs)
            self._runner.submit(runs)

    # -- writing outcomes ------------------------------------------------------------

    def _hand_to_writer(self) -> None:
        """Give the writer the finished outcomes and, if due, the leases to renew."""
        renewing = self._renewing() if self._heartbeat.due() else None
        if not self._unwritten and renewing is None:
            return
        batch = _Batch(self._unwritten, renewing)
        self._unwritten = []
        self._writing = batch
        self._batches.append(batch)
        self._writer_wake.set()

    def _write_loop(self) -> None:
        """The writer thread: write each batch, then wake the run thread. It never
        touches the worker's state: the run thread settles each batch."""
        try:
            while True:
                self._writer_wake.wait()
                self._writer_wake.clear()
                while self._batches:
                    batch = self._batches.popleft()
                    if batch is None:
                        return  # _close: the run thread is done with us
                    try:
                        self._write(batch)
                    except BaseException as exc:  # the run thread decides what it means
                        batch.error = exc
                    batch.done.set()
                    self._wake.set()
        finally:
            self._drop_write_connection()

    def _write(self, batch: _Batch) -> None:
        """Write *batch* in one transaction (in the writer thread).

        The common batch, successes only, is one complete statement: it runs on a
        connection held in autocommit, with no BEGIN or COMMIT round trip. A batch with
        failures or lease renewals takes a transaction of its own, so it is written
        whole or not at all.
        """
        if batch.renewing is None and all(r.error is None and not r.lost for r in batch.runs):
            try:
                conn = self._write_connection()
                batch.written = self._apply_outcomes(conn, batch.runs)
                conn.commit()  # ends SQLAlchemy's own transaction; nothing is sent
            except BaseException:
                self._drop_write_connection()
                raise
            return
        with self._engine.begin() as conn:
            batch.written = self._apply_outcomes(conn, batch.runs)
            batch.renewed = self._extend_leases(conn, batch.renewing)

    def _settle_batch(self, timeout: float | None = 0.0) -> None:
        """Apply what the writer did with the batch in flight (waiting up to *timeout*)."""
        batch = self._writing
        if batch is None or not batch.done.wait(timeout):
            return
        self._writing = None
        if batch.error is not None:
            if not is_transient(batch.error):
                raise batch.error
            self._unwritten[:0] = batch.runs  # written again, in order, once it is back
            self._back_off(batch.error)
            return
        self._recovered()
        self._settle(batch.written)
        if batch.renewing is not None:
            self._heartbeat.apply(batch.renewing, batch.renewed)

    def _apply_outcomes(self, conn: Connection, runs: list[Run]) -> _Written:
        """Write finished outcomes: one complete for every success, one fail per failure.

        A run whose lease was found lost writes nothing; any other lease lost since is
        found by the fence (the statement matches no row) and reported as None.
        """
        written: _Written = []
        successes = [r for r in runs if r.error is None and r.snooze is None and not r.lost]
        if successes:
            leases = [r.context.lease for r in successes]
            done = set(ops.complete(conn, leases, raise_on_lost=False))
            written += [(r, JobStatus.DONE if r.job.id in done else None) for r in successes]
        for run in runs:
            if run.lost:
                # Nothing to write: the job was cancelled, or claimed again elsewhere.
                written.append((run, JobStatus.CANCELLED if run.context.cancelled else None))
            elif run.error is not None:
                lease, error, retry_in = run.context.lease, run.error, run.retry_in
                status = ops.fail(conn, lease, error, retry_in=retry_in, raise_on_lost=False)
                written.append((run, status))
            elif run.snooze is not None:
                snoozed = ops.snooze(conn, run.context.lease, run.snooze, raise_on_lost=False)
                written.append((run, JobStatus.QUEUED if snoozed else None))
        # A job of a concurrency-limited kind ended: its slot is free, and the workers
        # that found the kind full (this one included) are told at once, not at their
        # next poll.
        freed = {r.job.queue for r in runs if r.handler is not None and r.handler.concurrency}
        if freed:
            ops.notify_queues(conn, sorted(freed))
        return written

    def _settle(self, written: _Written) -> None:
        """After commit: forget written runs, log each state change, tell the callback."""
        log = _log.isEnabledFor(logging.INFO)
        held = self._held
        finished = self._on_job_finished
        for run, status in written:
            del held[run.job.id]
            if status is None:
                _log.warning("job result not written: lease lost", extra=run.log_extra())
            elif log:
                run.log_outcome(_log, status)
            if finished is not None:
                try:
                    finished(run.result(status))
                except Exception:
                    _log.exception("on_job_finished callback raised")

    # -- leases --------------------------------------------------------------------

    def _renewing(self) -> list[Run]:
        """Runs whose lease the heartbeat keeps: held, not lost, not being written."""
        writing = {id(r) for r in self._unwritten}
        if self._writing is not None:
            writing.update(id(r) for r in self._writing.runs)
        return [r for r in self._held.values() if not r.lost and id(r) not in writing]

    def _extend_leases(self, conn: Connection, runs: list[Run] | None) -> dict[int, Lease | None]:
        """Renew the leases of *runs* if the heartbeat is due (None: not due)."""
        return {} if runs is None else self._heartbeat.extend(conn, runs)

    # -- waiting -------------------------------------------------------------------

    def _sleep(self, until: float | None = None) -> None:
        """Wait for something to do: an outcome, a written batch, a notification, a
        stop, or a timer (the next poll while a slot is free, the next heartbeat while
        leases are held and the writer is free)."""
        if self._finished or self._woken:
            return
        writing = self._writing
        if writing is None and self._unwritten:
            return  # the writer is free: hand it the outcomes at once
        if writing is not None and writing.done.is_set():
            return
        claimable = self._room() > 0 and not self._stopping.is_set()
        if claimable and self._due:
            return  # more may be due and there is room: claim again at once
        deadlines = [] if until is None else [until]
        if claimable:
            deadlines.append(self._next_poll)
            next_try = self._gates.next_try()
            if next_try is not None:
                deadlines.append(next_try)
        if self._held and writing is None:
            deadlines.append(self._heartbeat.next)  # (a busy writer wakes us when done)
        self._wake.wait(max(0.0, min(deadlines) - monotonic()) if deadlines else None)

    def _quiet(self) -> bool:
        return not (
            self._due
            or self._held
            or self._finished
            or self._woken
            or self._writing
            or self._gates.blocked
        )

    def _update_idle(self) -> None:
        if self._quiet():
            self.idle.set()
        else:
            self.idle.clear()

    def _handler_finished(self, run: Run) -> None:
        self._finished.append(run)  # from a handler's thread; deque.append is atomic
        # Set only if clear: set() takes a lock and is called once per job. Safe, as the
        # run thread clears the event before it collects: if it is still set here, the
        # run thread has yet to clear it, and its collect will see this run.
        if not self._wake.is_set():
            self._wake.set()

    def _notified(self, channel: str | None, payload: str | None) -> None:
        # From the listener's thread: (None, None) after (re)connecting.
        if channel == CANCEL_CHANNEL:
            if payload and payload.isdigit():
                self._cancels.append(int(payload))
                self._wake.set()
        elif payload is None or payload in self.config.queues:
            self._woken.append(payload)
            self._wake.set()

    def _back_off(self, error: BaseException) -> None:
        self._db_failures += 1
        delay = DATABASE_BACKOFF(self._db_failures).total_seconds()
        _log.warning(
            "database unavailable (attempt %d), retrying in %.2fs: %s",
            self._db_failures,
            delay,
            describe(error),
        )
        self._interrupt.wait(delay)

    def _recovered(self) -> None:
        if self._db_failures:
            _log.info("database available again after %d failed attempts", self._db_failures)
            self._db_failures = 0

    # -- stopping ------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Claim nothing more; let running jobs finish within the grace period, then
        write what finished and hand the rest back."""
        self._interrupt.clear()
        if self._forced:
            self._interrupt.set()
        if self._listener is not None:
            self._listener.stop(timeout=0)
        if self._maintenance is not None:
            self._maintenance.stop(timeout=0)
        deadline = monotonic() + self.config.grace_period.total_seconds()
        # Prefetched jobs that have not started go straight back.
        withdrawn = self._runner.withdraw()
        if withdrawn:
            self._busy -= len(withdrawn)
            self._hand_back(withdrawn)
        if self._busy:
            _log.info("worker stopping: waiting for %d running job(s)", self._busy)
        while True:
            self._step(claiming=False)  # writes what finished; keeps leases renewed
            if not self._busy or self._forced or monotonic() >= deadline:
                break
            self._sleep(deadline)
        # The batch in flight, written or failed. A writer stuck longer than that (a
        # hung connection) is left behind: its runs are neither written nor handed back
        # here, and their jobs run again once their leases end (at least once).
        self._settle_batch(timeout=FINAL_WRITE_SECONDS)
        self._final_write()

    def _final_write(self) -> None:
        """One transaction: write finished outcomes and hand back running jobs (status
        queued, due now, attempt refunded). Retried for a few seconds; once if forced."""
        deadline = monotonic() + (0 if self._forced else FINAL_WRITE_SECONDS)
        while True:
            self._collect()
            running = self._renewing()
            if not (running or self._unwritten):
                return
            try:
                with self._engine.begin() as conn:
                    written = self._apply_outcomes(conn, self._unwritten)
                    leases = [r.context.lease for r in running]
                    handed = set(ops.handback(conn, leases, raise_on_lost=False))
            except Exception as exc:
                if not is_transient(exc) or monotonic() >= deadline:
                    _log.error("could not hand back %d job(s): %s", len(running), describe(exc))
                    return
                self._back_off(exc)
                continue
            self._unwritten = []
            self._settle(written)
            for run in running:
                del self._held[run.job.id]
                run.lost = True  # whatever the handler returns now is not written
                if run.job.id in handed:
                    _log.info("job handed back", extra=run.log_extra())
            return

    def _hand_back(self, runs: list[Run]) -> None:
        """Hand *runs* (never started) back at once; on a database error they stay
        held, and :meth:`_final_write` tries again."""
        try:
            with self._engine.begin() as conn:
                leases = [r.context.lease for r in runs]
                handed = set(ops.handback(conn, leases, raise_on_lost=False))
        except Exception as exc:
            if not is_transient(exc):
                raise
            _log.warning("could not hand back prefetched jobs yet: %s", describe(exc))
            return
        for run in runs:
            del self._held[run.job.id]
            run.lost = True
            if run.job.id in handed:
                _log.info("job handed back", extra=run.log_extra())

    def _close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        if self._maintenance is not None:
            self._maintenance.stop()
        if self._writer is not None:
            self._batches.append(None)
            self._writer_wake.set()
            self._writer.join(timeout=2.0)  # it closes its connection on the way out
        self._drop_claim_connection()
        self._runner.close()
        _log.info("worker stopped", extra={"worker_id": str(self.worker_id)})


def _autocommit(engine: Engine) -> Connection:
    """A pooled connection in autocommit, for one-statement transactions."""
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def _close_quietly(conn: Connection | None) -> None:
    """Return *conn* to the pool (which discards it if it was invalidated)."""
    if conn is not None:
        try:
            conn.close()
        except Exception:
            _log.debug("closing a worker connection failed", exc_info=True)
