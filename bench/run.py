"""sqlaq's benchmark: a script with a results table, not a test.

    python bench/run.py [--rounds 3] [--only NAME ...] [--json bench/results.json]

Creates a database of its own on the local server (or on the server of
SQLAQ_BENCH_SERVER_URL), migrates it, runs every scenario --rounds times interleaved
(A B C, A B C, ...), prints a table of median, min and max and the targets met, writes
the raw figures as JSON, and drops the database (on failure too, after killing any
worker process it started). With SQLAQ_BENCH_DATABASE_URL it runs in that existing
database instead, neither created nor dropped: migrated if need be and, on a Citus
coordinator, converted by ``sqlaq citus-distribute`` (its jobs are deleted).
Needs nothing beyond sqlaq's own dependencies.

Scenarios (bench/RESULTS.md explains each figure):

1. ``enqueue_single``  one job per transaction, one process.
2. ``enqueue_bulk``    20,000 jobs with ``enqueue_many`` (ids back) and ``enqueue_copy``.
3. ``drain``           20,000 no-op jobs drained by ``sqlaq-worker --burst`` at its
                       defaults, at its defaults with ``--log-level warning``, and at the
                       best settings found; every job checked done, every handler run once.
   ``drain_queues``    the same 20,000 jobs over 8 queues, one worker serving the 8 at
                       ``--concurrency 200``: on Citus the queues spread over the nodes.
                       Not in the default run; name it with ``--only``.
4. ``drain_sleep``     20,000 jobs whose handler sleeps 10 ms, ``--concurrency 100``,
                       without and with ``--prefetch 200``, and with the default
                       ``--prefetch auto``;
   ``thread_ceiling``  the same work in bare Python threads, no database: the ceiling.
5. ``wakeup``          an idle worker, 200 single enqueues 20 ms apart: commit to
                       handler start.
6. ``claim_latency``   claim p50/p99 with 1,000 queued jobs, empty history vs 1,000,000
                       finished rows.
7. ``raw_baseline``    the claim-batch / complete-batch loop in raw psycopg with
                       hand-written SQL, at the batch sizes and in-flight bounds of (3).
8. peak RSS of each worker process (its ``VmHWM`` at exit), recorded by (3), (4), (5).
9. ``limits``          what per-kind limits cost: a claim of 10 plain and under limits,
                       and a drain of a kind with a concurrency limit and a rate.
13. ``process_executor`` 2,000 jobs of a CPU-bound handler (a few ms of pure Python)
                       drained on threads (defaults) and with ``--executor process``
                       (one child per core); two handlers stuck past a 1 s timeout (in
                       ``time.sleep``, in a loop), killed by the process executor; the
                       box's ceiling: the same work in 1 thread and in 2 bare processes.
14. ``dashboard``      the dashboard's queries on 1,000,000 finished rows (bench/dashboard.py).
15.-19. ``scale_processes``, ``scale_backlog``, ``scale_held_xmin``, ``scale_starved``,
                       ``scale_held_steady``: 4 worker processes, a 1,000,000-job backlog,
                       a snapshot held open for a whole drain, more workers than
                       ``max_connections`` allows, a steady arrival rate for 10 minutes
                       with a snapshot held (claim latency p50/p99 of the first and the
                       last minute) (bench/scale.py). Minutes each, and two start a
                       PostgreSQL server of their own: not in the default run; name them
                       with ``--only``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlaq  # noqa: E402 - after the path is set, for a run from a clean clone
from bench import dashboard as dashboard_scenario  # noqa: E402
from bench import process_probe  # noqa: E402
from bench import scale as scale_scenario  # noqa: E402
from sqlaq import NewJob  # noqa: E402
from sqlaq.ops import DEFAULT_LEASE  # noqa: E402

DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
APP = "bench.app:registry"
CPU_APP = "bench.app:cpu_registry"
CPU_JOBS = 2_000
LIMITED_APP = "bench.app:limited_registry"
#: The rate of the limits scenario's claims: its start log is filled to 990 of 1000
#: first (each claim reads the log and writes it back: the cost grows with the count).
LIMITED_RATE = "1000/h"
DRAIN_JOBS = 20_000
#: The best settings found for a no-op drain (bench/RESULTS.md has the sweep): the claim
#: batch is the number of free slots, so concurrency is the batch size.
BEST_CONCURRENCY = 200
#: ... and with a prefetch, which lets claims run ahead of the handlers: the best found
#: (bench/RESULTS.md). The raw loop is measured at the same number of jobs in hand.
BEST_PREFETCH = 200
BEST_FLAGS = f"--concurrency {BEST_CONCURRENCY} --prefetch {BEST_PREFETCH}"
BEST_IN_HAND = BEST_CONCURRENCY + BEST_PREFETCH
SLEEP_CONCURRENCY = 100
SLEEP_PREFETCH = 200
QUIET = ["--log-level", "warning"]


@dataclass
class Bench:
    """What a scenario gets: the database, a place to record figures, and the workers."""

    url: str
    engine: Engine
    figures: dict[str, list[float]] = field(default_factory=dict)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def record(self, name: str, value: float) -> None:
        self.figures.setdefault(name, []).append(value)

    def psycopg_dsn(self) -> str:
        return make_url(self.url).set(drivername="postgresql").render_as_string(False)

    def reset(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("TRUNCATE sqlaq_jobs, sqlaq_rates, sqlaq_periodic"))

    def fill(self, kind: str, count: int) -> None:
        """An empty queue, then *count* due jobs of *kind*, analyzed."""
        self.reset()
        with self.engine.begin() as conn:
            sqlaq.enqueue_copy(conn, [NewJob(kind, {"n": n}) for n in range(count)])
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                text("VACUUM ANALYZE sqlaq_jobs")
            )

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).scalar_one()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# --- worker processes ----------------------------------------------------------------


def worker_command() -> list[str]:
    """The ``sqlaq-worker`` console script beside this interpreter, else ``-m sqlaq.cli``."""
    script = Path(sys.executable).with_name("sqlaq-worker")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sqlaq.cli"]


@dataclass
class WorkerRun:
    """A finished worker process: exit code, wall time, peak RSS (its own ``VmHWM``, see
    bench/app.py), and its ledger."""

    returncode: int
    wall: float
    max_rss_mib: float
    ledger: list[tuple[int, str, float]]
    log: str


@contextmanager
def worker(b: Bench, *args: str, app: str = APP) -> Iterator[Callable[[float], WorkerRun]]:
    """Start ``sqlaq-worker <app> *args`` (default ``bench.app:registry``); yield
    ``wait(timeout)``.

    The worker's logs go to a file (a pipe nobody reads could fill and block it); its
    handlers' ledger goes to another. The process is killed on the way out if it is
    still running.
    """
    with tempfile.TemporaryDirectory(prefix="sqlaq-bench-") as tmp:
        ledger, log = Path(tmp, "ledger.txt"), Path(tmp, "worker.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SQLAQ_")}
        env |= {"SQLAQ_DATABASE_URL": b.url, "SQLAQ_BENCH_LEDGER": str(ledger)}
        # This tree's sqlaq in the worker (and its children), whatever the interpreter
        # has installed: a checkout beside an editable install measures itself.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with log.open("wb") as out:
            started = time.perf_counter()
            proc = subprocess.Popen(
                [*worker_command(), app, *args], cwd=ROOT, env=env, stdout=out, stderr=out
            )
        b.workers.append(proc)

        def wait(timeout: float) -> WorkerRun:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"worker still running after {timeout}s:\n{tail(log)}") from None
            wall = time.perf_counter() - started
            if proc.returncode != 0:
                raise RuntimeError(f"worker exited {proc.returncode}:\n{tail(log)}")
            runs = [line.split() for line in ledger.read_text().splitlines()]
            peak = [float(at) for _, kind, at in runs if kind == "peak_rss_kib"]
            return WorkerRun(
                proc.returncode,
                wall,
                peak[0] / 1024,
                [(int(i), kind, float(at)) for i, kind, at in runs if kind != "peak_rss_kib"],
                log.read_text(errors="replace"),
            )

        try:
            yield wait
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            b.workers.remove(proc)


def tail(path: Path, size: int = 4000) -> str:
    return path.read_text(errors="replace")[-size:] if path.exists() else "(no log)"


def drained(b: Bench, kind: str, run: WorkerRun | None) -> float:
    """Check every job is done, claimed once, and its handler ran once (from the
    worker's ledger; *run* None: handlers in child processes, whose ledger is not
    kept, checked in the table only); return jobs/s from the first claim to the last
    completion, on the database clock.

    A claim sets ``run_at = now() + lease`` and a completion ``finished_at = now()``
    (each its statement's start), so ``max(finished_at) - (min(run_at) - lease)`` is the
    drain as the table saw it, without the process's start-up.
    """
    with b.engine.connect() as conn:
        done, attempts, seconds, ids = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE status = 'done'), max(attempts),"
                " extract(epoch FROM max(finished_at) - (min(run_at) - :lease)),"
                " array_agg(id) FROM sqlaq_jobs"
            ),
            {"lease": DEFAULT_LEASE},
        ).one()
    total = len(ids)
    if done != total or attempts != 1:
        raise RuntimeError(f"{done} of {total} jobs done, max attempts {attempts}")
    if run is None:
        return total / float(seconds)
    runs = Counter(job_id for job_id, ran, _ in run.ledger if ran == kind)
    if set(runs) != set(ids) or max(runs.values()) != 1:
        twice = [i for i, n in runs.items() if n > 1][:5]
        raise RuntimeError(f"handlers ran {len(runs)} distinct jobs of {total}; twice: {twice}")
    return total / float(seconds)


# --- scenarios -----------------------------------------------------------------------


def enqueue_single(b: Bench) -> None:
    """1. enqueue one job per transaction, one process (jobs/s)."""
    b.reset()
    n = 3000
    start = time.perf_counter()
    for i in range(n):
        with b.engine.begin() as conn:
            sqlaq.enqueue(conn, "noop", {"i": i})
    b.record("1. enqueue, 1 job/transaction (jobs/s)", n / (time.perf_counter() - start))
    b.reset()
    # A producer's engine in autocommit (README, "One job on its own"): one round trip.
    producer = create_engine(b.engine.url, isolation_level="AUTOCOMMIT")
    try:
        start = time.perf_counter()
        for i in range(n):
            with producer.connect() as conn:
                sqlaq.enqueue(conn, "noop", {"i": i})
        rate = n / (time.perf_counter() - start)
    finally:
        producer.dispose()
    if b.scalar("SELECT count(*) FROM sqlaq_jobs") != n:
        raise RuntimeError("the autocommit enqueues did not all commit")
    b.record("1. enqueue, 1 job/transaction, autocommit engine (jobs/s)", rate)
    b.reset()
    b.record(
        "1. enqueue, 1 job/transaction, AsyncSession (jobs/s)",
        asyncio.run(_enqueue_async(b.engine.url, n)),
    )


async def _enqueue_async(url: Any, n: int) -> float:
    """Jobs/s of *n* enqueues, each in an AsyncSession transaction of its own (psycopg's
    async driver), the way an async web app enqueues."""
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqlaq.asyncio import enqueue

    engine = create_async_engine(url.set(drivername="postgresql+psycopg_async"))
    sessions = async_sessionmaker(engine)
    try:
        start = time.perf_counter()
        for i in range(n):
            async with sessions() as session, session.begin():
                await enqueue(session, "noop", {"i": i})
        return n / (time.perf_counter() - start)
    finally:
        await engine.dispose()


def enqueue_bulk(b: Bench) -> None:
    """2. bulk enqueue 20,000 jobs: enqueue_many (ids back) and enqueue_copy (COPY)."""
    n = DRAIN_JOBS
    for name, enqueue in (
        ("enqueue_many", sqlaq.enqueue_many),
        ("enqueue_copy", sqlaq.enqueue_copy),
    ):
        for built in (True, False):
            b.reset()
            jobs = [NewJob("noop", {"i": i}) for i in range(n)] if built else []
            start = time.perf_counter()
            with b.engine.begin() as conn:
                if not built:  # the caller's whole cost, validation included
                    jobs = [NewJob("noop", {"i": i}) for i in range(n)]
                result: Any = enqueue(conn, jobs)
            rate = n / (time.perf_counter() - start)
            written = len(result) if isinstance(result, list) else result
            if written != n or b.scalar("SELECT count(*) FROM sqlaq_jobs") != n:
                raise RuntimeError(f"{name} wrote {written} of {n} jobs")
            label = "NewJobs built" if built else "incl. building NewJobs"
            b.record(f"2. {name} 20k, {label} (jobs/s)", rate)
    # A batch of one kind (README, "Bulk of one kind"), in the peer bench's chunks of 1,000.
    b.reset()
    start = time.perf_counter()
    for first in range(0, n, 1000):
        with b.engine.begin() as conn:
            batch = NewJob("noop").with_payloads([{"i": i} for i in range(first, first + 1000)])
            sqlaq.enqueue_many(conn, batch)
    rate = n / (time.perf_counter() - start)
    if b.scalar("SELECT count(*) FROM sqlaq_jobs") != n:
        raise RuntimeError("enqueue_many of JobBatches did not write every job")
    b.record("2. enqueue_many of with_payloads batches, 1,000 a call (jobs/s)", rate)


def drain(b: Bench) -> None:
    """3. drain 20,000 no-op jobs: defaults; defaults quiet; concurrency 200; and the
    best settings found, concurrency 200 with a prefetch of 200."""
    for label, args in (
        ("defaults (concurrency 100, prefetch auto, info logs)", []),
        ("defaults, --log-level warning", QUIET),
        (
            f"--concurrency {BEST_CONCURRENCY} --log-level warning",
            ["--concurrency", str(BEST_CONCURRENCY), *QUIET],
        ),
        (f"{BEST_FLAGS} --log-level warning", [*BEST_FLAGS.split(), *QUIET]),
    ):
        b.fill("noop", DRAIN_JOBS)
        with worker(b, "--burst", *args) as wait:
            run = wait(300)
        b.record(f"3. drain no-op, {label} (jobs/s)", drained(b, "noop", run))
        b.record(f"8. worker peak RSS, drain no-op, {label} (MiB)", run.max_rss_mib)


def drain_queues(b: Bench, queues: int = 8) -> None:
    """3. drain 20,000 no-op jobs over *queues* queues, one worker serving them all."""
    names = [f"bench{i}" for i in range(queues)]
    b.reset()
    with b.engine.begin() as conn:
        sqlaq.enqueue_copy(
            conn, [NewJob("noop", {"n": n}, queue=names[n % queues]) for n in range(DRAIN_JOBS)]
        )
    with b.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")
        )
    args = ["--queue", ",".join(names), "--concurrency", str(BEST_CONCURRENCY), *QUIET]
    with worker(b, "--burst", *args) as wait:
        run = wait(300)
    label = f"{queues} queues, --concurrency {BEST_CONCURRENCY} --log-level warning"
    b.record(f"3. drain no-op, {label} (jobs/s)", drained(b, "noop", run))


def drain_transactional(b: Bench) -> None:
    """12. drain 20,000 no-op jobs, plain and transactional (each in a transaction of its
    own, completed there), at the same settings, one after the other."""
    args = ["--concurrency", "50", *QUIET]
    for kind, label in (("noop", "plain"), ("txn_noop", "transactional")):
        b.fill(kind, DRAIN_JOBS)
        with worker(b, "--burst", *args) as wait:
            run = wait(300)
        b.record(f"12. drain no-op, {label}, --concurrency 50 (jobs/s)", drained(b, kind, run))


def drain_sleep(b: Bench) -> None:
    """4. drain 20,000 jobs whose handler sleeps 10 ms, at concurrency 100: claiming for
    free slots only, with jobs prefetched for the slots to come, and with the prefetch
    left to the worker (the default, ``auto``: it follows the handlers' pace)."""
    for prefetch in (0, SLEEP_PREFETCH, "auto"):
        b.fill("sleep10", DRAIN_JOBS)
        args = ["--concurrency", str(SLEEP_CONCURRENCY), "--prefetch", str(prefetch), *QUIET]
        with worker(b, "--burst", *args) as wait:
            run = wait(300)
        label = f"concurrency {SLEEP_CONCURRENCY}, --prefetch {prefetch}"
        b.record(f"4. drain 10 ms handler, {label} (jobs/s)", drained(b, "sleep10", run))
        b.record(f"8. worker peak RSS, 10 ms handler, {label} (MiB)", run.max_rss_mib)


def process_executor(b: Bench) -> None:
    """13. the process executor: 2,000 jobs of a CPU-bound handler drained on threads
    and in child processes (each worker at its defaults: the threads' concurrency 100,
    the processes' one per core); then a handler stuck in ``time.sleep`` and one in a
    loop, 1 s timeout, killed by the process executor: how long each attempt lasted
    (claim to its failure written, on the database clock)."""
    from bench.app import CPU_ITERATIONS, cpu_work

    started = time.perf_counter()
    for _ in range(50):
        cpu_work()
    one = (time.perf_counter() - started) / 50 * 1000
    b.record(f"13. CPU-bound handler alone, {CPU_ITERATIONS:,} iterations (ms)", one)
    for label, args in (("threads", []), ("processes", ["--executor", "process"])):
        b.fill("cpu", CPU_JOBS)
        with worker(b, "--burst", *args, *QUIET, app=CPU_APP) as wait:
            run = wait(600)
        jobs_per_second = drained(b, "cpu", run if label == "threads" else None)
        b.record(f"13. drain CPU-bound handler, {label}, defaults (jobs/s)", jobs_per_second)
    b.reset()
    with b.engine.begin() as conn:
        for kind in ("stuck_sleep", "stuck_busy"):
            sqlaq.enqueue(conn, kind, max_attempts=1)
    with worker(b, "--burst", "--executor", "process", *QUIET, app=CPU_APP) as wait:
        run = wait(120)
    with b.engine.connect() as conn:
        ended = conn.execute(
            text(
                "SELECT kind, status, last_error, extract(epoch FROM finished_at - attempted_at)"
                " FROM sqlaq_jobs ORDER BY kind"
            )
        ).all()
    for kind, status, error, seconds in ended:
        if status != "failed" or "timed out after 1s" not in (error or ""):
            raise RuntimeError(f"{kind}: {status}, {error!r}")
        where = "time.sleep" if kind == "stuck_sleep" else "a Python loop"
        b.record(
            f"13. process executor, handler stuck in {where}, timeout 1 s: ended after (s)",
            float(seconds),
        )
    b.record("13. process executor, the stuck handlers' burst worker: wall (s)", run.wall)
    one, two = process_probe.bare(CPU_JOBS)
    b.record("13. ceiling: the handler's work in 1 thread, no database (jobs/s)", one)
    b.record("13. ceiling: the same in 2 bare processes, no queue (jobs/s)", two)


def thread_ceiling(b: Bench, jobs: int = DRAIN_JOBS) -> None:
    """4'. the ceiling of (4) without sqlaq or a database: 100 Python threads running
    10 ms sleeps, fed by one dispatcher that refills the free slots the way the worker
    does, pausing (GIL released) for a claim round trip of 0, 1 or 2 ms before each
    refill. Shows what threads alone allow on this machine."""
    for claim_ms in (0, 1, 2):
        work: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()

        threads = [
            threading.Thread(target=_sleeper, args=(work, finished), daemon=True)
            for _ in range(SLEEP_CONCURRENCY)
        ]
        for thread in threads:
            thread.start()
        busy = sent = done = 0
        start = time.perf_counter()
        while done < jobs:
            if busy == SLEEP_CONCURRENCY or sent == jobs:
                finished.get()
                busy, done = busy - 1, done + 1
            with suppress(queue.Empty):
                while True:
                    finished.get_nowait()
                    busy, done = busy - 1, done + 1
            room = min(SLEEP_CONCURRENCY - busy, jobs - sent)
            if room > 0:
                time.sleep(claim_ms / 1000)
                for _ in range(room):
                    work.put(1)
                busy, sent = busy + room, sent + room
        b.record(
            f"4'. ceiling: {SLEEP_CONCURRENCY} threads x 10 ms sleep, no database,"
            f" {claim_ms} ms per refill (jobs/s)",
            jobs / (time.perf_counter() - start),
        )
        for _ in threads:
            work.put(None)


def _sleeper(work: queue.SimpleQueue[int | None], finished: queue.SimpleQueue[int]) -> None:
    while work.get() is not None:
        time.sleep(0.010)
        finished.put(1)


def wakeup(b: Bench, count: int = 200, spacing: float = 0.020) -> None:
    """5. an idle worker (defaults), 200 single enqueues 20 ms apart: the time from the
    enqueue's commit returning to its handler starting (one clock: time.time())."""
    b.reset()
    committed: dict[int, float] = {}
    with worker(b) as wait:
        deadline = time.monotonic() + 30
        while not b.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'sqlaq-listener' AND query LIKE 'LISTEN%'"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the worker never started listening")
            time.sleep(0.05)
        time.sleep(0.5)  # its first look (at start) has found nothing: idle
        with b.engine.connect() as conn:
            for _ in range(count):
                job_id = sqlaq.enqueue(conn, "wake").job_id
                conn.commit()
                committed[job_id] = time.time()
                time.sleep(spacing)
        deadline = time.monotonic() + 30
        while b.scalar("SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'") < count:
            if time.monotonic() > deadline:
                raise RuntimeError("not every wake-up job was done in 30 s")
            time.sleep(0.05)
        for proc in b.workers:
            proc.send_signal(signal.SIGTERM)  # a graceful stop: the ledger is written
        run = wait(60)
    started = {job_id: at for job_id, kind, at in run.ledger if kind == "wake"}
    if set(started) != set(committed) or len(run.ledger) != count:
        raise RuntimeError(f"{len(run.ledger)} wake-up runs for {count} jobs")
    latencies = [(started[i] - committed[i]) * 1000 for i in committed]
    for q in (0.5, 0.95, 0.99):
        b.record(
            f"5. wake-up, commit to handler start: p{round(q * 100)} (ms)", percentile(latencies, q)
        )
    b.record("8. worker peak RSS, idle worker woken 200 times (MiB)", run.max_rss_mib)


def claim_latency(b: Bench) -> None:
    """6. claim p50/p99 with 1,000 queued jobs, empty history vs 1,000,000 finished rows."""
    for label, history in (("empty table", 0), ("1M finished rows", 1_000_000)):
        b.reset()
        with b.engine.begin() as conn:
            if history:
                conn.execute(
                    text(
                        "INSERT INTO sqlaq_jobs (kind, status, finished_at, attempts)"
                        " SELECT 'old', 'done', now(), 1 FROM generate_series(1, :n)"
                    ),
                    {"n": history},
                )
            sqlaq.enqueue_many(conn, [NewJob("noop") for _ in range(1000)])
        with b.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                text("VACUUM ANALYZE sqlaq_jobs")
            )
        worker_id = uuid.uuid4()
        samples = []
        with b.engine.connect() as conn:
            for _ in range(500):
                start = time.perf_counter()
                sqlaq.claim(conn, worker_id=worker_id, limit=10)
                samples.append((time.perf_counter() - start) * 1000)
                conn.rollback()  # keep the 1,000 queued jobs queued
        b.record(f"6. claim 10, {label}: p50 (ms)", percentile(samples, 0.5))
        b.record(f"6. claim 10, {label}: p99 (ms)", percentile(samples, 0.99))


