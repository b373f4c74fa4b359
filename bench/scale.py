"""Benchmark scenarios ``scale_*``: sqlaq at scale. Not in the default run (minutes each,
and ``scale_starved`` starts a PostgreSQL server of its own): name them.

    python bench/run.py --rounds 1 --only scale_processes scale_backlog scale_held_xmin \
        scale_starved
    python bench/run.py --rounds 1 --only scale_held_steady          (10 minutes)
    SQLAQ_BENCH_BACKLOG=100000 python bench/run.py --only scale_backlog --rounds 1   (smaller)

* ``scale_processes``  4 ``sqlaq-worker --burst`` processes on one database against 1,
  no-op (40,000 jobs) and 10 ms handlers (20,000 jobs): jobs/s on the table's clock, and
  the PostgreSQL CPU each job cost (utime + stime of the server's processes, read from
  ``/proc``: the backends of the bench's database, and the server's background
  processes, which are shared with anything else the server does).
* ``scale_backlog``    a backlog of ``SQLAQ_BENCH_BACKLOG`` (default 1,000,000) no-op jobs
  drained by one worker at the best settings: jobs/s per tenth of the backlog (from the
  ``finished_at`` of each tenth), the last tenth over the first, and the table's dead
  tuples and autovacuum runs (``pg_stat_user_tables``), sampled during the drain and
  after it until autovacuum has run (or 180 s). On a throwaway server with stock
  settings (as ``scale_starved``'s), since the local one runs with autovacuum off.
  ``SQLAQ_BENCH_NO_VACUUM=1`` runs the worker with ``--no-vacuum`` (autovacuum alone);
  set ``SQLAQ_BENCH_BACKLOG_HERE=1`` to drain on the bench's own server instead, and
  ``SQLAQ_BENCH_SERVER_SETTINGS="autovacuum_naptime=10s ..."`` to set more of the
  throwaway server's settings.
* ``scale_held_xmin``  ``SQLAQ_BENCH_HELD_JOBS`` (default 50,000) no-op jobs drained with
  and without a ``REPEATABLE READ`` transaction held open on another connection for the
  whole drain (its snapshot holds back the xmin horizon: no dead tuple or index entry of
  the drain can be removed), at four claim batches (``HELD_SETTINGS``: the old defaults,
  today's, the best no-op settings, a deep prefetch); the ratio, the median of a
  10-job claim timed every 100 ms during the drain (another consumer claiming as a
  worker does, from its last position: its jobs count as run once), the vacuums of the
  table during the drain (the worker's own, ``pg_stat_user_tables.vacuum_count``), and
  its dead row versions and size after it.
  ``SQLAQ_BENCH_HELD_SETTINGS=defaults`` (labels, comma-separated) runs only those.
* ``scale_held_steady`` one long-running worker (defaults) fed ``SQLAQ_BENCH_STEADY_RATE``
  (default 500) jobs/s in batches every 20 ms for ``SQLAQ_BENCH_STEADY_SECONDS`` (default
  600) with a snapshot held for the whole run: commit-to-start p50/p99 of the first and
  the last whole minute, and the p99's ratio (a claim that slows with the dead entries
  shows as a rising tail); every minute's p50, p99 and load are printed too (the load
  moves the tail from minute to minute on a shared machine). With
  ``SQLAQ_BENCH_STEADY_WAKES`` (per second, default 0) some batches also send the queue's
  name alone on ``sqlaq_jobs`` at their commit, as a workflow's release does: a
  notification without a position.
* ``scale_starved``    6 long-running workers (LISTEN and maintenance on: 4 connections
  each) on a throwaway server with ``max_connections=20`` (initdb'd as the ``postgres``
  OS user into a temporary folder, on a free port; stopped and deleted afterwards),
  20,000 jobs of 10 ms (``--concurrency 10 --prefetch 20 --lease 5s``: a short lease,
  so a claim sitting out its lease shows within the drain): jobs run twice (the
  handlers' ledger), jobs claimed again, and the longest any claimed job sat (the claim's
  age of the oldest ``running`` job, sampled every 200 ms).
  To measure another sqlaq (the one before a fix), point the workers at it:
  ``PYTHONPATH=/path/to/old/tree`` (the benchmark itself imports this tree's).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import psycopg
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

import sqlaq
from sqlaq.drive import run as run_plan
from sqlaq.ops import DEFAULT_LEASE
from sqlaq.ops.claiming import claim_bounded
from sqlaq.schema import DEFAULT_QUEUE

PROCESS_JOBS = {"noop": 40_000, "sleep10": 20_000}
BACKLOG = int(os.environ.get("SQLAQ_BENCH_BACKLOG", "1000000"))
HELD_JOBS = int(os.environ.get("SQLAQ_BENCH_HELD_JOBS", "50000"))
STARVED_JOBS = 20_000
#: A short lease, so a claim that sits shows within the drain (the default is 30 s).
STARVED_LEASE = timedelta(seconds=5)
#: The drain counts as stuck once no job was done for this long (seconds).
STALLED = 60.0
STARVED_WORKERS = 6
STARVED_MAX_CONNECTIONS = 20
#: The best no-op settings of bench/run.py (scenario 3).
BEST = ["--concurrency", "200", "--prefetch", "200"]
QUIET = ["--log-level", "warning"]
#: Where Debian keeps the server binaries (bin/initdb, bin/pg_ctl) of each version.
DEBIAN_POSTGRES = Path("/usr/lib/postgresql")


class WorkerRun(Protocol):
    ledger: list[tuple[int, str, float]]


Spawn = Callable[..., AbstractContextManager[Callable[[float], WorkerRun]]]


class Recorder(Protocol):
    """What the scenarios need of bench/run.py's ``Bench``."""

    url: str
    engine: Engine
    workers: list[subprocess.Popen[bytes]]

    def record(self, name: str, value: float) -> None: ...

    def reset(self) -> None: ...

    def fill(self, kind: str, count: int) -> None: ...

    def scalar(self, sql: str, **params: Any) -> Any: ...


