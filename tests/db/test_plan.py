"""The claim's plan stays on its partial index however much history the table holds."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from sqlaq import queries

pytestmark = pytest.mark.timeout(120)


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(_nodes(child))
    return found


def explain(conn: Connection, stmt: Any) -> list[dict[str, Any]]:
    compiled = stmt.compile(dialect=conn.dialect)
    (result,) = conn.exec_driver_sql(
        "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.params
    ).scalar_one()
    return _nodes(result["Plan"])


def test_claim_uses_the_partial_claim_index_beside_200k_finished_rows(
    committed: Engine,
) -> None:
    with committed.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (kind, status, finished_at, attempts)"
                " SELECT 'old', (ARRAY['done', 'failed', 'cancelled'])[1 + i % 3], now(), 1"
                " FROM generate_series(1, 200000) AS i"
            )
        )
        conn.execute(
            text("INSERT INTO sqlaq_jobs (kind) SELECT 'new' FROM generate_series(1, 1000)")
        )
    with committed.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE sqlaq_jobs"))
    with committed.connect() as conn:
        stmt = queries.claim_stmt(
            queue="default", worker_id=uuid.uuid4(), limit=10, lease=timedelta(seconds=30)
        )
        nodes = explain(conn, stmt)
    scans = [n for n in nodes if n.get("Relation Name") == "sqlaq_jobs"]
    assert any(n.get("Index Name") == "sqlaq_jobs_claim_idx" for n in scans), scans
    assert not any(n["Node Type"] == "Seq Scan" for n in scans), scans
    # The claim is ordered by the index itself: no sort over the due rows.
    assert not any(n["Node Type"] == "Sort" for n in nodes), nodes
