"""What pause and the worker heartbeat cost per claim.

    python bench/pause_cost.py [--samples 2000] [--paused 0]

Pause is a ``NOT EXISTS (SELECT FROM sqlaq_paused_queues WHERE queue = :b_queue)`` probe
inside every claim (see :func:`sqlaq.queries.claim_stmt`). This script times one claim of
10 jobs (with BEGIN/ROLLBACK, so the 1,000 queued jobs stay queued) with the claim
statement as shipped and with the same statement without the probe, alternating the two
*samples* times each on one connection, so drift and load hit both alike. Both run as
the same driver-level statement text (``exec_driver_sql``), so only the SQL differs. With
``--paused N``, N other queues are paused first (the probe is a primary-key lookup
either way).

The heartbeat is one UPSERT of the worker's ``sqlaq_workers`` row per maintenance
interval (60 s by default), in a transaction of its own on the maintenance thread: its
cost per claim is its measured time divided by the claims a worker makes in that
interval (printed for a few claim rates).

Creates a database of its own on the local server (or SQLAQ_BENCH_SERVER_URL) and drops
it at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
import uuid
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url

import sqlaq
from sqlaq import NewJob, queries
from sqlaq.config import DEFAULT_MAINTENANCE_INTERVAL

DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
_PROBE = re.compile(
    r" AND NOT \(EXISTS \(SELECT \*\s+FROM sqlaq_paused_queues\s+"
    r"WHERE sqlaq_paused_queues\.queue = %\(b_queue\)s::VARCHAR\)\)"
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _claim_sql() -> tuple[str, str, str]:
    """The claim as shipped, without the pause probe, and without the ``timeout``
    column in its RETURNING list (sqlaq_0005), as driver-level SQL text."""
    stmt = queries.claim_stmt(
        queue="default", worker_id=uuid.uuid4(), limit=10, lease=sqlaq.ops.DEFAULT_LEASE
    )
    shipped = str(stmt.compile(dialect=postgresql.psycopg.dialect()))
    bare, found = _PROBE.subn("", shipped)
    if found != 1:
        raise SystemExit(f"the pause probe was not found in the claim:\n{shipped}")
    untimed, found = re.subn(r", sqlaq_jobs\.timeout(?=,|$)", "", shipped)
    if found != 1:
        raise SystemExit(f"the timeout column was not found in the claim:\n{shipped}")
    return shipped, bare, untimed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--paused", type=int, default=0, help="other queues to pause first")
    args = parser.parse_args()
    server = os.environ.get("SQLAQ_BENCH_SERVER_URL", DEFAULT_SERVER)
    name = f"sqlaq_bench_pause_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(server).set(database=name)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
            conn.commit()
        _run(engine, args.samples, args.paused)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _run(engine: Any, samples: int, paused: int) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(1000)])
        for i in range(paused):
            sqlaq.pause(conn, f"other-{i}")
    with engine.connect() as conn:
        conn.commit()
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")
        )
    shipped, bare, untimed = _claim_sql()
    params = queries.claim_params(
        queue="default", worker_id=uuid.uuid4(), limit=10, lease=sqlaq.ops.DEFAULT_LEASE
    )
    times: dict[str, list[float]] = {
        "as shipped": [],
        "without the pause probe": [],
        "without the timeout column": [],
    }
    variants = list(zip(times.values(), (shipped, bare, untimed), strict=True))
    with engine.connect() as conn:
        for _ in range(20):  # warm up: prepared statements, caches
            for _, sql in variants:
                assert len(conn.exec_driver_sql(sql, params).all()) == 10
                conn.rollback()
        for round_ in range(samples):
            # Rotate which goes first, so none always follows another.
            shift = round_ % len(variants)
            order = variants[shift:] + variants[:shift]
            for values, sql in order:
                start = time.perf_counter()
                rows = conn.exec_driver_sql(sql, params).all()
                conn.rollback()
                values.append((time.perf_counter() - start) * 1000)
                assert len(rows) == 10
        beats = []
        heartbeat = queries.heartbeat_stmt(
            worker_id=uuid.uuid4(),
            hostname="bench",
            pid=os.getpid(),
            queues=["default"],
            concurrency=100,
        )
        for _ in range(samples):
            start = time.perf_counter()
            conn.execute(heartbeat)
            conn.commit()
            beats.append((time.perf_counter() - start) * 1000)
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {samples} samples each")
    if paused:
        print(f"{paused} other queues paused")
    for label, values in times.items():
        print(
            f"claim 10 (BEGIN/claim/ROLLBACK) {label}: p50 {_percentile(values, 0.5):.3f} ms, "
            f"p90 {_percentile(values, 0.9):.3f} ms, mean {statistics.fmean(values):.3f} ms"
        )
    shipped_times = times["as shipped"]
    for label in ("without the pause probe", "without the timeout column"):
        other = times[label]
        pairs = [a - b for a, b in zip(shipped_times, other, strict=True)]
        print(
            f"as shipped minus {label}: p50 difference "
            f"{_percentile(shipped_times, 0.5) - _percentile(other, 0.5):+.3f} ms; median of "
            f"paired differences {statistics.median(pairs):+.3f} ms"
        )
    beat = _percentile(beats, 0.5)
    interval = DEFAULT_MAINTENANCE_INTERVAL.total_seconds()
    print(f"heartbeat UPSERT + COMMIT: p50 {beat:.3f} ms, once per {interval:g} s")
    for claims_per_second in (1, 10, 100, 1000):
        share_us = beat * 1000 / (claims_per_second * interval)
        print(f"  at {claims_per_second} claims/s: {share_us:.4f} us per claim")


if __name__ == "__main__":
    main()
