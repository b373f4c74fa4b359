"""sqlaq tenants: one tenant floods the queue, the others still get served.

    python3 examples/tenants.py

Each job carries its tenant as its ``key``. One tenant (``acme``) enqueues a flood of
jobs first, then a few other tenants enqueue a few jobs each. A worker drains the queue
with fair claiming on (``fair=("tenants",)``): each claim is shared between the tenants
with due jobs, so the small tenants' jobs start within the first claims instead of
waiting behind the whole flood. The script prints each tenant's wait (from enqueue to
start, on the database's clock) at the 50th and 99th percentile, then does the same
without fairness to compare, and exits 0.

Which database it uses, in order (as examples/quickstart.py):

- ``SQLAQ_DATABASE_URL`` (or ``DATABASE_URL``), if set;
- else, with ``sqlaq[embedded]`` installed, sqlaq's embedded PostgreSQL (data in
  ``.sqlaq/`` or ``$SQLAQ_EMBEDDED_DIR``);
- else a database ``sqlaq_quickstart``, created once, on the local server at
  127.0.0.1:5432.

``TENANTS_FLOOD`` (default 5000) and ``TENANTS_PER_TENANT`` (default 50) set the sizes.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import uuid
from typing import Any

from _database import database_url  # the examples' shared choice of database
from sqlalchemy import Engine, create_engine, func, select

import sqlaq

QUEUE = "tenants"
FLOODER = "acme"
OTHERS = ("globex", "initech", "umbrella", "hooli", "stark")


registry = sqlaq.Registry()


@registry.handler("render_report")
def render_report(payload: dict[str, Any]) -> None:
    """A tenant's job: short work (a millisecond)."""
    time.sleep(0.001)


def run_once(engine: Engine, *, fair: bool, flood: int, per_tenant: int) -> None:
    """Enqueue the flood and the other tenants' jobs (tagged with this run), drain
    them, and print each tenant's wait percentiles."""
    run = uuid.uuid4().hex
    with engine.begin() as conn:
        # The flood first: in plain claim order, every other tenant waits behind it.
        sqlaq.enqueue_copy(
            conn,
            [
                sqlaq.NewJob("render_report", {"run": run}, queue=QUEUE, key=FLOODER)
                for _ in range(flood)
            ],
        )
        for tenant in OTHERS:
            sqlaq.enqueue_many(
                conn,
                [
                    sqlaq.NewJob("render_report", {"run": run}, queue=QUEUE, key=tenant)
                    for _ in range(per_tenant)
                ],
            )
    started = time.perf_counter()
    sqlaq.Worker(
        engine,
        registry,
        queues=(QUEUE,),
        fair=(QUEUE,) if fair else (),
        concurrency=10,
        burst=True,
    ).run()
    took = time.perf_counter() - started
    jobs = sqlaq.jobs.c
    wait = func.extract("epoch", jobs.attempted_at - jobs.created_at)
    with engine.connect() as conn:
        rows = conn.execute(
            select(jobs.key, jobs.status, wait).where(
                jobs.queue == QUEUE, jobs.payload["run"].astext == run
            )
        ).all()
    waits: dict[str, list[float]] = {}
    for key, status, seconds in rows:
        if status != "done":
            raise SystemExit(f"a job of {key} ended {status}")
        waits.setdefault(key, []).append(float(seconds))
    print(f"{'fair' if fair else 'plain'} claiming: {len(rows)} jobs drained in {took:.1f} s")
    for tenant in (FLOODER, *OTHERS):
        values = sorted(waits[tenant])
        p50 = statistics.median(values)
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        print(f"  {tenant:<9} {len(values):>6} jobs  wait p50 {p50:6.3f} s  p99 {p99:6.3f} s")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    engine = create_engine(database_url())
    with engine.connect() as conn:
        sqlaq.migrations.upgrade(conn)
    flood = int(os.environ.get("TENANTS_FLOOD", "5000"))
    per_tenant = int(os.environ.get("TENANTS_PER_TENANT", "50"))
    run_once(engine, fair=True, flood=flood, per_tenant=per_tenant)
    run_once(engine, fair=False, flood=flood, per_tenant=per_tenant)
    engine.dispose()


if __name__ == "__main__":
    main()