def limits(b: Bench) -> None:
    """9. what per-kind limits cost: one claim of 10 in a transaction, plain and under
    limits (p50, ms); and a drain of a limited kind at the best settings (jobs/s)."""
    b.reset()
    with b.engine.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("limited") for _ in range(1000)])
        conn.execute(
            text(
                "INSERT INTO sqlaq_rates (kind, starts) SELECT 'limited', array_agg(now())"
                " FROM generate_series(1, 990)"
            )
        )
    worker_id = uuid.uuid4()
    variants: dict[str, Callable[[Connection], object]] = {
        "plain claim": lambda conn: sqlaq.claim(conn, worker_id=worker_id, limit=10),
        "claim_limited, concurrency": lambda conn: sqlaq.claim_limited(
            conn, worker_id=worker_id, kind="limited", limit=10, concurrency=100_000
        ),
        "claim_limited, rate": lambda conn: sqlaq.claim_limited(
            conn, worker_id=worker_id, kind="limited", limit=10, rate=LIMITED_RATE
        ),
        "claim_limited, both": lambda conn: sqlaq.claim_limited(
            conn,
            worker_id=worker_id,
            kind="limited",
            limit=10,
            concurrency=100_000,
            rate=LIMITED_RATE,
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with b.engine.connect() as conn:
        for _ in range(300):  # interleaved, so drift hits every variant alike
            for name, claim in variants.items():
                start = time.perf_counter()
                claim(conn)
                conn.rollback()  # the jobs stay queued, the start log unchanged
                samples[name].append((time.perf_counter() - start) * 1000)
    for name, values in samples.items():
        b.record(f"9. {name}, 10 jobs, with BEGIN/ROLLBACK: p50 (ms)", percentile(values, 0.5))
    b.fill("limited", DRAIN_JOBS)
    args = ["--burst", "--concurrency", str(BEST_CONCURRENCY), *QUIET]
    with worker(b, *args, app=LIMITED_APP) as wait:
        run = wait(300)
    b.record(
        f"9. drain limited kind, --concurrency {BEST_CONCURRENCY} --log-level warning (jobs/s)",
        drained(b, "limited", run),
    )


# The raw loop's SQL does what sqlaq's claim and complete do for due queued jobs, in the
# same statement shapes (a MATERIALIZED CTE with SKIP LOCKED, ids handed to the primary
# key; a complete fenced by id and lease token) and returning the same columns, so the
# ratio measures sqlaq's Python and SQLAlchemy, not different SQL. What it leaves out:
# expired-lease handling (the CASEs of sqlaq's claim), validation, dataclasses, handler
# threads, callbacks and logging.
RAW_CLAIM = """
WITH c AS MATERIALIZED (
    SELECT id FROM sqlaq_jobs
    WHERE status IN ('queued', 'running') AND queue = 'default' AND run_at <= now()
    ORDER BY priority DESC, run_at, id LIMIT %(n)s FOR UPDATE SKIP LOCKED)
UPDATE sqlaq_jobs j SET status = 'running', attempts = j.attempts + 1, locked_by = %(w)s,
    lease_token = gen_random_uuid(), run_at = now() + %(lease)s
FROM c WHERE j.id = c.id AND j.id = ANY(ARRAY(SELECT id FROM c))
RETURNING j.id, j.queue, j.kind, j.payload, j.priority, j.status, j.attempts,
    j.max_attempts, j.lease_token, j.run_at, j.created_at
"""
RAW_COMPLETE = """
UPDATE sqlaq_jobs SET status = 'done', finished_at = now(), lease_token = NULL
WHERE id = ANY(%(ids)s) AND lease_token = ANY(%(tokens)s) AND status = 'running'
RETURNING id
"""


def raw_loop(dsn: str, in_flight: int) -> int:
    """Drain the queue the way the worker does, in raw psycopg, and return how many jobs
    were completed. This thread claims up to ``in_flight`` minus the jobs claimed and not
    yet completed, per statement (the worker's claim size: its free slots); a second
    thread, on a second connection, completes everything claimed since its last
    statement (the worker's writer). Both connections autocommit, as the worker's do."""
    claimed: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
    slots = threading.Condition()
    state = {"in_flight": 0, "done": 0}

    def complete() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                batches = [claimed.get()]
                with suppress(queue.Empty):
                    while True:
                        batches.append(claimed.get_nowait())
                rows = [row for batch in batches if batch for row in batch]
                if rows:
                    params = {"ids": [r[0] for r in rows], "tokens": [r[8] for r in rows]}
                    written = len(conn.execute(RAW_COMPLETE, params).fetchall())
                    with slots:
                        state["in_flight"] -= len(rows)
                        state["done"] += written
                        slots.notify()
                if None in batches:
                    return

    completer = threading.Thread(target=complete, name="raw-completer")
    completer.start()
    worker_id = uuid.uuid4()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                with slots:
                    slots.wait_for(lambda: state["in_flight"] < in_flight)
                    n = in_flight - state["in_flight"]
                params = {"n": n, "w": worker_id, "lease": DEFAULT_LEASE}
                rows = conn.execute(RAW_CLAIM, params).fetchall()
                if not rows:
                    break
                with slots:
                    state["in_flight"] += len(rows)
                claimed.put(rows)
    finally:
        claimed.put(None)
        completer.join()
    return state["done"]


def raw_baseline(b: Bench) -> None:
    """7. the claim-batch / complete-batch loop in raw psycopg, at the in-flight bounds
    (= claim batch sizes) of the drains in (3): the default 10 and the best found."""
    for in_flight in (10, BEST_CONCURRENCY, BEST_IN_HAND):
        b.fill("noop", DRAIN_JOBS)
        done = raw_loop(b.psycopg_dsn(), in_flight)
        seconds = b.scalar(
            "SELECT extract(epoch FROM max(finished_at) - (min(run_at) - :lease)) FROM sqlaq_jobs",
            lease=DEFAULT_LEASE,
        )
        if done != DRAIN_JOBS or b.scalar("SELECT count(*) FROM sqlaq_jobs WHERE status <> 'done'"):
            raise RuntimeError(f"raw loop finished {done} of {DRAIN_JOBS} jobs")
        b.record(
            f"7. raw psycopg loop, {in_flight} in flight (jobs/s)", DRAIN_JOBS / float(seconds)
        )


def ops_loop(b: Bench, batch: int = BEST_CONCURRENCY) -> None:
    """The same loop through sqlaq.claim / sqlaq.complete on one connection, no worker:
    how much of the worker's cost is the library's operations."""
    b.fill("noop", DRAIN_JOBS)
    worker_id = uuid.uuid4()
    done = 0
    with b.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        start = time.perf_counter()
        while jobs := sqlaq.claim(conn, worker_id=worker_id, limit=batch):
            conn.commit()
            done += len(sqlaq.complete(conn, [j.lease for j in jobs]))
            conn.commit()
        elapsed = time.perf_counter() - start
    if done != DRAIN_JOBS:
        raise RuntimeError(f"ops loop finished {done} of {DRAIN_JOBS} jobs")
    b.record(
        f"   sqlaq.claim/complete loop, one connection, batch {batch} (jobs/s)", done / elapsed
    )


SCENARIOS: dict[str, Callable[[Bench], None]] = {
    "enqueue_single": enqueue_single,
    "enqueue_bulk": enqueue_bulk,
    "drain": drain,
    "drain_queues": drain_queues,
    "drain_transactional": drain_transactional,
    "raw_baseline": raw_baseline,
    "drain_sleep": drain_sleep,
    "thread_ceiling": thread_ceiling,
    "wakeup": wakeup,
    "claim_latency": claim_latency,
    "ops_loop": ops_loop,
    "limits": limits,
    "process_executor": process_executor,
    "dashboard": dashboard_scenario.dashboard,
}
#: Run only when named (--only): see bench/scale.py.
SCALE_SCENARIOS = scale_scenario.scenarios(worker)
SCENARIOS |= SCALE_SCENARIOS
#: Run only when named with ``--only``.
OPT_IN = {*SCALE_SCENARIOS, "drain_queues"}


# --- targets -------------------------------------------------------------------------

SLEEP_LABEL = f"concurrency {SLEEP_CONCURRENCY}, --prefetch {SLEEP_PREFETCH}"
SLEEP_BEST = f"4. drain 10 ms handler, {SLEEP_LABEL} (jobs/s)"
SLEEP_BEST_RSS = f"8. worker peak RSS, 10 ms handler, {SLEEP_LABEL} (MiB)"
DRAIN_200 = f"3. drain no-op, --concurrency {BEST_CONCURRENCY} --log-level warning (jobs/s)"
RAW_200 = f"7. raw psycopg loop, {BEST_CONCURRENCY} in flight (jobs/s)"
BEST_DRAIN = f"3. drain no-op, {BEST_FLAGS} --log-level warning (jobs/s)"
RAW_BEST = f"7. raw psycopg loop, {BEST_IN_HAND} in flight (jobs/s)"
BEST_RATIO = f"3/7. sqlaq / raw, best ({BEST_IN_HAND} in hand)"
PROCESS_RATIO = "13. drain CPU-bound handler, processes / threads"
RATIOS = {
    "3/7. sqlaq at defaults / raw, 10 in flight": (
        "3. drain no-op, defaults, --log-level warning (jobs/s)",
        "7. raw psycopg loop, 10 in flight (jobs/s)",
    ),
    f"3/7. sqlaq / raw, concurrency {BEST_CONCURRENCY} (200 in flight)": (DRAIN_200, RAW_200),
    BEST_RATIO: (BEST_DRAIN, RAW_BEST),
    "6. claim p50, 1M finished / empty table": (
        "6. claim 10, 1M finished rows: p50 (ms)",
        "6. claim 10, empty table: p50 (ms)",
    ),
    PROCESS_RATIO: (
        "13. drain CPU-bound handler, processes, defaults (jobs/s)",
        "13. drain CPU-bound handler, threads, defaults (jobs/s)",
    ),
    "13. ceiling: 2 bare processes / 1 thread": (
        "13. ceiling: the same in 2 bare processes, no queue (jobs/s)",
        "13. ceiling: the handler's work in 1 thread, no database (jobs/s)",
    ),
}
# (figure, comparison, bound); a figure not measured in this run is left out.
TARGETS: list[tuple[str, str, float]] = [
    (BEST_DRAIN, ">=", 20_000),
    (BEST_RATIO, ">=", 0.7),
    (SLEEP_BEST, ">=", 8_000),
    ("2. enqueue_many 20k, NewJobs built (jobs/s)", ">=", 25_000),
    ("2. enqueue_copy 20k, NewJobs built (jobs/s)", ">=", 50_000),
    ("5. wake-up, commit to handler start: p50 (ms)", "<", 3),
    ("5. wake-up, commit to handler start: p99 (ms)", "<", 10),
    ("6. claim p50, 1M finished / empty table", "<=", 1.5),
    (SLEEP_BEST_RSS, "<", 80),
    (PROCESS_RATIO, ">=", 1.7),
    ("13. process executor, handler stuck in time.sleep, timeout 1 s: ended after (s)", "<", 2),
    ("13. process executor, handler stuck in a Python loop, timeout 1 s: ended after (s)", "<", 2),
    *dashboard_scenario.TARGETS,
]


def add_ratios(figures: dict[str, list[float]]) -> None:
    """Ratios per round (both figures of a ratio come from the same round)."""
    for name, (top, bottom) in RATIOS.items():
        if top in figures and bottom in figures:
            figures[name] = [a / b for a, b in zip(figures[top], figures[bottom], strict=False)]


def targets(figures: dict[str, list[float]]) -> list[str]:
    lines = []
    for name, op, bound in TARGETS:
        if name not in figures:
            continue
        median = statistics.median(figures[name])
        met = {">=": median >= bound, "<": median < bound, "<=": median <= bound}[op]
        lines.append(f"- [{'x' if met else ' '}] {name}: median {median:,.2f} {op} {bound:,}")
    return lines


# --- driver --------------------------------------------------------------------------


def create_database(server_url: str) -> tuple[str, Engine]:
    name = f"sqlaq_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url)
    with engine.connect() as conn:
        sqlaq.migrations.upgrade(conn)
        conn.commit()
    return url, engine


def existing_database(url: str) -> Engine:
    """SQLAQ_BENCH_DATABASE_URL's database, migrated if need be and, on a Citus
    coordinator, distributed (``sqlaq citus-distribute``); its jobs deleted."""
    import sqlaq.citus

    engine = create_engine(url)
    with engine.begin() as conn:
        sqlaq.migrations.upgrade(conn)
    with engine.begin() as conn:
        if not sqlaq.citus.problems(conn):
            sqlaq.citus.distribute(conn)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs"))
    return engine


def drop_database(server_url: str, url: str) -> None:
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def _citus_version(engine: Engine) -> str | None:
    """Citus's version in *engine*'s database, None without it."""
    from sqlaq.queries.citus import citus_version_stmt

    with engine.connect() as conn:
        return conn.execute(citus_version_stmt()).scalar()


def table(figures: dict[str, list[float]]) -> str:
    width = max(len(name) for name in figures)
    lines = [
        f"| {'figure':<{width}} | median | min | max |",
        f"|{'-' * (width + 2)}|---:|---:|---:|",
    ]
    for name in sorted(figures, key=lambda n: n.strip()):
        values = figures[name]
        med, low, high = statistics.median(values), min(values), max(values)
        digits = 2 if med < 100 else 0
        cells = (f"{v:,.{digits}f}" for v in (med, low, high))
        lines.append(f"| {name:<{width}} | {' | '.join(cells)} |")
    return "\n".join(lines)


def machine_info(server: str, argv: list[str]) -> dict[str, Any]:
    with psycopg.connect(
        make_url(server).set(drivername="postgresql").render_as_string(False)
    ) as c:
        row = c.execute("SHOW server_version").fetchone()
    cpu = "?"
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    return {
        "command": " ".join(["python", "bench/run.py", *argv]),
        "python": platform.python_version(),
        "postgresql": row[0] if row else "?",
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "psycopg_impl": psycopg.pq.__impl__,
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "machine": platform.machine(),
        "system": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS))
    parser.add_argument("--json", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    server = os.environ.get("SQLAQ_BENCH_SERVER_URL", DEFAULT_SERVER)
    existing = os.environ.get("SQLAQ_BENCH_DATABASE_URL")
    info = machine_info(existing or server, argv)
    if existing:
        url, engine = existing, existing_database(existing)
        info["citus"] = _citus_version(engine)
    else:
        url, engine = create_database(server)
    bench = Bench(url, engine)
    chosen = args.only or [name for name in SCENARIOS if name not in OPT_IN]
    started = time.perf_counter()
    try:
        for round_ in range(args.rounds):
            for name in chosen:
                print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                SCENARIOS[name](bench)
    finally:
        for proc in list(bench.workers):  # a scenario that failed half-way
            with suppress(OSError):
                proc.kill()
        engine.dispose()
        if not existing:
            drop_database(server, url)
    info["seconds"] = round(time.perf_counter() - started)
    figures = bench.figures
    add_ratios(figures)
    print(table(figures))
    print("\nTargets (median of the rounds):")
    print("\n".join(targets(figures)))
    print(json.dumps(info))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"info": info, "figures": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
