"""What fair claiming across keys buys and costs (issue 27, item 4).

    python bench/fairness.py [--flood 100000] [--small-keys 20] [--per-key 100]
                             [--drain 20000] [--rounds 3] [--samples 300]

Three measurements, on a database of its own on the local server (or
SQLAQ_BENCH_SERVER_URL), dropped at the end:

1. ``wait``: one key (``flood``) with *flood* queued jobs, enqueued first, then
   *small-keys* other keys with *per-key* jobs each; an in-process burst worker at its
   defaults drains it all (no-op handler), once with the queue claimed fairly
   (``fair=("default",)``) and once without. Printed: the p50/p99/max wait of the small
   keys' jobs (``attempted_at - created_at``, the database's clock) and how long the
   drain took. Without fairness a small key waits for the whole flood; with it, its jobs
   start within the first claims.
2. ``drain``: *drain* no-op jobs over 20 keys, drained by the same worker with fairness
   off and on, interleaved *rounds* times (off, on, off, on, ...): wall time per job.
3. ``claim``: the claim statement alone (BEGIN, claim, ROLLBACK) on those *drain*
   jobs, plain vs fair, alternating *samples* times at limits 10 and 100: p50 per claim
   and per job.

Print ``uptime`` beside the figures: the box may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

import sqlaq
from sqlaq import NewJob

DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _registry() -> sqlaq.Registry:
    registry = sqlaq.Registry()
    registry.add("work", lambda payload: None)
    return registry


def _reset(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs"))
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")
        )


def _enqueue(engine: Engine, key: str, count: int) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_copy(conn, [NewJob("work", key=key) for _ in range(count)])


def _drain(engine: Engine, *, fair: bool) -> float:
    start = time.perf_counter()
    sqlaq.Worker(engine, _registry(), burst=True, fair=("default",) if fair else ()).run()
    return time.perf_counter() - start


def wait(engine: Engine, flood: int, small_keys: int, per_key: int) -> None:
    for fair in (False, True):
        _reset(engine)
        _enqueue(engine, "flood", flood)
        for n in range(small_keys):
            _enqueue(engine, f"small{n:02d}", per_key)
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE sqlaq_jobs"))
        took = _drain(engine, fair=fair)
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT key = 'flood', "
                    "extract(epoch FROM attempted_at - created_at) FROM sqlaq_jobs"
                )
            ).all()
            undone = conn.execute(
                text("SELECT count(*) FROM sqlaq_jobs WHERE status <> 'done'")
            ).scalar_one()
        assert undone == 0, f"{undone} jobs not done"
        small = [float(w) for is_flood, w in rows if not is_flood]
        big = [float(w) for is_flood, w in rows if is_flood]
        label = "fair" if fair else "plain"
        print(
            f"wait [{label}] small keys ({len(small)} jobs): p50 {_percentile(small, 0.5):.3f} s, "
            f"p99 {_percentile(small, 0.99):.3f} s, max {max(small):.3f} s; "
            f"flood ({len(big)} jobs): p50 {_percentile(big, 0.5):.3f} s, "
            f"max {max(big):.3f} s; drain {took:.1f} s ({(len(rows)) / took:.0f} jobs/s)"
        )


def _fill(engine: Engine, total: int) -> None:
    _reset(engine)
    with engine.begin() as conn:
        sqlaq.enqueue_copy(conn, [NewJob("work", key=f"k{n % 20:02d}") for n in range(total)])
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE sqlaq_jobs"))


def drain(engine: Engine, total: int, rounds: int) -> None:
    times: dict[str, list[float]] = {"plain": [], "fair": []}
    for _ in range(rounds):
        for label in ("plain", "fair"):
            _fill(engine, total)
            times[label].append(_drain(engine, fair=label == "fair"))
    for label, values in times.items():
        per_job = [t / total * 1e6 for t in values]
        print(
            f"drain [{label}] {total} no-op jobs over 20 keys, {rounds} rounds: "
            f"median {statistics.median(values):.2f} s "
            f"({statistics.median(per_job):.1f} us/job; min {min(per_job):.1f}, "
            f"max {max(per_job):.1f})"
        )
    ratio = statistics.median(times["fair"]) / statistics.median(times["plain"])
    print(f"drain fair/plain (median per job): {ratio:.2f}x (target <= 1.3x)")


def claim(engine: Engine, total: int, samples: int) -> None:
    _fill(engine, total)
    worker = uuid.uuid4()
    for limit in (10, 100):
        times: dict[str, list[float]] = {"plain": [], "fair": []}
        calls: dict[str, Any] = {"plain": sqlaq.claim, "fair": sqlaq.claim_fair}
        with engine.connect() as conn:
            for round_ in range(samples + 20):
                order = ["plain", "fair"] if round_ % 2 == 0 else ["fair", "plain"]
                for label in order:
                    start = time.perf_counter()
                    jobs = calls[label](conn, worker_id=worker, limit=limit)
                    conn.rollback()
                    if round_ >= 20:  # warmed up
                        times[label].append((time.perf_counter() - start) * 1000)
                    assert len(jobs) == limit
        plain, fair = (statistics.median(times[k]) for k in ("plain", "fair"))
        print(
            f"claim {limit} (BEGIN/claim/ROLLBACK, {samples} samples): plain p50 {plain:.3f} ms "
            f"({plain / limit * 1000:.1f} us/job), fair p50 {fair:.3f} ms "
            f"({fair / limit * 1000:.1f} us/job): {fair / plain:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=100_000)
    parser.add_argument("--small-keys", type=int, default=20)
    parser.add_argument("--per-key", type=int, default=100)
    parser.add_argument("--drain", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--only", choices=["wait", "drain", "claim"], action="append")
    args = parser.parse_args()
    only = set(args.only or ["wait", "drain", "claim"])
    server = os.environ.get("SQLAQ_BENCH_SERVER_URL", DEFAULT_SERVER)
    name = f"sqlaq_bench_fair_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = create_engine(make_url(server).set(database=name))
    try:
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
            conn.commit()
        load = os.getloadavg()
        print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        if "wait" in only:
            wait(engine, args.flood, args.small_keys, args.per_key)
        if "drain" in only:
            drain(engine, args.drain, args.rounds)
        if "claim" in only:
            claim(engine, args.drain, args.samples)
        load = os.getloadavg()
        print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
