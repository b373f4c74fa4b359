"""What a fan-in costs its parents: completions per second with and without a child.

    python bench/fan_in.py [--parents 10000] [--threads 4] [--batch 50] [--rounds 3]

Enqueues *parents* jobs either as a plain group (no child) or as a chord (one callback
waiting for all of them), then *threads* connections claim and complete them, *batch*
per transaction, as fast as they can, and the script prints completions per second for
each, alternating the two *rounds* times. A chord's parents each delete their own edge
row and check the callback in their completion's transaction (the trigger): no row is
shared by two parents, and a parent notifies ``sqlaq_release`` only when every parent
left is finishing at that moment (a NOTIFY makes the commits that send one wait for
each other), so the completions should not serialise. After the chord's run, one
post-commit release check (what a worker does on the release notification) must leave
the callback due.

Creates a database of its own on the local server (or SQLAQ_BENCH_SERVER_URL) and drops
it at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

import sqlaq
from sqlaq import NewJob

SERVER = os.environ.get(
    "SQLAQ_BENCH_SERVER_URL", "postgresql+psycopg://postgres@127.0.0.1/postgres"
)


def drain(engine: Engine, threads: int, batch: int) -> float:
    """Claim and complete everything due on *threads* connections; the seconds taken."""
    start = threading.Barrier(threads + 1)

    def work() -> None:
        worker = uuid.uuid4()
        start.wait()
        while True:
            with engine.begin() as conn:
                jobs = sqlaq.claim(conn, worker_id=worker, queue="bench", limit=batch)
                sqlaq.complete(conn, [j.lease for j in jobs])
            if not jobs:
                return

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in pool:
        thread.join()
    return time.perf_counter() - began


def one_round(engine: Engine, parents: int, threads: int, batch: int, chord: bool) -> float:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs, sqlaq_job_deps"))
    jobs = [NewJob("p", queue="bench") for _ in range(parents)]
    with engine.begin() as conn:
        if chord:
            flow = sqlaq.chord(conn, jobs, then=NewJob("cb", queue="cb"))
        else:
            sqlaq.group(conn, jobs)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE sqlaq_jobs"))
    seconds = drain(engine, threads, batch)
    if chord:
        with engine.begin() as conn:
            assert flow.callback_id is not None
            sqlaq.release_waiting(conn, job_ids=[flow.callback_id])
            due = conn.execute(
                text("SELECT run_at <= now() FROM sqlaq_jobs WHERE id = :id"),
                {"id": flow.callback_id},
            ).scalar_one()
            assert due, "the callback was not released"
    return parents / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parents", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    name = f"sqlaq_bench_fanin_{uuid.uuid4().hex[:8]}"
    admin = create_engine(SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine = create_engine(
        make_url(SERVER).set(database=name), pool_size=args.threads + 2, max_overflow=0
    )
    try:
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
            conn.commit()
        plain: list[float] = []
        fan_in: list[float] = []
        for _ in range(args.rounds):
            plain.append(one_round(engine, args.parents, args.threads, args.batch, chord=False))
            fan_in.append(one_round(engine, args.parents, args.threads, args.batch, chord=True))
        p, f = statistics.median(plain), statistics.median(fan_in)
        print(f"parents={args.parents} threads={args.threads} batch={args.batch}")
        print(f"group (no child): {p:,.0f} completions/s  {[round(x) for x in plain]}")
        print(f"chord (one child): {f:,.0f} completions/s  {[round(x) for x in fan_in]}")
        print(f"ratio: {f / p:.2f}")
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


if __name__ == "__main__":
    main()
