"""unique_for: no second job of ``(kind, dedupe_key)`` within the period after
the first's enqueue, whatever became of the first; held enqueues report the holder, the
caller's transaction stays usable, racing enqueuers insert exactly one."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

import sqlaq
from sqlaq import EnqueueOutcome, queries
from sqlaq.testing import travel

pytestmark = pytest.mark.timeout(120)

HOUR = timedelta(hours=1)


def _usable(conn: Connection) -> None:
    assert conn.execute(text("SELECT 1")).scalar_one() == 1


def _holds(conn: Connection) -> list[tuple[Any, ...]]:
    rows = conn.execute(text("SELECT kind, key, job_id FROM sqlaq_unique_holds ORDER BY 1, 2"))
    return [tuple(row) for row in rows]


def _finish(conn: Connection, job_id: int, status: str) -> None:
    """Put the job in *status* the way sqlaq does."""
    if status == "queued":
        return
    (claimed,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    assert claimed.id == job_id
    if status == "done":
        sqlaq.complete(conn, claimed.lease)
    elif status == "failed":
        sqlaq.fail(conn, claimed.lease, "boom")
    elif status == "cancelled":
        sqlaq.cancel(conn, job_id)


@pytest.mark.parametrize("status", ["queued", "running", "done", "failed", "cancelled"])
def test_a_second_enqueue_within_the_period_is_held_whatever_the_first_became(
    conn: Connection, status: str
) -> None:
    first = sqlaq.enqueue(conn, "report", {"n": 1}, dedupe_key="day-1", unique_for=HOUR)
    assert first.outcome is EnqueueOutcome.INSERTED
    _finish(conn, first.job_id, status)
    status_now = "SELECT status FROM sqlaq_jobs WHERE id = :i"
    assert conn.execute(text(status_now), {"i": first.job_id}).scalar_one() == status
    second = sqlaq.enqueue(conn, "report", {"n": 2}, dedupe_key="day-1", unique_for=HOUR)
    assert second == sqlaq.EnqueueResult(first.job_id, outcome=EnqueueOutcome.HELD)
    assert second.duplicate
    assert not second.inserted
    _usable(conn)
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 1
    # Another key, or another kind, is not held.
    assert sqlaq.enqueue(conn, "report", dedupe_key="day-2", unique_for=HOUR).inserted
    assert sqlaq.enqueue(conn, "other", dedupe_key="day-1", unique_for=HOUR).inserted


def test_after_the_period_a_new_job_is_inserted_and_holds_the_key(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
    _finish(conn, first.job_id, "done")
    travel(conn, HOUR)  # the hold expires
    second = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
    assert second.inserted
    assert second.job_id != first.job_id
    assert _holds(conn) == [("report", "k", second.job_id)]
    third = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
    assert third == sqlaq.EnqueueResult(second.job_id, outcome=EnqueueOutcome.HELD)


def test_after_the_period_a_still_pending_first_job_is_a_duplicate(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
    travel(conn, 2 * HOUR)  # expired, but the job is still queued: the dedupe key holds
    again = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
    assert again == sqlaq.EnqueueResult(first.job_id, duplicate=True)
    assert again.outcome is EnqueueOutcome.DUPLICATE
    _usable(conn)
    # The hold follows the pending job (held until its created_at + unique_for).
    assert _holds(conn) == [("report", "k", first.job_id)]
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 1


def test_a_plain_dedupe_key_ignores_the_holds(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
    _finish(conn, first.job_id, "done")
    assert sqlaq.enqueue(conn, "report", dedupe_key="k").inserted  # no unique_for: no hold


def test_expired_holds_are_pruned(conn: Connection) -> None:
    for key in ("a", "b", "c"):
        sqlaq.enqueue(conn, "report", dedupe_key=key, unique_for=HOUR if key != "c" else 3 * HOUR)
    travel(conn, 2 * HOUR)
    pruned = conn.execute(queries.prune_unique_holds_stmt(limit=1)).all()
    assert len(pruned) == 1
    pruned = conn.execute(queries.prune_unique_holds_stmt(limit=10)).all()
    assert len(pruned) == 1
    assert [key for _, key, _ in _holds(conn)] == ["c"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_for": HOUR}, "unique_for needs a dedupe_key"),
        ({"dedupe_key": "k", "unique_for": timedelta(0)}, "unique_for must be more than zero"),
        ({"dedupe_key": "k", "unique_for": 60}, "unique_for must be a datetime.timedelta"),
        ({"dedupe_key": "k", "unique_for": timedelta(days=40000)}, "at most 100 years"),
        (
            {"dedupe_key": "k", "unique_for": HOUR, "debounce_key": "k", "debounce": HOUR},
            "debounce does not go with dedupe_key or unique_for",
        ),
    ],
)
def test_bad_unique_for_input_is_one_line_and_writes_nothing(
    conn: Connection, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match=message) as raised:
        sqlaq.enqueue(conn, "report", **options)
    assert "\n" not in str(raised.value)
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0
    assert _holds(conn) == []


@pytest.mark.parametrize("expired", [False, True], ids=["fresh", "expired-hold"])
def test_eight_racing_enqueuers_insert_exactly_one(committed: Engine, expired: bool) -> None:
    if expired:  # an earlier job, finished, whose hold has run out
        with committed.begin() as conn:
            old = sqlaq.enqueue(conn, "report", dedupe_key="k", unique_for=HOUR)
            _finish(conn, old.job_id, "done")
            travel(conn, HOUR)
    start = threading.Barrier(8)

    def enqueuer(i: int) -> sqlaq.EnqueueResult:
        with committed.connect() as conn:
            start.wait()
            with conn.begin():
                result = sqlaq.enqueue(conn, "report", {"n": i}, dedupe_key="k", unique_for=HOUR)
                _usable(conn)
        return result

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(enqueuer, range(8)))
    (winner,) = [r for r in results if r.inserted]
    assert sorted(r.outcome for r in results) == [EnqueueOutcome.HELD] * 7 + [
        EnqueueOutcome.INSERTED
    ]
    assert {r.job_id for r in results} == {winner.job_id}
    with committed.connect() as conn:
        queued = conn.execute(text("SELECT id FROM sqlaq_jobs WHERE status = 'queued'")).all()
        assert [row.id for row in queued] == [winner.job_id]
        assert _holds(conn) == [("report", "k", winner.job_id)]


def test_the_leader_deletes_expired_holds(committed: Engine) -> None:
    from workerkit import scalar, wait_until

    from sqlaq.config import WorkerConfig
    from sqlaq.maintenance import Maintenance

    with committed.begin() as conn:
        sqlaq.enqueue(conn, "report", dedupe_key="old", unique_for=HOUR)
        sqlaq.enqueue(conn, "report", dedupe_key="live", unique_for=3 * HOUR)
        travel(conn, 2 * HOUR)
    config = WorkerConfig(maintenance_interval=timedelta(milliseconds=50))
    maintainer = Maintenance(committed, [], config, "m")
    maintainer.start()
    try:
        wait_until(
            lambda: scalar(committed, "SELECT count(*) FROM sqlaq_unique_holds") == 1,
            10,
            "the expired hold deleted",
        )
    finally:
        maintainer.stop()
    assert scalar(committed, "SELECT key FROM sqlaq_unique_holds") == "live"
