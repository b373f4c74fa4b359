"""The worker: claims due jobs, runs their handlers, writes their outcomes. No SQL.

This module owns the orchestration of one worker: free slots, fetching, dispatching,
renewing leases, writing outcomes, and shutting down. Statements come from
:mod:`sqlaq.ops`, handlers run in :mod:`sqlaq.runner`, wake-ups come from
:mod:`sqlaq.listener`, and :mod:`sqlaq.transient` says which database errors to wait
out. It must not configure logging, read the environment, or install signal handlers.

The thread that calls :meth:`Worker.run` does all of the worker's database work, in one
short transaction per turn::

    _apply_outcomes   one complete for every success, one fail per failure
    _extend_leases    when due: one extend for all running jobs (per lease length)
    _fetch            one claim per due queue, round robin, limit = free slots
    commit, then _dispatch the claimed jobs to the runner

so a no-op job costs a share of three statements and one commit, never a round trip of
its own. When the database is away the turn is retried after a backoff; finished
outcomes wait in memory and are written when it is back, fenced by lease (a job
claimed again meanwhile is left alone and the run is logged as lost).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any
from uuid import UUID, uuid4

from sqlalchemy import Connection, Engine

from sqlaq import ops, queries
from sqlaq.config import WorkerConfig
from sqlaq.heartbeat import Heartbeat
from sqlaq.lease import Lease
from sqlaq.listener import Listener, connection_params
from sqlaq.registry import Registry
from sqlaq.runner import JobResult, Run, Runner
from sqlaq.schema import CHANNEL, JobStatus
from sqlaq.transient import DATABASE_BACKOFF, describe, is_transient

__all__ = ["JobResult", "Worker"]

_log = logging.getLogger(__name__)

#: After the grace period, how long to keep trying to write outcomes and hand jobs back.
FINAL_WRITE_SECONDS = 5.0
WORKER_APPLICATION_NAME = "sqlaq-worker"
LISTENER_APPLICATION_NAME = "sqlaq-listener"

_Written = list[tuple[Run, JobStatus | None]]


class Worker:
    """Runs the handlers of *registry* for the due jobs of the configured queues.

    Args:
        engine: The queue's database. The worker uses one connection at a time, plus one
            per handler calling ``current_job().extend_lease()``, plus a LISTEN
            connection of its own made from the engine's URL.
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
        self._wake = threading.Event()  # an outcome, a notification, a stop
        self._stopping = threading.Event()
        self._interrupt = threading.Event()  # cuts a database backoff short
        self._forced = False
        self._finished: deque[Run] = deque()  # appended by handler threads
        self._woken: deque[str | None] = deque()  # appended by the listener thread
        self._held: dict[int, Run] = {}  # every lease held: running or not yet written
        self._unwritten: list[Run] = []  # finished; outcome not yet committed
        self._busy = 0  # handlers running
        self._due: set[str] = set()  # queues that may have due jobs
        self._turn = 0
        self._next_poll = 0.0
        leases = [config.lease, *(h.lease for h in registry if h.lease is not None)]
        self._heartbeat = Heartbeat(engine, leases)
        self._db_failures = 0
        self._runner = Runner(config.concurrency, self._handler_finished)
        self._listener: Listener | None = None

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
            statement = queries.listen_stmt(channel=CHANNEL)
            self._listener = Listener(params, statement, self._notified)
            self._listener.start()
        self.started.set()

    def _step(self, *, claiming: bool) -> None:
        """One turn: write outcomes, renew leases, claim; one transaction."""
        self._wake.clear()  # before looking, so an event after the look is not missed
        self._collect()
        renewing = self._renewing() if self._heartbeat.due() else None
        room = self.config.concurrency - self._busy if claiming else 0
        queues = self._due_queues() if room > 0 else []
        if not (self._unwritten or renewing is not None or queues):
            return
        try:
            with self._engine.begin() as conn:
                written = self._apply_outcomes(conn)
                renewed = self._extend_leases(conn, renewing)
                claimed, empty = self._fetch(conn, queues, room)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._back_off(exc)
            return
        self._recovered()
        # Committed: only now may state change, and claimed jobs start.
        self._settle(written)
        if renewing is not None:
            self._heartbeat.apply(renewing, renewed)
        self._due.difference_update(empty)
        self._dispatch(claimed)
        self._update_idle()

    def _collect(self) -> None:
        while self._finished:
            self._unwritten.append(self._finished.popleft())
            self._busy -= 1
        while self._woken:
            queue = self._woken.popleft()
            self._due.update(self.config.queues if queue is None else (queue,))

    def _due_queues(self) -> list[str]:
        now = monotonic()
        if now >= self._next_poll:
            self._due.update(self.config.queues)
            self._next_poll = now + self.config.poll_interval.total_seconds()
        # Round robin: each turn starts one queue further, so a queue that fills every
        # free slot cannot starve the others.
        queues = self.config.queues
        start = self._turn % len(queues)
        self._turn += 1
        return [q for q in queues[start:] + queues[:start] if q in self._due]

    def _fetch(
        self, conn: Connection, queues: list[str], room: int
    ) -> tuple[list[ops.ClaimedJob], list[str]]:
        """Claim up to *room* jobs, one statement per queue; also name the empty queues."""
        claimed: list[ops.ClaimedJob] = []
        empty: list[str] = []
        for queue in queues:
            if room <= 0:
                break
            jobs = ops.claim(
                conn, worker_id=self.worker_id, queue=queue, limit=room, lease=self.config.lease
            )
            if not jobs:
                empty.append(queue)
            claimed.extend(jobs)
            room -= len(jobs)
        return claimed, empty

    def _dispatch(self, claimed: list[ops.ClaimedJob]) -> None:
        """Hand claimed jobs to the runner; a kind without a handler fails at once."""
        runs: list[Run] = []
        log = _log.isEnabledFor(logging.INFO)
        for job in claimed:
            handler = self._registry.get(job.kind)
            length = (handler.lease if handler else None) or self.config.lease
            run = Run.of(job, handler, length, self._heartbeat.renew_now)
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

    def _apply_outcomes(self, conn: Connection) -> _Written:
        """Write finished outcomes: one complete for every success, one fail per failure.

        A run whose lease was found lost writes nothing; any other lease lost since is
        found by the fence (the statement matches no row) and reported as None.
        """
        written: _Written = []
        successes = [r for r in self._unwritten if r.error is None and not r.lost]
        if successes:
            leases = [r.context.lease for r in successes]
            done = set(ops.complete(conn, leases, raise_on_lost=False))
            written += [(r, JobStatus.DONE if r.job.id in done else None) for r in successes]
        for run in self._unwritten:
            if run.lost:
                written.append((run, None))
            elif run.error is not None:
                lease, error, retry_in = run.context.lease, run.error, run.retry_in
                status = ops.fail(conn, lease, error, retry_in=retry_in, raise_on_lost=False)
                written.append((run, status))
        return written

    def _settle(self, written: _Written) -> None:
        """After commit: forget written runs, log each state change, tell the callback."""
        self._unwritten = []
        log = _log.isEnabledFor(logging.INFO)
        for run, status in written:
            del self._held[run.job.id]
            if status is None:
                _log.warning("job result not written: lease lost", extra=run.log_extra())
            elif log:
                run.log_outcome(_log, status)
            if self._on_job_finished is not None:
                try:
                    self._on_job_finished(run.result(status))
                except Exception:
                    _log.exception("on_job_finished callback raised")

    # -- leases --------------------------------------------------------------------

    def _renewing(self) -> list[Run]:
        """Runs whose lease the heartbeat keeps: held, not lost, not being written."""
        writing = {id(r) for r in self._unwritten}
        return [r for r in self._held.values() if not r.lost and id(r) not in writing]

    def _extend_leases(self, conn: Connection, runs: list[Run] | None) -> dict[int, Lease]:
        """Renew the leases of *runs* if the heartbeat is due (None: not due)."""
        return {} if runs is None else self._heartbeat.extend(conn, runs)

    # -- waiting -------------------------------------------------------------------

    def _sleep(self, until: float | None = None) -> None:
        """Wait for something to do: an outcome, a notification, a stop, or a timer (the
        next poll while a slot is free, the next heartbeat while leases are held)."""
        if self._finished or self._unwritten or self._woken:
            return
        claimable = self._busy < self.config.concurrency and not self._stopping.is_set()
        if claimable and self._due:
            return  # more may be due and there is room: claim again at once
        deadlines = [] if until is None else [until]
        if claimable:
            deadlines.append(self._next_poll)
        if self._held:
            deadlines.append(self._heartbeat.next)
        self._wake.wait(max(0.0, min(deadlines) - monotonic()) if deadlines else None)

    def _quiet(self) -> bool:
        return not (self._due or self._held or self._finished or self._woken)

    def _update_idle(self) -> None:
        if self._quiet():
            self.idle.set()
        else:
            self.idle.clear()

    def _handler_finished(self, run: Run) -> None:
        self._finished.append(run)  # from a handler's thread; deque.append is atomic
        self._wake.set()

    def _notified(self, queue: str | None) -> None:
        if queue is None or queue in self.config.queues:
            self._woken.append(queue)  # from the listener's thread
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
        deadline = monotonic() + self.config.grace_period.total_seconds()
        if self._busy:
            _log.info("worker stopping: waiting for %d running job(s)", self._busy)
        while True:
            self._step(claiming=False)  # writes what finished; keeps leases renewed
            if not self._busy or self._forced or monotonic() >= deadline:
                break
            self._sleep(deadline)
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
                    written = self._apply_outcomes(conn)
                    leases = [r.context.lease for r in running]
                    handed = set(ops.handback(conn, leases, raise_on_lost=False))
            except Exception as exc:
                if not is_transient(exc) or monotonic() >= deadline:
                    _log.error("could not hand back %d job(s): %s", len(running), describe(exc))
                    return
                self._back_off(exc)
                continue
            self._settle(written)
            for run in running:
                del self._held[run.job.id]
                run.lost = True  # whatever the handler returns now is not written
                if run.job.id in handed:
                    _log.info("job handed back", extra=run.log_extra())
            return

    def _close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        self._runner.close()
        _log.info("worker stopped", extra={"worker_id": str(self.worker_id)})
