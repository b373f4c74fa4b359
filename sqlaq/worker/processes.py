"""The process executor: sync handlers in a pool of child processes; no SQL.

A worker whose ``executor`` is ``"process"`` (or a handler registered with
``executor="process"``) runs those sync handlers in child processes it starts itself
(``multiprocessing``'s *spawn*: a fresh interpreter, never a fork of the worker's
threads and connections). Each child runs one job at a time; the worker's slot thread
that runs the job sends it to an idle child through a pipe and waits for the answer,
so the rest of the worker (claims, leases, the writer) is unchanged:

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

Why not a library: ``concurrent.futures.ProcessPoolExecutor`` cannot kill one task,
and a dead child breaks the whole pool; ``pebble`` kills per task and limits tasks per
child, but has no memory ceiling and keeps a thread of its own between the worker's
slot and the child. A child per pipe, driven by the slot thread that already waits for
the job, is small and gives every rule above.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Awaitable, Iterable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from time import monotonic, perf_counter
from typing import Any
from uuid import UUID

from sqlaq.config import WorkerConfig
from sqlaq.context import JobContext, bind, unbind
from sqlaq.errors import ConfigError, HandlerProcessDied
from sqlaq.lease import Lease
from sqlaq.outcome import CANCELLED, Outcome, Verdict, decide, describe_error
from sqlaq.registry import Handler
from sqlaq.worker.run import Finished, Run, timed_out

__all__ = [
    "ProcessPool",
    "cpus",
    "for_worker",
    "handler_reference",
    "in_a_process",
    "resident_memory",
]

_log = logging.getLogger("sqlaq.worker")

#: How long a closing pool waits for an idle child to exit before killing it.
CLOSE_SECONDS = 2.0
#: How long a starting worker waits for its children to import their handlers.
READY_SECONDS = 60.0
#: What a child sends once it has imported its handlers.
_READY = b"ready"
#: How often a slot thread waiting for a free child looks whether the pool closed.
_WAIT_STEP = 0.5


def in_a_process(handler: Handler, executor: str) -> bool:
    """Whether *handler* runs in a child process in a worker whose ``executor`` is
    *executor*: its own ``executor`` if it has one, else the worker's; never an
    ``async`` or a transactional handler (the registry refuses them the option)."""
    if handler.is_async or handler.transaction:
        return False
    return (handler.executor or executor) == "process"


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


def resident_memory() -> int:
    """This process's resident memory in bytes: ``/proc/self/statm`` on Linux (the
    current RSS); elsewhere the peak RSS (``getrusage``), which only grows."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class _Child:
    """One child process and the parent's end of its pipe."""

    __slots__ = ("cancelled", "conn", "jobs", "process", "ready")

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.jobs = 0
        self.cancelled = False
        self.ready = False  # it said it imported its handlers

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until it has imported its handlers (a job's deadline starts after
        that); False if it died first, or is still starting after *timeout*."""
        if not wait([self.conn, self.process.sentinel], timeout):
            return False
        try:
            self.ready = self.conn.poll() and self.conn.recv_bytes() == _READY
        except (EOFError, OSError):
            self.ready = False
        return self.ready

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL to its process group (what its handler started dies with it), or
        to it alone before it made that group."""
        pid = self.process.pid
        killpg = getattr(os, "killpg", None)
        if pid is not None and killpg is not None and self.process.exitcode is None:
            try:
                killpg(pid, signal.SIGKILL)
                return
            except OSError:  # no such group yet (it is starting): the child alone
                pass
        with contextlib.suppress(OSError, ValueError):  # gone already, or closed
            self.process.kill()

    def reap(self, timeout: float | None = None) -> None:
        """Wait for it to end (it was killed or told to exit), then free its pipe."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            self.process.join()
        self.conn.close()


class ProcessPool:
    """Up to *size* child processes running sync handlers, one job each at a time.

    :meth:`run` is called by the runner's slot threads (many at once); it blocks until
    the job's answer, its deadline or its child's death, and returns the
    :class:`~sqlaq.worker.run.Finished` run.

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
        self._lock = threading.Lock()
        self._free = threading.Semaphore(size)  # children free or not yet started
        self._idle: list[_Child] = []
        self._running: dict[UUID, _Child] = {}  # by run token
        self._closed = False

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
            children = [*self._idle, *self._running.values()]
        return [c.pid for c in children if c.pid is not None]

    def run(self, run: Run) -> Finished:
        """Run *run*'s handler in a child; its outcome, decided here."""
        started = perf_counter()
        while not self._free.acquire(timeout=_WAIT_STEP):
            if self._closed:  # its job was handed back: nothing of it is written
                return Finished(run, CANCELLED, 0.0)
        if run.context.cancelled:  # cancelled while it waited for a child: never started
            self._free.release()
            return Finished(run, CANCELLED, 0.0)
        try:
            return self._run(run, started)
        finally:
            self._free.release()

    def _run(self, run: Run, started: float) -> Finished:
        handler = run.handler
        if handler is None:  # the runner sends only runs with a handler here
            raise RuntimeError(f"job {run.job.id}: no handler for kind {run.job.kind!r}")
        job = run.job
        context = run.context
        message = pickle.dumps(
            (
                self._references[handler.kind],
                job.payload,
                (job.id, job.kind, job.queue, job.attempt, job.max_attempts, context.lease),
                context.lease_length,
                job.attempted_at,
            )
        )
        child = self._send(run, message)
        if child is None:
            return Finished(run, CANCELLED, 0.0)  # the pool closed meanwhile
        if isinstance(child, Outcome):
            return Finished(run, child, perf_counter() - started)
        timeout = run.timeout
        deadline = None if timeout is None else monotonic() + timeout.total_seconds()
        keep = False
        try:
            reply = self._wait(child, deadline)
            duration = perf_counter() - started
            if reply is None and timeout is not None:  # past its deadline: killed
                child.kill()
                _log.warning("job timed out; its process was killed", extra=_extra(run, child))
                return Finished(run, decide(handler, job, timed_out(timeout)), duration)
            if isinstance(reply, bytes):
                outcome, keep = self._answer(run, child, reply)
                return Finished(run, outcome, duration)
            # it died
            if child.cancelled or context.cancelled:
                return Finished(run, CANCELLED, duration)
            died = HandlerProcessDied(f"the handler's {_ending(child)}")
            if not self._closed:
                _log.warning("a job's process died", extra=_extra(run, child))
            return Finished(run, decide(handler, job, died), duration)
        finally:
            with self._lock:
                self._running.pop(run.token, None)
                kept = keep and not self._closed
                if kept:
                    self._idle.append(child)
            if not kept:  # not put back: ended (or to be), never reused
                child.kill()
                child.reap()
                self._replace()

    def _replace(self) -> None:
        """Start a child in place of one that ended, at once: it starts while no job
        waits for it (a job that comes first waits in its pipe)."""
        try:
            with self._lock:
                if not self._closed and len(self._idle) + len(self._running) < self._size:
                    self._idle.append(self._start())
        except Exception:  # the next job tries again, and fails if it cannot
            _log.exception("could not start a handler process")

    def _send(self, run: Run, message: bytes) -> _Child | Outcome | None:
        """Hand *message* to an idle child (or a new one); the child, or the outcome of
        a child that could not be started, or None once the pool is closed."""
        while True:
            with self._lock:
                if self._closed:
                    return None
                child = self._idle.pop() if self._idle else None
                if child is not None:
                    self._running[run.token] = child
            if child is None:
                try:
                    child = self._start()
                except Exception as exc:  # no process could be started: the job fails
                    _log.exception("could not start a handler process")
                    return decide(run.handler, run.job, exc)
                with self._lock:
                    if self._closed:
                        child.kill()
                        child.reap()
                        return None
                    self._running[run.token] = child
            if not child.ready and not child.wait_ready():
                # It died as it started (its deadline had not begun): the job fails.
                with self._lock:
                    self._running.pop(run.token, None)
                    closed = self._closed
                ending = _ending(child, "as it started")
                child.reap()
                if closed:
                    return None
                _log.error("a handler process died as it started: %s", ending)
                return decide(run.handler, run.job, HandlerProcessDied(f"the handler's {ending}"))
            try:
                child.conn.send_bytes(message)
                return child
            except (OSError, EOFError):  # died while idle: end it, take another
                with self._lock:
                    self._running.pop(run.token, None)
                child.kill()
                child.reap()

    def start(self) -> None:
        """Start every child and wait until each has imported its handlers (at most
        :data:`READY_SECONDS`), as the worker starts: it claims no job before a child
        can run it, and the first jobs do not wait for an interpreter to start."""
        started: list[_Child] = []
        with self._lock:
            while not self._closed and len(self._idle) + len(self._running) < self._size:
                child = self._start()
                self._idle.append(child)
                started.append(child)
        deadline = monotonic() + READY_SECONDS
        for child in started:
            if child.wait_ready(max(0.0, deadline - monotonic())):
                continue
            if child.process.exitcode is None:  # still starting: a job will wait for it
                _log.warning(
                    "a handler process is not ready after %gs; starting anyway", READY_SECONDS
                )
                continue
            with self._lock:  # it died as it started: the next job starts another
                if child in self._idle:
                    self._idle.remove(child)
            _log.error("a handler process died as it started: %s", _ending(child, "at start"))
            child.reap()

    def _start(self) -> _Child:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=serve,
            args=(theirs, list(self._references.values())),
            name="sqlaq-handler",
            daemon=False,
        )
        process.start()
        theirs.close()
        _log.debug("handler process started", extra={"pid": process.pid})
        return _Child(process, ours)

    @staticmethod
    def _wait(child: _Child, deadline: float | None) -> bytes | BaseException | None:
        """The child's answer; None at *deadline*; an EOFError when it died first."""
        conn, sentinel = child.conn, child.process.sentinel
        while True:
            remaining = None if deadline is None else deadline - monotonic()
            if remaining is not None and remaining <= 0:
                return None
            ready = wait([conn, sentinel], remaining)
            if not ready:
                continue  # (the loop checks the deadline again)
            try:
                if conn in ready or conn.poll():
                    return conn.recv_bytes()
            except (EOFError, OSError) as exc:
                return exc
            return EOFError("the child exited")

    def _answer(self, run: Run, child: _Child, reply: bytes) -> tuple[Outcome, bool]:
        """The outcome of *reply* (the child's answer), and whether to keep the child."""
        handler, job = run.handler, run.job
        child.jobs += 1
        try:
            kind, value, summary, rss = pickle.loads(reply)  # noqa: S301 - our own child's
        except Exception as exc:  # an exception class that cannot be rebuilt here
            outcome = Outcome(
                Verdict.FAILED,
                error=f"the handler's answer could not be read from its process: {exc!r}",
            )
            return outcome, False
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
        keep = True
        if self._max_jobs and child.jobs >= self._max_jobs:
            keep = False
            _log.info(
                "handler process replaced: max_jobs_per_child reached", extra=_extra(run, child)
            )
        elif self._max_memory and rss > self._max_memory:
            keep = False
            extra = _extra(run, child)
            extra["rss_mib"] = round(rss / 2**20, 1)
            _log.info("handler process replaced: over max_memory_per_child", extra=extra)
        if keep and run.context.cancelled:  # (a cancel that came as it answered)
            keep = not child.cancelled
        return outcome, keep

    def cancel(self, run: Run) -> None:
        """*run*'s job was cancelled: kill the child running it (reported cancelled)."""
        with self._lock:
            child = self._running.get(run.token)
            if child is None:
                return
            child.cancelled = True
        child.kill()

    def close(self) -> None:
        """Idle children exit; children still running a job are killed (their jobs
        were handed back, or are abandoned as a thread's would be). No new child
        starts after this."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            running = list(self._running.values())
        for child in idle:
            try:
                child.conn.send_bytes(b"")  # exit
            except (OSError, EOFError):
                child.kill()
        for child in running:
            child.kill()
        deadline = monotonic() + CLOSE_SECONDS
        for child in idle:
            child.reap(max(0.0, deadline - monotonic()))


def _extra(run: Run, child: _Child) -> dict[str, Any]:
    extra = run.log_extra()
    extra["pid"] = child.pid
    return extra


def _ending(child: _Child, when: str = "before the handler returned") -> str:
    """How *child* ended, for ``last_error``: ``process (pid N) was killed by SIGKILL``
    and *when*."""
    child.process.join(CLOSE_SECONDS)
    code = child.process.exitcode
    pid = child.pid
    if code is None:
        return f"process (pid {pid}) stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process (pid {pid}) was killed by {name} {when}"
    return f"process (pid {pid}) exited with code {code} {when}"


# -- the child ------------------------------------------------------------------------


def _not_in_a_child(context: JobContext, length: timedelta) -> Lease:
    raise RuntimeError(
        "current_job().extend_lease() is not available to a handler running in a child "
        '(executor="process"): the worker renews the lease on its own while it runs'
    )


def serve(conn: Connection, references: list[bytes]) -> None:
    """A child's loop: import the handlers (*references*), then run each job the pipe
    brings and answer, until told to exit (an empty message) or the worker is gone (the
    end of the pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's to act on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(os, "setpgid"):  # a group of its own: a kill takes what it started too
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    functions: dict[bytes, Any] = {}
    for reference in references:
        with contextlib.suppress(BaseException):  # (a job of it says why, if it must)
            functions[reference] = pickle.loads(reference)  # noqa: S301 - the worker's
    try:
        conn.send_bytes(_READY)
    except (OSError, EOFError):
        return
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        reference, payload, fields, lease_length, attempted_at = pickle.loads(message)  # noqa: S301
        func = functions.get(reference)
        error: BaseException | None = None
        returned: object = None
        if func is None:
            try:
                func = functions[reference] = pickle.loads(reference)  # noqa: S301
            except BaseException as exc:
                error = exc
        if func is not None:
            job_id, kind, queue, attempt, max_attempts, lease = fields
            context = JobContext(
                job_id, kind, queue, attempt, max_attempts, lease, lease_length,
                _not_in_a_child, attempted_at,
            )  # fmt: skip
            token = bind(context)
            try:
                returned = func(payload)
                if returned is not None and inspect.isawaitable(returned):
                    returned = asyncio.run(_awaited(returned))
            except BaseException as exc:  # recorded on the job, as on a thread
                error = exc
            finally:
                unbind(token)
        answer = _answer_bytes(returned, error, resident_memory())
        try:
            conn.send_bytes(answer)
        except (OSError, EOFError):
            return


def _answer_bytes(returned: object, error: BaseException | None, rss: int) -> bytes:
    if error is None:
        try:
            return pickle.dumps(("returned", returned, None, rss))
        except Exception as exc:
            note = (
                "the handler's return value cannot be sent from its process "
                f"(pickle: {type(exc).__name__}: {exc})"
            )
            return pickle.dumps(("unsendable", None, note, rss))
    summary = describe_error(error)
    try:
        sent = pickle.dumps(("raised", error, summary, rss))
        pickle.loads(sent)  # noqa: S301 - an exception that pickles but cannot be rebuilt
        return sent
    except Exception as exc:
        note = (
            "the handler raised an exception that cannot be sent from its process "
            f"(pickle: {type(exc).__name__}: {exc}); it was: {summary}"
        )
        return pickle.dumps(("unsendable", None, note, rss))


async def _awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable
