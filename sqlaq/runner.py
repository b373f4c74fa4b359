"""Running handlers off the worker's thread; no SQL, no scheduling.

This module owns where handler code executes: sync handlers on a set of long-lived
daemon threads fed by one queue (a job costs a queue hand-off, never a thread), async
handlers as tasks on one event loop in one daemon thread. It records each run's outcome
(the error text and the retry delay the handler's policy asks for) on the :class:`Run`
and hands the run back through a callback. It must not decide what a job's outcome
means for the table: that is the worker's.

Threads are daemons on purpose: at shutdown a handler that ignores the grace period is
abandoned (its job was handed back, and its lease is gone, so nothing it returns is
written) instead of keeping the process alive.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from time import perf_counter
from typing import Any, cast

from sqlaq.backoff import DEFAULT_BACKOFF
from sqlaq.context import JobContext, LeaseRenewer, bind, unbind
from sqlaq.errors import Snooze
from sqlaq.ops import ClaimedJob
from sqlaq.registry import Handler
from sqlaq.schema import JobStatus

__all__ = ["JobResult", "Run", "Runner", "describe_error"]

_log = logging.getLogger(__name__)

#: Frames of a handler's traceback kept in ``last_error`` (the innermost ones).
TRACEBACK_FRAMES = 8


@dataclass(frozen=True, slots=True)
class JobResult:
    """What became of one run, as a worker's ``on_job_finished`` callback receives it.

    Attributes:
        job_id: The job.
        kind: Its kind.
        queue: Its queue.
        attempt: The attempt that ran.
        status: The status written: done, queued (to be retried) or failed; None when
            the lease was lost and nothing was written.
        error: The failure summary written to ``last_error``, if the attempt failed.
        duration: Seconds the handler ran.
    """

    job_id: int
    kind: str
    queue: str
    attempt: int
    status: JobStatus | None
    error: str | None
    duration: float


@dataclass(eq=False, slots=True)
class Run:
    """One attempt of one job in this process, from claim to written outcome.

    Attributes:
        job: The claimed job.
        handler: Its handler; None when the kind has no handler here.
        context: What ``current_job()`` returns while it runs; holds the current lease.
        error: Set when the attempt failed: the error summary for ``last_error``.
        retry_in: Set with *error* when the policy retries: the delay before the next
            attempt.
        snooze: Set when the handler raised :class:`~sqlaq.Snooze`: the delay.
        duration: Seconds the handler ran.
        lost: The lease was found lost while it ran: its outcome must not be written.
    """

    job: ClaimedJob
    handler: Handler | None
    context: JobContext
    error: str | None = None
    retry_in: timedelta | None = None
    snooze: timedelta | None = None
    duration: float = 0.0
    lost: bool = False

    @classmethod
    def of(
        cls, job: ClaimedJob, handler: Handler | None, lease_length: timedelta, renew: LeaseRenewer
    ) -> Run:
        """A run of the claimed *job*, with the context its handler will see."""
        return cls(job, handler, JobContext.for_job(job, lease_length, renew))

    def result(self, status: JobStatus | None) -> JobResult:
        """This run as a :class:`JobResult`, once *status* was written (None: lost)."""
        job = self.job
        return JobResult(
            job.id, job.kind, job.queue, job.attempt, status, self.error, self.duration
        )

    def log_extra(self, *, finished: bool = False) -> dict[str, Any]:
        """The ``extra`` keys of this run's log lines (with its duration once finished)."""
        job = self.job
        extra: dict[str, Any] = {
            "job_id": job.id,
            "kind": job.kind,
            "attempt": job.attempt,
            "queue": job.queue,
        }
        if finished:
            extra["duration"] = round(self.duration, 6)
        return extra

    def log_outcome(self, log: logging.Logger, status: JobStatus) -> None:
        """Log the written *status* at INFO: one line per state change."""
        extra = self.log_extra(finished=True)
        if status is JobStatus.DONE:
            log.info("job done", extra=extra)
            return
        if status is JobStatus.CANCELLED:
            log.info("job cancelled; its result was not written", extra=extra)
            return
        if self.snooze is not None:
            extra["snooze"] = self.snooze.total_seconds()
            log.info("job snoozed", extra=extra)
            return
        extra["error"] = (self.error or "").partition("\n")[0]
        if status is JobStatus.QUEUED:
            extra["retry_in"] = self.retry_in.total_seconds() if self.retry_in else 0.0
            log.info("job failed, will retry", extra=extra)
        else:
            log.info("job failed", extra=extra)

    def fail(self, error: BaseException) -> None:
        """Record *error* as this attempt's failure, with the policy's retry delay; a
        :class:`~sqlaq.Snooze` is recorded as a snooze, not a failure."""
        if isinstance(error, Snooze):
            self.snooze = error.delay
            return
        self.error = describe_error(error)
        if self.handler is None or self.job.attempt >= self.job.max_attempts:
            return  # no attempts left: the fail statement would not retry anyway
        try:
            self.retry_in = self.handler.retry_in(self.job.attempt, error)
        except Exception:
            # A broken policy must not lose the job: retry on the default backoff.
            _log.exception("retry policy of kind %r raised; using the default", self.job.kind)
            self.retry_in = DEFAULT_BACKOFF(self.job.attempt)


