"""Where a 10 ms drain's time goes, thread by thread, in sqlaq's own worker.

    python bench/drain_probe.py [JOBS] [CONCURRENCY] [PREFETCH] [async|def|write] [--one-loop]
        [--command-gc] [--fillfactor=N]

On a database of its own (``bench_drain_probe``, dropped at the end): JOBS jobs
(default 60,000) whose handler sleeps 10 ms (``async def`` with ``asyncio.sleep``, or
``def`` with ``time.sleep``; or ``write``, a ``def`` handler that only writes 16 bytes
to a file opened ``O_APPEND`` in a temporary folder, what the peer bench's no-op handler
does), drained by an in-process burst worker at CONCURRENCY
(400) and PREFETCH (200). It prints:

- jobs/s, and the process's CPU and context switches per job over the drain
  (``getrusage``: a thread that waits for the GIL, or hands it over, is switched out);
- the garbage collections during the drain and their time (``gc.callbacks``);
- each thread's CPU per job (``/proc/self/task/*/schedstat``): the run thread (claims and the
  bookkeeping), the handlers' loop or the slot threads, the writer;
- the busy cores of the whole machine over the drain (PostgreSQL included);
- for ``async``: how late ``asyncio.sleep(0.01)`` returns (the loop's lag), p50/p90;
- the worker's slots, sampled every 2 ms: handlers running (p50), the share of samples
  with none running, and jobs claimed ahead and waiting for a slot (p50); for ``def``
  handlers, the slot threads alive (p50 and most);
- the claims (how many, their median size and wall time) and the writer's batches;
- the WAL the drain wrote, a job, and the table's pages before and after it.

``--fillfactor=N`` sets the jobs table's ``fillfactor`` before the jobs are enqueued
(the revisions leave PostgreSQL's default, 100): with the drain's WAL a job and the
table's pages before and after it, what the setting would change.

``--command-gc`` tunes the process's collector first, as ``sqlaq-worker`` does
(:func:`sqlaq.cli.tune_garbage_collector`); without it, Python's defaults.

``--one-loop`` (``async`` only) is a prototype, not the worker: the same bookkeeping
(``Worker._collect``, ``_dispatch``, the writer thread...) but driven by a coroutine on
the handlers' own event loop, with the claim run on psycopg's ``AsyncConnection`` there,
so a claimed job crosses no thread before its handler starts. It answers one question:
would a worker whose claims and handlers share one loop drain faster?

A probe, not a test: it wraps and reads the worker's private parts, and its timings
are the box's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import resource
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq  # after the path is set, for a run from a clean clone
import sqlaq.cli
from sqlaq.drive import PerEngine
from sqlaq.worker import fetcher as fetcher_module
from sqlaq.worker import precompiled as precompiled_module

ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_drain_probe"
DSN = "host=127.0.0.1 user=postgres dbname=bench_drain_probe"


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, slot threads summed as one."""
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        try:  # the scheduler's own run time, in ns (stat's ticks miss threads that
            # sleep 10 ms at a time: they run between two ticks)
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as stat:
                ran = int(stat.read().split()[0]) / 1e9
        except OSError:
            continue
        name = "slot threads" if thread.name.startswith("sqlaq-slot") else thread.name
        seconds[name] = seconds.get(name, 0.0) + ran
    return seconds


def busy() -> tuple[int, int]:
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main(
    jobs: int,
    concurrency: int,
    prefetch: int,
    sort: str,
    one_loop: bool,
    command_gc: bool,
    fillfactor: int | None = None,
) -> None:
    admin = create_engine(ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS bench_drain_probe"))
        conn.execute(text("CREATE DATABASE bench_drain_probe"))
    engine = create_engine(URL)
    try:
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
            if fillfactor is not None:
                conn.execute(text(f"ALTER TABLE sqlaq_jobs SET (fillfactor = {int(fillfactor)})"))
            conn.commit()
        if command_gc:  # as sqlaq-worker does once started
            sqlaq.cli.tune_garbage_collector()
        drain(engine, jobs, concurrency, prefetch, sort, one_loop)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text("DROP DATABASE IF EXISTS bench_drain_probe"))
        admin.dispose()


_PAGES = text("SELECT pg_relation_size('sqlaq_jobs') / current_setting('block_size')::int")
_WAL_NOW = text("SELECT pg_current_wal_lsn()")
_WAL_SINCE = text("SELECT pg_current_wal_lsn() - CAST(:lsn AS pg_lsn)")


