"""A burst after an idle spell: how soon a default worker drains it.

    python bench/burst_probe.py [JOBS] [ROUNDS] [IDLE_SECONDS]

An in-process default worker (``sqlaq.Worker`` at its defaults: concurrency 100, the
automatic prefetch) with one ``async`` handler that sleeps 10 ms, idle for IDLE_SECONDS
(default 1) after its start, then JOBS jobs (default 500) enqueued in one transaction.
Printed per burst: the time from the first handler's start to the last job's ``done``
as the table saw it (polled every 2 ms) and that rate, and the batches the handlers
started in (start times more than 3 ms apart). ROUNDS bursts (default 5), each on a
fresh worker; the median rate last.

A burst after a quiet spell is what the peer bench does not show: its worker starts
with the jobs already queued. It runs on a database of its own (``bench_burst_probe``),
dropped at the end.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq  # after the path is set, for a run from a clean clone
from bench.scratch import scratch_database

pc = time.perf_counter


def burst(url: str, jobs: int, idle: float) -> float:
    registry = sqlaq.Registry()
    starts: list[float] = []

    @registry.handler("sleep")
    async def sleep(payload: dict[str, Any]) -> None:
        starts.append(pc())
        await asyncio.sleep(0.010)

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE sqlaq_jobs"))
        worker = sqlaq.Worker(engine, registry, sqlaq.WorkerConfig())
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            time.sleep(idle)  # the quiet spell before the burst (what is measured)
            with engine.begin() as conn:
                sqlaq.enqueue_many(conn, [sqlaq.NewJob("sleep", {"i": i}) for i in range(jobs)])
            done = text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'")
            while True:
                with engine.connect() as conn:
                    if conn.execute(done).scalar_one() >= jobs:
                        break
                time.sleep(0.002)
            ended = pc()
        finally:
            worker.stop()
            thread.join()
    finally:
        engine.dispose()
    first = min(starts)
    batches: list[list[float]] = []
    for started in sorted(starts):
        if batches and started - batches[-1][-1] <= 0.003:
            batches[-1].append(started)
        else:
            batches.append([started])
    shown = " ".join(f"{(b[0] - first) * 1e3:.0f} ms: {len(b)}" for b in batches)
    rate = jobs / (ended - first)
    print(f"  {(ended - first) * 1e3:5.1f} ms, {rate:6,.0f} jobs/s; started at {shown}")
    return rate


def main(jobs: int = 500, rounds: int = 5, idle: float = 1.0) -> None:
    with scratch_database("bench_burst_probe") as url:
        print(f"{jobs} async 10 ms jobs after {idle:g} s idle, default worker:")
        rates = [burst(url, jobs, idle) for _ in range(rounds)]
        print(f"median {statistics.median(rates):,.0f} jobs/s")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        int(args[0]) if args else 500,
        int(args[1]) if len(args) > 1 else 5,
        float(args[2]) if len(args) > 2 else 1.0,
    )
