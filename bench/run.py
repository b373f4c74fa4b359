"""sqlaq's benchmark: a script with a results table, not a test.

    python bench/run.py [--rounds 3] [--only NAME ...] [--json bench/results.json]

Creates a database of its own on the local server (or on the server of
SQLAQ_BENCH_SERVER_URL), migrates it, runs every scenario --rounds times interleaved
(A B C, A B C, ...), prints a table of median, min and max, writes the raw figures as
JSON, and drops the database.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq
from sqlaq import NewJob

DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@dataclass
class Bench:
    """What a scenario gets: the database and a place to record figures."""

    url: str
    engine: Engine
    figures: dict[str, list[float]] = field(default_factory=dict)

    def record(self, name: str, value: float) -> None:
        self.figures.setdefault(name, []).append(value)

    def psycopg_dsn(self) -> str:
        return make_url(self.url).set(drivername="postgresql").render_as_string(False)

    def reset(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("TRUNCATE sqlaq_jobs"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# --- scenarios -----------------------------------------------------------------------


def enqueue_single(b: Bench) -> None:
    """1. enqueue one job per transaction, one process (jobs/s)."""
    b.reset()
    n = 3000
    start = time.perf_counter()
    for i in range(n):
        with b.engine.begin() as conn:
            sqlaq.enqueue(conn, "noop", {"i": i})
    b.record("enqueue 1/tx (jobs/s)", n / (time.perf_counter() - start))


def enqueue_bulk(b: Bench) -> None:
    """2. bulk enqueue 20,000 jobs: enqueue_many (ids back) and COPY (no ids)."""
    n = 20_000
    b.reset()
    jobs = [NewJob("noop", {"i": i}) for i in range(n)]
    start = time.perf_counter()
    with b.engine.begin() as conn:
        results = sqlaq.enqueue_many(conn, jobs)
    b.record("enqueue_many 20k (jobs/s)", n / (time.perf_counter() - start))
    if len(results) != n:
        raise RuntimeError(f"enqueue_many returned {len(results)} results for {n} jobs")
    b.reset()
    start = time.perf_counter()
    with b.engine.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("noop", {"i": i}) for i in range(n)])
    b.record("enqueue_many 20k incl. NewJob (jobs/s)", n / (time.perf_counter() - start))


def claim_latency(b: Bench) -> None:
    """6. claim p50/p99 with 1,000 queued jobs, empty history vs 1,000,000 finished rows."""
    for label, history in (("empty", 0), ("1M finished", 1_000_000)):
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
        worker = uuid.uuid4()
        samples = []
        with b.engine.connect() as conn:
            for _ in range(500):
                start = time.perf_counter()
                sqlaq.claim(conn, worker_id=worker, limit=10)
                samples.append((time.perf_counter() - start) * 1000)
                conn.rollback()  # keep the 1,000 queued jobs queued
        b.record(f"claim 10, {label}: p50 (ms)", percentile(samples, 0.5))
        b.record(f"claim 10, {label}: p99 (ms)", percentile(samples, 0.99))


RAW_CLAIM = """
WITH c AS MATERIALIZED (
    SELECT id FROM sqlaq_jobs
    WHERE status IN ('queued', 'running') AND queue = 'default' AND run_at <= now()
    ORDER BY priority DESC, run_at, id LIMIT %(n)s FOR UPDATE SKIP LOCKED)
UPDATE sqlaq_jobs j SET status = 'running', attempts = j.attempts + 1, locked_by = %(w)s,
    lease_token = gen_random_uuid(), run_at = now() + interval '30 seconds'
FROM c WHERE j.id = c.id
RETURNING j.id, j.kind, j.payload, j.lease_token
"""
RAW_COMPLETE = """
UPDATE sqlaq_jobs SET status = 'done', finished_at = now(), lease_token = NULL
WHERE id = ANY(%(ids)s) AND lease_token = ANY(%(tokens)s) AND status = 'running'
"""


def raw_baseline(b: Bench, batch: int = 100) -> None:
    """7. the claim-batch / complete-batch loop in raw psycopg, one connection."""
    n = 20_000
    b.reset()
    with b.engine.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("noop") for _ in range(n)])
    worker = uuid.uuid4()
    done = 0
    with psycopg.connect(b.psycopg_dsn()) as conn:
        start = time.perf_counter()
        while True:
            rows = conn.execute(RAW_CLAIM, {"n": batch, "w": worker}).fetchall()
            conn.commit()
            if not rows:
                break
            conn.execute(
                RAW_COMPLETE, {"ids": [r[0] for r in rows], "tokens": [r[3] for r in rows]}
            )
            conn.commit()
            done += len(rows)
        elapsed = time.perf_counter() - start
    if done != n:
        raise RuntimeError(f"raw baseline finished {done} of {n} jobs")
    b.record(f"raw psycopg loop, batch {batch} (jobs/s)", n / elapsed)


def ops_loop(b: Bench, batch: int = 100) -> None:
    """The same loop through sqlaq.claim / sqlaq.complete, one connection."""
    n = 20_000
    b.reset()
    with b.engine.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("noop") for _ in range(n)])
    worker = uuid.uuid4()
    done = 0
    with b.engine.connect() as conn:
        start = time.perf_counter()
        while True:
            jobs = sqlaq.claim(conn, worker_id=worker, limit=batch)
            conn.commit()
            if not jobs:
                break
            sqlaq.complete(conn, [j.lease for j in jobs])
            conn.commit()
            done += len(jobs)
        elapsed = time.perf_counter() - start
    if done != n:
        raise RuntimeError(f"ops loop finished {done} of {n} jobs")
    b.record(f"sqlaq ops loop, batch {batch} (jobs/s)", n / elapsed)


SCENARIOS: dict[str, Callable[[Bench], None]] = {
    "enqueue_single": enqueue_single,
    "enqueue_bulk": enqueue_bulk,
    "raw_baseline": raw_baseline,
    "ops_loop": ops_loop,
    "claim_latency": claim_latency,
}


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
    return url, engine


def drop_database(server_url: str, url: str) -> None:
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def table(figures: dict[str, list[float]]) -> str:
    width = max(len(name) for name in figures)
    lines = [
        f"| {'figure':<{width}} | median | min | max |",
        f"|{'-' * (width + 2)}|---:|---:|---:|",
    ]
    for name, values in figures.items():
        med, low, high = statistics.median(values), min(values), max(values)
        lines.append(f"| {name:<{width}} | {med:,.1f} | {low:,.1f} | {high:,.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS))
    parser.add_argument("--json", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    server = os.environ.get("SQLAQ_BENCH_SERVER_URL", DEFAULT_SERVER)
    url, engine = create_database(server)
    bench = Bench(url, engine)
    chosen = args.only or list(SCENARIOS)
    try:
        for round_ in range(args.rounds):
            for name in chosen:
                print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                SCENARIOS[name](bench)
    finally:
        engine.dispose()
        drop_database(server, url)
    with psycopg.connect(
        make_url(server).set(drivername="postgresql").render_as_string(False)
    ) as c:
        server_version = c.execute("SHOW server_version").fetchone()
    info: dict[str, Any] = {
        "command": " ".join(["python", "bench/run.py", *(argv or sys.argv[1:])]),
        "python": platform.python_version(),
        "postgresql": server_version[0] if server_version else "?",
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    print(table(bench.figures))
    print(json.dumps(info))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"info": info, "figures": bench.figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
