"""sqlaq.testing: drain and assertions inside a rolled-back transaction, and drain_async
from async tests on an AsyncConnection or AsyncSession, inside the test's transaction, on
both async drivers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import sqlaq
from sqlaq import JobStatus, PermanentError
from sqlaq.testing import assert_enqueued, drain, drain_async, enqueued_jobs
from tests.helpers import job_row


def make_registry(calls: list[Any]) -> sqlaq.Registry:
    registry = sqlaq.Registry()

    @registry.handler("ok")
    def ok(payload: dict[str, Any]) -> None:
        job = sqlaq.current_job()
        calls.append(("ok", payload, job.id, job.attempt))

    @registry.handler("async_ok")
    async def async_ok(payload: dict[str, Any]) -> None:
        calls.append(("async_ok", payload, sqlaq.current_job().kind))

    @registry.handler("flaky", wait=sqlaq.Backoff(base=timedelta(seconds=10), jitter=0))
    def flaky(payload: dict[str, Any]) -> None:
        raise ValueError("try later")

    @registry.handler("broken")
    def broken(payload: dict[str, Any]) -> None:
        raise PermanentError("bad data")

    return registry


def test_drain_runs_due_jobs_with_the_real_statements(conn: Connection) -> None:
    calls: list[Any] = []
    registry = make_registry(calls)
    ok = sqlaq.enqueue(conn, "ok", {"n": 1}).job_id
    sqlaq.enqueue(conn, "async_ok", {"n": 2}, queue="other")
    flaky = sqlaq.enqueue(conn, "flaky").job_id
    broken = sqlaq.enqueue(conn, "broken").job_id
    unknown = sqlaq.enqueue(conn, "nobody").job_id
    later = sqlaq.enqueue(conn, "ok", delay=timedelta(hours=1)).job_id

    results = {r.id: r for r in drain(conn, registry)}

    assert later not in results
    assert results[ok].status is JobStatus.DONE
    assert ("ok", {"n": 1}, ok, 1) in calls
    assert ("async_ok", {"n": 2}, "async_ok") in calls
    assert results[flaky].status is JobStatus.QUEUED
    assert isinstance(results[flaky].exception, ValueError)
    assert results[broken].status is JobStatus.FAILED
    assert results[unknown].status is JobStatus.FAILED
    assert "no handler for kind 'nobody'" in (results[unknown].error or "")
    assert job_row(conn, ok).status == "done"
    assert job_row(conn, broken).last_error.startswith("sqlaq.errors.PermanentError: bad data")
    flaky_row = job_row(conn, flaky)
    assert (flaky_row.status, flaky_row.attempts) == ("queued", 1)
    assert flaky_row.last_error.startswith("ValueError: try later")
    # The retried job waits for its backoff: a second drain runs nothing.
    assert drain(conn, registry) == []


def test_drain_limits_itself_to_the_given_queues(conn: Connection) -> None:
    calls: list[Any] = []
    sqlaq.enqueue(conn, "ok", queue="a")
    sqlaq.enqueue(conn, "ok", queue="b")
    assert [r.kind for r in drain(conn, make_registry(calls), queues=["b"])] == ["ok"]
    assert len(enqueued_jobs(conn, "ok", queue="a")) == 1


def test_assert_enqueued_matches_kind_payload_subset_and_count(engine: Engine) -> None:
    with Session(engine) as session:
        sqlaq.enqueue(session, "send_email", {"user_id": 7, "template": "welcome"})
        sqlaq.enqueue(session, "send_email", {"user_id": 8, "template": "welcome"})
        job = assert_enqueued(session, "send_email", payload={"user_id": 7})
        assert job.payload == {"user_id": 7, "template": "welcome"}
        assert_enqueued(session, "send_email", payload={"template": "welcome"}, count=2)
        with pytest.raises(AssertionError, match=r"found 0; queued jobs: .*'user_id': 7"):
            assert_enqueued(session, "send_email", payload={"user_id": 9})
        with pytest.raises(AssertionError, match="expected 1 queued job"):
            assert_enqueued(session, "send_email", count=1)
        with pytest.raises(AssertionError, match="kind 'other'"):
            assert_enqueued(session, "other")
        session.rollback()


def test_drain_writes_a_snooze_without_using_the_attempt(conn: Connection) -> None:
    registry = sqlaq.Registry()

    @registry.handler("not_yet")
    def not_yet(payload: dict[str, Any]) -> None:
        raise sqlaq.Snooze(timedelta(minutes=1))

    job_id = sqlaq.enqueue(conn, "not_yet").job_id
    (result,) = drain(conn, registry)
    assert result.status is JobStatus.QUEUED
    assert result.error is None
    row = job_row(conn, job_id)
    assert (row.status, row.attempts, row.last_error) == ("queued", 0, None)


def test_travel_drives_a_retry_with_backoff_without_a_sleep(conn: Connection) -> None:
    from sqlaq.testing import travel

    registry = sqlaq.Registry()
    attempts: list[int] = []

    @registry.handler("later", wait=sqlaq.Backoff(base=timedelta(hours=1), jitter=0))
    def later(payload: dict[str, Any]) -> None:
        attempts.append(sqlaq.current_job().attempt)
        if len(attempts) < 3:
            raise OSError("not yet")

    sqlaq.enqueue(conn, "later")
    assert [r.status for r in drain(conn, registry)] == [JobStatus.QUEUED]
    travel(conn, timedelta(minutes=59))
    assert drain(conn, registry) == []  # the backoff is an hour
    travel(conn, timedelta(minutes=1))
    assert [r.status for r in drain(conn, registry)] == [JobStatus.QUEUED]
    travel(conn, timedelta(hours=2))  # the second backoff: two hours
    assert [r.status for r in drain(conn, registry)] == [JobStatus.DONE]
    assert attempts == [1, 2, 3]


def test_travel_makes_a_periodic_slot_due(conn: Connection) -> None:
    from sqlaq.testing import travel

    registry = sqlaq.Registry()
    ticks: list[int] = []

    @registry.periodic("0 * * * *", kind="hourly")
    def hourly(payload: dict[str, Any]) -> None:
        ticks.append(1)

    assert sqlaq.enqueue_periodic(conn, registry.periodics) == []  # first sight
    travel(conn, timedelta(hours=1))
    assert len(sqlaq.enqueue_periodic(conn, registry.periodics)) == 1
    assert [r.status for r in drain(conn, registry)] == [JobStatus.DONE]
    assert sqlaq.enqueue_periodic(conn, registry.periodics) == []
    travel(conn, timedelta(hours=3))  # three slots passed: missed ones are not backfilled
    assert len(sqlaq.enqueue_periodic(conn, registry.periodics)) == 1
    assert [r.status for r in drain(conn, registry)] == [JobStatus.DONE]
    assert ticks == [1, 1]


def test_travel_refuses_a_negative_or_huge_jump(conn: Connection) -> None:
    from sqlaq.testing import travel

    with pytest.raises(sqlaq.InvalidJobError, match="zero or more"):
        travel(conn, timedelta(seconds=-1))
    with pytest.raises(sqlaq.InvalidJobError, match="at most 100 years"):
        travel(conn, timedelta(days=40000))


DRIVERS = ["postgresql+psycopg_async", "postgresql+asyncpg"]


@pytest.fixture
def notes(committed: Engine) -> Iterator[Engine]:
    with committed.begin() as conn:
        conn.execute(text("CREATE TABLE sqlaq_test_notes (job_id bigint, note text)"))
    try:
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS sqlaq_test_notes"))


def registry_of(loops: list[Any]) -> sqlaq.Registry:
    registry = sqlaq.Registry()

    @registry.handler("plain_async")
    async def plain_async(payload: dict[str, Any]) -> str:
        loops.append(asyncio.get_running_loop())
        return f"hello {sqlaq.current_job().id}"

    @registry.handler("txn_async")
    async def txn_async(payload: dict[str, Any], session: AsyncSession) -> None:
        await session.execute(
            text("INSERT INTO sqlaq_test_notes VALUES (:id, 'async')"),
            {"id": sqlaq.current_job().id},
        )
        if payload.get("fail"):
            raise sqlaq.PermanentError("no")

    @registry.handler("sync")
    def sync(payload: dict[str, Any]) -> None:
        loops.append(None)

    return registry


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("through", ["connection", "session"])
def test_drain_async_in_the_tests_transaction(notes: Engine, driver: str, through: str) -> None:
    pytest.importorskip(driver.rpartition("+")[2].replace("_async", ""))
    loops: list[Any] = []
    registry = registry_of(loops)
    url = notes.url.set(drivername=driver)

    async def test() -> None:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                await conn.begin()
                target: Any = AsyncSession(bind=conn) if through == "session" else conn

                def enqueue(sync_conn: Any) -> list[int]:
                    return [
                        sqlaq.enqueue(sync_conn, kind, payload).job_id
                        for kind, payload in [
                            ("plain_async", {}),
                            ("txn_async", {}),
                            ("txn_async", {"fail": True}),
                            ("sync", {}),
                        ]
                    ]

                ids = await conn.run_sync(enqueue)
                results = await drain_async(target, registry)
                assert [r.status for r in results] == ["done", "done", "failed", "done"]
                assert loops[0] is asyncio.get_running_loop()  # the test's own loop
                notes_seen = await conn.execute(text("SELECT job_id FROM sqlaq_test_notes"))
                assert notes_seen.scalars().all() == [ids[1]]  # the failed one rolled back
                outcome = await conn.run_sync(sqlaq.result, ids[0])
                assert outcome.result == f"hello {ids[0]}"
                await conn.rollback()
        finally:
            await engine.dispose()

    asyncio.run(test())
    with notes.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sqlaq_test_notes")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


def test_sync_drain_names_drain_async_for_an_async_transactional_handler(notes: Engine) -> None:
    registry = registry_of([])
    with notes.connect() as conn, conn.begin():
        sqlaq.enqueue(conn, "txn_async")
        with pytest.raises(sqlaq.ConfigError, match="drain_async"):
            drain(conn, registry)


def test_drain_runs_a_workflow_to_its_end_in_the_test_s_transaction(conn: Connection) -> None:
    """Each parent's completion releases its children in the test's own transaction
    (the trigger), where ``now()`` does not move: they are due at once, and drain runs
    every step, whatever the queue, before it returns."""
    registry = sqlaq.Registry()
    sums: list[int] = []

    @registry.handler("square")
    def square(payload: dict[str, Any]) -> int:
        return int(payload["n"]) ** 2

    @registry.handler("total")
    def total(payload: dict[str, Any], session: Session) -> int:
        parents = sqlaq.parent_results(session, sqlaq.current_job().id)
        sums.append(sum(p.result for p in parents))
        return sums[-1]

    @registry.handler("flaky", max_attempts=1)
    def flaky(payload: dict[str, Any]) -> None:
        raise PermanentError("no")

    @registry.handler("report")
    def report(payload: dict[str, Any], session: Session) -> list[str]:
        return [p.status for p in sqlaq.parent_results(session, sqlaq.current_job().id)]

    chord = sqlaq.chord(
        conn, [sqlaq.NewJob("square", {"n": n}) for n in range(4)], sqlaq.NewJob("total")
    )
    assert chord.callback_id is not None
    then = sqlaq.enqueue(conn, "square", {"n": 9}, queue="later", after=[chord.callback_id])
    batch = sqlaq.batch(
        conn, [sqlaq.NewJob("square", {"n": 1}), sqlaq.NewJob("flaky")], sqlaq.NewJob("report")
    )
    assert batch.callback_id is not None
    ran = drain(conn, registry)
    order = [job.id for job in ran]
    assert sums == [14]
    assert order.index(chord.callback_id) > max(order.index(i) for i in chord.job_ids)
    assert order.index(then.job_id) > order.index(chord.callback_id)
    assert order.index(batch.callback_id) > max(order.index(i) for i in batch.job_ids)
    assert len(order) == len(set(order)) == 9
    assert sqlaq.result(conn, batch.callback_id).result == ["done", "failed"]
    assert sqlaq.result(conn, then.job_id).result == 81
