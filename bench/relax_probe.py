"""What the relaxed commit of a claim costs, by the way it is sent.

    python bench/relax_probe.py [ROUNDS] [PAUSE_MS]

On a database of its own (``bench_relax_probe``, dropped at the end), a table of 200
finished jobs analyzed; each round enqueues one job on a second connection (committed as
usual), pauses PAUSE_MS (default 2: the worker's backend idle as at a wake-up), then claims
it with the worker's statement (sqlaq's plain and bounded claims, and a minimal
hand-written claim for scale), each way in turn, in shuffled order:

- ``synchronous``: the claim alone, its commit waiting for the WAL flush;
- ``session``: the claim alone on a session with ``synchronous_commit`` off (the floor);
- ``pipeline``: ``SELECT set_config('synchronous_commit', 'off', true)`` and the claim in
  one psycopg pipeline (one implicit transaction, one round trip): how the worker sent
  its claims before ``sqlaq.queries.relaxed_stmt``;
- ``in statement``: ``relaxed_stmt(claim)``, the setting in the claim's own ``WHERE``
  (what the worker sends now).

Prints each way's p50 and p90 of the claim's round trip (execute and fetch), in ms.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq  # after the path is set, for a run from a clean clone
from sqlaq import queries

ADMIN = "host=127.0.0.1 user=postgres dbname=postgres"
DSN = "host=127.0.0.1 user=postgres dbname=bench_relax_probe"
URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_relax_probe"
RELAX = str(queries.relaxed_commit_stmt())
MINIMAL = (
    "WITH picked AS MATERIALIZED (SELECT id FROM sqlaq_jobs"
    " WHERE status IN ('queued', 'running') AND queue = 'default' AND run_at <= now()"
    " ORDER BY priority DESC, run_at, id LIMIT 10 FOR UPDATE SKIP LOCKED)"
    " UPDATE sqlaq_jobs j SET status = 'running', attempts = j.attempts + 1,"
    " run_at = now() + interval '30 seconds', attempted_at = now()"
    " FROM picked WHERE j.id = picked.id RETURNING j.id, j.payload"
)


def claims(engine: Any) -> dict[str, tuple[str, dict[str, Any], str]]:
    """name -> (SQL, parameters, how it is sent)."""
    worker = uuid.uuid4()
    ways: dict[str, tuple[str, dict[str, Any], str]] = {
        "minimal, session": (MINIMAL, {}, "session")
    }
    for bounded in (False, True):
        name = "bounded" if bounded else "plain"
        lease = timedelta(seconds=30)
        stmt = queries.claim_stmt(
            queue="default", worker_id=worker, limit=10, lease=lease, bounded=bounded
        )
        for relaxed in (False, True):
            compiled = (queries.relaxed_stmt(stmt) if relaxed else stmt).compile(
                dialect=engine.dialect
            )
            params = dict(compiled.params)
            if bounded:
                params.update(b_priority=0, b_run_at=datetime(2000, 1, 1, tzinfo=UTC), b_id=0)
            hows = ("in statement",) if relaxed else ("synchronous", "session", "pipeline")
            for how in hows:
                ways[f"{name}, {how}"] = (str(compiled), params, how)
    return ways


def measure(rounds: int, pause: float) -> None:
    engine = create_engine(URL)
    with engine.connect() as conn:
        sqlaq.migrations.upgrade(conn)
        conn.commit()
    ways = claims(engine)
    engine.dispose()
    with (
        psycopg.connect(DSN, autocommit=True) as claimer,
        psycopg.connect(DSN, autocommit=True) as producer,
    ):
        claimer.execute(
            "INSERT INTO sqlaq_jobs (kind, payload, status, finished_at)"
            " SELECT 'noop', '{}', 'done', now() FROM generate_series(1, 200)"
        )
        claimer.execute("ANALYZE sqlaq_jobs")
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for n in range(rounds):
            random.shuffle(names)
            for name in names:
                sql, params, how = ways[name]
                claimer.execute(f"SET synchronous_commit = {'off' if how == 'session' else 'on'}")
                producer.execute("INSERT INTO sqlaq_jobs (kind, payload) VALUES ('noop', '{}')")
                time.sleep(pause)
                started = time.perf_counter()
                if how == "pipeline":
                    cursor = claimer.cursor()
                    with claimer.pipeline():
                        claimer.execute(RELAX)
                        cursor.execute(sql, params)
                    rows = cursor.fetchall()
                else:
                    rows = claimer.execute(sql, params).fetchall()
                took = time.perf_counter() - started
                if len(rows) != 1:
                    raise RuntimeError(f"{name}: claimed {len(rows)} jobs, not 1")
                if n >= 10:  # after psycopg prepared the statements
                    times[name].append(took)
                claimer.execute(
                    "UPDATE sqlaq_jobs SET status = 'done', finished_at = now() WHERE id = %s",
                    (rows[0][0],),
                )
    for name, took in times.items():
        p90 = statistics.quantiles(took, n=10)[-1]
        print(f"  {name:28s} p50 {statistics.median(took) * 1e3:.3f} ms  p90 {p90 * 1e3:.3f} ms")


def main(rounds: int = 200, pause_ms: float = 2.0) -> None:
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS bench_relax_probe")
        admin.execute("CREATE DATABASE bench_relax_probe")
    try:
        print(f"claim of one due job after a {pause_ms:g} ms pause, {rounds} rounds:")
        measure(rounds, pause_ms / 1000)
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute("DROP DATABASE IF EXISTS bench_relax_probe (FORCE)")


if __name__ == "__main__":
    main(*(float(arg) if i else int(arg) for i, arg in enumerate(sys.argv[1:])))
