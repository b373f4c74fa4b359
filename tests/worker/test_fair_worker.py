"""A worker with ``fair=[queue]`` claims that queue fairly across its keys (the flood
does not hold the other keys back), beside limited kinds (claimed under their limits,
left out of the fair claim) and with ``key_weights``; a handler reads its job's key."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text

import sqlaq

pytestmark = pytest.mark.timeout(60)


def test_a_fair_worker_starts_every_key_early_beside_a_limited_kind(committed: Engine) -> None:
    registry = sqlaq.Registry()
    seen: list[str | None] = []

    def record(payload: dict[str, Any]) -> None:
        seen.append(sqlaq.current_job().key)

    registry.handler("report")(record)
    registry.handler("limited", concurrency=2)(record)
    with committed.begin() as conn:
        sqlaq.enqueue_copy(conn, [sqlaq.NewJob("report", key="flood") for _ in range(1500)])
        for key in ("a", "b", "c"):
            sqlaq.enqueue_many(conn, [sqlaq.NewJob("report", key=key) for _ in range(10)])
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("limited", key="a") for _ in range(5)])
    sqlaq.Worker(
        committed, registry, fair=["default"], key_weights={"a": 2}, concurrency=4, burst=True
    ).run()
    with committed.connect() as conn:
        rows = conn.execute(
            text("SELECT kind, key, status FROM sqlaq_jobs ORDER BY attempted_at, id")
        ).all()
    assert {row.status for row in rows} == {"done"}
    assert len(seen) == len(rows) == 1535
    # In plain claim order the 30 small jobs would start after the 1500 of the flood.
    last_small = max(i for i, row in enumerate(rows) if row.kind == "report" and row.key != "flood")
    assert last_small < 500, last_small
    assert sorted(k for k in seen if k != "flood") == ["a"] * 15 + ["b"] * 10 + ["c"] * 10
