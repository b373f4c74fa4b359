"""What each part of the worker's claim costs on a backend that has just woken.

    python bench/claim_cost.py [ROUNDS] [PAUSE_MS] [FINISHED]

On a database of its own (``bench_claim_cost``, dropped at the end), a table of FINISHED
finished jobs (default 200) analyzed; each round pauses PAUSE_MS (default 20: the machine
idle, as between two wake-ups of the peer bench), enqueues one job on a second connection
(committed as usual), then claims it at once, as a woken worker does, with the worker's
statement (the bounded claim of :func:`sqlaq.queries.claim_stmt` with the relaxed commit
in it, :func:`sqlaq.queries.relaxed_stmt`, prepared, rows in binary) and with copies of
it that each lack one part, in shuffled order:

- ``no pause check``: without the two ``NOT EXISTS`` on ``sqlaq_paused_queues``;
- ``no expired-lease CASEs``: the ``SET`` of a fresh claim only (no job failed or
  noted for an expired lease);
- ``no position``: without the three subqueries that return where the next bounded
  claim starts;
- ``two columns``: ``RETURNING`` the id and the payload only;
- ``no gen_random_uuid()``: the worker's id as every lease token;
- ``setting in the session``: ``synchronous_commit`` off for the session, not in the
  statement;
- ``none of these``: all six at once;
- ``by its id, queued only``: the lean claim a worker told the new job's id could send
  (:func:`sqlaq.queries.claim_stmt` with ``ids``, unbounded, ``status = 'queued'`` only
  and so without the expired-lease ``CASE`` expressions; the pause check, the lease
  token, the relaxed commit and the job's columns kept): what claiming the notified job
  by its id would save over the worker's claim;
- ``minimal``: a one-CTE claim as a hand-written queue sends it (``UPDATE ... FROM``,
  two columns), on the session with ``synchronous_commit`` off.

None of the other copies is a claim sqlaq could send (each part is a behaviour: pauses, leases
that expire, held snapshots that cannot slow the claims, the jobs' fields, fenced
outcomes, the claim's relaxed commit); they say what each costs. Prints each one's p50
and p90 of the claim's round trip (execute and fetch), in ms. With the default 200
finished jobs the plans prepared at the start scan the table for the claimed ids, and the
table grows by a job a claim; FINISHED 5000 gives index scans throughout, as a worker's
table with a history has. A statement that no longer
has a part stops the probe with the part's name (``nox -s probes`` runs it).
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

from bench.scratch import scratch_database  # after the path is set, for a clean clone
from sqlaq import queries
from sqlaq.bounds import BIGINT_MIN
from sqlaq.dsn import connection_params

MINIMAL = (
    "WITH picked AS MATERIALIZED (SELECT id FROM sqlaq_jobs"
    " WHERE status IN ('queued', 'running') AND queue = 'default' AND run_at <= now()"
    " ORDER BY priority DESC, run_at, id LIMIT %(b_limit)s FOR UPDATE SKIP LOCKED)"
    " UPDATE sqlaq_jobs j SET status = 'running', attempts = j.attempts + 1,"
    " run_at = now() + interval '30 seconds', locked_by = %(b_worker)s,"
    " lease_token = gen_random_uuid(), attempted_at = now()"
    " FROM picked WHERE j.id = picked.id RETURNING j.id, j.payload"
)


def _cut(sql: str, part: str, start: str, end: str, keep_end: bool = True) -> str:
    """*sql* without the text from *start* up to *end* (kept, unless not *keep_end*)."""
    i = sql.find(start)
    j = sql.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise SystemExit(f"claim_cost: the claim no longer has its {part}; update the probe")
    return sql[:i] + sql[j if keep_end else j + len(end) :]


def _replace(sql: str, part: str, old: str, new: str) -> str:
    if old not in sql:
        raise SystemExit(f"claim_cost: the claim no longer has its {part}; update the probe")
    return sql.replace(old, new)


PAUSED = " AND NOT (EXISTS (SELECT *"


def _no_pause(sql: str) -> str:
    sql = _cut(sql, "pause check", PAUSED, "::VARCHAR))", keep_end=False)
    while PAUSED in sql:
        sql = _cut(sql, "pause check", PAUSED, "::VARCHAR))", keep_end=False)
    return sql


def _no_cases(sql: str, where: str = " WHERE sqlaq_jobs.id = any(") -> str:
    simple = (
        " SET status='running', run_at=now() + %(b_lease)s, attempts=sqlaq_jobs.attempts + 1,"
        " locked_by=%(b_worker)s::UUID, lease_token=gen_random_uuid(), attempted_at=now()"
    )
    head = _cut(sql, "expired-lease CASEs", " SET status=CASE", where)
    i = head.index(where)
    return head[:i] + simple + head[i:]


def _no_position(sql: str) -> str:
    return _cut(sql, "position", ", (SELECT candidates.priority", "AS last_id", keep_end=False)


def _two_columns(sql: str) -> str:
    """*sql* returning the id and the payload in place of a job's columns (the position
    that follows them, if any, kept)."""
    i = sql.find(" RETURNING sqlaq_jobs.id, ")
    if i < 0:
        raise SystemExit(
            "claim_cost: the claim no longer has its returned columns; update the probe"
        )
    j = sql.find(", (SELECT candidates.priority", i)
    return sql[:i] + " RETURNING sqlaq_jobs.id, sqlaq_jobs.payload" + (sql[j:] if j >= 0 else "")


def variants(engine: Any) -> dict[str, tuple[str, bool]]:
    """name -> (SQL, whether the session has ``synchronous_commit`` off)."""
    stmt = queries.claim_stmt(
        queue="default",
        worker_id=uuid.uuid4(),
        limit=10,
        lease=timedelta(seconds=30),
        bounded=True,
    )
    worker = str(queries.relaxed_stmt(stmt).compile(dialect=engine.dialect))
    setting = " AND (SELECT set_config("
    in_session = _cut(worker, "relaxed commit", setting, " RETURNING ")
    no_uuid = _replace(worker, "lease token", "gen_random_uuid()", "%(b_worker)s::UUID")
    none = _no_position(_no_cases(_no_pause(in_session)))
    none = _replace(none, "lease token", "gen_random_uuid()", "%(b_worker)s::UUID")
    none = _two_columns(none)
    plain = queries.claim_stmt(
        queue="default", worker_id=uuid.uuid4(), limit=10, lease=timedelta(seconds=30), ids=True
    )
    by_id = str(queries.relaxed_stmt(plain).compile(dialect=engine.dialect))
    by_id = _replace(by_id, "due statuses", "status IN ('queued', 'running')", "status = 'queued'")
    by_id = _no_cases(by_id, " FROM candidates WHERE")
    return {
        "the worker's claim": (worker, False),
        "no pause check": (_no_pause(worker), False),
        "no expired-lease CASEs": (_no_cases(worker), False),
        "no position": (_no_position(worker), False),
        "two columns": (_two_columns(worker), False),
        "no gen_random_uuid()": (no_uuid, False),
        "setting in the session": (in_session, True),
        "none of these": (none, True),
        "by its id, queued only": (by_id, False),
        "minimal": (MINIMAL, True),
    }


def measure(url: str, rounds: int, pause: float, finished: int = 200) -> None:
    engine = create_engine(url)
    ways = variants(engine)
    connect = connection_params(engine, "sqlaq-claim-cost")
    engine.dispose()
    # A notified claim's bound: before every job of the default priority.
    params = queries.claim_params(
        queue="default",
        worker_id=uuid.uuid4(),
        limit=10,
        lease=timedelta(seconds=30),
        after=queries.ClaimPosition(0, datetime(1970, 1, 1, tzinfo=UTC), BIGINT_MIN),
    )
    with (
        psycopg.connect(**connect, autocommit=True) as claimer,
        psycopg.connect(**connect, autocommit=True) as relaxed,
        psycopg.connect(**connect, autocommit=True) as producer,
    ):
        relaxed.execute("SET synchronous_commit = off")
        producer.execute(
            "INSERT INTO sqlaq_jobs (kind, payload, status, finished_at)"
            " SELECT 'noop', '{}', 'done', now() FROM generate_series(1, %s)",
            (finished,),
        )
        producer.execute("ANALYZE sqlaq_jobs")
        cursors = {False: claimer.cursor(binary=True), True: relaxed.cursor(binary=True)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for n in range(rounds + 10):
            random.shuffle(names)
            for name in names:
                sql, in_session = ways[name]
                cursor = cursors[in_session]
                time.sleep(pause)
                new = producer.execute(
                    "INSERT INTO sqlaq_jobs (kind, payload) VALUES ('noop', '{}') RETURNING id"
                ).fetchone()
                params["b_ids"] = [new[0] if new else 0]
                started = time.perf_counter()
                cursor.execute(sql, params, prepare=True)
                rows = cursor.fetchall()
                took = time.perf_counter() - started
                if len(rows) != 1:
                    raise RuntimeError(f"{name}: claimed {len(rows)} jobs, not 1")
                if n >= 10:  # prepared, and past the server's custom plans
                    times[name].append(took)
                producer.execute(
                    "UPDATE sqlaq_jobs SET status = 'done', finished_at = now() WHERE id = %s",
                    (rows[0][0],),
                )
    for name, each in times.items():
        p90 = statistics.quantiles(each, n=10)[-1]
        print(f"  {name:24s} p50 {statistics.median(each) * 1e3:.3f} ms  p90 {p90 * 1e3:.3f} ms")


def main(rounds: int = 300, pause_ms: float = 20.0, finished: int = 200) -> None:
    with scratch_database("bench_claim_cost") as url:
        print(
            f"claim of one job enqueued after a {pause_ms:g} ms pause, {rounds} rounds,"
            f" beside {finished} finished jobs:"
        )
        measure(url, rounds, pause_ms / 1000, finished)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        int(args[0]) if args else 300,
        float(args[1]) if len(args) > 1 else 20.0,
        int(args[2]) if len(args) > 2 else 200,
    )