# --- shared --------------------------------------------------------------------------


def load() -> str:
    """The load averages, for the record."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def check_once(
    engine: Engine, kind: str, runs: list[tuple[int, str, float]], extra: Iterable[int] = ()
) -> None:
    """Every job done, claimed once, run once (by a handler, or taken by *extra* ids)."""
    with engine.connect() as conn:
        done, total, attempts = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE status = 'done'), count(*), max(attempts)"
                " FROM sqlaq_jobs"
            )
        ).one()
        ids = set(conn.execute(text("SELECT id FROM sqlaq_jobs")).scalars())
    seen = Counter(i for i, ran, _ in runs if ran == kind)
    seen.update(extra)
    if done != total or attempts != 1:
        raise RuntimeError(f"{done} of {total} jobs done, max attempts {attempts}")
    if set(seen) != ids or max(seen.values()) != 1:
        raise RuntimeError(f"{len(seen)} distinct jobs run of {total}; twice: {twice(seen)}")


def twice(seen: Counter[int]) -> int:
    return sum(1 for n in seen.values() if n > 1)


def table_rate(engine: Engine) -> float:
    """Jobs/s from the first claim to the last completion, on the database's clock."""
    with engine.connect() as conn:
        total, seconds = conn.execute(
            text(
                "SELECT count(*), extract(epoch FROM max(finished_at) - (min(run_at) - :lease))"
                " FROM sqlaq_jobs"
            ),
            {"lease": DEFAULT_LEASE},
        ).one()
    return float(total) / float(seconds)


