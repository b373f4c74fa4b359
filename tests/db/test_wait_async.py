"""sqlaq.asyncio.wait: the waiting of sqlaq.wait (sqlaq.results.waiting) with async I/O,
on both async drivers: woken by the finish notification without blocking the event
loop, at once for a finished job, on time at its timeout, through a lost listening
connection, and closing what it opened."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from workerkit import wait_until

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import results
from sqlaq.results import complete_with_result, encode_result

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: Long enough that a wait which returns sooner was not served by a poll.
POLL = timedelta(seconds=20)


@pytest.fixture
def listening(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set when a wait starts listening for the job's notification (a spy on sqlaq's
    own code; the database untouched)."""
    event = asyncio.Event()
    original = aq._FinishListener.wait_for

    async def spy(self: aq._FinishListener, job_id: int, seconds: float) -> bool:
        event.set()
        return await original(self, job_id, seconds)

    monkeypatch.setattr(aq._FinishListener, "wait_for", spy)
    return event


def _enqueue_and_claim(conn: Connection) -> sqlaq.ClaimedJob:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    job_id = sqlaq.enqueue(conn, "report", {"n": 1}, queue=queue).job_id
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), queue=queue, limit=1)
    assert job.id == job_id
    return job


def _wait_backends(engine: Engine) -> int:
    with engine.connect() as conn:
        sql = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = :name"
        )
        return int(conn.execute(text(sql), {"name": results.APPLICATION_NAME}).scalar_one())


def _no_wait_backend_left(engine: Engine) -> None:
    # The server ends a backend a moment after its client closed the connection.
    wait_until(lambda: _wait_backends(engine) == 0, 5, "the wait's connection to close")


def _awaited(engine: Engine, job_id: int) -> bool:
    with engine.connect() as conn:
        sql = "SELECT awaited FROM sqlaq_jobs WHERE id = :id"
        return bool(conn.execute(text(sql), {"id": job_id}).scalar_one())


async def test_wait_is_woken_by_the_finish_while_the_loop_runs_on(
    committed: Engine, async_engine: AsyncEngine, listening: asyncio.Event
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiting = asyncio.ensure_future(aq.wait(async_engine, job.id, timeout=60, poll_interval=POLL))
    # This coroutine runs while the wait waits: a wait that blocked the loop would
    # return only at its timeout, and this test would time out first.
    await asyncio.wait_for(listening.wait(), 10)
    assert not waiting.done()
    assert _awaited(committed, job.id)

    def finish() -> None:
        with committed.begin() as conn:
            complete_with_result(conn, job.lease, encode_result({"rows": 7}) or "")

    await asyncio.to_thread(finish)
    finished_at = asyncio.get_running_loop().time()
    outcome = await asyncio.wait_for(waiting, 30)
    # Woken by the notification, not by the poll 20 s later.
    assert asyncio.get_running_loop().time() - finished_at < 2.0
    assert (outcome.status, outcome.result) == ("done", {"rows": 7})
    _no_wait_backend_left(committed)


async def test_wait_on_a_finished_job_returns_at_once_given_a_connection_or_session(
    committed: Engine, async_engine: AsyncEngine
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
        complete_with_result(conn, job.lease, '"ready"')
    async with async_engine.connect() as conn:
        await conn.execute(text("SELECT 1"))  # a transaction of the caller's, left alone
        outcome = await aq.wait(conn, job.id, timeout=timedelta(seconds=30), poll_interval=POLL)
        assert conn.in_transaction()
    assert (outcome.status, outcome.result) == ("done", "ready")
    async with AsyncSession(async_engine) as session:
        again = await aq.wait(session, job.id, timeout=5, poll_interval=POLL)
    assert again == outcome
    assert not _awaited(committed, job.id)  # finished already: nothing written
    _no_wait_backend_left(committed)


async def test_wait_times_out_with_the_job_as_last_read(
    committed: Engine, async_engine: AsyncEngine
) -> None:
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "report").job_id
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(sqlaq.WaitTimeoutError) as raised:
        await aq.wait(async_engine, job_id, timeout=0.5, poll_interval=0.2)
    assert 0.5 <= loop.time() - started < 5
    assert isinstance(raised.value, TimeoutError)
    assert raised.value.outcome.status == "queued"
    assert _awaited(committed, job_id)  # flagged: a later wait is notified all the same
    _no_wait_backend_left(committed)


async def test_wait_reads_on_after_losing_its_listening_connection(
    committed: Engine, async_engine: AsyncEngine, listening: asyncio.Event
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiting = asyncio.ensure_future(aq.wait(async_engine, job.id, timeout=60, poll_interval=0.5))
    await asyncio.wait_for(listening.wait(), 10)

    def kill_then_finish() -> None:
        with committed.begin() as conn:
            sql = (
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = :name"
            )
            killed = conn.execute(text(sql), {"name": results.APPLICATION_NAME}).scalar_one()
            assert killed == 1
        with committed.begin() as conn:
            complete_with_result(conn, job.lease, "true")

    await asyncio.to_thread(kill_then_finish)
    outcome = await asyncio.wait_for(waiting, 30)
    assert (outcome.status, outcome.result) == ("done", True)
    _no_wait_backend_left(committed)


async def test_wait_on_an_unknown_job_raises_and_closes_its_connection(
    committed: Engine, async_engine: AsyncEngine
) -> None:
    with pytest.raises(sqlaq.JobNotFoundError, match="or is not committed yet"):
        await aq.wait(async_engine, 987654321, timeout=5)
    _no_wait_backend_left(committed)


@pytest.mark.parametrize(
    ("target", "job_id", "kw", "error", "message"),
    [
        ("engine", 1, {"timeout": -1}, sqlaq.InvalidJobError, "timeout must be zero or more"),
        ("engine", 1, {"timeout": 1, "poll_interval": 0}, sqlaq.InvalidJobError, "more than zero"),
        ("engine", "1", {"timeout": 1}, sqlaq.ConfigError, "a job id must be an int"),
        (
            "sync",
            1,
            {"timeout": 1},
            sqlaq.ConfigError,
            r"^sqlaq\.asyncio\.wait\(\) was given an Engine: use sqlaq\.wait \(not awaited\)$",
        ),
    ],
)
async def test_wait_refuses_bad_input_before_connecting(
    committed: Engine,
    async_engine: AsyncEngine,
    target: str,
    job_id: Any,
    kw: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    given: Any = async_engine if target == "engine" else committed
    with pytest.raises(error, match=message):
        await aq.wait(given, job_id, **kw)
    assert _wait_backends(committed) == 0


async def test_the_sync_wait_given_async_objects_names_the_async_wait(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn:
        for given, kind in ((async_engine, "AsyncEngine"), (conn, "AsyncConnection")):
            with pytest.raises(sqlaq.ConfigError) as refused:
                sqlaq.wait(given, 1, timeout=1)  # type: ignore[arg-type]
            assert str(refused.value) == (
                f"sqlaq.wait() was given an {kind}: use sqlaq.asyncio.wait (awaited)"
            )
        assert not conn.in_transaction()  # nothing ran
