"""Shared tools of the worker and CLI tests: worker processes, the ledger, waiting.

Worker processes run ``python -m sqlaq.cli worker_app:registry`` with this directory as
their working directory and on PYTHONPATH; their logs go to a file (a pipe nobody reads
would fill and block them) that a failing test prints. Every process started through
:func:`worker_processes` is killed when the block exits, whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from worker_app import LEDGER

import sqlaq

TESTS_DIR = Path(__file__).resolve().parent

#: Seconds a worker's start-up may take: a process's imports and connections, a thread's
#: connections. A loaded CI box (2 cores, two suites at once) spent 12 s starting one
#: process. A test waits this long for a first sign of life its point does not depend
#: on, and runs its tight deadlines from there, not from the start.
START_TIMEOUT = 60.0

#: The tests that start three or more worker processes at once run one after another on
#: one xdist process (``--dist loadgroup``, as nox runs the suite): two of them side by
#: side (ten workers beside four of eight slots each, with their handlers' connections)
#: can pass a server's 100 connections ("too many clients" seen in the 4 x 4,000 test),
#: and a handler refused its connection fails its job's attempt.
MANY_WORKERS = pytest.mark.xdist_group("many_worker_processes")


def wait_until(
    condition: Callable[[], Any], timeout: float, message: str, interval: float = 0.05
) -> Any:
    """Poll *condition* until it returns something truthy; fail after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def libpq_url(database_url: str) -> str:
    """*database_url* (a SQLAlchemy URL) as a libpq URI for ``psycopg.connect``: any
    host (TCP, or a Unix socket in ``?host=``), port, user and password kept."""
    url = make_url(database_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def scalar(engine: Engine, sql: str, **params: Any) -> Any:
    """Run *sql* in its own transaction and return its one value."""
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar_one()


def rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    """Run *sql* in its own transaction and return all its rows."""
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).all())


def count_status(engine: Engine, status: str, kind: str | None = None) -> int:
    """How many jobs have *status* (and *kind*)."""
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM sqlaq_jobs "
            "WHERE status = :s AND (CAST(:k AS text) IS NULL OR kind = :k)",
            s=status,
            k=kind,
        )
    )


def ledger_runs(engine: Engine, job_id: int) -> list[Any]:
    """The ledger rows of *job_id*, oldest first."""
    return rows(engine, f"SELECT * FROM {LEDGER} WHERE job_id = :id ORDER BY seq", id=job_id)


