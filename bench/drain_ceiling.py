"""The ceiling of a no-op drain on sqlaq's own table: the worker's claim and complete
with nothing between them.

    python bench/drain_ceiling.py [JOBS] [BATCH] [serial|pipelined|handler]

What ``../shared/peer-bench/limit/raw_loop.py`` is to a lean hand-written table, this is
to sqlaq's: its schema (every index a feature needs), and the very statements its worker
sends, run as the worker runs them (:class:`~sqlaq.worker.precompiled.Precompiled`, on
connections in autocommit, the claim's commit relaxed): the bounded claim of BATCH jobs
(``claim_bounded``, each claim starting after the last one's position) and the complete
of the jobs claimed (``complete``, fenced by their leases). No handler, no thread per
job, no lease renewal, no outbox: no worker on this table can drain faster with these
statements.

``serial``: one connection, claim then complete, as the raw loop does. ``pipelined``
(the default): the worker's own shape, claims on one connection in the main thread and
completes on a second one in a thread of its own, so a complete and the next claim run
at once on the server. ``handler``: pipelined, with the peer bench's no-op handler between
the two on a third thread, as a worker runs a ``def`` handler on a slot thread: one
16-byte ``write`` per job to a file opened ``O_APPEND`` (what the harness's
``hooks.on_handler_start`` does), in a temporary folder removed at the end. The write
lets the GIL go, so each job is a hand-over between threads: what that costs any worker
whose ``def`` handlers run on threads other than its claims'.

JOBS (default 60,000) no-op jobs are loaded with ``enqueue_copy`` into a database of its
own (``bench_drain_ceiling``), dropped at the end. Prints jobs/s, then checks that every
job was claimed once and is done (it exits with an error otherwise).
"""

from __future__ import annotations

import os
import queue
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Connection, create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq  # after the path is set, for a run from a clean clone
from bench.scratch import scratch_database  # after the path is set, for a clean clone
from sqlaq import ops
from sqlaq.drive import plan_of
from sqlaq.ops.claiming import claim_bounded
from sqlaq.worker.precompiled import Precompiled

LEASE = timedelta(minutes=5)
_COMPLETE = plan_of(ops.complete)


def claims(conn: Connection, batch: int) -> Iterator[list[ops.ClaimedJob]]:
    """Claim BATCH at a time as the worker does, from the last claim's position; yields
    each claim's jobs until a claim comes back empty."""
    worker = uuid.uuid4()
    precompiled = Precompiled()
    after = None
    while True:
        plan = claim_bounded(
            worker_id=worker, queue="default", limit=batch, lease=LEASE, after=after
        )
        jobs, position = precompiled.run(conn, plan, relaxed=True)
        if not jobs:
            return
        after = position
        yield jobs


def handle(
    claimed: queue.SimpleQueue[list[ops.ClaimedJob] | None],
    handed: queue.SimpleQueue[list[ops.ClaimedJob] | None],
    log: int,
) -> None:
    """The no-op handler of the peer bench for each claimed job, one after another on
    this thread; each claim's jobs go on to *handed* once all are run."""
    record = struct.Struct("<qd")
    while (jobs := claimed.get()) is not None:
        for job in jobs:
            os.write(log, record.pack(int(job.payload["seq"]), time.time()))
        handed.put(jobs)
    handed.put(None)


def drain(url: str, batch: int, mode: str) -> int:
    """Drain the queue; return how many jobs were completed."""
    engine = create_engine(url)
    try:
        with (
            engine.connect().execution_options(isolation_level="AUTOCOMMIT") as claiming,
            engine.connect().execution_options(isolation_level="AUTOCOMMIT") as completing,
        ):
            writer = Precompiled()
            if mode == "serial":
                done = 0
                for jobs in claims(claiming, batch):
                    done += len(writer.run(claiming, _COMPLETE([j.lease for j in jobs])))
                return done
            handed: queue.SimpleQueue[list[ops.ClaimedJob] | None] = queue.SimpleQueue()
            completed = [0]

            def complete() -> None:
                while (jobs := handed.get()) is not None:
                    leases = [j.lease for j in jobs]
                    # Whatever else waits goes in the same statement, as the writer does.
                    while not handed.empty():
                        more = handed.get()
                        if more is None:
                            handed.put(None)
                            break
                        leases += [j.lease for j in more]
                    completed[0] += len(writer.run(completing, _COMPLETE(leases)))

            thread = threading.Thread(target=complete, name="completes")
            thread.start()
            if mode == "pipelined":
                try:
                    for jobs in claims(claiming, batch):
                        handed.put(jobs)
                finally:
                    handed.put(None)
                    thread.join()
                return completed[0]
            claimed: queue.SimpleQueue[list[ops.ClaimedJob] | None] = queue.SimpleQueue()
            with tempfile.TemporaryDirectory() as folder:
                log = os.open(f"{folder}/log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                handler = threading.Thread(
                    target=handle, args=(claimed, handed, log), name="handler"
                )
                handler.start()
                try:
                    for jobs in claims(claiming, batch):
                        claimed.put(jobs)
                finally:
                    claimed.put(None)
                    handler.join()
                    thread.join()
                    os.close(log)
            return completed[0]
    finally:
        engine.dispose()


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 60_000
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    mode = sys.argv[3] if len(sys.argv) > 3 else "pipelined"
    if mode not in ("serial", "pipelined", "handler"):
        raise SystemExit(f"mode must be serial, pipelined or handler, not {mode!r}")
    with scratch_database("bench_drain_ceiling") as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            sqlaq.enqueue_copy(conn, [sqlaq.NewJob("noop", {"seq": i}) for i in range(jobs)])
            conn.execute(text("ANALYZE sqlaq_jobs"))
        started = time.perf_counter()
        done = drain(url, batch, mode)
        elapsed = time.perf_counter() - started
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT count(*) FILTER (WHERE status = 'done' AND attempts = 1), count(*)"
                    " FROM sqlaq_jobs"
                )
            ).one()
        engine.dispose()
        print(f"drain ceiling: {mode} batch={batch} jobs={jobs} {jobs / elapsed:,.0f} jobs/s")
        if done != jobs or row[0] != jobs or row[1] != jobs:
            raise SystemExit(f"{done} completed, {row[0]} of {row[1]} done once: not {jobs}")


if __name__ == "__main__":
    main()
