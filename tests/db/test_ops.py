"""Queue operations against a real PostgreSQL, each test in a rolled-back transaction."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import Connection, text

import sqlaq
from sqlaq import JobStatus, NewJob
from tests.helpers import count_jobs, expire_lease, finish_long_ago, job_row

LEASE = timedelta(seconds=30)


def claim_one(conn: Connection, worker: uuid.UUID | None = None, **kw: object) -> sqlaq.ClaimedJob:
    jobs = sqlaq.claim(conn, worker_id=worker or uuid.uuid4(), limit=1, lease=LEASE, **kw)  # type: ignore[arg-type]
    assert len(jobs) == 1
    return jobs[0]


def test_enqueue_writes_defaults_and_database_times(conn: Connection) -> None:
    result = sqlaq.enqueue(conn, "send_email", {"user_id": 7})
    row = job_row(conn, result.job_id)
    assert result == sqlaq.EnqueueResult(result.job_id, duplicate=False)
    assert (row.kind, row.queue, row.payload, row.status) == (
        "send_email",
        "default",
        {"user_id": 7},
        "queued",
    )
    assert (row.priority, row.attempts, row.max_attempts) == (0, 0, 5)
    now = conn.execute(text("SELECT now()")).scalar_one()
    assert row.run_at == now == row.created_at


def test_enqueue_delay_is_added_to_database_now(conn: Connection) -> None:
    job_id = sqlaq.enqueue(conn, "k", delay=timedelta(minutes=5)).job_id
    late = conn.execute(
        text("SELECT run_at - now() FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
    ).scalar_one()
    assert late == timedelta(minutes=5)
    assert sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10) == []


def test_dedupe_reports_existing_pending_job_and_keeps_transaction_usable(
    conn: Connection,
) -> None:
    first = sqlaq.enqueue(conn, "sync", {"a": 1}, dedupe_key="user-7")
    second = sqlaq.enqueue(conn, "sync", {"a": 2}, dedupe_key="user-7")
    assert second == sqlaq.EnqueueResult(first.job_id, duplicate=True)
    assert count_jobs(conn) == 1
    # Same key, other kind: not a duplicate.
    assert not sqlaq.enqueue(conn, "other", dedupe_key="user-7").duplicate
    # The transaction is still usable after the conflict.
    assert conn.execute(text("SELECT 1")).scalar_one() == 1


def test_dedupe_key_is_free_again_once_the_job_finished(conn: Connection) -> None:
    first = sqlaq.enqueue(conn, "sync", dedupe_key="k")
    job = claim_one(conn)
    assert sqlaq.enqueue(conn, "sync", dedupe_key="k").duplicate  # running still holds it
    sqlaq.complete(conn, job.lease)
    again = sqlaq.enqueue(conn, "sync", dedupe_key="k")
    assert not again.duplicate
    assert again.job_id != first.job_id


def test_enqueue_many_returns_ids_in_input_order_and_resolves_duplicates(
    conn: Connection,
) -> None:
    existing = sqlaq.enqueue(conn, "b", dedupe_key="held").job_id
    batch = [
        NewJob("b", {"i": 0}),
        NewJob("b", {"i": 1}, dedupe_key="held"),
        NewJob("b", {"i": 2}, dedupe_key="new"),
        NewJob("b", {"i": 3}),
        NewJob("b", {"i": 4}, dedupe_key="new"),
        NewJob("c", {"i": 5}, queue="q2", priority=3, max_attempts=2),
    ]
    results = sqlaq.enqueue_many(conn, batch)
    assert [r.duplicate for r in results] == [False, True, False, False, True, False]
    assert results[1].job_id == existing
    assert results[4].job_id == results[2].job_id
    for job, result in zip(batch, results, strict=True):
        row = job_row(conn, result.job_id)
        if not result.duplicate:
            assert row.payload == job.payload
            assert (row.queue, row.priority, row.max_attempts) == (
                job.queue,
                job.priority,
                job.max_attempts,
            )
    assert count_jobs(conn) == 5


def test_enqueue_many_of_nothing_runs_nothing(conn: Connection) -> None:
    assert sqlaq.enqueue_many(conn, []) == []


def test_claim_orders_by_priority_then_run_at_then_id(conn: Connection) -> None:
    low = sqlaq.enqueue(conn, "k", priority=0).job_id
    high = sqlaq.enqueue(conn, "k", priority=5).job_id
    low2 = sqlaq.enqueue(conn, "k", priority=0).job_id
    older = sqlaq.enqueue(conn, "k", priority=0).job_id
    conn.execute(
        text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 minute' WHERE id = :id"),
        {"id": older},
    )
    worker = uuid.uuid4()
    order = [claim_one(conn, worker).id for _ in range(4)]
    assert order == [high, older, low, low2]


def test_claim_takes_only_due_jobs_of_its_queue(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k", queue="other")
    sqlaq.enqueue(conn, "k", delay=timedelta(seconds=60))
    due = sqlaq.enqueue(conn, "k").job_id
    jobs = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10)
    assert [j.id for j in jobs] == [due]
    assert [j.queue for j in sqlaq.claim(conn, worker_id=uuid.uuid4(), queue="other")] == ["other"]


def test_claim_sets_running_attempt_holder_and_lease(conn: Connection) -> None:
    job_id = sqlaq.enqueue(conn, "k", {"x": [1, 2]}).job_id
    worker = uuid.uuid4()
    job = claim_one(conn, worker)
    row = job_row(conn, job_id)
    assert (row.status, row.attempts, row.locked_by) == ("running", 1, worker)
    assert row.lease_token == job.lease.token
    assert job.payload == {"x": [1, 2]}
    assert job.attempt == job.lease.attempt == 1
    lease_end = conn.execute(text("SELECT now() + interval '30 seconds'")).scalar_one()
    assert row.run_at == job.lease.expires_at == lease_end


def test_batch_claim_returns_at_most_n(conn: Connection) -> None:
    sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(25)])
    worker = uuid.uuid4()
    sizes = [len(sqlaq.claim(conn, worker_id=worker, limit=10)) for _ in range(4)]
    assert sizes == [10, 10, 5, 0]
    assert count_jobs(conn, "status = 'running'") == 25


def test_expired_lease_is_claimed_again_and_noted(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    first = claim_one(conn)
    assert sqlaq.claim(conn, worker_id=uuid.uuid4()) == []  # lease still held
    expire_lease(conn, first.id)
    second = claim_one(conn)
    assert second.id == first.id
    assert second.attempt == 2
    assert "lease expired on attempt 1" in job_row(conn, first.id).last_error


def test_lease_expired_on_last_attempt_fails_the_job(conn: Connection) -> None:
    job_id = sqlaq.enqueue(conn, "crashy", max_attempts=2).job_id
    other = sqlaq.enqueue(conn, "fine", priority=-1).job_id
    for _ in range(2):
        job = claim_one(conn)
        assert job.id == job_id
        expire_lease(conn, job_id)
    # The next claim pass fails the exhausted job and hands out the other one instead.
    jobs = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=5)
    assert [j.id for j in jobs] == [other]
    row = job_row(conn, job_id)
    assert row.status == "failed"
    assert row.attempts == 2
    assert row.finished_at is not None
    assert row.locked_by is None
    assert "lease expired on attempt 2 of 2" in row.last_error
    assert sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=5) == []


def test_complete_marks_done(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    job = claim_one(conn)
    assert sqlaq.complete(conn, job.lease) == [job.id]
    row = job_row(conn, job.id)
    assert row.status == "done"
    assert row.finished_at is not None


def test_complete_many_in_one_call(conn: Connection) -> None:
    sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(5)])
    jobs = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=5)
    assert sorted(sqlaq.complete(conn, [j.lease for j in jobs])) == sorted(j.id for j in jobs)
    assert count_jobs(conn, "status = 'done'") == 5


@pytest.mark.parametrize("same_worker", [False, True], ids=["other-worker", "same-worker"])
def test_stale_lease_changes_nothing_after_reclaim(conn: Connection, same_worker: bool) -> None:
    sqlaq.enqueue(conn, "k")
    worker = uuid.uuid4()
    stale = claim_one(conn, worker)
    expire_lease(conn, stale.id)
    fresh = claim_one(conn, worker if same_worker else uuid.uuid4())
    before = job_row(conn, stale.id)

    with pytest.raises(sqlaq.LeaseLostError) as lost:
        sqlaq.complete(conn, stale.lease)
    assert lost.value.job_ids == (stale.id,)
    with pytest.raises(sqlaq.LeaseLostError):
        sqlaq.fail(conn, stale.lease, "late", retry_in=timedelta(0))
    with pytest.raises(sqlaq.LeaseLostError):
        sqlaq.extend_lease(conn, stale.lease, length=timedelta(hours=1))
    assert sqlaq.complete(conn, stale.lease, raise_on_lost=False) == []
    assert sqlaq.fail(conn, stale.lease, "late", raise_on_lost=False) is None
    assert sqlaq.extend_lease(conn, [stale.lease], raise_on_lost=False) == []

    assert job_row(conn, stale.id) == before
    # The current holder is unaffected.
    assert sqlaq.complete(conn, fresh.lease) == [fresh.id]


def test_complete_applies_held_leases_and_reports_lost_ones(conn: Connection) -> None:
    sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(2)])
    held, lost = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=2)
    sqlaq.cancel(conn, lost.id)
    with pytest.raises(sqlaq.LeaseLostError) as err:
        sqlaq.complete(conn, [held.lease, lost.lease])
    assert err.value.job_ids == (lost.id,)
    assert job_row(conn, held.id).status == "done"
    assert job_row(conn, lost.id).status == "cancelled"


def test_extend_lease_moves_the_end_from_database_now(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    job = claim_one(conn)
    (renewed,) = sqlaq.extend_lease(conn, job.lease, length=timedelta(minutes=10))
    expected = conn.execute(text("SELECT now() + interval '10 minutes'")).scalar_one()
    assert renewed.expires_at == expected == job_row(conn, job.id).run_at
    assert renewed.token == job.lease.token
    # An expired-but-not-reclaimed lease may still be extended: the job is still ours.
    expire_lease(conn, job.id)
    assert len(sqlaq.extend_lease(conn, job.lease)) == 1


def test_extend_lease_never_moves_the_end_earlier(conn: Connection) -> None:
    """A heartbeat computed with the worker's short lease that commits just after a
    handler asked for a longer one must not undo it."""
    sqlaq.enqueue(conn, "k")
    job = claim_one(conn)
    (longer,) = sqlaq.extend_lease(conn, job.lease, length=timedelta(minutes=5))
    (shorter,) = sqlaq.extend_lease(conn, job.lease, length=timedelta(seconds=3))
    assert shorter.expires_at == longer.expires_at == job_row(conn, job.id).run_at
    expire_lease(conn, job.id)  # once the end has passed, a short renewal moves it on
    (again,) = sqlaq.extend_lease(conn, job.lease, length=timedelta(seconds=3))
    expected = conn.execute(text("SELECT now() + interval '3 seconds'")).scalar_one()
    assert again.expires_at == expected == job_row(conn, job.id).run_at


def test_extend_lease_still_takes_its_old_keyword_with_a_warning(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    job = claim_one(conn)
    with pytest.warns(DeprecationWarning, match="pass length=") as warned:
        (renewed,) = sqlaq.extend_lease(conn, job.lease, lease=timedelta(minutes=20))
    assert warned[0].filename == __file__  # it points at the caller's line
    expected = conn.execute(text("SELECT now() + interval '20 minutes'")).scalar_one()
    assert renewed.expires_at == expected == job_row(conn, job.id).run_at
    with pytest.raises(sqlaq.ConfigError, match="not both"):
        sqlaq.extend_lease(conn, job.lease, length=timedelta(1), lease=timedelta(2))


def test_fail_with_attempts_left_requeues_after_backoff(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k", max_attempts=3)
    job = claim_one(conn)
    status = sqlaq.fail(conn, job.lease, "ValueError: boom", retry_in=timedelta(seconds=42))
    assert status is JobStatus.QUEUED
    row = job_row(conn, job.id)
    assert (row.status, row.attempts, row.last_error) == ("queued", 1, "ValueError: boom")
    assert (row.locked_by, row.lease_token, row.finished_at) == (None, None, None)
    delay = conn.execute(
        text("SELECT run_at - now() FROM sqlaq_jobs WHERE id = :id"), {"id": job.id}
    ).scalar_one()
    assert delay == timedelta(seconds=42)


def test_fail_on_last_attempt_or_without_retry_is_final(conn: Connection) -> None:
    last = sqlaq.enqueue(conn, "k", max_attempts=1).job_id
    permanent = sqlaq.enqueue(conn, "k", max_attempts=5).job_id
    worker = uuid.uuid4()
    jobs = {j.id: j for j in sqlaq.claim(conn, worker_id=worker, limit=2)}
    assert sqlaq.fail(conn, jobs[last].lease, "x", retry_in=timedelta(1)) is JobStatus.FAILED
    assert sqlaq.fail(conn, jobs[permanent].lease, "y") is JobStatus.FAILED
    for job_id in (last, permanent):
        row = job_row(conn, job_id)
        assert row.status == "failed"
        assert row.finished_at is not None


def test_fail_truncates_long_errors_and_strips_nul(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    job = claim_one(conn)
    sqlaq.fail(conn, job.lease, "a\x00b" + "x" * 20_000)
    error = job_row(conn, job.id).last_error
    assert len(error) <= sqlaq.ops.MAX_ERROR_LENGTH
    assert error.startswith("a\\x00b")
    assert error.endswith("(truncated)")


def test_cancel_queued_and_running_but_not_finished(conn: Connection) -> None:
    queued = sqlaq.enqueue(conn, "k", priority=-1).job_id
    sqlaq.enqueue(conn, "k")
    running = claim_one(conn)
    sqlaq.complete(conn, running.lease)
    sqlaq.enqueue(conn, "k")
    running2 = claim_one(conn)
    assert sorted(sqlaq.cancel(conn, [queued, running.id, running2.id])) == sorted(
        [queued, running2.id]
    )
    assert job_row(conn, queued).status == "cancelled"
    assert job_row(conn, running.id).status == "done"
    assert job_row(conn, running2.id).status == "cancelled"
    # The cancelled running job's holder cannot write a result over the cancel.
    with pytest.raises(sqlaq.LeaseLostError):
        sqlaq.complete(conn, running2.lease)
    assert job_row(conn, running2.id).status == "cancelled"


def test_retry_requeues_failed_and_cancelled_with_fresh_attempts(conn: Connection) -> None:
    failed = sqlaq.enqueue(conn, "k", max_attempts=1).job_id
    job = claim_one(conn)
    sqlaq.fail(conn, job.lease, "boom")
    cancelled = sqlaq.enqueue(conn, "k").job_id
    sqlaq.cancel(conn, cancelled)
    queued = sqlaq.enqueue(conn, "k").job_id
    assert sorted(sqlaq.retry(conn, [failed, cancelled, queued])) == sorted([failed, cancelled])
    row = job_row(conn, failed)
    assert (row.status, row.attempts, row.finished_at, row.last_error) == (
        "queued",
        0,
        None,
        "boom",
    )
    assert job_row(conn, queued).status == "queued"


def test_retry_leaves_a_job_whose_dedupe_key_is_taken(conn: Connection) -> None:
    old = sqlaq.enqueue(conn, "k", dedupe_key="d").job_id
    sqlaq.cancel(conn, old)
    sqlaq.enqueue(conn, "k", dedupe_key="d")
    assert sqlaq.retry(conn, old) == []
    assert job_row(conn, old).status == "cancelled"


def test_prune_deletes_old_finished_rows_in_bounded_batches(conn: Connection) -> None:
    ids = [r.job_id for r in sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(12)])]
    for job_id, status in zip(ids[:9], ["done", "failed", "cancelled"] * 3, strict=True):
        finish_long_ago(conn, job_id, status, "8 days")
    finish_long_ago(conn, ids[9], "done", "1 hour")
    # ids[10] queued, ids[11] running with an ancient run_at: never pruned.
    conn.execute(
        text(
            "UPDATE sqlaq_jobs SET status = 'running', run_at = now() - interval '30 days',"
            " created_at = now() - interval '30 days' WHERE id = :id"
        ),
        {"id": ids[11]},
    )
    week = timedelta(days=7)
    assert sqlaq.prune(conn, older_than=week, statuses=["failed"], limit=100) == 3
    assert sqlaq.prune(conn, older_than=week, limit=4) == 4
    assert sqlaq.prune(conn, older_than=week, limit=4) == 2
    assert sqlaq.prune(conn, older_than=week, limit=4) == 0
    remaining = conn.execute(text("SELECT id FROM sqlaq_jobs ORDER BY id")).scalars().all()
    assert remaining == ids[9:]


def test_prune_rejects_pending_statuses(conn: Connection) -> None:
    with pytest.raises(sqlaq.ConfigError, match="finished jobs only"):
        sqlaq.prune(conn, older_than=timedelta(0), statuses=["queued"])
    with pytest.raises(sqlaq.ConfigError, match="limit"):
        sqlaq.prune(conn, older_than=timedelta(0), limit=0)


def test_operations_never_commit(engine: object) -> None:
    from sqlalchemy import Engine

    assert isinstance(engine, Engine)
    with engine.connect() as c:
        job_id = sqlaq.enqueue(c, "k").job_id
        c.rollback()
    with engine.connect() as c:
        assert (
            c.execute(
                text("SELECT count(*) FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
            ).scalar_one()
            == 0
        )


def test_snooze_requeues_later_without_using_the_attempt(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k", max_attempts=1)
    job = claim_one(conn)
    assert sqlaq.snooze(conn, job.lease, timedelta(minutes=2)) == [job.id]
    row = job_row(conn, job.id)
    assert (row.status, row.attempts, row.lease_token, row.last_error) == ("queued", 0, None, None)
    delay = conn.execute(
        text("SELECT run_at - now() FROM sqlaq_jobs WHERE id = :id"), {"id": job.id}
    ).scalar_one()
    assert delay == timedelta(minutes=2)
    # Fenced like the others: the old lease cannot snooze (or complete) the job again.
    with pytest.raises(sqlaq.LeaseLostError):
        sqlaq.snooze(conn, job.lease, timedelta(0))
    with pytest.raises(sqlaq.InvalidJobError, match="delay must be zero or more"):
        sqlaq.snooze(conn, job.lease, timedelta(seconds=-1))
    with pytest.raises(sqlaq.InvalidJobError, match="non-negative"):
        sqlaq.Snooze(timedelta(seconds=-1))
