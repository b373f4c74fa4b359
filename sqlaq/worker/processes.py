"""The process executor: sync handlers in a pool of child processes; no SQL.

A worker whose ``executor`` is ``"process"`` (or a handler registered with
``executor="process"``) runs those sync handlers in child processes it starts itself
(``multiprocessing``'s *spawn*: a fresh interpreter, never a fork of the worker's
threads and connections). Each child runs one job at a time. One thread of the worker,
the pool's dispatcher, sends jobs to the children through a pipe each, waits on every
pipe at once and reports the answers; the rest of the worker (claims, leases, the
writer) is unchanged:

* A child never waits for the worker between two short jobs: a child whose
  last job ran under :data:`PIPELINE_SECONDS` is sent its next job while it runs the
  current one (a small message, waiting in its pipe), and starts it the moment it
  answers. The job's deadline starts then. A job waiting in a pipe that never starts
  (the job before it timed out, or its child died or went over its memory) goes to
  another child; a cancelled one is killed with its child as it starts. Longer jobs go
  to a child only once it is free, so no job waits behind a long one.
* Answers are reported to the worker together, at most :data:`REPORT_SECONDS` after the
  first (at once when no child runs a job): one wake-up of the worker and one write for
  several jobs.

* The child gets the handler by reference: the function pickled as its module and
  qualified name, imported in the child (module-level functions only: the worker
  checks each one when it starts). The child knows nothing of the registry, the
  database or the worker's configuration.
* The job goes over as its payload and the fields of ``current_job()`` (id, kind,
  queue, attempt, max_attempts, attempted_at, the lease as claimed); the answer comes
  back as the returned value or the raised exception (pickled), its ``last_error``
  text (with the traceback, as the thread path records it), and the child's RSS.
  Whatever cannot be pickled fails the job with a message saying so.
* The worker's parent process keeps renewing the lease and writes the outcome, as for
  a thread. ``current_job().extend_lease()`` is refused in a child (a clear
  RuntimeError); ``current_job().cancelled`` stays False there: a cancel kills the
  child instead, its job written cancelled as usual.
* Hard timeouts: at the handler's deadline the child is killed (SIGKILL, to its
  process group: each child makes one, so the processes its handler started die with
  it), the attempt written timed out (retried per the handler's policy) and the slot is
  free at once; the next job gets a new child.
* A child that dies while it runs a job (a signal, a crash in C code, ``os._exit``)
  fails that job with :class:`~sqlaq.errors.HandlerProcessDied` (retried per
  policy); the other children and their jobs go on.
* A child is replaced after ``max_jobs_per_child`` jobs, or after a job that left its
  resident memory above ``max_memory_per_child`` MiB (read by the child itself after
  each job: ``/proc/self/statm`` on Linux, else its peak RSS from ``getrusage``).
* Children ignore SIGINT and SIGTERM (a Ctrl-C or a supervisor's signal to the whole
  process group is the worker's to act on: graceful stop, grace period, hand-back);
  when the worker closes, idle children are told to exit and children still running
  a job (handed back already) are killed.

This module is the dispatcher: which job goes to which child, deadlines, deaths,
replacements, reports. A child itself (the parent's handle on it, the messages both
ends speak, the loop that runs in the child) is :mod:`sqlaq.worker.child`.

Why not a library: ``concurrent.futures.ProcessPoolExecutor`` cannot kill one task,
and a dead child breaks the whole pool; ``pebble`` kills per task and limits tasks per
child, but has no memory ceiling and keeps a thread of its own per task. A child per
pipe, driven by one dispatcher thread, is small and gives every rule above at a cost
per job of one message each way.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import selectors
import threading
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from time import monotonic, perf_counter
from typing import Any

from sqlaq import tracing
from sqlaq.config import WorkerConfig
from sqlaq.errors import ConfigError, HandlerProcessDied
from sqlaq.outcome import CANCELLED, Outcome, Verdict, decide
from sqlaq.registry import Handler
from sqlaq.worker.child import CLOSE_SECONDS, Child, Sent, job_message, read_answer, serve
from sqlaq.worker.run import Finished, Run, in_a_process, timed_out

__all__ = [
    "ProcessPool",
    "cpus",
    "for_worker",
    "handler_reference",
    "in_a_process",
]

_log = logging.getLogger("sqlaq.worker")

#: How long a starting worker waits for its children to import their handlers.
READY_SECONDS = 60.0
#: A child whose last job ran less than this many seconds gets its next job while it
#: runs the current one (it waits in its pipe): between two short jobs, the child does
#: not wait for the worker's turn. Longer jobs are sent to a child only once it is
#: free, so no job waits behind a long one while another child is idle.
PIPELINE_SECONDS = 0.1
#: How long the answers of jobs are kept to be reported together (one wake-up of the
#: worker and one write for several jobs, not one per job); reported at once when no
#: child runs a job.
REPORT_SECONDS = 0.025
#: How many jobs may wait in a child's pipe behind the one it runs. One is enough: a
#: child that emptied its pipe before the worker refilled it was measured at 1 job in
#: 1,000 (2 ms jobs, 2 children, a loaded box); 2 changed nothing measurable.
PIPELINE_JOBS = 1
#: The most bytes of messages sent to a child that is still running a job (with the
#: one it runs): they fit a pipe's buffer, so the worker never blocks on a busy child.
PIPELINE_BYTES = 4096


def for_worker(registry: Iterable[Handler], config: WorkerConfig) -> ProcessPool | None:
    """The pool of a worker of *registry* with *config*; None when no handler of it
    runs in a process.

    Raises:
        ConfigError: a handler that runs in a process cannot be sent to one.
    """
    references = {
        h.kind: handler_reference(h) for h in registry if in_a_process(h, config.executor)
    }
    if not references:
        return None
    return ProcessPool(
        min(config.processes or cpus(), config.concurrency),  # no idle children by design
        references,
        max_jobs_per_child=config.max_jobs_per_child,
        max_memory_per_child=config.max_memory_per_child * 2**20,
    )


def cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system tells it): the
    default number of children."""
    counted = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if counted is not None:
        return int(counted() or 1)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def handler_reference(handler: Handler) -> bytes:
    """*handler*'s function pickled by reference (its module and qualified name), as
    the child imports it.

    Raises:
        ConfigError: it cannot be (a lambda, a nested function, a method of an
            instance, a function its module does not name).
    """
    try:
        return pickle.dumps(handler.func)
    except Exception as exc:
        raise ConfigError(
            f'the handler of {handler.kind!r} runs in a child process (executor="process") '
            f"but cannot be sent to one: define it at module level, importable as "
            f"module.name ({type(exc).__name__}: {exc})"
        ) from None


