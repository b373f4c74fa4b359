"""One child process of the process executor: both ends of its pipe; no SQL.

The pool's dispatcher (:mod:`sqlaq.worker.processes`) decides which job goes to which
child, when a child is killed and when one is replaced. This module owns what a child
is, apart from those decisions:

* the parent's handle on it (:class:`Child`): its process, the parent's end of its
  pipe, the runs sent to it; waiting for it to say it is ready, killing it with what it
  started, reaping it, saying how it ended;
* the messages between the two ends: a job (:func:`job_message`: the handler by
  reference, the payload, the fields of ``current_job()``) and its answer (the returned
  value or the raised exception, its ``last_error`` text, the child's RSS);
* the child's own loop (:func:`serve`), which runs in the child process: it imports the
  handlers, runs each job its pipe brings and answers. It knows nothing of the
  registry, the database or the worker's configuration.

The two ends are kept in one module so that the message format is spelled once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pickle
import signal
from collections import deque
from collections.abc import Awaitable
from datetime import timedelta

# (One end of a pipe, not a database connection: named so.)
from multiprocessing.connection import Connection as Pipe
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any

from sqlaq import tracing
from sqlaq.context import JobContext, bind, unbind
from sqlaq.lease import Lease
from sqlaq.outcome import describe_error

if TYPE_CHECKING:
    from sqlaq.worker.run import Run

__all__ = [
    "CLOSE_SECONDS",
    "Answer",
    "Child",
    "Sent",
    "job_message",
    "read_answer",
    "resident_memory",
    "serve",
]

#: How long the parent waits for a child told to exit (or killed) to end.
CLOSE_SECONDS = 2.0
#: What a child sends once it has imported its handlers.
_READY = b"ready"

#: A child's answer: ``(kind, value, summary, rss)``. *kind* is ``"returned"`` (*value*
#: the returned value), ``"raised"`` (*value* the exception, *summary* its
#: ``last_error`` text with the child's traceback) or ``"unsendable"`` (*summary* says
#: what could not be pickled); *rss* the child's resident memory after the job, in
#: bytes (0 when the pool has no memory ceiling).
Answer = tuple[str, Any, "str | None", int]


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


# -- the parent's end -----------------------------------------------------------------


class Sent:
    """A run sent to a child: running, or waiting in the child's pipe behind its run."""

    __slots__ = ("deadline", "run", "size", "span", "started")

    def __init__(self, run: Run, size: int) -> None:
        self.run = run
        self.size = size  # of its message
        self.span: tracing.AttemptSpan | None = None
        self.started = 0.0  # perf_counter when it started
        self.deadline: float | None = None  # monotonic

    def begin(self) -> None:
        """It starts now: its duration and its deadline count from here."""
        self.started = perf_counter()
        timeout = self.run.timeout
        if timeout is not None:
            self.deadline = monotonic() + timeout.total_seconds()
        self.span = tracing.span_for(self.run, current=False)


class Child:
    """One child process, the parent's end of its pipe, and the runs sent to it."""

    __slots__ = (
        "conn",
        "jobs",
        "last",
        "process",
        "ready",
        "retiring",
        "runs",
        "sent",
    )

    def __init__(self, process: BaseProcess, conn: Pipe) -> None:
        self.process = process
        self.conn = conn
        self.jobs = 0  # answered
        self.sent = 0  # jobs sent
        self.ready = False  # it said it imported its handlers
        self.retiring = False  # no job more: it ends once its runs are answered
        self.last: float | None = None  # how long its last job ran (seconds)
        # The run it runs first, then at most one waiting in its pipe.
        self.runs: deque[Sent] = deque()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until it has imported its handlers (a job's deadline starts after
        that); False if it died first, or is still starting after *timeout*."""
        if not wait([self.conn, self.process.sentinel], timeout):
            return False
        try:
            self.ready = self.conn.poll() and self.said_ready(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.ready = False
        return self.ready

    def said_ready(self, message: bytes) -> bool:
        """Whether *message*, its first, says it imported its handlers."""
        self.ready = message == _READY
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

    def ending(self, when: str = "before the handler returned") -> str:
        """How it ended, for ``last_error``: ``process (pid N) was killed by SIGKILL``
        and *when*."""
        self.process.join(CLOSE_SECONDS)
        code = self.process.exitcode
        pid = self.pid
        if code is None:
            return f"process (pid {pid}) stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"process (pid {pid}) was killed by {name} {when}"
        return f"process (pid {pid}) exited with code {code} {when}"


def job_message(reference: bytes, run: Run) -> bytes:
    """The message that runs *run* in a child: its handler by *reference*
    (:func:`sqlaq.worker.processes.handler_reference`), its payload and the fields of
    ``current_job()``."""
    job = run.job
    context = run.context
    lease = context.lease  # its fields: a dataclass pickles its state slowly
    return pickle.dumps(
        (
            reference,
            job.payload,
            (job.id, job.kind, job.queue, job.attempt, job.max_attempts),
            (
                lease.job_id,
                lease.worker_id,
                lease.token,
                lease.attempt,
                lease.expires_at,
                lease.queue,
            ),
            context.lease_length,
            job.attempted_at,
        )
    )


def read_answer(reply: bytes) -> Answer:
    """A child's answer to a job (:data:`Answer`).

    Raises:
        Exception: it cannot be read here (an exception class that cannot be rebuilt
            in the worker's process).
    """
    kind, value, summary, rss = pickle.loads(reply)  # noqa: S301 - our own child's
    return kind, value, summary, rss


# -- the child's end ------------------------------------------------------------------


def _not_in_a_child(context: JobContext, length: timedelta) -> Lease:
    raise RuntimeError(
        "current_job().extend_lease() is not available to a handler running in a child "
        '(executor="process"): the worker renews the lease on its own while it runs'
    )


def serve(conn: Pipe, references: list[bytes], max_memory: int = 0) -> None:
    """A child's loop: import the handlers (*references*), then run each job the pipe
    brings and answer, until told to exit (an empty message), the worker is gone (the
    end of the pipe), or a job left its resident memory above *max_memory* bytes (0:
    no ceiling): it exits after answering, and a job waiting in its pipe never starts
    (the worker sends it to another child)."""
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
        reference, payload, fields, leased, lease_length, attempted_at = pickle.loads(message)  # noqa: S301
        func = functions.get(reference)
        error: BaseException | None = None
        returned: object = None
        if func is None:
            try:
                func = functions[reference] = pickle.loads(reference)  # noqa: S301
            except BaseException as exc:
                error = exc
        if func is not None:
            job_id, kind, queue, attempt, max_attempts = fields
            context = JobContext(
                job_id, kind, queue, attempt, max_attempts, Lease(*leased), lease_length,
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
        rss = resident_memory() if max_memory else 0  # (read only for a ceiling)
        try:
            conn.send_bytes(_answer_bytes(returned, error, rss))
        except (OSError, EOFError):
            return
        if max_memory and rss > max_memory:
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
