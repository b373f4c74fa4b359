"""A claim narrowed with ``where=``: only matching jobs are claimed, and only they are locked.

The clause lands inside the claim's locking CTE. Applied after it (``claim_stmt(...)
.where(...)``), the CTE would lock and count the first *limit* due jobs whatever they
are, the UPDATE would then drop the ones that do not match: fewer jobs claimed, and other
workers' rows locked until commit.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, column, exists, table, text

import sqlaq
from sqlaq import ConfigError, NewJob, queries

pytestmark = pytest.mark.timeout(120)

EU = sqlaq.jobs.c.payload["region"].astext == "eu"


def lockable(engine: Engine, ids: list[int], mode: str = "UPDATE") -> bool:
    """Whether another session can lock every row of *ids* at once (``NOWAIT``)."""
    with engine.connect() as other:
        try:
            other.execute(
                text(f"SELECT id FROM sqlaq_jobs WHERE id = ANY(:ids) FOR {mode} NOWAIT"),
                {"ids": ids},
            ).all()
        except Exception as exc:
            if getattr(getattr(exc, "orig", None), "sqlstate", None) == "55P03":
                return False  # lock_not_available
            raise
        finally:
            other.rollback()
    return True


def regional(conn: Connection, regions: list[str], **fields: Any) -> list[int]:
    jobs = [NewJob("k", {"region": r, "i": i}, **fields) for i, r in enumerate(regions)]
    return [r.job_id for r in sqlaq.enqueue_many(conn, jobs)]


def test_narrowed_claim_takes_matching_jobs_and_locks_nothing_else(committed: Engine) -> None:
    with committed.begin() as conn:
        # The other region's jobs come first by priority: the CTE would pick them.
        others = regional(conn, ["us"] * 5, priority=10)
        eu = regional(conn, ["eu"] * 3)
    with committed.connect() as conn:
        claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=3, where=EU)
        assert sorted(j.id for j in claimed) == eu
        assert {j.payload["region"] for j in claimed} == {"eu"}
        # Still uncommitted: the claimed rows are locked, the others are free.
        assert not lockable(committed, eu[:1])
        assert lockable(committed, others)
        conn.commit()
    with committed.connect() as conn:
        statuses = dict(conn.execute(text("SELECT id, status FROM sqlaq_jobs")).all())
    assert {statuses[i] for i in eu} == {"running"}
    assert {statuses[i] for i in others} == {"queued"}


def test_a_where_applied_after_the_builder_is_what_where_fixes(committed: Engine) -> None:
    """The failure the ``where=`` option exists for, pinned so the docs stay true."""
    with committed.begin() as conn:
        others = regional(conn, ["us"] * 2, priority=10)
        regional(conn, ["eu"] * 3)
    outside = queries.claim_stmt(
        queue="default", worker_id=uuid.uuid4(), limit=2, lease=timedelta(seconds=30)
    ).where(EU)
    with committed.connect() as conn:
        assert conn.execute(outside).all() == []  # 3 matching jobs due, none claimed
        assert not lockable(committed, others)  # and the other two locked till commit
        conn.rollback()


def test_where_takes_a_sequence_and_combines_with_exclude_kinds(conn: Connection) -> None:
    regional(conn, ["eu", "eu", "us"])
    sqlaq.enqueue(conn, "limited", {"region": "eu"})
    sqlaq.enqueue(conn, "k", {"region": "eu", "tenant": 7})
    tenant = sqlaq.jobs.c.payload["tenant"].as_integer() == 7
    (job,) = sqlaq.claim(
        conn, worker_id=uuid.uuid4(), limit=10, where=[EU, tenant], exclude_kinds=["limited"]
    )
    assert job.payload == {"region": "eu", "tenant": 7}
    rest = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10, where=(EU,))
    assert sorted(j.kind for j in rest) == ["k", "k", "limited"]
    assert sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10, where=[]) != []  # the "us" one


def test_where_may_test_another_table_inside_a_subquery(conn: Connection) -> None:
    conn.execute(text("CREATE TEMP TABLE paused_tenants (tenant int) ON COMMIT DROP"))
    conn.execute(text("INSERT INTO paused_tenants VALUES (2)"))
    ids = [sqlaq.enqueue(conn, "k", {"tenant": t}).job_id for t in (1, 2, 3)]
    paused = table("paused_tenants", column("tenant"))
    tenant = sqlaq.jobs.c.payload["tenant"].as_integer()
    active = ~exists().where(paused.c.tenant == tenant)
    claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10, where=active)
    assert sorted(j.id for j in claimed) == [ids[0], ids[2]]


def test_the_same_clause_reuses_its_statement_and_keeps_its_values(conn: Connection) -> None:
    from sqlaq.ops import claiming as ops

    regional(conn, ["eu", "us", "eu", "us"])
    us = sqlaq.jobs.c.payload["region"].astext == "us"
    first = sqlaq.claim(conn, worker_id=uuid.uuid4(), where=EU)
    cached = ops._narrowed_claim(EU, False)
    assert ops._narrowed_claim(EU, False) is cached
    second = sqlaq.claim(conn, worker_id=uuid.uuid4(), where=us)
    third = sqlaq.claim(conn, worker_id=uuid.uuid4(), where=EU)
    assert [j.payload["region"] for j in first + second + third] == ["eu", "us", "eu"]


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("payload->>'region' = 'eu'", r"where must be a SQLAlchemy boolean clause.*got str"),
        ([EU, 5], r"got int"),
        (sqlaq.jobs, r"got Table"),
        (
            table("tenants", column("id")).c.id == sqlaq.jobs.c.id,
            r"where uses tenants beside sqlaq_jobs.*inside a subquery",
        ),
    ],
    ids=["str", "not-a-clause-in-list", "table", "other-table-in-from"],
)
def test_where_refuses_what_is_not_a_clause_over_jobs(
    conn: Connection, where: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        sqlaq.claim(conn, worker_id=uuid.uuid4(), where=where)


def test_eight_racing_narrowed_claimers_take_each_matching_job_once(committed: Engine) -> None:
    with committed.begin() as conn:
        regions = ["eu" if i % 2 else "us" for i in range(800)]
        ids = regional(conn, regions)
    eu = {i for i, r in zip(ids, regions, strict=True) if r == "eu"}
    us = sorted(set(ids) - eu)
    start = threading.Barrier(8)
    unlocked_checks: list[bool] = []

    def claimer() -> list[int]:
        worker = uuid.uuid4()
        seen: list[int] = []
        start.wait()
        while True:
            with committed.begin() as conn:
                jobs = sqlaq.claim(conn, worker_id=worker, limit=10, where=EU)
                # While this claim's locks are held, the other region is not locked by
                # anyone: KEY SHARE conflicts with a claim's FOR UPDATE, not with itself.
                unlocked_checks.append(lockable(committed, us, "KEY SHARE"))
                sqlaq.complete(conn, [j.lease for j in jobs])
            if not jobs:
                return seen
            seen.extend(j.id for j in jobs)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: claimer(), range(8)))
    counts = Counter(job_id for seen in results for job_id in seen)
    assert set(counts) == eu
    assert max(counts.values()) == 1
    assert sum(1 for seen in results if seen) > 1  # the work was actually shared
    assert all(unlocked_checks)
    assert lockable(committed, us)
    with committed.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT status, attempts, count(*) FROM sqlaq_jobs"
                " WHERE id = ANY(:us) GROUP BY 1, 2"
            ),
            {"us": us},
        ).all()
    assert [tuple(r) for r in rows] == [("queued", 0, 400)]


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(_nodes(child))
    return found


def test_narrowed_claim_still_walks_the_partial_claim_index(committed: Engine) -> None:
    with committed.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (kind, status, finished_at, attempts, payload)"
                " SELECT 'old', (ARRAY['done', 'failed', 'cancelled'])[1 + i % 3], now(), 1,"
                " jsonb_build_object('region', 'eu') FROM generate_series(1, 200000) AS i"
            )
        )
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (kind, payload) SELECT 'new',"
                " jsonb_build_object('region', CASE WHEN i % 4 = 0 THEN 'eu' ELSE 'us' END)"
                " FROM generate_series(1, 1000) AS i"
            )
        )
    with committed.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE sqlaq_jobs"))
    stmt = queries.claim_stmt(
        queue="default", worker_id=uuid.uuid4(), limit=10, lease=timedelta(seconds=30), where=EU
    )
    with committed.connect() as conn:
        compiled = stmt.compile(dialect=conn.dialect)
        (plan,) = conn.exec_driver_sql(
            "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.params
        ).scalar_one()
        (cte,) = [n for n in _nodes(plan["Plan"]) if n.get("Subplan Name") == "CTE candidates"]
        nodes = _nodes(cte)
        claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10, where=EU)
        conn.rollback()
    scans = [n for n in nodes if n.get("Relation Name") == "sqlaq_jobs"]
    assert any(n.get("Index Name") == "sqlaq_jobs_claim_idx" for n in scans), scans
    assert not any(n["Node Type"] == "Seq Scan" for n in scans), scans
    # The candidates come in the index's order: no sort over the due rows. (How the
    # UPDATE then joins its ten ids is the planner's business.)
    assert not any(n["Node Type"] == "Sort" for n in nodes), nodes
    assert len(claimed) == 10
    assert {j.payload["region"] for j in claimed} == {"eu"}


def test_the_clause_is_inside_the_locking_cte() -> None:
    from sqlalchemy.dialects import postgresql

    stmt = queries.claim_stmt(
        queue="q", worker_id=uuid.uuid4(), limit=5, lease=timedelta(seconds=30), where=EU
    )
    sql = " ".join(str(stmt.compile(dialect=postgresql.psycopg.dialect())).split())  # type: ignore[attr-defined]
    cte, _, rest = sql.partition(") UPDATE sqlaq_jobs")
    assert re.search(r"\(sqlaq_jobs.payload ->> %\(payload_1\)s\S*\) = %\(param_1\)s", cte)
    assert "FOR UPDATE SKIP LOCKED" in cte
    assert "payload" not in rest.split("RETURNING")[0]