def fill_sql(engine: Engine, kind: str, count: int) -> None:
    """An empty queue, then *count* due jobs of *kind* (one INSERT ... SELECT), analyzed."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs, sqlaq_rates, sqlaq_periodic"))
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (queue, kind, payload)"
                " SELECT 'default', :kind, jsonb_build_object('n', n)"
                " FROM generate_series(1, :count) AS n"
            ),
            {"kind": kind, "count": count},
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")
        )


# --- PostgreSQL CPU --------------------------------------------------------------------


def postgres_processes() -> dict[int, tuple[str, float]]:
    """Every process of the OS user ``postgres``: pid -> (command line, CPU seconds)."""
    uid = pwd.getpwnam("postgres").pw_uid
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        found[int(entry.name)] = (cmdline, (int(fields[11]) + int(fields[12])) / ticks)
    return found


@dataclass
class CpuMeter:
    """Samples the server's processes every *interval* s while running: a backend
    lives only as long as its connection, so its CPU is read while it lives (the last
    sample before it ended counts: at most *interval* of it is missed)."""

    database: str
    interval: float = 0.1
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, tuple[str, float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> CpuMeter:
        self.first = {pid: cpu for pid, (_, cpu) in postgres_processes().items()}
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.last.update(postgres_processes())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.last.update(postgres_processes())

    def seconds(self) -> tuple[float, float]:
        """CPU seconds used meanwhile: (the database's backends, the server's background
        processes: postmaster, WAL writer, checkpointer, autovacuum, ...). Other
        databases' backends are left out."""
        ours = background = 0.0
        for pid, (cmdline, cpu) in self.last.items():
            used = cpu - self.first.get(pid, 0.0)
            if f" {self.database} " in cmdline:
                ours += used
            elif "(" not in cmdline and "[local]" not in cmdline:
                background += used
        return ours, background


# --- (a) worker processes --------------------------------------------------------------


def processes(b: Recorder, worker: Spawn) -> None:
    """4 worker processes vs 1 on one database: jobs/s and PostgreSQL CPU per job."""
    database = make_url(b.url).database or ""
    for kind, jobs in PROCESS_JOBS.items():
        for count in (1, 4):
            b.fill(kind, jobs)
            with CpuMeter(database) as meter, ExitStack() as stack:
                waits = [
                    stack.enter_context(worker(b, "--burst", *BEST, *QUIET)) for _ in range(count)
                ]
                runs = [wait(600) for wait in waits]
            check_once(b.engine, kind, [r for run in runs for r in run.ledger])
            rate = table_rate(b.engine)
            ours, background = meter.seconds()
            label = f"{count} process{'es' if count > 1 else ''}, {kind}, {' '.join(BEST)}"
            b.record(f"15. scale: {label} (jobs/s)", rate)
            b.record(f"15. scale: {label}, PostgreSQL CPU/job, backends (us)", ours / jobs * 1e6)
            b.record(
                f"15. scale: {label}, PostgreSQL CPU/job, background processes (us)",
                background / jobs * 1e6,
            )
            b.record(f"15. scale: {label}, load", float(load().split()[0]))


# --- (b) backlog ------------------------------------------------------------------------


@contextmanager
def table_stats(engine: Engine, every: float = 5.0) -> Iterator[list[tuple[float, ...]]]:
    """Samples of ``pg_stat_user_tables`` for sqlaq_jobs every *every* s: (seconds, live,
    dead, autovacuum count, autoanalyze count)."""
    samples: list[tuple[float, ...]] = []
    stop = threading.Event()
    start = time.monotonic()

    def loop() -> None:
        with engine.connect() as conn:
            while True:
                row = conn.execute(
                    text(
                        "SELECT n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count"
                        " FROM pg_stat_user_tables WHERE relname = 'sqlaq_jobs'"
                    )
                ).one()
                conn.rollback()
                samples.append((time.monotonic() - start, *map(float, row)))
                if stop.wait(every):
                    return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def backlog(b: Recorder, worker: Spawn) -> None:
    """A backlog of BACKLOG no-op jobs drained by one worker: jobs/s per tenth. On a
    throwaway server with stock settings (autovacuum on), unless SQLAQ_BENCH_BACKLOG_HERE
    is set (the bench's own server: the local one runs with autovacuum off)."""
    if os.environ.get("SQLAQ_BENCH_BACKLOG_HERE"):
        drain_backlog(b, worker)
        return
    with throwaway_database(b) as elsewhere:
        drain_backlog(elsewhere, worker)


