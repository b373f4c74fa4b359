"""Where a worker process's memory goes: its resident set, step by step (Linux).

    python bench/rss_probe.py [--jobs 20000] [--rounds 1] [--database-url URL]

Run it with the sqlaq to measure importable (installed, or ``PYTHONPATH=.`` from a
clone); it prints the path it measured. Each figure comes from a fresh interpreter (this
script started again with ``--step``), read from ``/proc/self/status``:

* ``deps``: ``import sqlalchemy, psycopg`` alone, its peak (``VmHWM``): what the
  dependencies cost, the issue's reference point;
* ``engine``: then the psycopg dialect, an engine, a connection and ``SELECT 1`` (any
  SQLAlchemy application on PostgreSQL pays it), ``VmRSS``;
* ``sqlaq``: then ``import sqlaq.cli, sqlaq.worker.core`` (what ``sqlaq-worker`` imports
  before it loads the application), ``VmRSS`` and ``VmHWM``;
* ``drain``: a burst worker, ``sqlaq.cli.run_worker([app, "--burst", "--log-level",
  "warning"])`` at defaults, draining JOBS no-op jobs (loaded with ``enqueue_copy``)
  in a process of its own: its peak (``VmHWM``) at exit.

The drain runs on a database of its own, ``bench_rss_probe``, created on the server of
``--database-url`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``,
or ``SQLAQ_DATABASE_URL``) and dropped at the end, even after a failure.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DATABASE = "bench_rss_probe"


def status() -> dict[str, float]:
    """This process's ``VmRSS`` and ``VmHWM``, in MiB."""
    found: dict[str, float] = {}
    with open("/proc/self/status", encoding="ascii") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) / 1024
    return found


def noop(_payload: Any) -> None:
    """The drained jobs' handler: does nothing."""


def step(name: str, url: str) -> dict[str, Any]:
    """One figure, in this (fresh) process."""
    # What the step measures (sqlaq's own imports below): argparse is not imported yet.
    import psycopg  # noqa: F401
    import sqlalchemy

    deps = status()
    if name == "deps":
        return deps
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text("SELECT 1"))
    engine.dispose()
    with_engine = status()
    if name == "engine":
        return with_engine
    import sqlaq.cli
    import sqlaq.worker.core

    imported = status() | {"sqlaq": os.path.dirname(sqlaq.cli.__file__)}
    if name == "sqlaq":
        return imported
    import sqlaq

    registry = sqlaq.Registry()
    registry.handler("noop")(noop)
    sys.modules["__main__"].registry = registry  # type: ignore[attr-defined]
    argv = ["__main__:registry", "--burst", "--log-level", "warning", "--database-url", url]
    code = sqlaq.cli.run_worker(argv, {})
    if code:
        raise SystemExit(f"the worker exited with {code}")
    return status()


def fresh(name: str, url: str) -> dict[str, Any]:
    """:func:`step` *name* in a new interpreter."""
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, "--step", name, "--database-url", url],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def load(admin: Any, url: str, jobs: int) -> None:
    """A new scratch database holding *jobs* no-op jobs."""
    import sqlalchemy

    import sqlaq

    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {DATABASE} (FORCE)"))
        conn.execute(sqlalchemy.text(f"CREATE DATABASE {DATABASE}"))
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            sqlaq.migrations.upgrade(conn)
            sqlaq.enqueue_copy(conn, [sqlaq.NewJob("noop") for _ in range(jobs)])
    finally:
        engine.dispose()


def left(url: str) -> int:
    """The jobs of the scratch database not done."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as conn:
            query = "SELECT count(*) FROM sqlaq_jobs WHERE status <> 'done'"
            return int(conn.execute(sqlalchemy.text(query)).scalar_one())
    finally:
        engine.dispose()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--database-url", default=os.environ.get("SQLAQ_DATABASE_URL", DEFAULT_URL))
    options = parser.parse_args()
    import sqlalchemy

    server = sqlalchemy.make_url(options.database_url)
    scratch = server.set(database=DATABASE).render_as_string(hide_password=False)
    admin = sqlalchemy.create_engine(server, isolation_level="AUTOCOMMIT")
    with open("/proc/loadavg", encoding="ascii") as loadavg:
        print(f"load {loadavg.read().strip()}")
    try:
        for round_ in range(1, options.rounds + 1):
            load(admin, scratch, options.jobs)
            deps = fresh("deps", scratch)["VmHWM"]
            engine_rss = fresh("engine", scratch)["VmRSS"]
            imported = fresh("sqlaq", scratch)
            drained = fresh("drain", scratch)["VmHWM"]
            if left(scratch):
                raise SystemExit(f"the burst worker left {left(scratch)} jobs not done")
            print(
                f"round {round_}: deps {deps:.1f} MiB (VmHWM); + engine {engine_rss:.1f} "
                f"(VmRSS); + sqlaq {imported['VmRSS']:.1f} (VmRSS), {imported['VmHWM']:.1f} "
                f"(VmHWM); drain of {options.jobs:,} no-op jobs {drained:.1f} (VmHWM); "
                f"sqlaq's modules {imported['VmRSS'] - engine_rss:+.1f}, drain over deps "
                f"{drained - deps:+.1f}  [{imported['sqlaq']}]"
            )
    finally:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {DATABASE} (FORCE)"))
        admin.dispose()
        with open("/proc/loadavg", encoding="ascii") as loadavg:
            print(f"load {loadavg.read().strip()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--step"]:  # a measured process: no argparse before its figure
        print(json.dumps(step(sys.argv[2], sys.argv[4])))
    else:
        main()
