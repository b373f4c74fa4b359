"""Job timeouts: an async handler is cancelled at its deadline; a sync one,
which nothing can interrupt, has its attempt written as timed out at the deadline, due
again only after its lease, and its late result dropped."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
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
