"""The worker: one run thread that owns the bookkeeping, and its parts. No SQL.

Each concurrent responsibility is a part with one inbox; the run thread (the caller of
:meth:`Worker.run`) moves values between them and owns every piece of state::

    fetcher      (run thread)   claims due jobs: limited kinds under their locks, then
                                one autocommit claim per due queue  (fetcher.py)
    runner       (slot threads, one event loop)
                                runs handlers; each finished one becomes a Finished
                                value with its Outcome  (runner.py, sqlaq.outcome);
                                how many slot threads  (slots.py)
    outbox       (run thread)   outcomes waiting for the writer, the batch in flight;
                                settles each written batch  (outbox.py)
    writer       (its thread)   writes batches of outcomes and lease renewals; a batch
                                the server refuses is written row by row  (writer.py)
    leases       (run thread)   what is held, keyed by run; every lost and
                                cancelled decision; the heartbeat  (leases.py)
    listener     (run thread; a thread of its own only to connect)
                                LISTEN: new jobs, cancels of running ones  (listener.py)
    maintenance  (its thread)   periodic jobs; the leader's sweep and retention

A turn: collect finished runs and notifications, settle the batch the writer wrote,
hand it the next one (outcomes, and leases when the heartbeat is due), claim for the
free slots, start what was claimed. A no-op job costs a share of two statements and
two commits, never a round trip of its own. When the database is away the failed step
is retried after a backoff; finished outcomes wait in memory and are written when it is
back, fenced by lease (a job claimed again meanwhile is left alone and the run is
logged as lost).

It must not configure logging, read the environment, or install signal handlers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from time import monotonic
from typing import TYPE_CHECKING, Any
from uuid import UUID, uuid4

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy import exc as sa_exc

from sqlaq import ops, queries
from sqlaq.config import WorkerConfig, check_options
from sqlaq.dsn import ASYNC_DRIVERS, SYNC_DRIVER, sync_url
from sqlaq.errors import ConfigError, SchemaOutOfDateError
from sqlaq.queries import ClaimPosition

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from sqlaq.worker.processes import ProcessPool
from sqlaq.maintenance import Maintenance, direct_engine
from sqlaq.outcome import Outcome, Verdict, decide
from sqlaq.registry import Registry
from sqlaq.schema import CANCEL_CHANNEL, CHANNEL, RELEASE_CHANNEL
from sqlaq.transient import DATABASE_BACKOFF, describe, is_transient
from sqlaq.worker import pool
from sqlaq.worker.fetcher import Fetcher, parse_wake
from sqlaq.worker.leases import Leases
from sqlaq.worker.listener import Listener, Waker, connection_params
from sqlaq.worker.outbox import Outbox
from sqlaq.worker.pacing import Pace
from sqlaq.worker.run import Finished, JobResult, Run, in_a_process, timed_out
from sqlaq.worker.runner import Runner
from sqlaq.worker.startup import schema_mismatch, start_check
from sqlaq.worker.transaction import Sessions
from sqlaq.worker.vacuum import DrainVacuum
from sqlaq.worker.writer import Writer, Written

__all__ = ["FINAL_WRITE_SECONDS", "LISTENER_APPLICATION_NAME", "WORKER_APPLICATION_NAME", "Worker"]

#: How long a worker's check of a waiting job (on ``sqlaq_release``) waits for the
#: other parents finishing in flight (``lock_timeout``): their completions commit in
#: milliseconds; one held open longer is left to the leader's sweep.
RELEASE_WAIT = "5s"

_log = logging.getLogger("sqlaq.worker")

#: After the grace period, how long to keep trying to write outcomes and hand jobs back.
FINAL_WRITE_SECONDS = 5.0
#: The ``application_name`` of a worker's connections (``pg_stat_activity`` shows it).
WORKER_APPLICATION_NAME = "sqlaq-worker"
#: The ``application_name`` of a worker's LISTEN connection.
LISTENER_APPLICATION_NAME = "sqlaq-listener"


class Worker:
    """Runs the handlers of *registry* for the due jobs of the configured queues.

    Args:
        engine: The queue's database: an Engine, or an ``AsyncEngine`` (the worker then
            makes an Engine of its own on the same URL with the sync psycopg driver,
            disposed when it stops: its bookkeeping runs in threads). While
            :meth:`run` runs, each part holds connections of its pool (its claims,
            its writer, the maintenance leader's lock and rounds, the drain vacuum:
            counted in :mod:`sqlaq.worker.pool`; an engine whose pool cannot hold
            them all is refused), plus one per handler calling
            ``current_job().extend_lease()``, plus a LISTEN connection of its own made
            from the engine's URL (or from ``listen_url``).
        registry: The handlers.
        config: The options; or pass them as keywords (``concurrency=8``), which
            override *config*'s.
        on_job_finished: Called with a :class:`JobResult` after each outcome is written
            (or found lost), in the thread running :meth:`run`; keep it quick.
        on_job_started: Called with each :class:`~sqlaq.ClaimedJob` as it is handed to
            its handler, in the thread running :meth:`run`; keep it quick.
        sessionmaker: What makes the session of a transactional handler's transaction
            (a ``sessionmaker``, or an ``async_sessionmaker`` for ``async`` ones), so
            the host's own options apply. Default: ``sessionmaker(bind=engine)``, and
            for async handlers an ``async_sessionmaker`` on an AsyncEngine the worker
            makes on the same URL (the ``asyncio`` extra). Each transactional handler
            holds one connection while it runs: the engine's pool must hold the
            worker's concurrency plus its own parts' connections
            (:mod:`sqlaq.worker.pool`). A pool too small for the worker's own parts
            is refused at start.

    Attributes:
        worker_id: This worker's id, written to ``locked_by`` of the jobs it claims.
        started: Set once :meth:`run` is looking for jobs.
        idle: Set while nothing runs and the last look found nothing due.
        stopped: Set when :meth:`run` has returned.

    Raises:
        ConfigError: an option is unknown or unusable, or the engine's pool cannot hold
            the connections of the worker's parts (the message names each).

    Starting (:meth:`run`, :meth:`run_async`, ``async with``) first checks the database,
    whichever way the worker runs (:mod:`sqlaq.worker.startup`): its schema must be at
    this sqlaq's head and its role must hold the privileges a worker needs, or the start
    fails with :class:`~sqlaq.errors.SchemaOutOfDateError` or
    :class:`~sqlaq.errors.ConfigError`; a database that is unavailable (restarting) is
    retried for ``start_timeout``, then :class:`~sqlaq.errors.DatabaseUnavailableError`.
    If the schema changes under a running worker (a downgrade), it logs one line, stops
    gracefully and raises :class:`~sqlaq.errors.SchemaOutOfDateError`.
    """

    def __init__(
        self,
        engine: Engine | AsyncEngine,
        registry: Registry,
        config: WorkerConfig | None = None,
        *,
        on_job_finished: Callable[[JobResult], None] | None = None,
        on_job_started: Callable[[ops.ClaimedJob], None] | None = None,
        sessionmaker: Any = None,
        **options: Any,
    ) -> None:
        if options or config is None:
            check_options(options, also=_KEYWORDS)
            config = WorkerConfig.from_options(config, **options)
        # Before anything is started: a handler that cannot reach a child is refused.
        self._processes = _process_pool(registry, config)
        self.config = config
        self._own_engine = not isinstance(engine, Engine)
        engine = sync_engine(engine, pool.sized(config, registry))
        self.worker_id: UUID = uuid4()
        self.started = threading.Event()
        self.idle = threading.Event()
        self.stopped = threading.Event()
        self._engine = engine
        self._registry = registry
        self._on_job_finished = on_job_finished
        self._on_job_started = on_job_started
        # An outcome, a written batch, a notification, a stop; the LISTEN socket beside it.
        self._wake = Waker()
        self._stopping = threading.Event()
        self._interrupt = threading.Event()  # cuts a database backoff short
        self._forced = False
        # Inboxes filled by other threads (deque.append is atomic).
        self._finished: deque[Finished] = deque()  # the runner's
        # The listener's: queues with the position of their new jobs, if known (None:
        # every queue, anywhere).
        self._woken: deque[tuple[str, ClaimPosition | None] | None] = deque()
        self._cancels: deque[int] = deque()  # the listener's: job ids
        self._releases: deque[int] = deque()  # the listener's: waiting jobs to check
        self._db_failures = 0
        self._fetcher = Fetcher(
            engine,
            registry,
            config,
            self.worker_id,
            self._back_off,
            self._recovered,
            found=self._found_behind,
        )
        self._writer = Writer(engine, self._wake.set)
        #: Vacuums the jobs table during deep drains (None with ``vacuum`` off).
        self.vacuum = DrainVacuum(engine) if config.vacuum else None
        sorts = {h.is_async for h in registry}
        parts = pool.needs(config)
        self._sessions = Sessions(engine, registry, config.concurrency, sessionmaker, parts)
        if self._sessions.concurrency != config.concurrency:  # the default, fitted to the pool
            config = self.config = replace(config, concurrency=self._sessions.concurrency)
        if not self._own_engine:  # its own parts must never wait on each other
            pool.check(engine, parts)
        self._runner = Runner(
            config.concurrency,
            self._handler_finished,
            mixed=len(sorts) > 1,
            sessions=self._sessions.sync,
            async_sessions=self._sessions.async_,
            on_deadline=self._wake.set,
            processes=self._processes,
            on_finished_many=self._handlers_finished,
        )
        lengths = [config.lease, *(h.lease for h in registry if h.lease is not None)]
        self._leases = Leases(engine, lengths, on_cancelled=self._runner.cancel)
        self._outbox = Outbox(
            self._writer, self._leases, on_job_finished, self._back_off, self._recovered
        )
        # prefetch None ("auto"): the pace decides, from what the worker observes; not
        # when every handler is limited (limited kinds are never claimed ahead, and a
        # claim of the others would find none, every turn).
        auto = config.prefetch is None and any(not h.limited for h in registry)
        self._pace = Pace(config.concurrency, monotonic()) if auto else None
        self._prefetch = config.prefetch or 0  # jobs claimed ahead of free slots, now
        self._listener: Listener | None = None
        self._maintenance: Maintenance | None = None
        self._task: asyncio.Task[None] | None = None  # run_async's, under async with

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up."""
        return self._listener is not None and self._listener.listening.is_set()

    def run(self) -> None:
        """Run until :meth:`stop` (or, with ``burst``, until nothing is due). Blocks.

        On stop: claim nothing more, let running jobs finish within the grace period,
        write their outcomes, then hand the rest back to the queue.

        Raises:
            SchemaOutOfDateError: at start, or once the schema changed under the worker
                (after a graceful stop).
            ConfigError: at start, the role lacks privileges or ``listen_url`` reaches
                another database.
            DatabaseUnavailableError: at start, the database stayed unavailable for
                ``start_timeout``.
        """
        changed: SchemaOutOfDateError | None = None
        try:
            config = self.config
            if not start_check(
                self._engine,
                listen_url=config.listen_url,
                start_timeout=config.start_timeout,
                interrupted=self._stopping,
            ):
                return  # stopped while the database was away: never started
            self._start()
            while not self._stopping.is_set():
                try:
                    self._step(claiming=True)
                except _DATABASE_ERRORS as exc:
                    changed = self._schema_changed(exc)
                    if changed is None:
                        raise
                    break
                if config.burst and self._quiet() and not self._release_left():
                    break
                self._sleep()
            self._shutdown(changed)
        finally:
            self._close()
            self.stopped.set()
        if changed is not None:
            raise changed

    def _schema_changed(self, error: Exception) -> SchemaOutOfDateError | None:
        """If *error*, which no wait cures, comes from the schema having changed under
        the worker (``alembic downgrade``), say so in one line and stop; else None."""
        if is_transient(error):
            return None
        mismatch = schema_mismatch(self._engine)
        if mismatch is not None:
            _log.error(
                "the database schema changed under the worker (%s): stopping; %s",
                describe(
                    error.__cause__ or error if isinstance(error, SchemaOutOfDateError) else error
                ),
                mismatch,
            )
            self._stopping.set()
        return mismatch

    async def run_async(self) -> None:
        """:meth:`run` inside an asyncio application: ``async`` handlers run on the
        calling event loop (the app's), sync handlers on the worker's threads, and the
        worker's own bookkeeping in a thread of its own, so the loop is never blocked.

        Cancelling the awaiting task (an app's lifespan ending) stops the worker
        gracefully: running jobs get the grace period, then the rest is handed back;
        the cancellation is re-raised once the worker has stopped.
        """
        self._runner.use_loop(asyncio.get_running_loop())
        thread = asyncio.ensure_future(asyncio.to_thread(self.run))
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            self.stop()
            try:
                await asyncio.shield(thread)
            except asyncio.CancelledError:
                # Cancelled again (a second Ctrl-C): hand running jobs back at once.
                _log.warning("worker cancelled again: handing running jobs back now")
                self.stop(now=True)
                await thread
            raise

    async def __aenter__(self) -> Worker:
        """Start :meth:`run_async` as a task of the running loop (e.g. in a FastAPI
        lifespan: ``async with sqlaq.Worker(engine, registry):``); return once the
        worker is looking for jobs."""
        self._task = asyncio.create_task(self.run_async(), name="sqlaq-worker")
        await asyncio.to_thread(self._wait_started)
        if self._task.done():
            self._task.result()  # raises what stopped it
        return self

    def _wait_started(self) -> None:
        while not (self.started.wait(0.05) or self.stopped.is_set()):
            pass

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop gracefully (the grace period applies) and wait until stopped."""
        self.stop()
        if self._task is not None:
            await self._task

    def stop(self, *, now: bool = False) -> None:
        """Ask :meth:`run` to stop; safe from any thread, not from a signal handler
        (setting an event takes a lock the interrupted code may hold: a signal handler
        should only set a flag or write to a pipe, as ``sqlaq-worker`` does).

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
        self._fetcher.check_where()  # a where the table refuses: ConfigError, nothing started
        self._wake.open()
        _log.info(
            "worker started",
            extra={"worker_id": str(self.worker_id), "queues": list(config.queues)},
        )
        if config.listen and not config.burst:
            direct = config.listen_url  # PostgreSQL itself when the engine goes via PgBouncer
            engine = direct_engine(direct, LISTENER_APPLICATION_NAME) if direct else self._engine
            params = connection_params(engine, LISTENER_APPLICATION_NAME)
            statement = queries.listen_stmt(channel=(CHANNEL, CANCEL_CHANNEL, RELEASE_CHANNEL))
            self._listener = Listener(params, statement, self._notified, self._wake.set)
            self._listener.start()
        if not config.burst:  # with maintenance off, it keeps the heartbeat row only
            self._maintenance = Maintenance(
                self._engine,
                self._registry.periodics,
                config,
                str(self.worker_id),
                worker_id=self.worker_id,
            )
            self._maintenance.start()
        self._writer.start()
        if self._processes is not None:  # its children ready before the first claim
            self._processes.start()
        self.started.set()

    def _step(self, *, claiming: bool) -> None:
        """One turn: settle what the writer wrote, hand it the next batch, claim."""
        self._wake.clear()  # before looking, so an event after the look is not missed
        if self._listener is not None:
            self._listener.read()  # notifications: into _woken and _cancels
        self._collect()
        self._outbox.turn()
        # No claim while the writer has no connection: its jobs could sit until their
        # leases ran out; the prefetched ones go back for another worker to take.
        if claiming and not self._writer.connected:
            self._withdraw()
            claiming = False
        room = self._room() if claiming else 0
        if room > 0:
            held = self._runner.busy
            free = self.config.concurrency - held
            pace = self._pace
            started = monotonic() if pace is not None else 0.0
            claimed = self._fetcher.fetch(room, free, self._stopping.is_set)
            if pace is not None:
                pace.claimed(room, len(claimed), started=started, ended=monotonic(), held=held)
                self._prefetch = pace.prefetch
            if claimed:
                if self.vacuum is not None:
                    self.vacuum.claimed(len(claimed))
                self._dispatch(claimed)
        self._update_idle()

    def _room(self) -> int:
        """How many jobs to claim now: the free slots, plus the prefetch to refill.

        A prefetching worker whose slots are all busy tops its prefetch up only once
        half of it is used: one claim of many instead of a claim per freed slot (each
        claim costs about a millisecond of the GIL, whatever its size). Nothing is
        claimed while outcomes waiting for the writer reach twice the capacity (the
        concurrency plus the prefetch: the jobs held in hand at most). With ``prefetch``
        left to auto, the prefetch is the pace's (:mod:`sqlaq.worker.pacing`), updated
        after each claim.
        """
        busy, concurrency, prefetch = self._runner.busy, self.config.concurrency, self._prefetch
        capacity = concurrency + prefetch
        room = capacity - busy
        if busy >= concurrency and room < max(1, prefetch // 2):
            return 0
        # Back-pressure: while the writer lags (a slow database), finished outcomes pile
        # up in memory with their leases held; stop claiming until it catches up.
        if len(self._outbox) >= 2 * capacity:
            return 0
        return room

    def _collect(self) -> None:
        """Take in what other threads reported: finished runs, notifications, cancels."""
        while self._woken:
            woken = self._woken.popleft()
            if woken is None:  # the listener (re)connected: what it missed is looked up
                self._fetcher.woken(self.config.queues)  # new jobs: a full claim at once
                self._leases.renew_soon()  # cancels of held jobs: a renewal at once
            else:
                self._fetcher.notified(*woken)
        while self._cancels:
            self._leases.cancelled(self._cancels.popleft())
        if self._releases:
            self._release()
        leases = self._leases
        committed: list[Written] = []
        if self._pace is not None and self._finished:
            self._pace.finished(len(self._finished), monotonic())
        while self._finished:
            finished = self._finished.popleft()
            run = finished.run
            self._fetcher.finished(run.job.kind, run.job.queue)
            if leases.late(run):  # timed out: its outcome was written at the deadline
                _log.info("late result of a timed-out attempt dropped", extra=run.log_extra())
                continue
            if finished.committed:  # a transactional handler's transaction wrote it
                committed.append((finished, finished.outcome, finished.status))
                continue
            # The lease bookkeeping has the last word: a run whose lease is gone writes
            # nothing, whatever its handler did.
            self._outbox.add(finished, leases.verdict(run) or finished.outcome)
        if committed:
            self._outbox.settle(committed)
        for run in self._runner.expired(monotonic()):
            self._time_out(run)

    def _release(self) -> None:
        """Check again, after their parent's commit, the waiting jobs a finishing parent
        named: the check waits for the other parents finishing in flight (up to
        RELEASE_WAIT), then sees every delete, so one check releases each job (see
        :func:`sqlaq.release_waiting`). A failure is left to the leader's sweep."""
        ids = list(dict.fromkeys(self._releases))
        self._releases.clear()
        try:
            with self._engine.begin() as conn:
                # The wait is for completions in flight (milliseconds); a parent
                # finishing in a transaction held open longer is left to the sweep.
                conn.execute(queries.set_setting_stmt(name="lock_timeout", value=RELEASE_WAIT))
                ops.release_waiting(conn, job_ids=ids)
        except Exception as exc:
            _log.warning("could not release waiting jobs (the sweep will): %s", describe(exc))

    def _release_left(self) -> bool:
        """A burst worker with nothing due: release the waiting jobs whose parents have
        all finished (it has neither a listener nor the leader's sweep), and go on if
        there were any, or if it wrote outcomes since its last look: the completion of
        a parent releases its children in its own commit (the trigger), after the
        claim that found nothing due."""
        wrote, self._outbox.wrote = self._outbox.wrote, False
        try:
            with self._engine.begin() as conn:
                released = ops.release_waiting(conn)
        except Exception as exc:
            _log.warning("could not release waiting jobs: %s", describe(exc))
            return False
        if released or wrote:
            self._fetcher.woken(self.config.queues)
        return bool(released) or wrote

    def _time_out(self, run: Run) -> None:
        """*run*, a sync handler, is past its deadline and cannot be interrupted: write
        its attempt as timed out now, due again no sooner than its lease length (so
        another worker takes it only once the lease it held has run out); its slot
        stays taken until the thread returns, and what it returns then is dropped."""
        if self._leases.verdict(run) is not None or run.handler is None:
            return  # its lease is gone already: nothing to write
        timeout = run.timeout or timedelta(0)
        outcome = decide(run.handler, run.job, timed_out(timeout))
        if outcome.verdict is Verdict.RETRY:
            delay = max(outcome.delay or timedelta(0), run.context.lease_length)
            outcome = replace(outcome, delay=delay)
        self._leases.timed_out(run)
        _log.warning("job timed out; its thread runs on", extra=run.log_extra())
        self._outbox.add(Finished(run, outcome, timeout.total_seconds()), outcome)

    def _dispatch(self, claimed: list[ops.ClaimedJob]) -> None:
        """Hold claimed jobs and hand them to the runner; a kind without a handler
        fails at once."""
        runs: list[Run] = []
        log = _log.isEnabledFor(logging.DEBUG)
        get_handler = self._registry.get
        default_lease = self.config.lease
        renew = self._leases.renew_now
        for job in claimed:
            handler = get_handler(job.kind)
            length = (handler.lease if handler else None) or default_lease
            run = Run.of(job, handler, length, renew)
            self._leases.hold(run)
            if log:
                _log.debug("job started", extra=run.log_extra())
            if self._on_job_started is not None:
                try:
                    self._on_job_started(job)
                except Exception:
                    _log.exception("on_job_started callback raised")
            if handler is None:
                kinds = ", ".join(map(repr, self._registry.kinds)) or "none"
                outcome = Outcome(
                    Verdict.FAILED,
                    error=f"no handler for kind {job.kind!r} in this worker (it has: {kinds})",
                )
                self._outbox.add(Finished(run, outcome, 0.0), outcome)
            else:
                runs.append(run)
        if runs:
            self._runner.submit(runs)

    # -- waiting -------------------------------------------------------------------

    def _sleep(self, until: float | None = None) -> None:
        """Wait for something to do: an outcome, a written batch, a notification, a
        stop, or a timer (the next poll while a slot is free, the next heartbeat while
        leases are held and the writer is free)."""
        if self._finished or self._woken or self._cancels or self._releases:
            return
        if self._outbox.ready:
            return  # a batch to settle, or outcomes for a free writer: at once
        claimable = self._room() > 0 and not self._stopping.is_set() and self._writer.connected
        if claimable and self._fetcher.due:
            return  # more may be due and there is room: claim again at once
        deadlines = [] if until is None else [until]
        if claimable:
            deadlines.append(self._fetcher.next_wake())
        expiry = self._runner.next_deadline()
        if expiry is not None:
            deadlines.append(expiry)
        if self._leases and not self._outbox.writing:
            deadlines.append(self._leases.next_renewal())  # (a busy writer wakes us)
        timeout = max(0.0, min(deadlines) - monotonic()) if deadlines else None
        listener = self._listener
        self._wake.wait(timeout, listener.fileno() if listener is not None else None)

    def _quiet(self) -> bool:
        return not (
            self._fetcher.due
            or self._leases
            or self._finished
            or self._woken
            or self._outbox.writing
            or self._fetcher.blocked
            or not self._writer.connected
        )

    def _update_idle(self) -> None:
        if self._quiet():
            self.idle.set()
        else:
            self.idle.clear()

    def _handlers_finished(self, finished: list[Finished]) -> None:
        # From the process executor's thread: several at once, then one wake-up (a
        # wake-up per run would have this thread collect and write them one by one).
        self._finished.extend(finished)
        self._wake.set()

    def _handler_finished(self, finished: Finished) -> None:
        self._finished.append(finished)  # from a handler's thread; deque.append is atomic
        # Waker.set writes to its socket only if the flag is clear: once per turn of the
        # run thread, not per job. Safe, as the run thread clears the flag before it
        # collects: if it is still set here, its collect will see this run.
        self._wake.set()

    def _found_behind(self, queue: str, position: ClaimPosition) -> None:
        # From the fetcher's look behind its bounds (its own thread): a due job there,
        # taken in as a NOTIFY that says where (deque.append is atomic).
        self._woken.append((queue, position))
        self._wake.set()

    def _notified(self, channel: str | None, payload: str | None) -> None:
        # From Listener.read, on this thread, right before _collect; (None, None) from
        # the listener's thread after it (re)connected, which then wakes this one.
        if channel == CANCEL_CHANNEL:
            if payload and payload.isdigit():
                self._cancels.append(int(payload))
        elif channel == RELEASE_CHANNEL:
            if payload and payload.isdigit():
                self._releases.append(int(payload))
        elif payload is None:
            self._woken.append(None)
        else:
            woken = parse_wake(payload, self.config.queues)
            if woken is not None:
                self._woken.append(woken)

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

    def _shutdown(self, changed: SchemaOutOfDateError | None = None) -> None:
        """Claim nothing more; let running jobs finish within the grace period, then
        write what finished and hand the rest back.

        With the schema *changed* under the worker, a statement that fails for it is
        logged, not raised: what is not written runs again once its lease ends."""
        if changed is None:
            self._drain()
            return
        try:
            self._drain()
        except _DATABASE_ERRORS as exc:
            if is_transient(exc):
                raise
            _log.error(
                "could not write every outcome on the changed schema (%s); those jobs run "
                "again once their leases end",
                describe(exc),
            )

    def _drain(self) -> None:
        self._interrupt.clear()
        if self._forced:
            self._interrupt.set()
        if self._listener is not None:
            self._listener.stop(timeout=0)
        if self._maintenance is not None:
            self._maintenance.stop(timeout=0)
        deadline = monotonic() + self.config.grace_period.total_seconds()
        self._withdraw(stopping=True)  # prefetched jobs that have not started go back
        if self._runner.busy:
            _log.info("worker stopping: waiting for %d running job(s)", self._runner.busy)
        while True:
            self._step(claiming=False)  # writes what finished; keeps leases renewed
            if not self._runner.busy or self._forced or monotonic() >= deadline:
                break
            self._sleep(deadline)
        # The batch in flight, written or failed. A writer stuck longer than that (a
        # hung connection) is left behind: its runs are neither written nor handed back
        # here, and their jobs run again once their leases end (at least once).
        self._outbox.settle_batch(timeout=FINAL_WRITE_SECONDS)
        self._final_write()

    def _final_write(self) -> None:
        """One transaction: write finished outcomes and hand back running jobs (status
        queued, due now, attempt refunded). Retried for a few seconds; once if forced.
        A batch the server refuses is left to the writer's row-by-row path."""
        deadline = monotonic() + (0 if self._forced else FINAL_WRITE_SECONDS)
        while True:
            self._collect()
            outbox = self._outbox
            if not outbox.writing and outbox.waiting:
                outbox.hand_to_writer()  # the writer's path: row by row if refused
                if not outbox.settle_batch(timeout=FINAL_WRITE_SECONDS):
                    return  # the writer is stuck: the leases will end
            running = outbox.renewable()
            if not (running or outbox.waiting):
                return
            if self._hand_back(running, final=True) or monotonic() >= deadline:
                return

    def _withdraw(self, *, stopping: bool = False) -> None:
        """Hand the prefetched jobs (not started) back; if that fails, a running worker
        runs them after all, a stopping one hands them back at the end."""
        withdrawn = self._runner.withdraw()
        if withdrawn and not self._hand_back(withdrawn, final=False) and not stopping:
            self._runner.submit(withdrawn)

    def _hand_back(self, runs: list[Run], *, final: bool) -> bool:
        """Hand *runs* back to the queue (status queued, due now, attempt refunded);
        True once done. On a transient error they stay held, to be handed back later
        (a final hand-back backs off first)."""
        if not runs:
            return True
        try:  # on the claim connection: the writer may have none
            handed = set(self._fetcher.hand_back([r.context.lease for r in runs]))
        except Exception as exc:
            if not is_transient(exc):
                _log.error("could not hand back %d job(s): %s", len(runs), describe(exc))
                return True
            if final:
                self._back_off(exc)
            else:
                _log.warning("could not hand back prefetched jobs yet: %s", describe(exc))
            return False
        for run in runs:
            self._leases.handed_back(run)
            if run.job.id in handed:
                _log.info("job handed back", extra=run.log_extra())
        return True

    def _close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        if self._maintenance is not None:
            self._maintenance.stop()
        self._writer.close()  # it closes its connection on the way out
        self._fetcher.stop()
        self._sessions.close(self._runner.loop)  # on the loop its connections know
        self._runner.close()
        self._wake.close()
        if self._own_engine:
            self._engine.dispose()
        if self.started.is_set():
            _log.info("worker stopped", extra={"worker_id": str(self.worker_id)})


#: A statement's failure: the driver's, or sqlaq's translation of a missing table or
#: column (:func:`sqlaq.drive.schema_error`).
_DATABASE_ERRORS = (sa_exc.DBAPIError, psycopg.Error, SchemaOutOfDateError)


def _process_pool(registry: Registry, config: WorkerConfig) -> ProcessPool | None:
    """The process executor's pool of a worker (:func:`sqlaq.worker.processes.for_worker`);
    None, without importing it (nor ``multiprocessing``), when no handler runs in a
    child process."""
    if not any(in_a_process(h, config.executor) for h in registry):
        return None
    from sqlaq.worker import processes

    return processes.for_worker(registry, config)


#: The Worker's keyword arguments besides its options (for the did-you-mean of an
#: unknown one).
_KEYWORDS = ("config", "on_job_finished", "on_job_started", "sessionmaker")


def sync_engine(engine: object, pool_size: tuple[int, int] = (5, 10)) -> Engine:
    """*engine* if it is an Engine; for an AsyncEngine, a new Engine on its URL with the
    sync psycopg driver (the worker's threads need blocking connections), its pool
    *pool_size* (``pool_size``, ``max_overflow``).

    Raises:
        ConfigError: *engine* is neither, or its driver has no sync counterpart here.
    """
    if isinstance(engine, Engine):
        return engine
    # An AsyncEngine wraps an Engine; recognised without importing sqlalchemy.ext.asyncio
    # (which needs greenlet, an extra a sync application does not install).
    inner = getattr(engine, "sync_engine", None)
    if not isinstance(inner, Engine):
        raise ConfigError(
            f"sqlaq.Worker needs a SQLAlchemy Engine or AsyncEngine, got {type(engine).__name__}"
        )
    url = inner.url
    if url.drivername not in ASYNC_DRIVERS:
        raise ConfigError(
            f"sqlaq.Worker cannot use the async driver {url.drivername!r}; "
            "use postgresql+psycopg_async:// or postgresql+asyncpg://"
        )
    _log.info("worker connects with %s (sync) to the AsyncEngine's database", SYNC_DRIVER)
    size, overflow = pool_size
    return create_engine(sync_url(url), pool_pre_ping=True, pool_size=size, max_overflow=overflow)
