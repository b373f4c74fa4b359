"""Debounce: an enqueue with a debounce key while its job is still queued and
never started updates that job (payload, ``run_at = now() + debounce`` capped by
``max_wait`` from the first enqueue) in one statement; racing enqueuers leave one job."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

import sqlaq
from sqlaq import EnqueueOutcome
from sqlaq.testing import travel

pytestmark = pytest.mark.timeout(120)

HOUR = timedelta(hours=1)


def _now(conn: Connection) -> datetime:
    return conn.execute(text("SELECT now()")).scalar_one()


def _job(conn: Connection, job_id: int) -> Any:
    return conn.execute(
        text("SELECT status, payload, run_at, created_at, timeout FROM sqlaq_jobs WHERE id = :i"),
        {"i": job_id},
    ).one()


def _usable(conn: Connection) -> None:
    assert conn.execute(text("SELECT 1")).scalar_one() == 1


def test_a_second_enqueue_updates_the_queued_job(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "digest", {"n": 1}, debounce_key="user-7", debounce=HOUR)
    assert first.outcome is EnqueueOutcome.INSERTED
    assert first.inserted
    assert not first.duplicate
    _usable(conn)
    second = sqlaq.enqueue(
        conn,
        "digest",
        {"n": 2},
        debounce_key="user-7",
        debounce=2 * HOUR,
        priority=3,
        timeout=timedelta(seconds=9),
    )
    assert second == sqlaq.EnqueueResult(first.job_id, outcome=EnqueueOutcome.DEBOUNCED)
    assert second.duplicate
    assert not second.inserted
    _usable(conn)
    row = _job(conn, first.job_id)
    assert row.payload == {"n": 2}
    assert row.run_at == _now(conn) + 2 * HOUR
    assert row.timeout == timedelta(seconds=9)
    count = "SELECT count(*) FROM sqlaq_jobs WHERE kind = 'digest'"
    assert conn.execute(text(count)).scalar_one() == 1
    # Another key, or another kind, is another job.
    assert sqlaq.enqueue(conn, "digest", debounce_key="user-8", debounce=HOUR).inserted
    assert sqlaq.enqueue(conn, "other", debounce_key="user-7", debounce=HOUR).inserted


def test_max_wait_caps_how_far_the_job_is_pushed_from_its_first_enqueue(
    conn: Connection,
) -> None:
    first = sqlaq.enqueue(
        conn, "digest", {"n": 1}, debounce_key="k", debounce=HOUR, max_wait=2 * HOUR
    )
    travel(conn, timedelta(minutes=110))  # the first enqueue was 110 minutes ago
    again = sqlaq.enqueue(
        conn, "digest", {"n": 2}, debounce_key="k", debounce=HOUR, max_wait=2 * HOUR
    )
    assert again.outcome is EnqueueOutcome.DEBOUNCED
    row = _job(conn, first.job_id)
    assert row.payload == {"n": 2}
    assert row.run_at == row.created_at + 2 * HOUR == _now(conn) + timedelta(minutes=10)
    # Without a cap, it is pushed the whole debounce.
    sqlaq.enqueue(conn, "digest", {"n": 3}, debounce_key="k", debounce=HOUR)
    assert _job(conn, first.job_id).run_at == _now(conn) + HOUR


def test_a_started_job_does_not_absorb_a_new_enqueue(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "digest", {"n": 1}, debounce_key="k", debounce=HOUR)
    travel(conn, HOUR)
    (claimed,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    assert claimed.id == first.job_id
    assert claimed.payload == {"n": 1}
    second = sqlaq.enqueue(conn, "digest", {"n": 2}, debounce_key="k", debounce=HOUR)
    assert second.outcome is EnqueueOutcome.INSERTED
    assert second.job_id != first.job_id
    # Back to queued (a snooze): it has started once, so it stays out of the way.
    sqlaq.snooze(conn, claimed.lease, timedelta(0))
    third = sqlaq.enqueue(conn, "digest", {"n": 3}, debounce_key="k", debounce=HOUR)
    assert third == sqlaq.EnqueueResult(second.job_id, outcome=EnqueueOutcome.DEBOUNCED)
    assert _job(conn, first.job_id).payload == {"n": 1}
    assert _job(conn, second.job_id).payload == {"n": 3}
    _usable(conn)


def test_a_cancelled_twin_is_not_retried_over_the_queued_one(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "digest", debounce_key="k", debounce=HOUR)
    assert sqlaq.cancel(conn, first.job_id) == [first.job_id]
    second = sqlaq.enqueue(conn, "digest", debounce_key="k", debounce=HOUR)
    assert second.inserted
    assert sqlaq.retry(conn, first.job_id) == []  # left alone, no error
    _usable(conn)
    assert _job(conn, first.job_id).status == "cancelled"


def test_the_async_api_debounces_too() -> None:
    import inspect

    import sqlaq.asyncio

    parameters = inspect.signature(sqlaq.asyncio.enqueue).parameters
    for name in ("debounce_key", "debounce", "max_wait", "unique_for", "timeout"):
        assert name in parameters


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": HOUR}, "debounce needs a debounce_key"),
        ({"debounce_key": "k"}, "go with debounce=timedelta"),
        ({"debounce_key": "k", "max_wait": HOUR}, "go with debounce=timedelta"),
        ({"debounce_key": "k", "debounce": timedelta(0)}, "debounce must be more than zero"),
        ({"debounce_key": "k", "debounce": -HOUR}, "debounce must be more than zero"),
        ({"debounce_key": "k", "debounce": 30}, "debounce must be a datetime.timedelta"),
        ({"debounce_key": "k", "debounce": timedelta(days=40000)}, "at most 100 years"),
        ({"debounce_key": "", "debounce": HOUR}, "debounce_key must not be empty"),
        ({"debounce_key": 7, "debounce": HOUR}, "debounce_key must be a str"),
        ({"debounce_key": "a\x00", "debounce": HOUR}, "debounce_key contains a NUL"),
        (
            {"debounce_key": "k", "debounce": 2 * HOUR, "max_wait": HOUR},
            r"max_wait \(1:00:00\) must be at least debounce",
        ),
        ({"debounce_key": "k", "debounce": HOUR, "max_wait": timedelta(0)}, "max_wait must be"),
        (
            {"debounce_key": "k", "debounce": HOUR, "dedupe_key": "k"},
            "debounce does not go with dedupe_key",
        ),
        ({"debounce_key": "k", "debounce": HOUR, "delay": HOUR}, "drop delay and run_at"),
    ],
)
def test_bad_debounce_input_is_one_line_and_writes_nothing(
    conn: Connection, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match=message) as raised:
        sqlaq.enqueue(conn, "digest", **options)
    assert "\n" not in str(raised.value)
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


def _race(
    engine: Engine, n: int, **options: Any
) -> list[tuple[sqlaq.EnqueueResult, datetime, int, int]]:
    """*n* enqueuers of one debounce key, started together, each in its own transaction;
    each returns its result, its transaction's now(), its commit rank (a sequence drawn
    while the enqueue's row lock is held, so in commit order) and its payload's n."""
    start = threading.Barrier(n)

    def enqueuer(i: int) -> tuple[sqlaq.EnqueueResult, datetime, int, int]:
        with engine.connect() as conn:
            start.wait()
            with conn.begin():
                result = sqlaq.enqueue(conn, "digest", {"n": i}, debounce_key="k", **options)
                _usable(conn)
                now = _now(conn)
                rank = conn.execute(text("SELECT nextval('commit_order')")).scalar_one()
        return result, now, rank, i

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(enqueuer, range(n)))


@pytest.fixture
def commit_order(committed: Engine) -> Engine:
    with committed.begin() as conn:
        conn.execute(text("DROP SEQUENCE IF EXISTS commit_order"))
        conn.execute(text("CREATE SEQUENCE commit_order"))
    yield committed
    with committed.begin() as conn:
        conn.execute(text("DROP SEQUENCE commit_order"))


def test_eight_racing_enqueuers_leave_one_job_with_the_last_payload_and_run_at(
    commit_order: Engine,
) -> None:
    results = _race(commit_order, 8, debounce=HOUR)
    outcomes = sorted(r.outcome for r, *_ in results)
    assert outcomes == [EnqueueOutcome.DEBOUNCED] * 7 + [EnqueueOutcome.INSERTED]
    assert len({r.job_id for r, *_ in results}) == 1
    _, now, _, n = max(results, key=lambda r: r[2])  # the last to commit
    with commit_order.connect() as conn:
        (row,) = conn.execute(text("SELECT id, payload, run_at, status FROM sqlaq_jobs")).all()
    assert row.payload == {"n": n}
    assert row.run_at == now + HOUR
    assert row.status == "queued"


def test_racing_enqueuers_respect_max_wait(commit_order: Engine) -> None:
    with commit_order.begin() as conn:
        first = sqlaq.enqueue(
            conn, "digest", {"n": -1}, debounce_key="k", debounce=HOUR, max_wait=2 * HOUR
        )
        travel(conn, timedelta(minutes=90))
    results = _race(commit_order, 8, debounce=HOUR, max_wait=2 * HOUR)
    assert {(r.job_id, r.outcome) for r, *_ in results} == {
        (first.job_id, EnqueueOutcome.DEBOUNCED)
    }
    _, _, _, n = max(results, key=lambda r: r[2])
    with commit_order.connect() as conn:
        (row,) = conn.execute(text("SELECT payload, run_at, created_at FROM sqlaq_jobs")).all()
    assert row.payload == {"n": n}
    assert row.run_at == row.created_at + 2 * HOUR


def test_enqueuers_racing_a_claimer_never_fail_and_leave_one_unstarted_job(
    committed: Engine,
) -> None:
    """Debounced jobs due at once while a claimer takes them: every enqueue either
    inserts or updates a never-started job, none fails, and at the end at most one
    never-started queued job holds the key."""
    start = threading.Barrier(5)
    stop = threading.Event()
    tiny = timedelta(microseconds=1)

    def enqueuer(i: int) -> list[sqlaq.EnqueueResult]:
        results = []
        with committed.connect() as conn:
            start.wait()
            for n in range(40):
                with conn.begin():
                    results.append(
                        sqlaq.enqueue(
                            conn, "digest", {"i": i, "n": n}, debounce_key="k", debounce=tiny
                        )
                    )
        return results

    def claimer() -> int:
        claimed = 0
        worker = uuid.uuid4()
        with committed.connect() as conn:
            start.wait()
            while not stop.is_set():
                with conn.begin():
                    jobs = sqlaq.claim(conn, worker_id=worker, limit=5)
                    sqlaq.complete(conn, [j.lease for j in jobs])
                claimed += len(jobs)
        return claimed

    with ThreadPoolExecutor(5) as pool:
        claiming = pool.submit(claimer)
        batches = list(pool.map(enqueuer, range(4)))
        stop.set()
        claimed = claiming.result()
    results = [r for batch in batches for r in batch]
    inserted = {r.job_id for r in results if r.inserted}
    assert len(inserted) == sum(r.inserted for r in results)  # each insert a new job
    assert {r.job_id for r in results if not r.inserted} <= inserted
    with committed.connect() as conn:
        unstarted = conn.execute(
            text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'queued' AND attempted_at IS NULL")
        ).scalar_one()
        total = conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one()
    assert unstarted <= 1
    assert total == len(inserted)
    assert claimed >= 1