def describe_error(error: BaseException) -> str:
    """``last_error`` for *error*: its ``Type: message`` line first, then the innermost
    frames of its traceback (a summary for operators, not a full log)."""
    head = "".join(traceback.format_exception_only(error)).strip()
    frames = traceback.format_tb(error.__traceback__, limit=-TRACEBACK_FRAMES)
    if not frames:
        return head
    return f"{head}\n\nTraceback (most recent call last):\n{''.join(frames)}".rstrip()


class Runner:
    """Executes runs: sync handlers on up to *size* threads, async ones on one loop, at
    most *size* of either kind at once.

    Runs may be submitted beyond *size* (a worker that prefetches does): they wait, sync
    ones in the threads' queue and async ones in a waiting line on the loop, and start
    as running ones finish, with no round trip through the worker. One gate, shared by
    threads and loop, keeps the handlers running at once at *size* or fewer.

    Args:
        size: The most handlers running at once (the worker's concurrency).
        mixed: Sync and async handlers may run side by side, so sync ones pass the
            gate too. False when all handlers are of one sort: *size* threads are then
            the bound of sync ones, and the gate only counts async ones.
        on_finished: Called with each finished run, from the thread that ran it. The
            run's ``error``, ``retry_in`` and ``duration`` are set before the call.
    """

    def __init__(
        self, size: int, on_finished: Callable[[Run], None], *, mixed: bool = True
    ) -> None:
        self._size = size
        self._mixed = mixed
        self._on_finished = on_finished
        self._queue: queue.SimpleQueue[Run | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: deque[Run] = deque()  # async runs not started; the loop pops them
        self._blocking = 0  # sync runs submitted and not finished
        self._count_lock = threading.Lock()
        self._count = threading.Lock()  # guards _running
        self._running = 0  # handlers started and not finished, sync and async
        self._gate = threading.Condition()  # sync threads wait on it while the gate is full
        self._waiters = 0

    def submit(self, runs: Iterable[Run]) -> None:
        """Start *runs* (or queue them, beyond *size*): sync handlers on the threads
        (started as first needed, up to *size*), async ones on the loop."""
        coroutines: list[Run] = []
        blocking = 0
        for run in runs:
            if run.handler is not None and run.handler.is_async:
                coroutines.append(run)
            else:
                self._queue.put(run)
                blocking += 1
        if blocking:
            with self._count_lock:
                self._blocking += blocking
                wanted = min(self._size, self._blocking)
            self._grow(wanted)
        if coroutines:
            self._waiting.extend(coroutines)
            self._ensure_loop().call_soon_threadsafe(self._pump)

    def withdraw(self) -> list[Run]:
        """Take back every submitted run that has not started (for a stopping worker,
        which hands their jobs back); they will never start."""
        taken: list[Run] = []
        while True:
            try:
                run = self._queue.get_nowait()
            except queue.Empty:
                break
            if run is not None:
                taken.append(run)
        with self._count_lock:
            self._blocking -= len(taken)
        while True:
            try:
                taken.append(self._waiting.popleft())
            except IndexError:
                break
        return taken

    def close(self) -> None:
        """Let idle threads exit, cancel running async handlers, stop the loop.

        Threads still running a sync handler are abandoned (they are daemons).
        """
        for _ in self._threads:
            self._queue.put(None)
        loop = self._loop
        if loop is not None and self._loop_thread is not None:
            loop.call_soon_threadsafe(self._cancel_tasks)
            self._loop_thread.join(timeout=2.0)

    def _grow(self, target: int) -> None:
        while len(self._threads) < target:
            thread = threading.Thread(
                target=self._serve, name=f"sqlaq-slot-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    # -- the gate: at most *size* handlers at once -----------------------------------------

    def _enter(self) -> None:
        """Wait for a place under the gate (sync threads). The fast path is one plain
        lock; the condition is used only while the gate is full."""
        with self._count:
            if self._running < self._size:
                self._running += 1
                return
        with self._gate:
            self._waiters += 1
            try:
                while True:
                    with self._count:
                        if self._running < self._size:
                            self._running += 1
                            return
                    self._gate.wait()
            finally:
                self._waiters -= 1

    def _try_enter(self) -> bool:
        with self._count:
            if self._running >= self._size:
                return False
            self._running += 1
            return True

    def _leave(self) -> None:
        with self._count:
            self._running -= 1
        if self._waiters:  # a waiter holds the gate until it waits: the notify lands
            with self._gate:
                self._gate.notify()
        if self._waiting and self._loop is not None:
            self._loop.call_soon_threadsafe(self._pump)

    # -- sync handlers -------------------------------------------------------------------

    def _serve(self) -> None:
        get = self._queue.get
        if not self._mixed:  # the threads alone keep sync handlers at *size*
            while (run := get()) is not None:
                self._run_one(run)
            return
        while (run := get()) is not None:
            self._enter()
            try:
                self._run_one(run)
            finally:
                self._leave()

    def _run_one(self, run: Run) -> None:
        token = bind(run.context)
        started = perf_counter()
        try:
            if run.handler is None:  # pragma: no cover - the worker never submits these
                raise RuntimeError(f"no handler for kind {run.job.kind!r}")
            if not run.lost:  # a job cancelled while it waited is not started
                result = run.handler.func(run.job.payload)
                if result is not None and inspect.isawaitable(result):
                    # A sync callable that returned an awaitable (a wrapped coroutine
                    # function): run it on the shared loop rather than a loop of its own.
                    future = asyncio.run_coroutine_threadsafe(_awaited(result), self._ensure_loop())
                    future.result()
        except BaseException as exc:  # a handler's error never ends the slot thread
            run.fail(exc)
        finally:
            unbind(token)
        run.duration = perf_counter() - started
        with self._count_lock:  # before reporting: the worker may refill the slot at once
            self._blocking -= 1
        self._on_finished(run)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(
                    target=self._run_loop, args=(self._loop,), name="sqlaq-asyncio", daemon=True
                )
                self._loop_thread.start()
            return self._loop

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _pump(self) -> None:
        """Start waiting async runs while the gate lets them (in the loop's thread)."""
        loop = asyncio.get_running_loop()
        while self._waiting and self._try_enter():
            try:
                run = self._waiting.popleft()
            except IndexError:  # withdrawn meanwhile
                self._leave()
                return
            task = loop.create_task(self._run_one_async(run))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_one_async(self, run: Run) -> None:
        handler = run.handler
        if handler is None:  # pragma: no cover - only handled kinds are submitted
            return
        # Each task runs in its own copy of the context, so this binding is the task's.
        bind(run.context)
        started = perf_counter()
        try:
            if not run.lost:  # a job cancelled while it waited is not started
                await cast(Awaitable[object], handler.func(run.job.payload))
        except asyncio.CancelledError:
            return  # cancelled at shutdown, after its job was handed back
        except BaseException as exc:  # recorded on the job, like a sync handler's
            run.fail(exc)
        finally:
            self._leave()
        run.duration = perf_counter() - started
        self._on_finished(run)

    def _cancel_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        for task in self._tasks:
            task.cancel()
        pending = list(self._tasks)
        if pending:
            done = asyncio.gather(*pending, return_exceptions=True)
            done.add_done_callback(lambda _f: loop.stop())
        else:
            loop.stop()


async def _awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable
