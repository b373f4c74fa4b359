"""Where a wake-up goes, stage by stage, and what an idle pause costs a round trip.

    python bench/wake_probe.py [JOBS] [def|async|sleep]

Two measurements on a database of its own (``bench_wake_probe``, dropped at the end):

1. ``sqlaq-worker`` at its defaults, in a process of its own as the peer bench runs it,
   with a no-op handler (``def`` unless ``async`` is given; ``sleep``: an ``async``
   handler that sleeps 10 ms after its first line) and ``bench/wake_marks.py``
   timing its run thread; woken JOBS times (default 200), one enqueue every 20 ms from
   this process, the table analyzed. It prints the p50 of each stage of a wake-up: from
   the run thread's wait returning (the NOTIFY readable) to its waker cleared, the
   listener's read begun, the notification taken in, the listener's read done, the
   finished runs collected, the outbox's turn, the queue chosen, the claim's plan
   entered and run (its checks and parameters, up to the statement's compiled form
   looked up, the cursor taken), the claim sent, through the claim's statement, to the
   jobs built, held and
   handed to the runner, to the run thread waiting again, to the handler's first line
   (on a slot thread or the runner's event loop); and from the enqueue's commit to the
   handler. Then the slowest wake-ups, each with its steps that took longer than
   :data:`SLOW_STEP` (none: the time went before the worker woke, on the
   notification's way to it). Each mark costs the run thread a microsecond or two.
2. Raw psycopg: the worker's own claim statement (prepared, one due job, a 200-row
   analyzed table), committed as usual and as the worker commits it (relaxed: the
   setting inside the statement, ``relaxed_stmt``), and a ``SELECT 1``, with no pause,
   2 ms and 20 ms before each: on a VM, waking a process that has been idle costs more
   than the statement, and a commit's WAL flush after an idle moment more still.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
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

ROOT = Path(__file__).resolve().parent.parent

DSN = "host=127.0.0.1 user=postgres dbname=bench_wake_probe"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_wake_probe"
pc = time.perf_counter
#: The stages of a wake-up on the run thread, in order (bench/wake_marks.py).
STAGES = (
    "woken",
    "cleared",
    "reading",
    "notified",
    "read",
    "collected",
    "outbox turned",
    "queue chosen",
    "claim entered",
    "plan run",
    "compiled lookup",
    "cursor",
    "claim sent",
    "claim answered",
    "jobs built",
    "held",
    "handed over",
    "waits",
)
#: Seconds between two enqueues (the peer bench's spacing).
SPACING = 0.02
#: How many of the slowest wake-ups to show step by step.
SLOWEST = 8
#: A step of a slow wake-up is shown if it took longer than this (seconds).
SLOW_STEP = 0.00015


def stages(jobs: int, flavour: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "marks"
        environ = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "WAKE_MARKS_OUT": str(out),
            "WAKE_MARKS_FLAVOUR": flavour,
        }
        argv = [sys.executable, "-c", "from sqlaq.cli import worker_main; worker_main()"]
        argv += ["bench.wake_marks:registry", "--database-url", URL, "--log-level", "warning"]
        worker = subprocess.Popen(argv, env=environ)
        engine = create_engine(URL)
        commits: dict[int, float] = {}
        try:
            time.sleep(2)  # started and listening
            for seq in range(-5, 0):  # warm-up: prepared statements, threads
                with engine.begin() as conn:
                    sqlaq.enqueue(conn, "noop", {"seq": seq})
                time.sleep(0.05)
            with engine.begin() as conn:
                conn.execute(text("ANALYZE sqlaq_jobs"))
            time.sleep(0.5)
            for seq in range(jobs):
                with engine.begin() as conn:
                    sqlaq.enqueue(conn, "noop", {"seq": seq})
                commits[seq] = time.time()
                time.sleep(SPACING)
            time.sleep(0.5)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
            engine.dispose()
        marks = [line.split("\t") for line in out.read_text().splitlines()]
    gaps: dict[tuple[str, str], list[float]] = {}
    slowest: list[tuple[float, int, list[str]]] = []
    totals: list[float] = []
    seen: dict[str, float] = {}
    for stage, at, extra in marks:
        if stage == "woken":
            seen = {}
        if stage != "handler":
            seen.setdefault(stage, float(at))  # the first of each in this turn
            continue
        text_seq, wall = extra.split()
        number = int(text_seq)
        if number < 0 or "claim sent" not in seen:
            continue
        order = [s for s in STAGES if s in seen] + ["handler"]
        seen["handler"] = float(at)
        for first, then in itertools.pairwise(order):
            gaps.setdefault((first, then), []).append(seen[then] - seen[first])
        totals.append(float(wall) - commits[number])
        slow = [
            f"{first} -> {then} {(seen[then] - seen[first]) * 1e3:.3f}"
            for first, then in itertools.pairwise(order)
            if seen[then] - seen[first] > SLOW_STEP
        ]
        slowest.append((totals[-1], number, slow))
    for (first, then), values in gaps.items():
        print(f"  {first:>15} -> {then:<15} p50 {statistics.median(values) * 1e3:.3f} ms")
    print(f"  commit -> handler p50 {statistics.median(totals) * 1e3:.3f} ms ({len(totals)} jobs)")
    print(f"the {SLOWEST} slowest wake-ups, and their steps over {SLOW_STEP * 1e3} ms:")
    for total, seq, slow in sorted(slowest, reverse=True)[:SLOWEST]:
        steps = "; ".join(slow) or "none: the time went before the worker woke"
        print(f"  job {seq:4d} ({seq * SPACING:5.2f} s in): {total * 1e3:.3f} ms; {steps}")


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
        print(f"wake-up stages, sqlaq-worker at its defaults, {flavour} handler:")
        stages(jobs, flavour)
        print("round trips after an idle pause, raw psycopg:")
        idle_cost()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 200, args[1] if len(args) > 1 else "def")
