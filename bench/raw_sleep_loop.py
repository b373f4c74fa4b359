"""The ceiling of a 10 ms-handler drain in Python on this box: a hand-written loop.

    python bench/raw_sleep_loop.py [JOBS] [CONCURRENCY] [BATCH] [async|def]

What ``../shared/peer-bench/limit/raw_loop.py`` is to the no-op drain, this is to the
10 ms one: no queue library, the leanest loop Python allows. One asyncio event loop on
psycopg's async connections (autocommit, statements prepared), the same lean table and
claim/complete SQL as that raw loop; up to CONCURRENCY handlers (``asyncio.sleep(0.01)``)
run at once, jobs are claimed BATCH at a time as slots free, and finished ones are
completed in batches by a task of their own on a second connection, while claims go on.
No leases renewed, no retries, no logging, no handler lookup, no result objects.

``def`` is the same for a ``def`` handler (``time.sleep(0.01)``): CONCURRENCY threads fed
by one ``queue.SimpleQueue``, claims on a sync connection in the main thread as slots
free, completions in batches by a thread of its own on a second connection: what a
worker that runs ``def`` handlers on threads cannot beat in one Python process.

With ``BENCH_HANDLER_LOG`` set (a file name), each handler first appends a 16-byte
record to that file with one ``os.write``, as the peer bench's handlers do
(``../shared/peer-bench/hooks.py``): the same loop under the harness's own cost per job.

It uses its own database (``bench_raw_sleep``), dropped at the end. Prints jobs/s.
"""

from __future__ import annotations

import asyncio
import os
import queue
import struct
import sys
import threading
import time
import uuid

import psycopg

ADMIN = "host=127.0.0.1 user=postgres dbname=postgres"
DSN = "host=127.0.0.1 user=postgres dbname=bench_raw_sleep"
DDL = """
create table jobs (
 id bigint generated always as identity primary key,
 queue text not null default 'default', kind text not null, payload jsonb not null default '{}',
 status text not null default 'queued'
   check (status in ('queued','running','done','failed','cancelled')),
 priority smallint not null default 0, run_at timestamptz not null default now(),
 attempts int not null default 0, max_attempts int not null default 5, locked_by uuid,
 last_error text, dedupe_key text, created_at timestamptz not null default now(),
 finished_at timestamptz
) with (autovacuum_vacuum_scale_factor = 0.01, fillfactor = 90);
create index jobs_claim_idx on jobs (queue, priority desc, run_at, id)
 where status in ('queued','running');
"""
CLAIM = """
with picked as materialized (
  select id from jobs where status in ('queued','running') and queue = 'default'
  and run_at <= now() order by priority desc, run_at, id limit %(n)s for update skip locked)
update jobs j set status='running', attempts=j.attempts+1, locked_by=%(w)s,
  run_at=now()+interval '5 minutes'
from picked where j.id = picked.id returning j.id, j.kind, j.payload, j.attempts
"""
DONE = (
    "update jobs set status='done', locked_by=null, finished_at=now()"
    " where id = any(%(ids)s) and locked_by=%(w)s and status='running'"
)

_RECORD = struct.Struct("<qd")  # the peer bench's handler record: (seq, unix time)


def _hook() -> int | None:
    """The peer bench's handler log, opened for appending, if BENCH_HANDLER_LOG names one."""
    path = os.environ.get("BENCH_HANDLER_LOG")
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None


async def drain(jobs: int, concurrency: int, batch: int) -> float:
    worker = uuid.uuid4()
    claim_conn = await psycopg.AsyncConnection.connect(DSN, autocommit=True)
    done_conn = await psycopg.AsyncConnection.connect(DSN, autocommit=True)
    free = asyncio.Semaphore(concurrency)
    finished: list[int] = []
    more = asyncio.Event()
    completed = 0

    log = _hook()

    async def handler(job_id: int) -> None:
        if log is not None:
            os.write(log, _RECORD.pack(job_id, time.time()))
        await asyncio.sleep(0.010)
        finished.append(job_id)
        free.release()
        more.set()

    async def completer() -> None:
        nonlocal completed
        while completed < jobs:
            await more.wait()
            more.clear()
            ids, finished[:] = finished[:], []
            if ids:
                await done_conn.execute(DONE, {"ids": ids, "w": worker}, prepare=True)
                completed += len(ids)

    tasks: set[asyncio.Task[None]] = set()
    started = time.perf_counter()
    writing = asyncio.create_task(completer())
    claimed = 0
    while claimed < jobs:
        await free.acquire()  # at least one slot free; take the others that are
        slots = 1
        while slots < batch and not free.locked():
            await free.acquire()
            slots += 1
        cursor = await claim_conn.execute(CLAIM, {"n": slots, "w": worker}, prepare=True)
        rows = await cursor.fetchall()
        for _ in range(slots - len(rows)):
            free.release()
        for row in rows:
            task = asyncio.create_task(handler(row[0]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        claimed += len(rows)
        if not rows:
            await asyncio.sleep(0.001)
    await writing
    elapsed = time.perf_counter() - started
    await claim_conn.close()
    await done_conn.close()
    return jobs / elapsed


def drain_threads(jobs: int, concurrency: int, batch: int) -> float:
    worker = uuid.uuid4()
    free = threading.Semaphore(concurrency)
    work: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    finished: list[int] = []
    more = threading.Event()

    log = _hook()

    def handler() -> None:
        while (job_id := work.get()) is not None:
            if log is not None:
                os.write(log, _RECORD.pack(job_id, time.time()))
            time.sleep(0.010)
            finished.append(job_id)  # list.append is atomic
            free.release()
            more.set()

    def completer() -> None:
        completed = 0
        with psycopg.connect(DSN, autocommit=True) as done_conn:
            while completed < jobs:
                more.wait()
                more.clear()
                ids = []
                while finished:
                    ids.append(finished.pop())
                if ids:
                    done_conn.execute(DONE, {"ids": ids, "w": worker}, prepare=True)
                    completed += len(ids)

    threads = [threading.Thread(target=handler, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    with psycopg.connect(DSN, autocommit=True) as claim_conn:
        started = time.perf_counter()
        writing = threading.Thread(target=completer)
        writing.start()
        claimed = 0
        while claimed < jobs:
            free.acquire()  # at least one slot free; take the others that are
            slots = 1
            while slots < batch and free.acquire(blocking=False):
                slots += 1
            rows = claim_conn.execute(CLAIM, {"n": slots, "w": worker}, prepare=True).fetchall()
            for _ in range(slots - len(rows)):
                free.release()
            for row in rows:
                work.put(row[0])
            claimed += len(rows)
            if not rows:
                time.sleep(0.001)
        writing.join()
        elapsed = time.perf_counter() - started
    for _ in threads:
        work.put(None)
    return jobs / elapsed


def main(jobs: int = 20_000, concurrency: int = 400, batch: int = 200, kind: str = "async") -> None:
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute("drop database if exists bench_raw_sleep")
        admin.execute("create database bench_raw_sleep")
    try:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(DDL)
            conn.execute(
                "insert into jobs (kind, payload) select 'sleep', jsonb_build_object('i', g)"
                " from generate_series(1, %s) g",
                (jobs,),
            )
            conn.execute("vacuum analyze jobs")
        if kind == "def":
            rate = drain_threads(jobs, concurrency, batch)
        else:
            rate = asyncio.run(drain(jobs, concurrency, batch))
        print(
            f"raw {kind} 10 ms loop: jobs={jobs} concurrency={concurrency} batch={batch}"
            f" {rate:,.0f} jobs/s"
        )
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute("drop database if exists bench_raw_sleep")


if __name__ == "__main__":
    args = sys.argv[1:]
    kind = args.pop() if args and args[-1] in ("async", "def") else "async"
    main(*(int(arg) for arg in args), kind=kind)