def ledger_table(committed: Engine) -> Iterator[Engine]:
    """Create the ledger table in the suite's database, yield, drop it (the body of the
    test modules' ``ledger`` fixture)."""
    with committed.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {LEDGER}"))
        conn.execute(
            text(
                f"CREATE TABLE {LEDGER} (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                "job_id bigint NOT NULL, attempt int NOT NULL, pid int NOT NULL, "
                "note text NOT NULL DEFAULT '', at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        )
    try:
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {LEDGER}"))


class WorkerProcess:
    """One ``sqlaq-worker`` process."""

    def __init__(self, args: list[str], env: dict[str, str], log: IO[bytes]) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sqlaq.cli", *args],
            cwd=TESTS_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def started(self) -> bool:
        """Whether it has logged "worker started" (at the command's default log level,
        info, or below): imported, the schema checked, about to claim. Fails at once if
        it exited first."""
        alive = self.alive()  # before the read: an exit after it leaves the log whole
        if "worker started" in self.output():
            return True
        assert alive, f"worker {self.pid} exited ({self.proc.returncode}) before starting"
        return False


def wait_started(*processes: WorkerProcess, timeout: float = START_TIMEOUT) -> None:
    """Wait until every one of *processes* (started together) has started
    (:meth:`WorkerProcess.started`): the start-up a test's tight deadlines should not
    include."""
    names = ", ".join(str(p.pid) for p in processes)
    wait_until(lambda: all(p.started() for p in processes), timeout, f"workers {names} to start")


def worker_env(database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a worker process: this one, plus the test app on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLAQ_")}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(TESTS_DIR) + (os.pathsep + path if path else "")
    env["SQLAQ_DATABASE_URL"] = database_url
    env.update(extra)
    return env


@contextmanager
def worker_processes(database_url: str) -> Iterator[Callable[..., WorkerProcess]]:
    """Yield ``start(*args, app=..., **env)``; kill every process it started on exit.

    On an error inside the block, the logs of the processes are printed (pytest shows
    them with the failure).
    """
    started: list[WorkerProcess] = []

    def start(*args: str, app: str = "worker_app:registry", **env: str) -> WorkerProcess:
        log = tempfile.NamedTemporaryFile(prefix="sqlaq-worker-", suffix=".log")  # noqa: SIM115
        process = WorkerProcess([app, *args], worker_env(database_url, **env), log)
        started.append(process)
        return process

    try:
        yield start
    except BaseException:
        for process in started:
            print(f"--- worker {process.pid} (exit {process.proc.poll()}) ---")
            print(process.output()[-6000:])
        raise
    finally:
        for process in started:
            if process.alive():
                process.proc.kill()
            process.proc.wait(10)
            process.log.close()


def backends(engine: Engine, application_name: str) -> list[int]:
    """Backend pids of this database with *application_name*."""
    return [
        row[0]
        for row in rows(
            engine,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = :name",
            name=application_name,
        )
    ]


def listener_backends(engine: Engine) -> list[int]:
    """Backend pids of this database waiting in LISTEN (one per listening worker)."""
    return backends(engine, "sqlaq-listener")


def terminate(engine: Engine, pids: list[int]) -> None:
    """``pg_terminate_backend`` each of *pids*."""
    with engine.connect() as conn:
        for pid in pids:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


# -- in-process workers and jobs (shared by the worker tests) ------------------------

FAST = ["--poll-interval", "0.2", "--log-level", "info"]


def enqueue(
    engine: Engine, kind: str, payload: dict[str, Any] | None = None, **options: Any
) -> int:
    with engine.begin() as conn:
        return sqlaq.enqueue(conn, kind, payload, **options).job_id


def enqueue_many(engine: Engine, kind: str, count: int, **options: Any) -> list[int]:
    with engine.begin() as conn:
        results = sqlaq.enqueue_many(conn, [sqlaq.NewJob(kind, **options) for _ in range(count)])
    return [r.job_id for r in results]


def job(engine: Engine, job_id: int) -> Any:
    return rows(engine, "SELECT * FROM sqlaq_jobs WHERE id = :id", id=job_id)[0]


@contextmanager
def running(worker: sqlaq.Worker) -> Iterator[sqlaq.Worker]:
    """Run *worker* in a thread; stop it (at once) and join it on exit."""
    thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    thread.start()
    try:
        assert worker.started.wait(START_TIMEOUT)
        yield worker
    finally:
        worker.stop(now=True)
        # A forced stop joins the worker's parts (the listener and the maintenance
        # thread up to a few seconds each) and writes its hand-back: 30 s leaves a
        # loaded machine room. If it is still running then, the threads' stacks say
        # where it waits.
        thread.join(30)
        assert not thread.is_alive(), f"the worker did not stop:\n{thread_stacks()}"


def thread_stacks() -> str:
    """The Python stack of every live thread (for a test's failure message)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


class Recorder:
    """Collects what handlers saw and what the worker reported."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, str, dict[str, Any]]] = []
        self.results: list[sqlaq.JobResult] = []
        self.done = threading.Condition()

    def saw(self, payload: dict[str, Any]) -> None:
        job = sqlaq.current_job()
        self.seen.append((job.kind, job.id, job.attempt, threading.current_thread().name, payload))

    def finished(self, result: sqlaq.JobResult) -> None:
        with self.done:
            self.results.append(result)
            self.done.notify_all()

    def wait_for(self, count: int, timeout: float = 15) -> list[sqlaq.JobResult]:
        with self.done:
            assert self.done.wait_for(lambda: len(self.results) >= count, timeout), self.results
            return list(self.results)


def fast_worker(
    engine: Engine, registry: sqlaq.Registry, recorder: Recorder, **options: Any
) -> sqlaq.Worker:
    options.setdefault("poll_interval", timedelta(milliseconds=100))
    return sqlaq.Worker(engine, registry, on_job_finished=recorder.finished, **options)
