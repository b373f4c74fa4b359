"""Races between connections: claims, fencing and dedupe on committed data."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import Engine, text

import sqlaq
from sqlaq import NewJob

pytestmark = pytest.mark.timeout(120)


def test_eight_claimers_take_every_job_exactly_once(committed: Engine) -> None:
    with committed.begin() as conn:
        ids = {r.job_id for r in sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(5000)])}
    start = threading.Barrier(8)

    def claimer() -> list[int]:
        worker = uuid.uuid4()
        seen: list[int] = []
        start.wait()
        while True:
            with committed.begin() as conn:
                jobs = sqlaq.claim(conn, worker_id=worker, limit=25)
                assert len(jobs) <= 25
                sqlaq.complete(conn, [j.lease for j in jobs])
            if not jobs:
                return seen
            seen.extend(j.id for j in jobs)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: claimer(), range(8)))
    counts = Counter(job_id for seen in results for job_id in seen)
    assert set(counts) == ids
    assert max(counts.values()) == 1
    assert sum(1 for seen in results if seen) > 1  # the work was actually shared
    with committed.connect() as conn:
        statuses = conn.execute(text("SELECT status, count(*) FROM sqlaq_jobs GROUP BY 1")).all()
    assert statuses == [("done", 5000)]


@pytest.mark.parametrize(
    "planner",
    [
        "",
        "SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off",
        "SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off;"
        " SET LOCAL enable_indexscan = off; SET LOCAL enable_bitmapscan = off",
    ],
    ids=["default", "nested-loop", "nested-loop-seqscan"],
)
def test_batch_claim_never_exceeds_n_whatever_the_plan(committed: Engine, planner: str) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(2000)])
        conn.execute(text("ANALYZE sqlaq_jobs"))
    with committed.begin() as conn:
        for statement in filter(None, planner.split(";")):
            conn.execute(text(statement))
        jobs = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10)
        assert len(jobs) == 10
        running = conn.execute(
            text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'running'")
        ).scalar_one()
        assert running == 10


def test_concurrent_claimers_skip_each_others_locked_rows(committed: Engine) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(10)])
    with committed.connect() as first, committed.connect() as second:
        a = sqlaq.claim(first, worker_id=uuid.uuid4(), limit=6)  # still uncommitted
        b = sqlaq.claim(second, worker_id=uuid.uuid4(), limit=6)
        first.commit()
        second.commit()
    assert len(a) == 6
    assert len(b) == 4
    assert not {j.id for j in a} & {j.id for j in b}


def test_dedupe_under_eight_concurrent_enqueuers(committed: Engine) -> None:
    start = threading.Barrier(8)

    def enqueuer(n: int) -> sqlaq.EnqueueResult:
        with committed.begin() as conn:
            start.wait()
            result = sqlaq.enqueue(conn, "sync_user", {"n": n}, dedupe_key="user-1")
            # The transaction is still usable after a conflict.
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
            return result

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(enqueuer, range(8)))
    assert sum(not r.duplicate for r in results) == 1
    assert len({r.job_id for r in results}) == 1
    with committed.connect() as conn:
        pending = conn.execute(
            text("SELECT count(*) FROM sqlaq_jobs WHERE status IN ('queued', 'running')")
        ).scalar_one()
    assert pending == 1


def test_stale_holder_cannot_touch_a_job_reclaimed_by_another_connection(
    committed: Engine,
) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "k")
    with committed.begin() as conn:
        (stale,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
        conn.execute(text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 second'"))
    with committed.begin() as conn:
        (fresh,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    with committed.begin() as conn:
        assert sqlaq.complete(conn, stale.lease, raise_on_lost=False) == []
    with committed.begin() as conn:
        assert sqlaq.complete(conn, fresh.lease) == [fresh.id]
        row = conn.execute(text("SELECT status, attempts FROM sqlaq_jobs")).one()
    assert tuple(row) == ("done", 2)
