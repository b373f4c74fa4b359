"""Where the process executor's time goes, and the box's ceiling for it.

    python bench/process_probe.py [JOBS] [--only threads processes ceiling] [--worker-args ...]

On a database of its own (``zz_process_probe``, dropped at the end):

1. ``ceiling``: the CPU-bound handler's work (``bench.app.cpu_work``) JOBS times, with
   no database and no queue: in one thread; in 2 bare spawned processes that each run
   half (the box's ceiling for 2 children); and in 2 processes fed one job at a time
   through a pipe each by one parent thread (what a minimal per-job round trip costs).
2. ``threads`` / ``processes``: JOBS jobs of ``cpu`` drained by ``sqlaq-worker --burst``
   (``bench.app:cpu_registry``), threads and ``--executor process``; while it drains,
   the CPU time of the worker, of each child and of the database's backends is read
   from ``/proc`` (from the first claim to the last sample before the worker exits),
   and the box's busy time from ``/proc/stat``. Per job: how many ms of CPU each part
   used, and how busy the children were (their CPU over the drain's wall time).

3. ``parent``: JOBS jobs of ``cpu`` drained by an in-process burst worker with
   ``executor="process"`` (2 children): the worker process's own CPU (``getrusage``: user,
   system, context switches) per job over ``Worker.run``, the children excluded. The
   part of the box the worker takes from its children, whatever the load.

A probe, not a test: it prints, it asserts nothing but that every job was done.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlaq  # noqa: E402 - after the path is set, for a run from a clean clone
from bench.app import CPU_ITERATIONS, cpu_work  # noqa: E402
from sqlaq import NewJob  # noqa: E402
from sqlaq.ops import DEFAULT_LEASE  # noqa: E402

NAME = "zz_process_probe"
ADMIN = "host=127.0.0.1 user=postgres dbname=postgres"
URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{NAME}"
TICK = os.sysconf("SC_CLK_TCK")


# -- the ceiling -----------------------------------------------------------------------


def _half(count: int, go: Any, done: Any) -> None:
    go.wait()
    for _ in range(count):
        cpu_work()
    done.put(time.perf_counter())


def _served(conn: Any) -> None:
    while conn.recv_bytes():
        cpu_work()
        conn.send_bytes(b"x")


def bare(jobs: int) -> tuple[float, float]:
    """The box's ceiling for the process executor: ``cpu_work`` *jobs* times in one
    thread, and in 2 bare spawned processes running half each (no queue, no pipe, no
    database); both in jobs/s."""
    started = time.perf_counter()
    for _ in range(jobs):
        cpu_work()
    one = jobs / (time.perf_counter() - started)
    spawn = multiprocessing.get_context("spawn")
    go, done = spawn.Event(), spawn.Queue()
    procs = [spawn.Process(target=_half, args=(jobs // 2, go, done)) for _ in range(2)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # both imported
    started = time.perf_counter()
    go.set()
    ends = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return one, jobs / (max(ends) - started)


def ceiling(jobs: int) -> None:
    one, two = bare(jobs)
    print(f"  1 thread, {jobs} x cpu_work: {one:,.0f} jobs/s ({1000 / one:.2f} ms each)")
    print(f"  2 bare processes, {jobs // 2} each, no queue: {two:,.0f} jobs/s ({two / one:.2f} x)")
    spawn = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    one_time = jobs / one
    pipes = [spawn.Pipe() for _ in range(2)]
    procs = [spawn.Process(target=_served, args=(theirs,)) for _, theirs in pipes]
    for p in procs:
        p.start()
    ours = [o for o, _ in pipes]
    for conn in ours:  # a first round trip: both imported
        conn.send_bytes(b"j")
        conn.recv_bytes()
    sent = 0
    started = time.perf_counter()
    for conn in ours:
        conn.send_bytes(b"j")
        sent += 1
    answered = 0
    from multiprocessing.connection import wait

    while answered < jobs:
        for conn in wait(ours):
            conn.recv_bytes()
            answered += 1
            if sent < jobs:
                conn.send_bytes(b"j")
                sent += 1
    fed = time.perf_counter() - started
    for conn in ours:
        conn.send_bytes(b"")
    for p in procs:
        p.join()
    print(
        f"  2 processes fed one job at a time by a pipe each: {jobs / fed:,.0f} jobs/s"
        f" ({one_time / fed:.2f} x 1 thread)"
    )


# -- a drain, with its CPU --------------------------------------------------------------


def _cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def _box() -> tuple[float, float]:
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / TICK, time.monotonic()


def drain(engine: Any, label: str, jobs: int, args: list[str]) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs"))
        sqlaq.enqueue_copy(conn, [NewJob("cpu", {"n": n}) for n in range(jobs)])
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLAQ_")}
    env["SQLAQ_DATABASE_URL"] = URL
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = Path(sys.executable).with_name("sqlaq-worker")
    proc = subprocess.Popen(
        [str(script), "bench.app:cpu_registry", "--burst", "--log-level", "warning", *args],
        cwd=ROOT,
        env=env,
    )
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    roles: dict[int, str] = {proc.pid: "worker"}
    started_box: tuple[float, float] | None = None
    ended_box = _box()
    commits = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={NAME}", autocommit=True) as db:
        db.execute("SELECT pg_stat_clear_snapshot()")
        committed = db.execute(commits).fetchone()[0]
        while proc.poll() is None:
            claimed = (
                started_box is not None
                or db.execute(
                    "SELECT EXISTS (SELECT FROM sqlaq_jobs WHERE status <> 'pending')"
                ).fetchone()[0]
            )
            backends = [
                r[0]
                for r in db.execute(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (NAME,),
                )
            ]
            for pid in backends:
                roles.setdefault(pid, "postgres")
            for pid in _children(proc.pid):
                roles.setdefault(pid, "child")
            pids = [proc.pid, *backends, *(p for p, r in roles.items() if r == "child")]
            sample = {pid: c for pid in pids if (c := _cpu(pid)) is not None}
            if claimed and started_box is None:
                started_box = _box()
                first.update(sample)
            if started_box is not None:
                for pid, c in sample.items():
                    first.setdefault(pid, c if roles[pid] == "postgres" else 0.0)
                last.update(sample)
                ended_box = _box()
            time.sleep(0.02)
        if proc.returncode != 0:
            raise RuntimeError(f"{label}: worker exited {proc.returncode}")
        time.sleep(0.6)  # (the statistics are flushed every half second at most)
        db.execute("SELECT pg_stat_clear_snapshot()")
        committed = db.execute(commits).fetchone()[0] - committed
        done, seconds = db.execute(
            "SELECT count(*) FILTER (WHERE status = 'done'),"
            " extract(epoch FROM max(finished_at) - (min(run_at) - %s)) FROM sqlaq_jobs",
            (DEFAULT_LEASE,),
        ).fetchone()
    if done != jobs:
        raise RuntimeError(f"{label}: {done} of {jobs} done")
    seconds = float(seconds)
    assert started_box is not None
    wall = ended_box[1] - started_box[1]
    box = (ended_box[0] - started_box[0]) / wall
    used: dict[str, float] = {}
    count: dict[str, int] = {}
    for pid, c in last.items():
        role = roles[pid]
        used[role] = used.get(role, 0.0) + c - first.get(pid, 0.0)
        count[role] = count.get(role, 0) + 1
    parts = ", ".join(
        f"{role} x{count[role]} {used[role] / jobs * 1000:.2f}" for role in sorted(used)
    )
    busy = used.get("child", 0.0) / wall
    print(
        f"  {label}: {jobs / seconds:,.0f} jobs/s (database clock); CPU per job (ms): {parts};"
        f" box busy {box:.2f} of 2 cores; children busy {busy:.2f} cores over {wall:.2f} s;"
        f" {jobs / committed:.1f} jobs per transaction (claims, writes, this probe's polls)"
    )


def parent(engine: Any, jobs: int) -> None:
    import resource

    from bench.app import cpu_registry

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs"))
        sqlaq.enqueue_copy(conn, [NewJob("cpu", {"n": n}) for n in range(jobs)])
    worker = sqlaq.Worker(engine, cpu_registry, executor="process", processes=2, burst=True)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    worker.run()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    with engine.connect() as conn:
        done = conn.execute(text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'"))
        if done.scalar_one() != jobs:
            raise RuntimeError("not every job was done")
    per_job = 1e6 / jobs
    print(
        f"  parent (in-process worker, 2 children): {jobs / wall:,.0f} jobs/s wall;"
        f" its CPU per job: user {(after.ru_utime - before.ru_utime) * per_job:.0f} us,"
        f" system {(after.ru_stime - before.ru_stime) * per_job:.0f} us;"
        f" context switches per job: {(after.ru_nvcsw - before.ru_nvcsw) / jobs:.1f}"
        f" voluntary, {(after.ru_nivcsw - before.ru_nivcsw) / jobs:.1f} involuntary"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", type=int, nargs="?", default=4000)
    parser.add_argument("--only", nargs="*", default=["ceiling", "threads", "processes"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker-args", default="")
    options = parser.parse_args()
    with open("/proc/loadavg", encoding="ascii") as f:
        print(f"load {f.read().strip()}; cpu_work({CPU_ITERATIONS:,})")
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {NAME}")
        admin.execute(f"CREATE DATABASE {NAME}")
    try:
        engine = create_engine(URL)
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
            conn.commit()
        for round_ in range(options.rounds):
            print(f"round {round_ + 1}")
            if "ceiling" in options.only:
                ceiling(options.jobs)
            if "threads" in options.only:
                drain(engine, "threads", options.jobs, [])
            if "processes" in options.only:
                extra = options.worker_args.split()
                drain(engine, "processes", options.jobs, ["--executor", "process", *extra])
            if "parent" in options.only:
                parent(engine, options.jobs)
        engine.dispose()
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {NAME} (FORCE)")
        with open("/proc/loadavg", encoding="ascii") as f:
            print(f"load {f.read().strip()}")


if __name__ == "__main__":
    main()