class ProcessPool:
    """Up to *size* child processes running sync handlers, one job each at a time.

    :meth:`submit` hands runs to the pool's dispatcher, one thread that sends each to
    a child, waits on every child's pipe at once, and reports the
    :class:`~sqlaq.worker.run.Finished` runs (their answers, deadlines or children's
    deaths) to the callback given to :meth:`report_to`, from its thread, several at
    once: within :data:`REPORT_SECONDS` of each other, at once when no child runs.

    A child whose last job was short (under :data:`PIPELINE_SECONDS`) gets its next
    job while it runs the current one: the job waits in its pipe and starts the moment
    the current one ends, so the child never waits for the worker's turn between two
    short jobs. Its deadline starts when the child answers the job before it.

    Args:
        size: The most children at once (:meth:`start` starts them all; one that ends
            is replaced at once).
        references: Each kind run here, and its function pickled by reference
            (:func:`handler_reference`).
        max_jobs_per_child: Replace a child after this many jobs (0: never).
        max_memory_per_child: Replace a child whose RSS exceeds this many bytes after a
            job (0: never).
    """

    def __init__(
        self,
        size: int,
        references: dict[str, bytes],
        *,
        max_jobs_per_child: int = 0,
        max_memory_per_child: int = 0,
    ) -> None:
        self._size = size
        self._references = references
        self._max_jobs = max_jobs_per_child
        self._max_memory = max_memory_per_child
        self._context = multiprocessing.get_context("spawn")
        self._on_finished: Callable[[list[Finished]], None] = _unbound
        self._lock = threading.Lock()  # guards the lists below, filled by other threads
        self._waiting: deque[Run] = deque()  # submitted, not sent to a child
        self._cancels: list[Run] = []  # cancelled since the dispatcher last looked
        self._children: list[Child] = []  # alive (or not yet seen dead)
        self._closed = False
        self._poked = False  # a byte is in the wake-up pipe, not read yet
        self._wake_reader, self._wake_writer = self._context.Pipe(duplex=False)
        self._thread: threading.Thread | None = None
        self._finished: list[Finished] = []  # reported by the next flush (the dispatcher's)
        self._selector: selectors.BaseSelector | None = None  # the dispatcher's
        self._watched: list[Child] = []  # the children its selector watches
        self._report_at = 0.0  # monotonic: when they are reported at the latest

    @property
    def size(self) -> int:
        """The most children at once."""
        return self._size

    def runs(self, handler: Handler) -> bool:
        """True when *handler*'s kind runs in this pool."""
        return handler.kind in self._references

    @property
    def pids(self) -> list[int]:
        """The pids of the children alive now, idle or running."""
        with self._lock:
            children = list(self._children)
        return [c.pid for c in children if c.pid is not None]

    def report_to(self, on_finished: Callable[[list[Finished]], None]) -> None:
        """Report finished runs to *on_finished*, several at once (called from the
        dispatcher's thread). Call before :meth:`start`."""
        self._on_finished = on_finished

    def submit(self, runs: Iterable[Run]) -> None:
        """Run *runs*' handlers in children, in their order, as children are free."""
        with self._lock:
            self._waiting.extend(runs)
        self._poke()

    def withdraw(self) -> list[Run]:
        """Take back the runs not sent to a child yet (for a stopping worker, which
        hands their jobs back); they will never start."""
        with self._lock:
            taken = list(self._waiting)
            self._waiting.clear()
        return taken

    def cancel(self, run: Run) -> None:
        """*run*'s job was cancelled: its child is killed (it is reported cancelled);
        one not started yet never starts."""
        with self._lock:
            self._cancels.append(run)
        self._poke()

    def _poke(self) -> None:
        """Wake the dispatcher (one byte in its pipe until it reads it)."""
        with self._lock:
            if self._poked or self._closed:
                return
            self._poked = True
        with contextlib.suppress(OSError):
            self._wake_writer.send_bytes(b"!")

    # -- starting and closing ------------------------------------------------------------

    def start(self) -> None:
        """Start every child and wait until each has imported its handlers (at most
        :data:`READY_SECONDS`), as the worker starts: it claims no job before a child
        can run it, and the first jobs do not wait for an interpreter to start. Then
        the dispatcher starts."""
        started: list[Child] = []
        with self._lock:
            while not self._closed and len(self._children) < self._size:
                child = self._start()
                self._children.append(child)
                started.append(child)
        deadline = monotonic() + READY_SECONDS
        for child in started:
            if child.wait_ready(max(0.0, deadline - monotonic())):
                continue
            if child.process.exitcode is None:  # still starting: the dispatcher sees it
                _log.warning(
                    "a handler process is not ready after %gs; starting anyway", READY_SECONDS
                )
                continue
            with self._lock:  # it died as it started: the first job starts another
                self._children.remove(child)
            _log.error("a handler process died as it started: %s", child.ending("at start"))
            child.reap()
        self._thread = threading.Thread(target=self._serve, name="sqlaq-processes", daemon=True)
        self._thread.start()

    def _start(self) -> Child:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=serve,
            args=(theirs, list(self._references.values()), self._max_memory),
            name="sqlaq-handler",
            daemon=False,
        )
        process.start()
        theirs.close()
        _log.debug("handler process started", extra={"pid": process.pid})
        return Child(process, ours)

    def close(self) -> None:
        """Idle children exit; children still running a job are killed (their jobs
        were handed back, or are abandoned as a thread's would be); nothing more is
        reported. No new child starts after this."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_writer.send_bytes(b"!")
        if self._thread is not None:
            self._thread.join(CLOSE_SECONDS)
        with self._lock:
            children, self._children = self._children, []
        idle = [c for c in children if not c.runs]
        for child in idle:
            try:
                child.conn.send_bytes(b"")  # exit
            except (OSError, EOFError):
                child.kill()
        for child in children:
            if child.runs:
                child.kill()
        deadline = monotonic() + CLOSE_SECONDS
        for child in children:
            child.reap(max(0.0, deadline - monotonic()))
        self._wake_reader.close()
        self._wake_writer.close()
        if self._selector is not None:
            self._selector.close()

    # -- the dispatcher --------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed:
            try:
                self._turn()
            except Exception:  # never the end of the pool: the next turn goes on
                _log.exception("the process executor's dispatcher failed a turn")

    def _turn(self) -> None:
        """Send what waits, wait for an answer, a death, a deadline or a wake-up."""
        self._cancel()
        self._dispatch()
        deadlines = [d for c in self._children if c.runs and (d := c.runs[0].deadline) is not None]
        if self._finished:
            deadlines.append(self._report_at)
        timeout = max(0.0, min(deadlines) - monotonic()) if deadlines else None
        ready = self._ready(timeout)
        if self._closed:
            return
        for child, answered in ready:
            if child is None:  # the wake-up pipe
                self._woken()
            elif child in self._children:
                self._read(child, answered)
        self._expire()
        self._flush()

    def _woken(self) -> None:
        """Empty the wake-up pipe, then lower the flag. In that order: a :meth:`_poke`
        between the two finds the flag raised and writes nothing, and what it was for
        is already in the lists the next turn reads; the other way round, a poke
        between lowering and emptying would have its byte taken and leave the flag
        raised with the pipe empty, so no later poke would write one and the
        dispatcher would sleep through every submit until a child answered (a job
        claimed while every child was idle, never started)."""
        while self._wake_reader.poll():
            self._wake_reader.recv_bytes()
        with self._lock:
            self._poked = False

    def _ready(self, timeout: float | None) -> list[tuple[Child | None, bool]]:
        """Wait for the wake-up pipe or a child (its pipe: True; its death: False).
        One selector kept while the children stay the same (on POSIX; elsewhere
        ``multiprocessing.connection.wait`` each time)."""
        if os.name != "posix":
            objects: dict[Any, tuple[Child | None, bool]] = {self._wake_reader: (None, True)}
            for child in self._children:
                objects[child.conn] = (child, True)
                objects[child.process.sentinel] = (child, False)
            return [objects[fired] for fired in wait(list(objects), timeout)]
        if self._selector is None or self._watched != self._children:
            if self._selector is not None:
                self._selector.close()
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._wake_reader, selectors.EVENT_READ, (None, True))
            for child in self._children:
                self._selector.register(child.conn, selectors.EVENT_READ, (child, True))
                self._selector.register(
                    child.process.sentinel, selectors.EVENT_READ, (child, False)
                )
            self._watched = list(self._children)
        return [key.data for key, _ in self._selector.select(timeout)]

    def _dispatch(self) -> None:
        """Send waiting runs: to idle children first, then behind a short job."""
        with self._lock:
            if not self._waiting:
                return
        for _ in range(self._size - len(self._children)):  # (died as it started)
            self._replace()
        for behind in (False, True):
            for child in list(self._children):
                while self._takes(child, behind):
                    with self._lock:
                        run = self._waiting.popleft() if self._waiting else None
                    if run is None:
                        return
                    if self._send(child, run) or not run.context.cancelled:
                        break  # sent; or back in line (too large to wait, or it died)

    def _takes(self, child: Child, behind: bool) -> bool:
        if not child.ready or child.retiring or child not in self._children:
            return False
        if self._max_jobs and child.sent >= self._max_jobs:
            return False
        if not behind:
            return not child.runs
        return (
            0 < len(child.runs) <= PIPELINE_JOBS
            and child.last is not None
            and child.last < PIPELINE_SECONDS
        )

    def _send(self, child: Child, run: Run) -> bool:
        """Send *run* to *child*; False if it was not (cancelled: reported; too large to
        wait behind another job, or the child died: back in the waiting line)."""
        if run.context.cancelled:  # cancelled while it waited: never started
            self._report(run, None, CANCELLED, 0.0)
            return False
        handler = run.handler
        if handler is None:  # the runner sends only runs with a handler here
            raise RuntimeError(f"job {run.job.id}: no handler for kind {run.job.kind!r}")
        message = job_message(self._references[handler.kind], run)
        size = len(message)
        if child.runs and size + sum(s.size for s in child.runs) > PIPELINE_BYTES:
            with self._lock:  # (it could fill the pipe of a busy child: for a free one)
                self._waiting.appendleft(run)
            return False
        try:
            child.conn.send_bytes(message)
        except (OSError, EOFError):  # it died: the run goes to another child
            with self._lock:
                self._waiting.appendleft(run)
            self._read(child)  # its answers first, then its death
            return False
        sent = Sent(run, size)
        child.sent += 1
        if not child.runs:
            sent.begin()
        child.runs.append(sent)
        return True

    def _read(self, child: Child, answered: bool = False) -> None:
        """Read what *child* said (its readiness, its answers): one message when its
        pipe is known readable (*answered*; a second one makes the next wait return at
        once), else all there is; see whether it died."""
        conn = child.conn
        try:
            while answered or conn.poll():
                reply = conn.recv_bytes()
                if not child.ready:
                    child.said_ready(reply)
                else:
                    self._answered(child, reply)
                if answered or child not in self._children:
                    return
        except (EOFError, OSError):  # the end of its pipe: it died (or is dying)
            self._died(child)
            return
        if child in self._children and (conn.closed or child.process.exitcode is not None):
            self._died(child)

    def _answered(self, child: Child, reply: bytes) -> None:
        sent = child.runs.popleft()
        duration = perf_counter() - sent.started
        child.last = duration
        outcome, keep, over_memory = self._answer(sent.run, child, reply)
        self._report(sent.run, sent.span, outcome, duration)
        if over_memory:  # it exits by itself: what waits in its pipe never started
            self._end(child)
            return
        if not keep:
            child.retiring = True
        if child.runs:  # the one behind it starts now
            following = child.runs[0]
            following.begin()
            if following.run.context.cancelled:
                self._kill(child, CANCELLED, "job cancelled; its process was killed")
                return
        if child.retiring and not child.runs:
            self._end(child)

    def _expire(self) -> None:
        """Kill the children whose job is past its deadline."""
        now = monotonic()
        for child in list(self._children):
            front = child.runs[0] if child.runs else None
            if front is None or front.deadline is None or now < front.deadline:
                continue
            timeout = front.run.timeout
            if timeout is None:  # (a deadline comes from a timeout)
                continue
            self._read(child)  # an answer that came at the deadline counts
            if child not in self._children or not child.runs or child.runs[0] is not front:
                continue
            outcome = decide(front.run.handler, front.run.job, timed_out(timeout))
            self._kill(child, outcome, "job timed out; its process was killed")

    def _cancel(self) -> None:
        """Act on cancels: a run not sent never starts; a running one's child is killed;
        one waiting in a child's pipe is killed with its child when it starts."""
        with self._lock:
            cancels, self._cancels = self._cancels, []
        for run in cancels:
            with self._lock:
                try:
                    self._waiting.remove(run)
                    found = True
                except ValueError:
                    found = False
            if found:
                self._report(run, None, CANCELLED, 0.0)
                continue
            for child in list(self._children):
                if child.runs and child.runs[0].run is run:
                    self._kill(child, CANCELLED, "job cancelled; its process was killed")
                    break

    def _kill(self, child: Child, outcome: Outcome, said: str) -> None:
        """Kill *child*; its running job ends with *outcome*; what waits in its pipe
        goes to another child."""
        child.kill()
        front = child.runs.popleft()
        duration = perf_counter() - front.started
        if outcome is CANCELLED:
            _log.info(said, extra=_extra(front.run, child))
        else:
            _log.warning(said, extra=_extra(front.run, child))
        self._report(front.run, front.span, outcome, duration)
        self._end(child)

    def _died(self, child: Child) -> None:
        """*child* died: its running job fails (HandlerProcessDied), or the first one
        waiting does if it died as it started."""
        if child not in self._children:
            return
        if not child.ready:
            ending = child.ending("as it started")
            self._end(child, replace=False)
            _log.error("a handler process died as it started: %s", ending)
            with self._lock:
                run = self._waiting.popleft() if self._waiting else None
            if run is not None:  # (it was to run there: none would, if each dies so)
                outcome = decide(
                    run.handler, run.job, HandlerProcessDied(f"the handler's {ending}")
                )
                self._report(run, None, outcome, 0.0)
            return
        front = child.runs.popleft() if child.runs else None
        if front is not None:
            duration = perf_counter() - front.started
            if front.run.context.cancelled:
                outcome = CANCELLED
            else:
                died = HandlerProcessDied(f"the handler's {child.ending()}")
                outcome = decide(front.run.handler, front.run.job, died)
                _log.warning("a job's process died", extra=_extra(front.run, child))
            self._report(front.run, front.span, outcome, duration)
        self._end(child)

    def _end(self, child: Child, *, replace: bool = True) -> None:
        """*child* is done with: killed and reaped, the runs waiting in its pipe (never
        started) sent to another, a new child in its place."""
        with self._lock:
            if child in self._children:
                self._children.remove(child)
            self._waiting.extendleft(reversed([s.run for s in child.runs]))
        child.runs.clear()
        child.kill()
        child.reap()
        if replace:
            self._replace()

    def _replace(self) -> None:
        """Start a child in place of one that ended, at once: it starts while no job
        waits for it (the dispatcher sends it jobs once it says it is ready)."""
        try:
            with self._lock:
                if self._closed or len(self._children) >= self._size:
                    return
            child = self._start()
            with self._lock:
                self._children.append(child)
        except Exception:  # the next turn tries again
            _log.exception("could not start a handler process")

    def _report(
        self, run: Run, span: tracing.AttemptSpan | None, outcome: Outcome, duration: float
    ) -> None:
        """Report *run* finished: at once if no child runs a job, else with the others
        that finish within :data:`REPORT_SECONDS`."""
        tracing.end(span, outcome)
        if not self._finished:
            self._report_at = monotonic() + REPORT_SECONDS
        self._finished.append(Finished.of(run, outcome, duration))

    def _flush(self) -> None:
        """Hand the finished runs to the worker, if it is time."""
        if not self._finished:
            return
        if monotonic() < self._report_at and any(c.runs for c in self._children):
            return
        finished, self._finished = self._finished, []
        self._on_finished(finished)

    def _answer(self, run: Run, child: Child, reply: bytes) -> tuple[Outcome, bool, bool]:
        """The outcome of *reply* (the child's answer), whether to keep the child, and
        whether it is over its memory (it exits by itself)."""
        handler, job = run.handler, run.job
        child.jobs += 1
        try:
            kind, value, summary, rss = read_answer(reply)
        except Exception as exc:  # an exception class that cannot be rebuilt here
            outcome = Outcome(
                Verdict.FAILED,
                error=f"the handler's answer could not be read from its process: {exc!r}",
            )
            return outcome, False, False
        if kind == "returned":
            outcome = decide(handler, job, None, value)
        elif kind == "raised":
            outcome = decide(handler, job, value)
            if outcome.error is not None and summary:  # the traceback is the child's
                outcome = Outcome(
                    outcome.verdict, outcome.delay, summary, outcome.exception, outcome.result
                )
        else:  # "unsendable": what it returned or raised cannot be pickled
            outcome = Outcome(Verdict.FAILED, error=summary)
        if self._max_memory and rss > self._max_memory:
            extra = _extra(run, child)
            extra["rss_mib"] = round(rss / 2**20, 1)
            _log.info("handler process replaced: over max_memory_per_child", extra=extra)
            return outcome, False, True
        if self._max_jobs and child.jobs >= self._max_jobs:
            _log.info(
                "handler process replaced: max_jobs_per_child reached", extra=_extra(run, child)
            )
            return outcome, False, False
        return outcome, True, False


def _unbound(finished: list[Finished]) -> None:
    raise RuntimeError("ProcessPool.report_to was not called")


def _extra(run: Run, child: Child) -> dict[str, Any]:
    extra = run.log_extra()
    extra["pid"] = child.pid
    return extra
