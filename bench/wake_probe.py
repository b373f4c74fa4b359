"""Where a wake-up goes, stage by stage, and what an idle pause costs a round trip.

    python bench/wake_probe.py [JOBS] [def|async]

Two measurements on a database of its own (``bench_wake_probe``, dropped at the end):

1. An in-process default worker (a no-op handler, ``def`` unless ``async`` is given)
   woken JOBS times (default 200), one enqueue every 20 ms on an autocommit engine, the
   table analyzed: the p50 of each stage, from the enqueue's commit to the listener's
   callback, to the claiming thread's claim, through the claim, to the runner, to the
   handler on its slot thread (or the runner's event loop).
2. Raw psycopg: the worker's own claim statement (prepared, one due job, a 200-row
   analyzed table), committed as usual and as the worker commits it (relaxed: the
   setting inside the statement, ``relaxed_stmt``), and a ``SELECT 1``, with no pause,
   2 ms and 20 ms before each: on a VM, waking a process that has been idle costs more
   than the statement, and a commit's WAL flush after an idle moment more still.

The stage timestamps come from wrapping the worker's methods (``Worker._notified``,
``Fetcher.fetch``, ``Precompiled.run``, ``Runner.submit``) in this process: a probe, not
a test.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, event, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq  # after the path is set, for a run from a clean clone
from bench.scratch import scratch_database
from sqlaq import WorkerConfig
from sqlaq.worker import core, fetcher, precompiled, runner

DSN = "host=127.0.0.1 user=postgres dbname=bench_wake_probe"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_wake_probe"
pc = time.perf_counter


def stages(jobs: int, flavour: str) -> None:
    marks: dict[tuple[int, str], float] = {}
    current: dict[str, int | None] = {"seq": None}

    def mark(stage: str) -> None:
        seq = current["seq"]
        if seq is not None:
            marks.setdefault((seq, stage), pc())

    notified, fetch, run = core.Worker._notified, fetcher.Fetcher.fetch, precompiled.Precompiled.run

    def on_notify(self: Any, *args: Any) -> None:
        mark("notify")
        notified(self, *args)

    def on_fetch(self: Any, *args: Any) -> Any:
        mark("claim starts")
        claimed = fetch(self, *args)
        if claimed:
            mark("claim ends")
        return claimed

    def on_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = pc()
        result = run(self, *args, **kwargs)
        if result and current["seq"] is not None:
            marks.setdefault((current["seq"], "statement"), pc() - started)
        return result

    submit = runner.Runner.submit

    def on_submit(self: Any, *args: Any) -> None:
        mark("submitted")
        submit(self, *args)

    core.Worker._notified, fetcher.Fetcher.fetch = on_notify, on_fetch  # type: ignore[method-assign]
    precompiled.Precompiled.run = on_run  # type: ignore[method-assign]
    runner.Runner.submit = on_submit  # type: ignore[method-assign,assignment]
    registry = sqlaq.Registry()

    if flavour == "async":

        @registry.handler("noop")
        async def noop_async(payload: dict[str, Any]) -> None:
            marks[(payload["seq"], "handler")] = pc()

    else:

        @registry.handler("noop")
        def noop(payload: dict[str, Any]) -> None:
            marks[(payload["seq"], "handler")] = pc()

    engine = create_engine(URL)
    producer = create_engine(URL, isolation_level="AUTOCOMMIT")
    worker = sqlaq.Worker(engine, registry, WorkerConfig())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        worker.started.wait(10)
        for seq in range(-5, 0):  # warm-up: prepared statements, threads
            with producer.connect() as conn:
                sqlaq.enqueue(conn, "noop", {"seq": seq})
            time.sleep(0.05)
        with producer.connect() as conn:
            conn.execute(text("ANALYZE sqlaq_jobs"))
        time.sleep(0.5)
        for seq in range(jobs):
            current["seq"] = seq
            with producer.connect() as conn:
                sqlaq.enqueue(conn, "noop", {"seq": seq})
            marks[(seq, "commit")] = pc()
            time.sleep(0.02)  # the peer bench's spacing
        time.sleep(0.5)
    finally:
        worker.stop()
        thread.join(10)
        producer.dispose()
        engine.dispose()
    order = ["commit", "notify", "claim starts", "claim ends", "submitted", "handler"]
    for first, then in itertools.pairwise(order):
        gaps = [marks[(s, then)] - marks[(s, first)] for s in range(jobs) if (s, then) in marks]
        print(f"  {first:>12} -> {then:<12} p50 {statistics.median(gaps) * 1e3:.3f} ms")
    statement = [marks[(s, "statement")] for s in range(jobs) if (s, "statement") in marks]
    print(f"  the claim's statement alone p50 {statistics.median(statement) * 1e3:.3f} ms")
    total = [
        marks[(s, "handler")] - marks[(s, "commit")] for s in range(jobs) if (s, "handler") in marks
    ]
    print(f"  commit -> handler p50 {statistics.median(total) * 1e3:.3f} ms ({len(total)} jobs)")


def idle_cost() -> None:
    engine = create_engine(URL)
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            seen: list[tuple[str, Any]] = []
            event.listen(conn, "before_cursor_execute", lambda *a: seen.append((a[2], a[3])))
            sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=100, lease=timedelta(seconds=30))
            claim_sql, params = seen[-1]
    finally:
        engine.dispose()
    with psycopg.connect(DSN, autocommit=True) as raw, psycopg.connect(DSN, autocommit=True) as ins:
        raw.execute("TRUNCATE sqlaq_jobs")
        raw.execute(
            "INSERT INTO sqlaq_jobs (kind, payload, status, finished_at)"
            " SELECT 'noop', '{}', 'done', now() FROM generate_series(1, 200)"
        )
        raw.execute("ANALYZE sqlaq_jobs")
        relaxed = sqlaq.queries.relaxed_stmt(
            sqlaq.queries.claim_stmt(
                queue="default", worker_id=uuid.uuid4(), limit=100, lease=timedelta(seconds=30)
            )
        ).compile(dialect=engine.dialect)
        relaxed_sql, relaxed_params = str(relaxed), relaxed.params
        for pause in (0.0, 0.002, 0.02):
            claims, relaxed_times, selects = [], [], []
            for _ in range(150):
                ins.execute("INSERT INTO sqlaq_jobs (kind, payload) VALUES ('noop', '{}')")
                time.sleep(pause)
                started = pc()
                raw.execute(claim_sql, params, prepare=True).fetchall()
                claims.append(pc() - started)
                ins.execute("INSERT INTO sqlaq_jobs (kind, payload) VALUES ('noop', '{}')")
                time.sleep(pause)
                started = pc()
                # What the worker sends: the setting inside the claim (relaxed_stmt).
                raw.execute(relaxed_sql, relaxed_params, prepare=True).fetchall()
                relaxed_times.append(pc() - started)
                time.sleep(pause)
                started = pc()
                raw.execute("SELECT 1", prepare=True).fetchall()
                selects.append(pc() - started)
            print(
                f"  pause {pause * 1e3:4.0f} ms: claim of one due job p50"
                f" {statistics.median(claims[20:]) * 1e3:.3f} ms (relaxed commit"
                f" {statistics.median(relaxed_times[20:]) * 1e3:.3f} ms), SELECT 1 p50"
                f" {statistics.median(selects[20:]) * 1e3:.3f} ms"
            )


def main(jobs: int = 200, flavour: str = "def") -> None:
    with scratch_database("bench_wake_probe"):
        print(f"wake-up stages, in-process default worker, {flavour} handler:")
        stages(jobs, flavour)
        print("round trips after an idle pause, raw psycopg:")
        idle_cost()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 200, args[1] if len(args) > 1 else "def")