def drain_backlog(b: Any, worker: Spawn) -> None:
    fill_sql(b.engine, "noop", BACKLOG)
    with b.engine.connect() as conn:
        autovacuum = conn.execute(text("SHOW autovacuum")).scalar_one()
        if autovacuum == "on":
            naptime = conn.execute(text("SHOW autovacuum_naptime")).scalar_one()
            autovacuum = f"on, naptime {naptime}"
    # SQLAQ_BENCH_NO_VACUUM=1: the worker leaves the table to autovacuum (--no-vacuum).
    vacuum = [] if not os.environ.get("SQLAQ_BENCH_NO_VACUUM") else ["--no-vacuum"]
    autovacuum += ", worker vacuum " + ("off" if vacuum else "on")
    counts = text(
        "SELECT autovacuum_count, vacuum_count FROM pg_stat_user_tables"
        " WHERE relname = 'sqlaq_jobs'"
    )
    with b.engine.connect() as conn:
        before, manual_before = conn.execute(counts).one()
    with table_stats(b.engine) as samples, worker(b, "--burst", *BEST, *QUIET, *vacuum) as wait:
        run = wait(3600)
    with b.engine.connect() as conn:
        manual = conn.execute(counts).one()[1] - manual_before
    check_once(b.engine, "noop", run.ledger)
    drained_at = time.monotonic()
    with table_stats(b.engine, every=1.0) as after:  # until autovacuum has run, or 180 s
        while time.monotonic() - drained_at < 180 and not (after and after[-1][3] > before):
            time.sleep(1.0)
    vacuumed = time.monotonic() - drained_at if after[-1][3] > before else float("nan")
    with b.engine.connect() as conn:
        tenths = conn.execute(
            text(
                "SELECT tenth, count(*), extract(epoch FROM max(finished_at) - min(finished_at))"
                " FROM (SELECT finished_at, ntile(10) OVER (ORDER BY finished_at) AS tenth"
                " FROM sqlaq_jobs) AS t GROUP BY tenth ORDER BY tenth"
            )
        ).all()
    rates = [count / float(seconds) for _, count, seconds in tenths]
    size = f"{BACKLOG:,}, autovacuum {autovacuum}"
    b.record(f"16. backlog {size}: drain (jobs/s)", table_rate(b.engine))
    for (tenth, _, _), rate in zip(tenths, rates, strict=True):
        b.record(f"16. backlog {size}: tenth {tenth:>2} (jobs/s)", rate)
    b.record(f"16. backlog {size}: last tenth / first tenth", rates[-1] / rates[0])
    b.record(f"16. backlog {size}: dead tuples, peak", max(s[2] for s in samples))
    b.record(f"16. backlog {size}: autovacuum runs during the drain", samples[-1][3] - before)
    b.record(f"16. backlog {size}: the worker's vacuums during the drain", manual)
    b.record(f"16. backlog {size}: first autovacuum after the drain ended (s)", vacuumed)
    b.record(f"16. backlog {size}: dead tuples after it", after[-1][2])
    b.record(f"16. backlog {size}: load", float(load().split()[0]))
    for at, live, dead, vacuums, analyzes in samples:
        print(
            f"  backlog t={at:6.1f}s live={live:,.0f} dead={dead:,.0f}"
            f" autovacuum={vacuums:.0f} autoanalyze={analyzes:.0f}",
            flush=True,
        )
    print(
        f"  backlog after the drain: {vacuumed:.0f}s to the first autovacuum,"
        f" dead={after[-1][2]:,.0f}"
    )


# --- (c) held xmin ----------------------------------------------------------------------


