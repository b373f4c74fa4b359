"""Benchmark scenario ``dashboard``: the dashboard's queries on 1,000,000 finished rows.

    python bench/run.py --only dashboard [--rounds 3]      (or: nox -s bench -- --only dashboard)

The table holds 1,000,000 finished jobs (a fiftieth failed, a hundredth cancelled, the rest
done; ten kinds, three queues), inserted in the order they finished, as a queue's table
grows, plus 1,000 queued and 50 running jobs, then VACUUM ANALYZE. Two histories:

* ``7d``: the million finished over the last 7 days (sqlaq's default retention of done
  jobs: a steady state at about 1.7 jobs/s);
* ``24h``: the million finished within the last 24 hours (11.6 jobs/s): the worst case
  of the 24-hour view, where every finished row is in range.

Each statement the overview runs on every refresh (counts, per-queue health, the two
plots' series) is timed for the 3-hour view (the default) and the 24-hour one: the
median of 20 runs on one connection, after one warm-up. The failures page (7 days), the
first page of the jobs list and a job's page are timed too. The target: every overview
statement under 200 ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import Engine, text

from sqlaq import queries
from sqlaq.schema import JobStatus

FINISHED_ROWS = 1_000_000
RUNS = 20
#: The bar each overview statement must stay under (milliseconds).
TARGET_MS = 200.0
HISTORIES = {"7d": "7 days", "24h": "24 hours"}
#: The plots' ranges timed, with their buckets (as sqlaq.dashboard.reads.WINDOWS).
VIEWS = {3: timedelta(minutes=1), 24: timedelta(minutes=10)}


class Recorder(Protocol):
    """What the scenario needs of bench/run.py's ``Bench``."""

    engine: Engine

    def record(self, name: str, value: float) -> None: ...

    def reset(self) -> None: ...


def fill(engine: Engine, span: str) -> None:
    """1,000,000 finished jobs over *span* back from now, oldest first, and 1,050
    pending ones; analyzed."""
    with engine.begin() as conn:
        conn.execute(text("SELECT setseed(0.14)"))
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (queue, kind, status, attempts, created_at,"
                " attempted_at, finished_at, run_at, last_error)"
                " SELECT (ARRAY['default', 'emails', 'reports'])[1 + n % 3], 'kind_' || n % 10,"
                " CASE WHEN n % 50 = 0 THEN 'failed' WHEN n % 100 = 1 THEN 'cancelled'"
                " ELSE 'done' END, 1 + (n % 7 = 0)::int,"
                " f - interval '1 second' * (1 + 30 * random()), f - interval '200 ms', f, f,"
                " CASE WHEN n % 50 = 0 THEN 'TimeoutError: upstream ' || n % 4 || chr(10)"
                " || '  File job.py' END"
                " FROM (SELECT n, now() - CAST(:span AS interval) * (1 - n / CAST(:rows AS float))"
                " AS f FROM generate_series(1, :rows) AS n) AS history"
            ),
            {"span": span, "rows": FINISHED_ROWS},
        )
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (queue, kind, status, attempts, run_at, attempted_at,"
                " locked_by) SELECT 'default', 'kind_' || n % 10,"
                " CASE WHEN n <= 50 THEN 'running' ELSE 'queued' END, (n <= 50)::int,"
                " now() + interval '30 seconds' * (n <= 50)::int,"
                " CASE WHEN n <= 50 THEN now() END, CASE WHEN n <= 50 THEN gen_random_uuid() END"
                " FROM generate_series(1, 1050) AS n"
            )
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")
        )


def statements() -> dict[str, Callable[[], Any]]:
    """The statements timed, by label: the overview's per view, then the other pages'."""
    found: dict[str, Callable[[], Any]] = {}
    for hours, bucket in VIEWS.items():
        window = timedelta(hours=hours)
        found[f"overview {hours}h: counts"] = lambda w=window: queries.overview_counts_stmt(
            window=w
        )
        found[f"overview {hours}h: throughput"] = lambda w=window, b=bucket: (
            queries.throughput_stmt(window=w, bucket=b)
        )
        found[f"overview {hours}h: wait percentiles"] = lambda w=window, b=bucket: (
            queries.wait_percentiles_stmt(window=w, bucket=b)
        )
    found["overview: queue health"] = queries.overview_health_stmt
    found["failures page, 7d"] = lambda: queries.failure_groups_stmt(
        since=timedelta(days=7), limit=200
    )
    found["jobs list, first page"] = lambda: queries.find_jobs_stmt(limit=51, newest_first=True)
    found["jobs list, failed, first page"] = lambda: queries.find_jobs_stmt(
        statuses=[JobStatus.FAILED], limit=51, newest_first=True
    )
    found["job page"] = lambda: queries.get_job_stmt(job_id=FINISHED_ROWS // 2)
    return found


def dashboard(b: Recorder) -> None:
    """14. The dashboard's queries on 1,000,000 finished rows (see the module doc)."""
    for label, span in HISTORIES.items():
        b.reset()
        fill(b.engine, span)
        with b.engine.connect() as conn:
            for name, build in statements().items():
                stmt = build()
                conn.execute(stmt).all()  # warm-up (and the plan's first build)
                samples = []
                for _ in range(RUNS):
                    start = time.perf_counter()
                    conn.execute(stmt).all()
                    samples.append((time.perf_counter() - start) * 1000)
                conn.rollback()
                b.record(figure(label, name), median(samples))


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def figure(history: str, name: str) -> str:
    """The label of a timing in bench/run.py's table."""
    return f"14. dashboard, 1M finished over {history}: {name} (ms)"


#: bench/run.py's targets: every overview statement under 200 ms, in both histories.
TARGETS = [
    (figure(history, name), "<", TARGET_MS)
    for history in HISTORIES
    for name in statements()
    if name.startswith("overview")
]
