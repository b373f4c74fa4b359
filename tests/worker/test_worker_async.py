"""The worker inside an asyncio application (``async with Worker`` / ``run_async``)."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import create_async_engine
from workerkit import Recorder, enqueue, job

import sqlaq

pytestmark = pytest.mark.timeout(60)

FAST = {"poll_interval": timedelta(milliseconds=100), "maintenance": False}


def test_async_handlers_run_on_the_apps_loop_and_sync_ones_on_threads(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    seen: dict[str, Any] = {}

    @registry.handler("on_loop")
    async def on_loop(payload: dict[str, Any]) -> None:
        seen["loop"] = asyncio.get_running_loop()
        seen["async_job"] = sqlaq.current_job().id

    @registry.handler("on_thread")
    def on_thread(payload: dict[str, Any]) -> None:
        seen["thread"] = threading.current_thread().name

    async def app() -> asyncio.AbstractEventLoop:
        worker = sqlaq.Worker(committed, registry, on_job_finished=recorder.finished, **FAST)
        async with worker:
            assert worker.started.is_set()
            enqueue(committed, "on_loop")
            enqueue(committed, "on_thread")
            await asyncio.to_thread(recorder.wait_for, 2)
        assert worker.stopped.is_set()
        return asyncio.get_running_loop()

    app_loop = asyncio.run(app())
    assert seen["loop"] is app_loop
    assert seen["thread"].startswith("sqlaq-slot")
    assert {r.status for r in recorder.results} == {sqlaq.JobStatus.DONE}
    assert job(committed, seen["async_job"]).status == "done"


def test_lifespan_exit_hands_back_a_job_still_running_after_the_grace_period(
    committed: Engine,
) -> None:
    registry = sqlaq.Registry()
    started = threading.Event()

    @registry.handler("forever")
    async def forever(payload: dict[str, Any]) -> None:
        started.set()
        await asyncio.Event().wait()

    job_id = enqueue(committed, "forever")

    async def app() -> None:
        async with sqlaq.Worker(committed, registry, grace_period=timedelta(0), **FAST):
            await asyncio.to_thread(started.wait, 20)

    asyncio.run(app())
    assert started.is_set()
    row = job(committed, job_id)
    assert (row.status, row.attempts) == ("queued", 0)


def test_lifespan_exit_lets_a_running_job_finish_within_the_grace_period(
    committed: Engine,
) -> None:
    registry = sqlaq.Registry()
    started = threading.Event()

    @registry.handler("short")
    async def short(payload: dict[str, Any]) -> None:
        started.set()
        await asyncio.sleep(0.3)  # the work: still running when the app stops

    job_id = enqueue(committed, "short")

    async def app() -> None:
        async with sqlaq.Worker(committed, registry, grace_period=timedelta(seconds=20), **FAST):
            await asyncio.to_thread(started.wait, 20)

    asyncio.run(app())
    assert job(committed, job_id).status == "done"


def test_cancelling_run_async_stops_the_worker_gracefully(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.handler("noop")(lambda payload: None)

    async def app() -> sqlaq.Worker:
        worker = sqlaq.Worker(committed, registry, on_job_finished=recorder.finished, **FAST)
        task = asyncio.create_task(worker.run_async())
        enqueue(committed, "noop")
        await asyncio.to_thread(recorder.wait_for, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return worker

    worker = asyncio.run(app())
    assert worker.stopped.is_set()


def test_an_async_engine_is_accepted(committed: Engine, database_url: str) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.handler("noop")(lambda payload: None)
    async_url = committed.url.set(drivername="postgresql+psycopg_async")
    job_id = enqueue(committed, "noop")

    async def app() -> None:
        async_engine = create_async_engine(async_url)
        try:
            worker = sqlaq.Worker(async_engine, registry, on_job_finished=recorder.finished, **FAST)
            async with worker:
                await asyncio.to_thread(recorder.wait_for, 1)
        finally:
            await async_engine.dispose()

    asyncio.run(app())
    assert job(committed, job_id).status == "done"


def test_a_worker_refuses_what_is_not_an_engine() -> None:
    with pytest.raises(sqlaq.ConfigError, match="needs a SQLAlchemy Engine or AsyncEngine"):
        sqlaq.Worker("postgresql://nowhere", sqlaq.Registry())  # type: ignore[arg-type]
