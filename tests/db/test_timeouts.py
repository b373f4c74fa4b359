"""Timeouts: a handler's and a job's own.

An async handler is cancelled at its deadline; a sync one, which nothing can interrupt,
has its attempt written as timed out at the deadline, due again only after its lease, and
its late result dropped. A job's own timeout (``enqueue(..., timeout=...)``) is stored
with the job, returned by the claim, and used by the worker over its handler's, in both
directions."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from workerkit import Recorder, enqueue, fast_worker, job, running, scalar

import sqlaq

pytestmark = pytest.mark.timeout(60)


def test_an_async_handler_is_cancelled_at_its_deadline_and_retried(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    cancelled: list[int] = []

    @registry.handler(
        "stuck",
        timeout=timedelta(milliseconds=200),
        wait=sqlaq.Backoff(base=timedelta(milliseconds=10)),
    )
    async def stuck(payload: dict[str, Any]) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(sqlaq.current_job().attempt)
            raise

    job_id = enqueue(committed, "stuck", max_attempts=2)
    with running(fast_worker(committed, registry, recorder)):
        first, second = recorder.wait_for(2)
    assert (first.status, second.status) == (sqlaq.JobStatus.QUEUED, sqlaq.JobStatus.FAILED)
    assert cancelled == [1, 2]
    row = job(committed, job_id)
    assert row.last_error.startswith("sqlaq.errors.JobTimeoutError: timed out after 0.2s")


def test_an_async_handlers_own_timeout_error_is_not_the_deadline(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("own", timeout=timedelta(seconds=30))
    async def own(payload: dict[str, Any]) -> None:
        raise TimeoutError("the API timed out")

    job_id = enqueue(committed, "own", max_attempts=1)
    with running(fast_worker(committed, registry, recorder)):
        recorder.wait_for(1)
    assert job(committed, job_id).last_error.startswith("TimeoutError: the API timed out")


def test_a_sync_handler_past_its_deadline_is_written_timed_out_and_its_late_result_dropped(
    committed: Engine,
) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    @registry.handler("blocking", timeout=timedelta(milliseconds=300), lease=timedelta(seconds=5))
    def blocking(payload: dict[str, Any]) -> str:
        entered.set()
        try:
            assert release.wait(30)
            return "too late"
        finally:
            returned.set()

    job_id = enqueue(committed, "blocking", max_attempts=3)
    worker = fast_worker(committed, registry, recorder)
    with running(worker):
        (result,) = recorder.wait_for(1)  # written at the deadline, the thread still runs
        assert not returned.is_set()
        assert result.status is sqlaq.JobStatus.QUEUED
        row = job(committed, job_id)
        assert (row.status, row.attempts) == ("queued", 1)
        assert "JobTimeoutError: timed out after 0.3s" in row.last_error
        # Due again no sooner than the lease it held (5 s) after the deadline.
        wait = scalar(
            committed,
            "SELECT extract(epoch FROM run_at - now()) FROM sqlaq_jobs WHERE id = :id",
            id=job_id,
        )
        assert wait > 4
        release.set()
        assert returned.wait(10)
        assert worker.idle.wait(10)  # the late result was taken in, and dropped
    row = job(committed, job_id)
    assert (row.status, row.attempts, row.result) == ("queued", 1, None)
    assert len(recorder.results) == 1


def test_a_timeout_must_be_positive() -> None:
    registry = sqlaq.Registry()
    with pytest.raises(sqlaq.ConfigError, match="timeout of 'k' must be a timedelta above 0"):
        registry.add("k", lambda payload: None, timeout=timedelta(0))


def test_the_claim_returns_the_jobs_timeout(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k", timeout=timedelta(seconds=7))
    sqlaq.enqueue(conn, "k")
    sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", timeout=timedelta(minutes=2)), sqlaq.NewJob("k")])
    claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10)
    assert [j.timeout for j in claimed] == [timedelta(seconds=7), None, timedelta(minutes=2), None]


def test_the_orm_job_takes_a_timeout(conn: Connection) -> None:
    from sqlalchemy.orm import Session

    with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
        session.add(sqlaq.Job(kind="k", timeout=timedelta(seconds=3)))
        session.flush()
        with pytest.raises(sqlaq.InvalidJobError, match="timeout must be more than zero"):
            sqlaq.Job(kind="k", timeout=timedelta(0))
        with pytest.raises(sqlaq.InvalidJobError, match=r"debounce_key is set by sqlaq\.enqueue"):
            sqlaq.Job(kind="k", debounce_key="x")
        session.commit()  # releases the savepoint; the test's transaction goes on
    assert conn.execute(text("SELECT timeout FROM sqlaq_jobs")).scalar_one() == timedelta(seconds=3)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (timedelta(0), "timeout must be more than zero"),
        (timedelta(seconds=-1), "timeout must be more than zero"),
        (5, "timeout must be a datetime.timedelta"),
        (timedelta(days=40000), "at most 100 years"),
    ],
)
def test_a_bad_timeout_is_one_line_and_writes_nothing(
    conn: Connection, value: Any, message: str
) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match=message) as raised:
        sqlaq.enqueue(conn, "k", timeout=value)
    assert "\n" not in str(raised.value)
    with pytest.raises(sqlaq.InvalidJobError, match=message):
        sqlaq.NewJob("k", timeout=value)
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


def test_enqueue_copy_refuses_a_timeout(conn: Connection) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match=r"jobs\[1\] has a timeout"):
        sqlaq.enqueue_copy(conn, [sqlaq.NewJob("k"), sqlaq.NewJob("k", timeout=timedelta(1))])


def test_an_async_handler_without_a_timeout_is_cancelled_at_the_jobs(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    cancelled: list[int] = []

    @registry.handler("stuck")
    async def stuck(payload: dict[str, Any]) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(sqlaq.current_job().attempt)
            raise

    job_id = enqueue(committed, "stuck", max_attempts=1, timeout=timedelta(milliseconds=200))
    with running(fast_worker(committed, registry, recorder)):
        (result,) = recorder.wait_for(1)
    assert result.status is sqlaq.JobStatus.FAILED
    assert cancelled == [1]
    assert job(committed, job_id).last_error.startswith(
        "sqlaq.errors.JobTimeoutError: timed out after 0.2s"
    )


def test_a_jobs_longer_timeout_overrides_its_handlers_shorter_one(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("slowish", timeout=timedelta(milliseconds=50))
    async def slowish(payload: dict[str, Any]) -> str:
        await asyncio.sleep(0.3)
        return "made it"

    job_id = enqueue(committed, "slowish", max_attempts=1, timeout=timedelta(seconds=20))
    short_id = enqueue(committed, "slowish", max_attempts=1)  # the handler's 50 ms
    with running(fast_worker(committed, registry, recorder)):
        recorder.wait_for(2)
    assert job(committed, job_id).status == "done"
    assert job(committed, job_id).result == "made it"
    assert job(committed, short_id).status == "failed"
    assert "timed out after 0.05s" in job(committed, short_id).last_error


def test_a_sync_handler_is_written_timed_out_at_the_jobs_shorter_timeout(
    committed: Engine,
) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    release, returned = threading.Event(), threading.Event()

    @registry.handler("blocking", timeout=timedelta(seconds=30), lease=timedelta(seconds=5))
    def blocking(payload: dict[str, Any]) -> str:
        try:
            assert release.wait(30)
            return "too late"
        finally:
            returned.set()

    job_id = enqueue(committed, "blocking", max_attempts=3, timeout=timedelta(milliseconds=300))
    worker = fast_worker(committed, registry, recorder)
    with running(worker):
        (result,) = recorder.wait_for(1)  # written at the job's deadline, the thread runs on
        assert not returned.is_set()
        assert result.status is sqlaq.JobStatus.QUEUED
        row = job(committed, job_id)
        assert (row.status, row.attempts) == ("queued", 1)
        assert "JobTimeoutError: timed out after 0.3s" in row.last_error
        release.set()
        assert returned.wait(10)
        assert worker.idle.wait(10)
    assert len(recorder.results) == 1


def test_a_uniform_batch_keeps_its_timeout(conn: Connection) -> None:
    batch = [sqlaq.NewJob("k", {"i": i}, timeout=timedelta(seconds=5)) for i in range(3)]
    assert all(r.inserted for r in sqlaq.enqueue_many(conn, batch))
    claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10)
    assert [j.timeout for j in claimed] == [timedelta(seconds=5)] * 3


def test_the_dashboards_job_page_shows_the_timeout_and_debounce_key(committed: Engine) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from sqlaq.dashboard import app as dashboard_app

    with committed.begin() as conn:
        own = sqlaq.enqueue(
            conn, "k", debounce_key="doc-7", debounce=timedelta(1), timeout=timedelta(minutes=5)
        ).job_id
        plain = sqlaq.enqueue(conn, "k").job_id
    with TestClient(dashboard_app(committed), base_url="http://localhost") as client:
        page = client.get(f"/jobs/{own}").text
        assert "<dt>timeout</dt><dd>0:05:00 (its own)</dd>" in page
        assert "<dt>debounce key</dt><dd>doc-7</dd>" in page
        page = client.get(f"/jobs/{plain}").text
        assert "<dt>timeout</dt><dd>the handler's</dd>" in page
        assert "debounce key" not in page