@contextmanager
def claim_sampler(engine: Engine, every: float = 0.1) -> Iterator[tuple[list[float], list[int]]]:
    """Claims 10 jobs every *every* s (completing them): the claim's times (ms) and the
    ids it took, while a drain runs. The claim is a worker's (from the position of the
    last job it took, a full one at each poll: :mod:`sqlaq.worker.fetcher`), so it
    costs what another worker's would."""
    times: list[float] = []
    taken: list[int] = []
    stop = threading.Event()
    worker_id = uuid.uuid4()
    poll = sqlaq.WorkerConfig().poll_interval.total_seconds()

    def loop() -> None:
        position = None
        next_poll = time.monotonic() + poll
        with engine.connect() as conn:
            while not stop.wait(every):
                if time.monotonic() >= next_poll:
                    position, next_poll = None, time.monotonic() + poll
                start = time.perf_counter()
                jobs, last = run_plan(
                    conn,
                    claim_bounded(
                        worker_id=worker_id,
                        queue=DEFAULT_QUEUE,
                        limit=10,
                        lease=DEFAULT_LEASE,
                        after=position,
                    ),
                )
                position = last or position
                elapsed = (time.perf_counter() - start) * 1000
                sqlaq.complete(conn, [j.lease for j in jobs])
                conn.commit()
                if jobs:
                    times.append(elapsed)
                    taken.extend(j.id for j in jobs)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield times, taken
    finally:
        stop.set()
        thread.join()