def drain(
    engine: Any, jobs: int, concurrency: int, prefetch: int, sort: str, one_loop: bool
) -> None:
    with tempfile.TemporaryDirectory() as folder:  # the write handler's file
        log = os.open(f"{folder}/log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            drain_with(engine, jobs, concurrency, prefetch, sort, one_loop, log)
        finally:
            os.close(log)


def drain_with(
    engine: Any,
    jobs: int,
    concurrency: int,
    prefetch: int,
    sort: str,
    one_loop: bool,
    log: int,
) -> None:
    registry = sqlaq.Registry()
    lags: list[float] = []
    if sort == "async":

        @registry.handler("sleep")
        async def sleep_async(payload: dict[str, Any]) -> None:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - started - 0.01)

    elif sort == "def":

        @registry.handler("sleep")
        def sleep_sync(payload: dict[str, Any]) -> None:
            time.sleep(0.01)

    else:
        record = struct.Struct("<qd")

        @registry.handler("sleep")
        def write(payload: dict[str, Any]) -> None:
            os.write(log, record.pack(payload["seq"], time.time()))

    with engine.begin() as conn:
        for start in range(0, jobs, 1000):
            payloads = [{"seq": s} for s in range(start, min(jobs, start + 1000))]
            sqlaq.enqueue_many(conn, sqlaq.NewJob("sleep").with_payloads(payloads))
        conn.execute(text("ANALYZE sqlaq_jobs"))

    worker = sqlaq.Worker(engine, registry, concurrency=concurrency, prefetch=prefetch, burst=True)
    claims: list[tuple[int, float]] = []
    writes: list[tuple[int, float]] = []
    fetch, write = worker._fetcher.fetch, worker._writer._write

    def timed_fetch(*args: Any) -> Any:
        started = time.perf_counter()
        claimed = fetch(*args)
        claims.append((len(claimed), time.perf_counter() - started))
        return claimed

    def timed_write(batch: Any) -> None:
        started = time.perf_counter()
        write(batch)
        writes.append((len(batch.items), time.perf_counter() - started))

    worker._fetcher.fetch = timed_fetch  # type: ignore[method-assign]
    worker._writer._write = timed_write  # type: ignore[method-assign]
    at_end: dict[str, float] = {}
    shutdown = worker._shutdown

    def on_shutdown(changed: Any = None) -> None:
        at_end.update(thread_cpu())  # before the worker's threads end
        shutdown(changed)

    worker._shutdown = on_shutdown  # type: ignore[method-assign]
    samples: list[tuple[int, int]] = []
    threads: list[int] = []  # slot threads alive, at each sample
    done = threading.Event()

    def sample() -> None:
        runner = worker._runner
        while not done.wait(0.002):
            if sort == "async":
                samples.append((runner._running, len(runner._waiting)))
            else:  # slot threads: submitted and not finished, less those queued
                queued = runner._queue.qsize()
                samples.append((runner._slots.blocking - queued, queued))
                threads.append(runner._slots.count)

    sampler = threading.Thread(target=sample, daemon=True)
    collected: list[float] = []  # seconds in each garbage collection during the drain
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            collected.append(time.perf_counter() - gc_started[0])

    gc.callbacks.append(on_gc)
    with engine.connect() as conn:
        wal_before = conn.execute(_WAL_NOW).scalar_one()
        pages_before = conn.execute(_PAGES).scalar_one()
    before = thread_cpu()
    usage, machine = resource.getrusage(resource.RUSAGE_SELF), busy()
    started = time.perf_counter()
    sampler.start()
    if one_loop:
        asyncio.run(one_loop_run(worker, claims))
    else:
        worker.run()
    elapsed = time.perf_counter() - started
    done.set()
    gc.callbacks.remove(on_gc)
    after, machine_after = resource.getrusage(resource.RUSAGE_SELF), busy()
    with engine.connect() as conn:
        finished = conn.execute(text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'"))
        count = finished.scalar_one()
        wal = conn.execute(_WAL_SINCE, {"lsn": wal_before}).scalar_one()
        pages_after = conn.execute(_PAGES).scalar_one()
    cpu = after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime
    mode = "one loop (prototype)" if one_loop else "worker"
    handler = "def handler writing 16 bytes" if sort == "write" else f"{sort} 10 ms handler"
    print(f"{mode}, {handler}, concurrency {concurrency}, prefetch {prefetch}")
    print(f"  {count} done in {elapsed:.2f} s: {count / elapsed:,.0f} jobs/s")
    print(f"  process CPU per job: {cpu / count * 1e6:.1f} us")
    switches = after.ru_nvcsw - usage.ru_nvcsw + after.ru_nivcsw - usage.ru_nivcsw
    print(f"  context switches per job: {switches / count:.2f}")
    print(f"  WAL per job: {wal / count:.0f} bytes; table pages {pages_before} before,", end="")
    print(f" {pages_after} after")
    print(f"  garbage collections: {len(collected)}, {sum(collected) * 1e3:.0f} ms in all")
    per_thread = {
        name: round((at_end[name] - before.get(name, 0.0)) / count * 1e6, 1)
        for name in at_end
        if at_end[name] - before.get(name, 0.0) > 0.005
    }
    print(f"  CPU per job by thread (us): {per_thread}")
    cores = os.cpu_count() or 1
    spent = machine_after[0] - machine[0]
    print(f"  machine busy: {cores * spent / (machine_after[1] - machine[1]):.2f} of {cores} cores")
    if lags:
        print(f"  loop lag (ms): p50 {p(lags, 0.5) * 1e3:.2f}, p90 {p(lags, 0.9) * 1e3:.2f}")
    middle = samples[len(samples) // 10 : len(samples) * 9 // 10]
    if middle:
        running = [float(s[0]) for s in middle]
        idle = sum(1 for s in middle if s[0] == 0) / len(middle)
        print(
            f"  slots: running p50 {p(running, 0.5):.0f} of {concurrency}, none running in"
            f" {idle:.0%} of samples; waiting p50 {p([float(s[1]) for s in middle], 0.5):.0f}"
        )
    if threads:
        alive = p([float(t) for t in threads], 0.5)
        print(f"  slot threads alive: p50 {alive:.0f}, most {max(threads)}")
    if claims:
        sizes, walls = [c[0] for c in claims], [c[1] for c in claims]
        print(
            f"  claims: {len(claims)}, median {statistics.median(sizes):.0f} jobs in"
            f" {statistics.median(walls) * 1e3:.1f} ms (p90 {p(walls, 0.9) * 1e3:.1f})"
        )
    if writes:
        sizes, walls = [w[0] for w in writes], [w[1] for w in writes]
        print(
            f"  writer batches: {len(writes)}, median {statistics.median(sizes):.0f} in"
            f" {statistics.median(walls) * 1e3:.1f} ms"
        )


class LoopWake:
    """``Worker._wake`` on the loop: set from the loop or from another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.event, self.thread = loop, asyncio.Event(), threading.get_ident()

    def open(self) -> None:
        """Nothing to create: the loop is the waiter (``Waker.open``'s place)."""

    def close(self) -> None:
        """Nothing to close (``Waker.close``'s place)."""

    def set(self) -> None:
        if threading.get_ident() == self.thread:
            self.event.set()
        else:
            self.loop.call_soon_threadsafe(self.event.set)

    def clear(self) -> None:
        self.event.clear()

    def is_set(self) -> bool:
        return self.event.is_set()


async def one_loop_run(worker: Any, claims: list[tuple[int, float]]) -> None:
    """The prototype: the worker's turn as a coroutine on the handlers' loop."""
    loop = asyncio.get_running_loop()
    worker._runner.use_loop(loop)
    wake = LoopWake(loop)
    worker._wake = wake
    worker._writer._on_done = wake.set
    conn = await psycopg.AsyncConnection.connect(DSN, autocommit=True)
    compiled: dict[int, str] = {}

    async def claim(room: int) -> list[Any]:
        plan = fetcher_module.claim_bounded(
            worker_id=worker.worker_id,
            queue="default",
            limit=room,
            lease=worker.config.lease,
            after=None,
        )
        started = time.perf_counter()
        step = plan.send(None)
        try:
            while True:
                if isinstance(step, PerEngine):  # "is the table distributed?": not here
                    step = plan.send(False)
                    continue
                statement, params = step
                sql = compiled.get(id(statement))
                if sql is None:
                    sql = compiled[id(statement)] = statement.compile(
                        dialect=worker._engine.dialect
                    ).string
                cursor = conn.cursor()
                await cursor.execute(sql, params)
                step = plan.send(precompiled_module._Rows(await cursor.fetchall()))
        except StopIteration as stop:
            jobs, _position = stop.value  # a full claim each time: no bound kept
            claims.append((len(jobs), time.perf_counter() - started))
            return list(jobs)

    worker._start()
    due = True
    try:
        while True:
            wake.clear()
            worker._collect()
            worker._outbox.turn()
            room = worker._room()
            if room > 0 and due:
                claimed = await claim(room)
                if claimed:
                    worker._dispatch(claimed)
                else:
                    due = False
            outbox = worker._outbox
            if not due and not worker._leases and not outbox.writing and not worker._finished:
                break
            ready = worker._finished or (not outbox.writing and outbox.waiting)
            if ready or (due and worker._room() > 0):
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.event.wait(), 0.05)
        worker._shutdown()
    finally:
        worker._close()
        await conn.close()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(
        int(args[0]) if len(args) > 0 else 60_000,
        int(args[1]) if len(args) > 1 else 400,
        int(args[2]) if len(args) > 2 else 200,
        args[3] if len(args) > 3 else "async",
        "--one-loop" in sys.argv,
        "--command-gc" in sys.argv,
        next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--fillfactor=")), None),
    )
