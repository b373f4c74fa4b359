"""What one job enqueued in a transaction of its own costs, layer by layer.

    python bench/enqueue_probe.py [JOBS] [ROUNDS]

On a database of its own (``bench_enqueue_probe``, migrated to sqlaq's head, dropped at
the end), four producers alternate, JOBS one-job transactions each per round (default
1,000 and 5), and the median jobs/s of each is printed:

* ``autocommit``: raw psycopg, the ``INSERT`` alone in autocommit (one round trip: the
  shape of pgqueuer's producer, and the most any producer can do per commit here);
* ``psycopg``: raw psycopg, ``with conn.transaction(): INSERT ... RETURNING id`` (the
  same three round trips as below: ``BEGIN``, the ``INSERT``, ``COMMIT``);
* ``sqlalchemy``: the same ``INSERT`` as a ``text()`` in ``engine.begin()`` (the pool's
  checkout and return, SQLAlchemy's execution);
* ``sqlaq``: ``sqlaq.enqueue(conn, ...)`` in ``engine.begin()``.

The ratios between them say what a transaction of its own costs against one round trip
(``psycopg / autocommit``: the most a producer in ``engine.begin()`` can reach against
one that sends its ``INSERT`` in autocommit, whatever its library does), what the
application's shape costs (SQLAlchemy's) and what sqlaq adds to it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlaq  # after the path is set, for a run from a clean clone
from sqlaq import migrations

SERVER = "host=127.0.0.1 user=postgres dbname=postgres"
NAME = "bench_enqueue_probe"
URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{NAME}"
INSERT = "INSERT INTO sqlaq_jobs (kind, payload) VALUES (%s, %s::jsonb) RETURNING id"


def main(jobs: int, rounds: int) -> None:
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {NAME}")
        admin.execute(f"CREATE DATABASE {NAME}")
    engine = create_engine(URL)
    try:
        with engine.begin() as conn:
            migrations.upgrade(conn)
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={NAME}") as raw:
            raw.autocommit = True  # each transaction() is one BEGIN ... COMMIT
            measure(engine, raw, jobs, rounds)
    finally:
        engine.dispose()
        with psycopg.connect(SERVER, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {NAME} WITH (FORCE)")


def measure(engine: Engine, raw: psycopg.Connection[Any], jobs: int, rounds: int) -> None:
    plain = text(
        "INSERT INTO sqlaq_jobs (kind, payload) VALUES (:k, CAST(:p AS jsonb)) RETURNING id"
    )

    def with_autocommit(n: int) -> None:
        for _ in range(n):
            raw.execute(INSERT, ("noop", '{"seq": 1}')).fetchone()

    def with_psycopg(n: int) -> None:
        for _ in range(n):
            with raw.transaction():
                raw.execute(INSERT, ("noop", '{"seq": 1}')).fetchone()

    def with_sqlalchemy(n: int) -> None:
        for _ in range(n):
            with engine.begin() as conn:
                conn.execute(plain, {"k": "noop", "p": '{"seq": 1}'}).scalar_one()

    def with_sqlaq(n: int) -> None:
        for i in range(n):
            with engine.begin() as conn:
                sqlaq.enqueue(conn, "noop", {"seq": i})

    producers: dict[str, Callable[[int], None]] = {
        "autocommit": with_autocommit,
        "psycopg": with_psycopg,
        "sqlalchemy": with_sqlalchemy,
        "sqlaq": with_sqlaq,
    }
    for produce in producers.values():
        produce(min(jobs, 300))  # warm: connections, prepared statements, caches
    rates: dict[str, list[float]] = {name: [] for name in producers}
    for _ in range(rounds):
        for name, produce in producers.items():
            started = time.perf_counter()
            produce(jobs)
            rates[name].append(jobs / (time.perf_counter() - started))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        shown = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:11} {medians[name]:8,.0f} jobs/s (rounds: {shown})")
    print(f"psycopg / autocommit {medians['psycopg'] / medians['autocommit']:.2f}")
    print(f"sqlalchemy / psycopg {medians['sqlalchemy'] / medians['psycopg']:.2f}")
    print(f"sqlaq / sqlalchemy   {medians['sqlaq'] / medians['sqlalchemy']:.2f}")


if __name__ == "__main__":
    arguments = [int(a) for a in sys.argv[1:3]]
    main(*(arguments + [1000, 5][len(arguments) :]))
