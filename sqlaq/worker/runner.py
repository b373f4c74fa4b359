"""Running handlers off the worker's thread; no SQL, no scheduling.

This module owns where handler code executes: sync handlers on a set of long-lived
daemon threads fed by one queue (a job costs a queue hand-off, never a thread; how many
threads is :mod:`sqlaq.worker.slots`'s to decide), async
handlers as tasks on one event loop in one daemon thread. Sync handlers of the
process executor go to its pool (:mod:`sqlaq.worker.processes`), whose one thread
sends them to child processes and reports their answers. Each finished handler becomes a
:class:`~sqlaq.worker.run.Finished` value (its outcome decided by
:func:`sqlaq.outcome.decide`, in the thread that ran it) handed back through a callback.
It writes nothing and keeps no state about a run once it is reported.

Threads are daemons on purpose: at shutdown a handler that ignores the grace period is
abandoned (its job was handed back, and its lease is gone, so nothing it returns is
written) instead of keeping the process alive.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from datetime import timedelta
from time import monotonic, perf_counter, thread_time
from typing import TYPE_CHECKING
from uuid import UUID

from sqlaq import tracing
from sqlaq.context import bind, unbind
from sqlaq.outcome import CANCELLED, decide
from sqlaq.worker import transaction
from sqlaq.worker.run import Finished, Run, bounded, timed_out
from sqlaq.worker.slots import Slots

if TYPE_CHECKING:
    from sqlaq.worker.processes import ProcessPool

__all__ = ["Runner"]


class Runner:
    """Executes runs: sync handlers on up to *size* threads (as many as they can use:
    :mod:`sqlaq.worker.slots`), async ones on one loop, at most *size* of either kind at once.

    Runs may be submitted beyond *size* (a worker that prefetches does): they wait, sync
    ones in the threads' queue and async ones in a waiting line on the loop, and start
    as running ones finish, with no round trip through the worker. One gate, shared by
    threads and loop, keeps the handlers running at once at *size* or fewer.

    Args:
        size: The most handlers running at once (the worker's concurrency).
        mixed: Sync and async handlers may run side by side, so sync ones pass the
            gate too. False when all handlers are of one sort: *size* threads are then
            the bound of sync ones, and the gate only counts async ones.
        on_finished: Called with each :class:`~sqlaq.worker.run.Finished` (the run, its
            outcome and duration), from the thread that ran it.
        on_deadline: Called (from a slot thread) when a sync handler with a timeout
            starts, so the worker wakes at its deadline (:meth:`next_deadline`).
        processes: The child processes that run the sync handlers of the process
            executor (their kinds), if any.
        on_finished_many: Called with several :class:`~sqlaq.worker.run.Finished` at
            once (the process executor reports them together); *on_finished* for each
            when not given.
    """

    def __init__(
        self,
        size: int,
        on_finished: Callable[[Finished], None],
        *,
        mixed: bool = True,
        sessions: transaction.SessionFactory | None = None,
        async_sessions: transaction.AsyncSessionFactory | None = None,
        on_deadline: Callable[[], None] | None = None,
        processes: ProcessPool | None = None,
        on_finished_many: Callable[[list[Finished]], None] | None = None,
    ) -> None:
        self._processes = processes
        self._on_finished_many = on_finished_many
        if processes is not None:
            processes.report_to(self._report_many)
        self._sessions = sessions
        self._on_deadline = on_deadline
        self._async_sessions = async_sessions
        self._deadlines: dict[UUID, tuple[float, Run]] = {}  # sync runs with a timeout
        self._deadlines_lock = threading.Lock()
        self._size = size
        self._mixed = mixed
        self._on_finished = on_finished
        self._queue: queue.SimpleQueue[Run | None] = queue.SimpleQueue()
        self._slots = Slots(size, self._serve, self._queued)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._tasks: dict[Run, asyncio.Task[None]] = {}  # running async handlers, by run
        self._waiting: deque[Run] = deque()  # async runs not started; the loop pops them
        self._pumping = False  # the loop's thread is in _pump (read and set there only)
        self._busy_lock = threading.Lock()  # _busy changes in every thread that reports
        self._busy = 0  # runs submitted and not reported: running or waiting to start
        # Guards _running, the gate's count: taken by slot threads and the loop.
        self._running_lock = threading.Lock()
        self._running = 0  # handlers started and not finished, sync and async
        self._gate = threading.Condition()  # sync threads wait on it while the gate is full
        self._waiters = 0
        # Runs taken by a slot thread that waits for a place under the gate: not started,
        # so withdraw() takes them back too (guarded by the gate's lock).
        self._at_gate: set[Run] = set()

    def submit(self, runs: Iterable[Run]) -> None:
        """Start *runs* (or queue them, beyond *size*): sync handlers on the threads
        (started as first needed, up to *size*), async ones on the loop, those of the
        process executor in its pool."""
        coroutines: list[Run] = []
        in_children: list[Run] = []
        blocking = 0
        processes = self._processes
        for run in runs:
            handler = run.handler
            if handler is not None and handler.is_async:
                coroutines.append(run)
            elif processes is not None and handler is not None and processes.runs(handler):
                in_children.append(run)
            else:
                self._queue.put(run)
                blocking += 1
        with self._busy_lock:
            self._busy += blocking + len(coroutines) + len(in_children)
        if in_children and processes is not None:
            processes.submit(in_children)
        self._slots.handed(blocking)
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
        with self._gate:  # their threads see them gone and take the next
            taken += self._at_gate
            self._at_gate.clear()
            self._gate.notify_all()
        blocking = len(taken)
        if self._processes is not None:
            taken += self._processes.withdraw()
        while True:
            try:
                taken.append(self._waiting.popleft())
            except IndexError:
                break
        self._slots.withdrawn(blocking)
        with self._busy_lock:
            self._busy -= len(taken)
        return taken

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop async handlers run on, once there is one."""
        return self._loop

    @property
    def busy(self) -> int:
        """Runs submitted and not yet reported finished (running, or waiting to start):
        the one count of the worker's taken slots."""
        return self._busy

    def _report(self, finished: Finished) -> None:
        """Hand *finished* to the worker, its slot counted free first (the worker may
        refill it at once)."""
        with self._busy_lock:
            self._busy -= 1
        self._on_finished(finished)

    def _report_many(self, finished: list[Finished]) -> None:
        """:meth:`_report` for several runs at once."""
        with self._busy_lock:
            self._busy -= len(finished)
        if self._on_finished_many is not None:
            self._on_finished_many(finished)
            return
        for each in finished:
            self._on_finished(each)

    def cancel(self, run: Run) -> None:
        """*run*'s job was cancelled: an async handler's task is cancelled (it is
        reported as cancelled), a handler in a child process is killed (likewise); a
        sync handler on a thread only sees ``current_job().cancelled``."""
        processes = self._processes
        if processes is not None and run.handler is not None and processes.runs(run.handler):
            processes.cancel(run)
            return
        loop = self._loop
        if run.handler is None or not run.handler.is_async or loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._cancel_task, run)

    def _cancel_task(self, run: Run) -> None:
        task = self._tasks.get(run)
        if task is not None:
            task.cancel()

    def use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run async handlers on *loop*, the host application's (``Worker.run_async``),
        instead of a loop of the runner's own. Call before the first submit."""
        with self._loop_lock:
            self._loop = loop

    def close(self) -> None:
        """Let idle threads exit, cancel running async handlers, stop the loop (only
        the runner's own: a host's loop goes on).

        Threads still running a sync handler are abandoned (they are daemons); child
        processes still running one are killed.
        """
        if self._processes is not None:
            self._processes.close()
        for _ in range(self._slots.close()):
            self._queue.put(None)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        own = self._loop_thread is not None
        loop.call_soon_threadsafe(self._cancel_tasks, own)
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=2.0)

    # -- the gate: at most *size* handlers at once -----------------------------------------

    def _enter(self, run: Run) -> bool:
        """Wait for a place under the gate for *run* (sync threads); False if it was
        withdrawn meanwhile (it never starts). The fast path is one plain lock; the
        condition is used only while the gate is full."""
        with self._running_lock:
            if self._running < self._size:
                self._running += 1
                return True
        with self._gate:
            self._waiters += 1
            self._at_gate.add(run)
            try:
                while run in self._at_gate:
                    with self._running_lock:
                        if self._running < self._size:
                            self._running += 1
                            self._at_gate.discard(run)
                            return True
                    self._gate.wait()
                return False
            finally:
                self._waiters -= 1

    def _leave(self, *, on_loop: bool = False, places: int = 1) -> None:
        """Give *places* under the gate back; start waiting async runs in them.
        *on_loop*: called in the loop's thread, which starts them at once (from another
        thread it is a wake-up of the loop: a write to its self-pipe, and one more
        callback)."""
        with self._running_lock:
            self._running -= places
        if self._waiters:  # a waiter holds the gate until it waits: the notify lands
            with self._gate:
                self._gate.notify(places)
        if self._waiting:
            if on_loop:
                self._pump()
            elif self._loop is not None:
                self._loop.call_soon_threadsafe(self._pump)

    # -- sync handlers -------------------------------------------------------------------

    def _serve(self) -> None:
        get, taken = self._queue.get, self._slots.taken
        if not self._mixed:  # the threads alone keep sync handlers at *size*
            while (run := get()) is not None:
                taken()
                if not self._run_one(run):
                    return
            return
        while (run := get()) is not None:
            taken()
            if not self._enter(run):  # withdrawn: its job is handed back
                self._slots.skipped()
                continue
            try:
                serving = self._run_one(run)
            finally:
                self._leave()
            if not serving:
                return

    def _queued(self) -> bool:
        """Whether sync runs wait in the slot threads' queue."""
        return not self._queue.empty()

    def _run_one(self, run: Run) -> bool:
        """Run *run* and report it; False when this thread ends now, one more than the
        kinds' runs can use (see :meth:`Slots.ended <sqlaq.worker.slots.Slots.ended>`)."""
        span = tracing.span_for(run)  # None without sqlaq[otel]
        kind = run.job.kind
        cpu = thread_time() if self._slots.reads(kind) else None
        started = perf_counter()
        ran = not run.context.cancelled
        if not ran:  # cancelled while it waited: never started
            finished = Finished(run, CANCELLED, 0.0)
        elif run.handler is not None and run.timeout is not None:
            finished = self._run_with_deadline(run, run.timeout)
        elif run.handler is not None and run.handler.transaction:
            finished = transaction.run_sync(run, self._session_factory())
        else:
            finished = self._call_sync(run)
        ended = perf_counter()
        if cpu is not None:
            cpu = thread_time() - cpu
        tracing.end(span, finished.outcome)
        # Before reporting: the worker may refill the slot at once.
        serving = self._slots.ended(kind, started, ended, cpu, ran=ran)
        self._report(finished)
        return serving

    def _call_sync(self, run: Run) -> Finished:
        token = bind(run.context)
        started = perf_counter()
        error: BaseException | None = None
        returned: object = None
        try:
            returned = run.handler.func(run.job.payload) if run.handler else None
            if returned is not None and inspect.isawaitable(returned):
                # A sync callable that returned an awaitable (a wrapped coroutine
                # function): run it on the shared loop rather than a loop of its own.
                loop = self._ensure_loop()
                returned = asyncio.run_coroutine_threadsafe(_awaited(returned), loop).result()
        except BaseException as exc:  # a handler's error never ends the slot thread
            error = exc
        finally:
            unbind(token)
        duration = perf_counter() - started
        return Finished(run, decide(run.handler, run.job, error, returned), duration)

    def _run_with_deadline(self, run: Run, timeout: timedelta) -> Finished:
        """Run a sync handler that has a timeout: its deadline is known to
        :meth:`expired` while it runs (nothing can interrupt the thread), and the worker
        is woken to sleep no longer than it. A handler that returns past its deadline
        (before the worker saw it expire) has timed out all the same."""
        deadline = monotonic() + timeout.total_seconds()
        with self._deadlines_lock:
            self._deadlines[run.token] = (deadline, run)
        if self._on_deadline is not None:
            self._on_deadline()
        try:
            if run.handler is not None and run.handler.transaction:
                finished = transaction.run_sync(run, self._session_factory(), deadline)
            else:
                finished = self._call_sync(run)
        finally:
            with self._deadlines_lock:
                mine = self._deadlines.pop(run.token, None) is not None
        if mine and monotonic() >= deadline and not finished.committed:
            # (a transactional one checked its deadline before its commit)
            outcome = decide(run.handler, run.job, timed_out(timeout))
            return Finished(run, outcome, finished.duration)
        return finished

    def expired(self, now: float) -> list[Run]:
        """The sync runs whose deadline has passed by *now* (each reported once)."""
        if not self._deadlines:
            return []
        with self._deadlines_lock:
            late = [t for t, (deadline, _) in self._deadlines.items() if deadline <= now]
            return [self._deadlines.pop(t)[1] for t in late]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a running sync handler (``time.monotonic``)."""
        if not self._deadlines:
            return None
        with self._deadlines_lock:
            return min((d for d, _ in self._deadlines.values()), default=None)

    def _session_factory(self) -> transaction.SessionFactory:
        if self._sessions is None:  # pragma: no cover - the worker always passes one
            raise RuntimeError("a transactional handler needs a session factory")
        return self._sessions

    def _async_session_factory(self) -> transaction.AsyncSessionFactory:
        if self._async_sessions is None:  # pragma: no cover - the worker passes one
            raise RuntimeError("a transactional async handler needs an async session factory")
        return self._async_sessions

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
        """Start waiting async runs while the gate lets them (in the loop's thread): the
        places for all of them are taken at once, one look at the gate.

        On Python 3.12 and later each handler's task starts eagerly (``eager_start``):
        its first step, up to its first real wait, runs here rather than at the loop's
        next iteration (a wake-up on the loop is 0.02 ms shorter). A handler that ends
        in that step gives its place back here; its places are filled by this loop, not
        by a nested pump (a line of a thousand such handlers would otherwise nest a
        thousand deep)."""
        if self._pumping:
            return
        self._pumping = True
        try:
            self._start_waiting(asyncio.get_running_loop())
        finally:
            self._pumping = False

    def _start_waiting(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting, tasks, run_one = self._waiting, self._tasks, self._run_one_async
        while waiting:
            with self._running_lock:
                starting = min(len(waiting), self._size - self._running)
                if starting <= 0:
                    return
                self._running += starting
            for started in range(starting):
                try:
                    run = waiting.popleft()
                except IndexError:  # withdrawn meanwhile: the places not used go back
                    self._leave(on_loop=True, places=starting - started)
                    return
                task = _start_task(loop, run_one(run))
                if not task.done():  # one that ended in its first step is gone already
                    tasks[run] = task

    async def _run_one_async(self, run: Run) -> None:
        try:
            span = tracing.span_for(run)  # None without sqlaq[otel]
            if run.context.cancelled:  # cancelled while it waited: never started
                self._leave(on_loop=True)
                tracing.end(span, CANCELLED)
                self._report(Finished(run, CANCELLED, 0.0))
                return
            if run.handler is not None and run.handler.transaction:
                started = perf_counter()
                try:
                    finished = await transaction.run_async(run, self._async_session_factory())
                except asyncio.CancelledError:
                    if not run.context.cancelled:
                        raise  # the worker is closing: its job was handed back
                    finished = Finished(run, CANCELLED, perf_counter() - started)
                finally:
                    self._leave(on_loop=True)
                tracing.end(span, finished.outcome)
                self._report(finished)
                return
            # Each task runs in its own copy of the context, so this binding is the task's.
            bind(run.context)
            started = perf_counter()
            error: BaseException | None = None
            returned: object = None
            cancelled = False
            try:
                if run.handler is not None:
                    call: Awaitable[object] = run.handler.func(run.job.payload)  # type: ignore[assignment]
                    timeout = run.timeout
                    returned = await (call if timeout is None else bounded(call, timeout))
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    if not run.context.cancelled:
                        tracing.end(span, None)
                        return  # the worker is closing: its job was handed back
                    cancelled = True  # its job was cancelled (Runner.cancel)
                else:
                    error = exc  # a sub-task's cancellation escaped the handler: a failure
            except BaseException as exc:  # recorded on the job, like a sync handler's
                error = exc
            finally:
                self._leave(on_loop=True)
            duration = perf_counter() - started
            if cancelled:
                finished = Finished.of(run, CANCELLED, duration)
            else:
                finished = Finished.of(run, decide(run.handler, run.job, error, returned), duration)
            tracing.end(span, finished.outcome)
            self._report(finished)
        finally:
            # Out of the running tasks at its end (a done callback would cost the loop
            # one more callback per job).
            self._tasks.pop(run, None)

    def _cancel_tasks(self, stop: bool) -> None:
        loop = asyncio.get_running_loop()
        for task in self._tasks.values():
            task.cancel()
        if not stop:
            return
        pending = list(self._tasks.values())
        if pending:
            done = asyncio.gather(*pending, return_exceptions=True)
            done.add_done_callback(lambda _f: loop.stop())
        else:
            loop.stop()


async def _awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable


def _start_task(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[object, object, None]
) -> asyncio.Task[None]:
    """A task for *coroutine* on *loop* (the running one), started eagerly where Python
    can (3.12 and later: its first step runs now, in the task's own context)."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coroutine, loop=loop, eager_start=True)
    return loop.create_task(coroutine)