@contextmanager
def held_snapshot(b: Recorder) -> Iterator[None]:
    """A REPEATABLE READ transaction open on another connection (its snapshot taken)."""
    dsn = make_url(b.url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1")
        try:
            yield
        finally:
            conn.rollback()


#: Claim batches from small to large: the old defaults (10 slots, no prefetch), today's
#: defaults (100 slots, automatic prefetch), the best no-op settings, a deep prefetch.
HELD_SETTINGS = {
    "--concurrency 10 --prefetch 0": ["--concurrency", "10", "--prefetch", "0"],
    "defaults": [],
    "--concurrency 200 --prefetch 200": BEST,
    "--concurrency 200 --prefetch 1000": ["--concurrency", "200", "--prefetch", "1000"],
}


def table_after(engine: Engine) -> tuple[float, float, float]:
    """sqlaq_jobs' vacuums so far (manual: the worker's), dead row versions, and size
    with its indexes (MB)."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT vacuum_count, n_dead_tup, pg_total_relation_size(relid) / 1e6"
                " FROM pg_stat_user_tables WHERE relname = 'sqlaq_jobs'"
            )
        ).one()
    return float(row[0]), float(row[1]), float(row[2])


def held_xmin(b: Recorder, worker: Spawn) -> None:
    """The same drain without and with a snapshot held open, at a few claim batches."""
    size = f"{HELD_JOBS:,}"
    # SQLAQ_BENCH_HELD_SETTINGS=defaults (labels of HELD_SETTINGS, comma-separated):
    # only those, e.g. for a drain of 1,000,000 jobs.
    chosen = os.environ.get("SQLAQ_BENCH_HELD_SETTINGS")
    settings = {
        label: flags
        for label, flags in HELD_SETTINGS.items()
        if chosen is None or label in chosen.split(",")
    }
    for label, flags in settings.items():
        rates = {}
        for held in (False, True):
            fill_sql(b.engine, "noop", HELD_JOBS)
            vacuums_before = table_after(b.engine)[0]
            with ExitStack() as stack:
                if held:
                    stack.enter_context(held_snapshot(b))
                times, taken = stack.enter_context(claim_sampler(b.engine))
                wait = stack.enter_context(worker(b, "--burst", *flags, *QUIET))
                run = wait(1800)
                stack.close()
            check_once(b.engine, "noop", run.ledger, extra=taken)
            which = "snapshot held" if held else "no snapshot"
            rates[held] = table_rate(b.engine)
            b.record(f"17. held xmin, {size} jobs, {label}, {which} (jobs/s)", rates[held])
            vacuums, dead, megabytes = table_after(b.engine)
            b.record(
                f"17. held xmin, {size} jobs, {label}, {which}: vacuums during the drain",
                vacuums - vacuums_before,
            )
            b.record(f"17. held xmin, {size} jobs, {label}, {which}: dead tuples after", dead)
            b.record(f"17. held xmin, {size} jobs, {label}, {which}: table size (MB)", megabytes)
            if times:
                b.record(
                    f"17. held xmin, {size} jobs, {label}, {which}: claim 10 p50 (ms)",
                    statistics.median(times),
                )
            b.record(
                f"17. held xmin, {size} jobs, {label}, {which}: load", float(load().split()[0])
            )
        b.record(
            f"17. held xmin, {size} jobs, {label}: held / not held", rates[True] / rates[False]
        )


#: The steady run: its length (s) and arrival rate (jobs/s), enqueued in batches every 20 ms.
STEADY_SECONDS = float(os.environ.get("SQLAQ_BENCH_STEADY_SECONDS", "600"))
STEADY_RATE = int(os.environ.get("SQLAQ_BENCH_STEADY_RATE", "500"))
STEADY_TICK = 0.020
STEADY_WAKES = float(os.environ.get("SQLAQ_BENCH_STEADY_WAKES", "0"))


def held_steady(b: Recorder, worker: Spawn) -> None:
    """A long-running worker (defaults) fed at a fixed rate for STEADY_SECONDS with a
    snapshot held for the whole run: the time from each batch's commit to its handlers'
    start, per minute (first and last), and their ratio (flat is 1)."""
    b.reset()
    committed: dict[int, float] = {}
    per_tick = max(1, round(STEADY_RATE * STEADY_TICK))
    with held_snapshot(b), worker(b, *QUIET) as wait:
        deadline = time.monotonic() + 30
        with b.engine.connect() as conn:
            listening = text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'sqlaq-listener' AND query LIKE 'LISTEN%'"
            )
            while not conn.execute(listening).scalar_one():
                conn.rollback()
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker never started listening")
                time.sleep(0.05)
            conn.rollback()
            start = next_tick = time.monotonic()
            batch = [sqlaq.NewJob("wake")] * per_tick
            loads: list[str] = []  # the load at the end of each minute
            wakes = 0
            while time.monotonic() - start < STEADY_SECONDS:
                if time.monotonic() - start >= 60 * (len(loads) + 1):
                    loads.append(load().split()[0])
                results = sqlaq.enqueue_many(conn, batch)
                if STEADY_WAKES and wakes < STEADY_WAKES * (time.monotonic() - start):
                    sqlaq.ops.notify_queues(conn, ["default"])  # no position: "somewhere"
                    wakes += 1
                conn.commit()
                now = time.time()
                for result in results:
                    committed[result.job_id] = now
                next_tick += STEADY_TICK
                delay = next_tick - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        deadline = time.monotonic() + 120
        with b.engine.connect() as conn:
            done = text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'")
            while conn.execute(done).scalar_one() < len(committed):
                conn.rollback()
                if time.monotonic() > deadline:
                    raise RuntimeError("the steady run's jobs were not done 120 s after")
                time.sleep(0.2)
        for proc in b.workers:
            proc.send_signal(signal.SIGTERM)  # a graceful stop: the ledger is written
        run = wait(60)
    started = {job_id: at for job_id, kind, at in run.ledger if kind == "wake"}
    if set(started) != set(committed) or len(run.ledger) != len(committed):
        raise RuntimeError(f"{len(run.ledger)} runs for {len(committed)} jobs")
    first = min(committed.values())
    minutes: dict[int, list[float]] = {}
    for job_id, at in committed.items():
        minutes.setdefault(int((at - first) // 60), []).append((started[job_id] - at) * 1000)
    # Whole minutes (the last may be cut short); a run under a minute has its one.
    whole = [m for m, values in minutes.items() if len(values) >= STEADY_RATE * 50] or [0]
    label = f"{STEADY_SECONDS / 60:.0f} min at {STEADY_RATE}/s, snapshot held"
    for which, minute in (("first", min(whole)), ("last", max(whole))):
        values = sorted(minutes[minute])
        for q in (0.5, 0.99):
            b.record(
                f"19. steady, {label}: {which} minute, commit to start p{round(q * 100)} (ms)",
                values[min(len(values) - 1, int(q * len(values)))],
            )
    p99 = {
        m: sorted(minutes[m])[min(len(minutes[m]) - 1, int(0.99 * len(minutes[m])))] for m in whole
    }
    b.record(f"19. steady, {label}: p99 last / first minute", p99[max(whole)] / p99[min(whole)])
    b.record(f"19. steady, {label}: load", float(load().split()[0]))
    for minute in whole:
        values = sorted(minutes[minute])
        print(
            f"  steady minute {minute + 1:2}: p50 {values[int(0.5 * len(values))]:7.2f} ms,"
            f" p99 {p99[minute]:7.2f} ms, load {loads[minute] if minute < len(loads) else '-'}",
            flush=True,
        )


# --- (d) more workers than max_connections ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def throwaway_server(max_connections: int) -> Iterator[str]:
    """initdb a temporary cluster (Debian's newest server binaries, as the ``postgres``
    OS user when run as root), start it on a free port with *max_connections*, yield
    its URL; stop it and delete its folder afterwards, whatever happened (as noxfile.py's
    ``_throwaway_server``, with trust authentication on 127.0.0.1)."""
    initdbs = sorted(DEBIAN_POSTGRES.glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if not initdbs:
        raise RuntimeError(f"no PostgreSQL server binaries under {DEBIAN_POSTGRES}")
    bin_dir = initdbs[-1].parent
    folder = Path(tempfile.mkdtemp(prefix="sqlaq-bench-pg-"))
    account = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    if account:
        os.chown(folder, account.pw_uid, account.pw_gid)

    def pg(tool: str, *args: object, check: bool = True) -> None:
        as_user = {"user": account.pw_uid, "group": account.pw_gid} if account else {}
        subprocess.run(
            [bin_dir / tool, *map(str, args)], check=check, cwd=folder,
            stdout=subprocess.DEVNULL, extra_groups=[] if account else None, **as_user,
        )  # fmt: skip

    data = folder / "data"
    port = _free_port()
    extra = os.environ.get("SQLAQ_BENCH_SERVER_SETTINGS", "").split()
    settings = "".join(f" -c {setting}" for setting in extra)
    try:
        pg("initdb", "-D", data, "-U", "postgres", "-E", "UTF8", "--no-sync",
           "--auth-local=trust", "--auth-host=trust")  # fmt: skip
        pg("pg_ctl", "-D", data, "-l", folder / "server.log", "-w", "-t", "120", "-o",
           f"-p {port} -h 127.0.0.1 -k {folder} -c max_connections={max_connections}"
           f"{settings}",
           "start")  # fmt: skip
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            pg("pg_ctl", "-D", data, "-m", "fast", "-w", "-t", "120", "stop", check=False)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Elsewhere:
    """The bench's Recorder, on a throwaway server's database."""

    url: str
    engine: Engine
    parent: Recorder
    workers: list[subprocess.Popen[bytes]]

    def record(self, name: str, value: float) -> None:
        self.parent.record(name, value)


@contextmanager
def throwaway_database(b: Recorder, max_connections: int = 100) -> Iterator[Elsewhere]:
    """A migrated database on a throwaway server (stock settings but *max_connections*)."""
    with throwaway_server(max_connections) as server:
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text('CREATE DATABASE "sqlaq_bench_scale"'))
        admin.dispose()
        url = make_url(server).set(database="sqlaq_bench_scale").render_as_string(False)
        engine = create_engine(url, pool_size=2, max_overflow=0)
        try:
            with engine.connect() as conn:
                sqlaq.migrations.upgrade(conn)
                conn.commit()
            yield Elsewhere(url, engine, b, b.workers)
        finally:
            engine.dispose()


def starved(b: Recorder, worker: Spawn) -> None:
    """6 long-running workers on a server with max_connections=20: jobs run twice, and
    how long claimed jobs sat."""
    with throwaway_database(b, STARVED_MAX_CONNECTIONS) as elsewhere:
        fill_sql(elsewhere.engine, "sleep10", STARVED_JOBS)
        run_starved(elsewhere, worker)


def run_starved(s: Elsewhere, worker: Spawn) -> None:
    lease = f"{STARVED_LEASE.total_seconds():.0f}s"
    flags = ["--concurrency", "10", "--prefetch", "20", "--lease", lease, *QUIET]
    ages: list[float] = []
    clients: list[int] = []
    held_by: Counter[str] = Counter()  # claims seen held, per worker, over the samples
    start = progress = time.monotonic()
    last_done = 0
    with ExitStack() as stack:
        waits = [stack.enter_context(worker(s, *flags)) for _ in range(STARVED_WORKERS)]
        procs = list(s.workers[-STARVED_WORKERS:])
        with s.engine.connect() as conn:
            while True:
                done, oldest, holders, connected = conn.execute(
                    text(
                        "SELECT count(*) FILTER (WHERE status = 'done'),"
                        " extract(epoch FROM max(now() - (run_at - :lease))"
                        " FILTER (WHERE status = 'running')),"
                        " array_agg(DISTINCT locked_by::text) FILTER (WHERE status = 'running'),"
                        " (SELECT count(*) FROM pg_stat_activity"
                        "  WHERE backend_type = 'client backend')"
                        " FROM sqlaq_jobs"
                    ),
                    {"lease": STARVED_LEASE},
                ).one()
                conn.rollback()
                ages.append(float(oldest or 0.0))
                clients.append(int(connected))
                held_by.update(holders or [])
                now = time.monotonic()
                if done > last_done:
                    last_done, progress = done, now
                if done >= STARVED_JOBS or now - progress > STALLED:
                    break  # drained, or stuck
                time.sleep(0.2)
        drained = time.monotonic() - start
        for proc in procs:
            proc.send_signal(signal.SIGTERM)  # a graceful stop: the ledger is written
        runs = [wait(120) for wait in waits]
    seen = Counter(i for run in runs for i, kind, _ in run.ledger if kind == "sleep10")
    with s.engine.connect() as conn:
        retried = conn.execute(
            text("SELECT count(*) FROM sqlaq_jobs WHERE attempts > 1")
        ).scalar_one()
        done = conn.execute(
            text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'")
        ).scalar_one()
    label = f"{STARVED_WORKERS} workers, max_connections={STARVED_MAX_CONNECTIONS}"
    s.record(f"18. starved: {label}: jobs done of {STARVED_JOBS:,}", float(done))
    s.record(f"18. starved: {label}: jobs run twice", float(twice(seen)))
    s.record(f"18. starved: {label}: jobs claimed again (attempts > 1)", float(retried))
    s.record(f"18. starved: {label}: oldest claim seen held (s)", max(ages))
    s.record(f"18. starved: {label}: workers seen holding claims", float(len(held_by)))
    s.record(f"18. starved: {label}: drain, or until stuck {STALLED:.0f} s (s)", drained)
    s.record(f"18. starved: {label}: client connections, peak", float(max(clients)))
    s.record(f"18. starved: {label}: load", float(load().split()[0]))


def scenarios(worker: Spawn) -> dict[str, Callable[[Any], None]]:
    """bench/run.py's entries, bound to its worker-process helper."""
    return {
        "scale_processes": lambda b: processes(b, worker),
        "scale_backlog": lambda b: backlog(b, worker),
        "scale_held_xmin": lambda b: held_xmin(b, worker),
        "scale_held_steady": lambda b: held_steady(b, worker),
        "scale_starved": lambda b: starved(b, worker),
    }
