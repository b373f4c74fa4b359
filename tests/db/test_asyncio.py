"""sqlaq.asyncio: every operation awaited on an AsyncConnection and an AsyncSession, on
both of SQLAlchemy's async PostgreSQL drivers (psycopg's async connection and asyncpg),
against the real database; debounce, unique_for and the per-job timeout through it (the
same plans as the sync API: the arguments flow through).

Each case runs in a transaction rolled back at its end, on an emptied queue; the cases
about commit and notifications clean up through the ``committed`` fixture.

One implementation for sync and async: every operation is a plan, run by two drivers.
These tests fail when a sync operation has no async twin (or the reverse), when a twin's
signature drifts from its original, or when logic is written in sqlaq/asyncio.py (or a
connection is used directly in sqlaq/ops/) instead of in the one plan both share.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import uuid
from asyncio import current_task
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import docsamples
import psycopg
import pytest
import pytest_asyncio
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    Table,
    text,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
)
from sqlalchemy.orm import Session, scoped_session, sessionmaker
from workerkit import libpq_url

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import ConfigError, EnqueueOutcome, JobStatus, LeaseLostError, NewJob, Rate, drive
from sqlaq.cron import CronSchedule
from sqlaq.periodic import Periodic

pytestmark = pytest.mark.timeout(120)

LEASE = timedelta(seconds=30)
AsyncExecutor = Any  # AsyncConnection | AsyncSession, as the fixture gives it


@pytest_asyncio.fixture(params=["connection", "session"])
async def aconn(
    request: pytest.FixtureRequest, async_engine: AsyncEngine
) -> AsyncIterator[AsyncExecutor]:
    """An AsyncConnection or AsyncSession in a transaction rolled back after the test."""
    if request.param == "connection":
        async with async_engine.connect() as conn:
            await conn.begin()
            try:
                yield conn
            finally:
                await conn.rollback()
    else:
        async with AsyncSession(async_engine) as session:
            try:
                yield session
            finally:
                await session.rollback()


async def rows(conn: AsyncExecutor, sql: str, **params: Any) -> list[Any]:
    return list((await conn.execute(text(sql), params)).all())


async def scalar(conn: AsyncExecutor, sql: str, **params: Any) -> Any:
    return (await conn.execute(text(sql), params)).scalar_one()


async def claim_one(conn: AsyncExecutor, **options: Any) -> sqlaq.ClaimedJob:
    (job,) = await aq.claim(conn, worker_id=uuid.uuid4(), lease=LEASE, **options)
    return job


async def expire(conn: AsyncExecutor, job_id: int) -> None:
    sql = "UPDATE sqlaq_jobs SET run_at = now() - interval '1 second' WHERE id = :id"
    await conn.execute(text(sql), {"id": job_id})


# -- enqueue ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_enqueue_writes_the_job_and_dedupes_keeping_the_transaction(
    aconn: AsyncExecutor,
) -> None:
    first = await aq.enqueue(aconn, "mail", {"to": 7}, queue="q", priority=3, dedupe_key="u7")
    again = await aq.enqueue(aconn, "mail", {"to": 8}, queue="q", dedupe_key="u7")
    assert again == sqlaq.EnqueueResult(first.job_id, duplicate=True)
    assert await scalar(aconn, "SELECT 1") == 1  # the transaction is still usable
    later = await aq.enqueue(aconn, "mail", delay=timedelta(minutes=5))
    found = await rows(aconn, "SELECT id, kind, queue, payload, priority FROM sqlaq_jobs")
    assert sorted(tuple(r) for r in found) == [
        (first.job_id, "mail", "q", {"to": 7}, 3),
        (later.job_id, "mail", "default", {}, 0),
    ]
    late = await scalar(
        aconn, "SELECT run_at - now() FROM sqlaq_jobs WHERE id = :id", id=later.job_id
    )
    assert late == timedelta(minutes=5)


@pytest.mark.asyncio
async def test_enqueue_many_in_input_order_with_duplicates(aconn: AsyncExecutor) -> None:
    held = (await aq.enqueue(aconn, "b", dedupe_key="held")).job_id
    batch = [NewJob("b", {"i": 0}), NewJob("b", dedupe_key="held"), NewJob("b", dedupe_key="new")]
    batch.append(NewJob("b", dedupe_key="new"))
    results = await aq.enqueue_many(aconn, batch)
    assert [r.duplicate for r in results] == [False, True, False, True]
    assert results[1].job_id == held
    assert results[3].job_id == results[2].job_id
    assert await scalar(aconn, "SELECT count(*) FROM sqlaq_jobs") == 3


@pytest.mark.asyncio
async def test_keys_are_written_and_claimed_within_their_limit(aconn: AsyncExecutor) -> None:
    await aq.enqueue(aconn, "tenant", key="a")
    await aq.enqueue_many(aconn, [NewJob("tenant", key="a"), NewJob("tenant", key="b")])
    await aq.enqueue_many(aconn, NewJob("tenant", key="b").with_payloads([{}, {}]))
    assert await aq.enqueue_copy(aconn, [NewJob("tenant", key="c"), NewJob("tenant")]) == 2
    keys = await rows(aconn, "SELECT key FROM sqlaq_jobs ORDER BY id")
    assert [r.key for r in keys] == ["a", "a", "b", "b", "b", "c", None]
    claimed = await aq.claim_limited(
        aconn, worker_id=uuid.uuid4(), kind="tenant", limit=10, key_concurrency=1
    )
    assert (len(claimed.jobs), claimed.full) == (4, True)  # one of a, b and c; the keyless one
    running = await rows(
        aconn, "SELECT key FROM sqlaq_jobs WHERE status = 'running' ORDER BY key NULLS LAST"
    )
    assert [r.key for r in running] == ["a", "b", "c", None]


@pytest.mark.asyncio
async def test_a_fair_claim_shares_the_keys_and_carries_them(aconn: AsyncExecutor) -> None:
    await aq.enqueue_many(aconn, [NewJob("tenant", key="flood") for _ in range(20)])
    await aq.enqueue_many(aconn, [NewJob("tenant", key=k) for k in ("a", "b", None)])
    claimed = await aq.claim_fair(aconn, worker_id=uuid.uuid4(), limit=5, weights={"flood": 2})
    # Shares flood (weight 2), a and b (the job without a key is in none): of the five
    # slots flood scores 1/2, 1, 3/2, a and b 1 each (they have one job each).
    assert sorted(job.key or "-" for job in claimed) == ["a", "b", "flood", "flood", "flood"]


@pytest.mark.asyncio
async def test_enqueue_many_takes_a_job_batch(aconn: AsyncExecutor) -> None:
    batch = NewJob("jb", queue="q").with_payloads([{"i": i} for i in range(4)])
    results = await aq.enqueue_many(aconn, batch)
    assert [r.inserted for r in results] == [True] * 4
    rows = await scalar(
        aconn,
        "SELECT json_agg(json_build_array(queue, payload) ORDER BY id) FROM sqlaq_jobs"
        " WHERE kind = 'jb'",
    )
    assert rows == [["q", {"i": i}] for i in range(4)]


@pytest.mark.asyncio
async def test_enqueue_copy_writes_inside_the_callers_transaction(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn:
        await conn.begin()
        jobs = [NewJob("copied", {"i": i}, queue="bulk", priority=i) for i in range(5)]
        assert await aq.enqueue_copy(conn, jobs) == 5
        found = await rows(
            conn, "SELECT kind, queue, payload, priority FROM sqlaq_jobs ORDER BY id"
        )
        assert [tuple(r) for r in found] == [("copied", "bulk", {"i": i}, i) for i in range(5)]
        await conn.rollback()  # COPY was inside the transaction: nothing stays
        assert await scalar(conn, "SELECT count(*) FROM sqlaq_jobs") == 0
    async with AsyncSession(async_engine) as session:
        assert await aq.enqueue_copy(session, [NewJob("copied")]) == 1
        await session.commit()
    async with async_engine.connect() as conn:
        assert await scalar(conn, "SELECT count(*) FROM sqlaq_jobs") == 1


@pytest.mark.asyncio
async def test_bad_input_is_refused_before_any_sql(aconn: AsyncExecutor) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match="lone surrogate"):
        await aq.enqueue(aconn, "k", {"x": "\ud800"})
    with pytest.raises(sqlaq.InvalidJobError, match="has a dedupe_key"):
        await aq.enqueue_copy(aconn, [NewJob("k", dedupe_key="d")])
    assert await scalar(aconn, "SELECT count(*) FROM sqlaq_jobs") == 0


# -- the lifecycle -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_claim_complete_fail_extend_on_held_leases(aconn: AsyncExecutor) -> None:
    ids = [(await aq.enqueue(aconn, "k", {"i": i}, priority=-i)).job_id for i in range(4)]
    claimed = await aq.claim(aconn, worker_id=uuid.uuid4(), limit=4, lease=LEASE)
    assert [j.id for j in claimed] == ids
    extended = await aq.extend_lease(aconn, [j.lease for j in claimed], length=timedelta(hours=1))
    assert [lease.job_id for lease in extended] == ids
    assert await aq.complete(aconn, [claimed[0].lease, claimed[1].lease]) == ids[:2]
    retry_in = timedelta(seconds=5)
    assert await aq.fail(aconn, claimed[2].lease, "boom", retry_in=retry_in) == JobStatus.QUEUED
    assert await aq.fail(aconn, claimed[3].lease, "final") == JobStatus.FAILED
    statuses = dict(await rows(aconn, "SELECT id, status FROM sqlaq_jobs"))
    assert [statuses[i] for i in ids] == ["done", "done", "queued", "failed"]


@pytest.mark.asyncio
async def test_extend_lease_still_takes_its_old_keyword_with_a_warning(
    aconn: AsyncExecutor,
) -> None:
    await aq.enqueue(aconn, "k")
    job = await claim_one(aconn)
    with pytest.warns(DeprecationWarning, match="pass length=") as warned:
        (renewed,) = await aq.extend_lease(aconn, job.lease, lease=timedelta(hours=2))
    assert warned[0].filename == __file__  # it points at the caller's line
    assert renewed.expires_at == await scalar(aconn, "SELECT now() + interval '2 hours'")


@pytest.mark.asyncio
async def test_a_narrowed_claim_takes_only_matching_jobs(aconn: AsyncExecutor) -> None:
    await aq.enqueue(aconn, "k", {"region": "us"}, priority=5)
    eu = (await aq.enqueue(aconn, "k", {"region": "eu"})).job_id
    where = sqlaq.jobs.c.payload["region"].astext == "eu"
    assert [j.id for j in await aq.claim(aconn, worker_id=uuid.uuid4(), where=where)] == [eu]


@pytest.mark.asyncio
async def test_fenced_operations_with_a_stale_lease_change_nothing(aconn: AsyncExecutor) -> None:
    job_id = (await aq.enqueue(aconn, "k")).job_id
    stale = await claim_one(aconn)
    await expire(aconn, job_id)
    fresh = await claim_one(aconn)
    before = await rows(aconn, "SELECT status, attempts, lease_token, run_at FROM sqlaq_jobs")
    for call in (
        aq.complete(aconn, stale.lease),
        aq.extend_lease(aconn, stale.lease),
        aq.fail(aconn, stale.lease, "late", retry_in=timedelta(0)),
        aq.snooze(aconn, stale.lease, timedelta(minutes=1)),
        aq.handback(aconn, stale.lease),
    ):
        with pytest.raises(LeaseLostError) as lost:
            await call
        assert lost.value.job_ids == (job_id,)
    assert await aq.complete(aconn, stale.lease, raise_on_lost=False) == []
    assert await aq.fail(aconn, stale.lease, "late", raise_on_lost=False) is None
    assert (
        await rows(aconn, "SELECT status, attempts, lease_token, run_at FROM sqlaq_jobs") == before
    )
    assert await aq.complete(aconn, fresh.lease) == [job_id]


@pytest.mark.asyncio
async def test_snooze_handback_retry_cancel(aconn: AsyncExecutor) -> None:
    ids = [(await aq.enqueue(aconn, "k", priority=-i)).job_id for i in range(3)]
    claimed = await aq.claim(aconn, worker_id=uuid.uuid4(), limit=3, lease=LEASE)
    assert await aq.snooze(aconn, claimed[0].lease, timedelta.max) == [ids[0]]
    late = await scalar(aconn, "SELECT run_at - now() FROM sqlaq_jobs WHERE id = :id", id=ids[0])
    assert late == timedelta(days=36525)  # for ever, brought down to 100 years
    assert await aq.handback(aconn, [claimed[1].lease]) == [ids[1]]
    assert sorted(await aq.cancel(aconn, [ids[1], ids[2]])) == [ids[1], ids[2]]
    assert sorted(await aq.cancelled_among(aconn, ids)) == [ids[1], ids[2]]
    assert await aq.retry(aconn, ids[1]) == [ids[1]]
    statuses = dict(await rows(aconn, "SELECT id, status FROM sqlaq_jobs"))
    assert [statuses[i] for i in ids] == ["queued", "queued", "cancelled"]


@pytest.mark.asyncio
async def test_claim_limited_within_its_limits(aconn: AsyncExecutor) -> None:
    for _ in range(3):
        await aq.enqueue(aconn, "api")
    first = await aq.claim_limited(
        aconn, worker_id=uuid.uuid4(), kind="api", limit=3, concurrency=2, rate=Rate.parse("5/s")
    )
    assert len(first.jobs) == 2
    assert first.full
    again = await aq.claim_limited(aconn, worker_id=uuid.uuid4(), kind="api", concurrency=2)
    assert (again.jobs, again.full) == ([], True)


@pytest.mark.asyncio
async def test_claim_limited_refuses_autocommit(async_engine: AsyncEngine) -> None:
    async with async_engine.connect() as conn:
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(ConfigError, match="claim_limited needs a transaction"):
            await aq.claim_limited(auto, worker_id=uuid.uuid4(), kind="api")


@pytest.mark.asyncio
async def test_sweep_and_prune(aconn: AsyncExecutor) -> None:
    last = (await aq.enqueue(aconn, "k", max_attempts=1)).job_id
    await claim_one(aconn)
    await expire(aconn, last)
    assert await aq.sweep(aconn) == 1
    sql = "UPDATE sqlaq_jobs SET finished_at = now() - interval '8 days'"
    await aconn.execute(text(sql))
    pruned = await aq.prune(aconn, older_than=timedelta(days=7))
    assert (int(pruned), pruned.skipped) == (1, 0)
    assert await scalar(aconn, "SELECT count(*) FROM sqlaq_jobs") == 0


@pytest.mark.asyncio
async def test_enqueue_periodic_and_notify_queues(aconn: AsyncExecutor) -> None:
    hourly = Periodic.build(CronSchedule.parse("@hourly"), kind="tick")
    now = await scalar(aconn, "SELECT now()")
    assert await aq.enqueue_periodic(aconn, [hourly], now=now) == []  # first sight
    (job,) = await aq.enqueue_periodic(aconn, [hourly], now=now + timedelta(hours=1))
    assert job.name == "tick"
    assert await aq.notify_queues(aconn, ["default"]) is None


@pytest.mark.asyncio
async def test_pause_resume_and_the_operators_reads(aconn: AsyncExecutor) -> None:
    await aq.enqueue(aconn, "k", queue="q")
    assert await aq.pause(aconn, "q", by="ops@host") is True
    assert await aq.pause(aconn, "q") is False  # already paused: the first pause is kept
    (paused,) = await aq.paused_queues(aconn)
    assert (paused.queue, paused.paused_by) == ("q", "ops@host")
    assert isinstance(paused, sqlaq.PausedQueue)
    assert await aq.claim(aconn, worker_id=uuid.uuid4(), queue="q") == []
    assert await aq.resume(aconn, "q") is True
    assert await aq.paused_queues(aconn) == []
    assert len(await aq.claim(aconn, worker_id=uuid.uuid4(), queue="q")) == 1
    worker_id = uuid.uuid4()
    await aconn.execute(
        text(
            "INSERT INTO sqlaq_workers (worker_id, hostname, pid, queues, concurrency)"
            " VALUES (:id, 'h', 7, '{q}', 2)"
        ),
        {"id": worker_id},
    )
    (worker,) = [w for w in await aq.list_workers(aconn) if w.worker_id == worker_id]
    assert (worker.hostname, worker.pid, worker.queues, worker.concurrency) == ("h", 7, ("q",), 2)


@pytest.mark.asyncio
async def test_explain_result_and_complete_with_result(aconn: AsyncExecutor) -> None:
    job_id = (await aq.enqueue(aconn, "k", queue="q", delay=timedelta(hours=1))).job_id
    codes = [reason.code for reason in await aq.explain(aconn, job_id)]
    assert codes[0] is sqlaq.ReasonCode.NOT_DUE
    assert (await aq.result(aconn, job_id)).status is JobStatus.QUEUED
    await aq.enqueue(aconn, "k", queue="now")
    job = await claim_one(aconn, queue="now")
    assert await aq.complete_with_result(aconn, job.lease, '{"n": 1}') is True
    outcome = await aq.result(aconn, job.id)
    assert (outcome.status, outcome.result) == (JobStatus.DONE, {"n": 1})
    with pytest.raises(sqlaq.JobNotFoundError):
        await aq.result(aconn, job_id + 1000)


@pytest.mark.asyncio
async def test_travel_moves_the_queues_clock(aconn: AsyncExecutor) -> None:
    job_id = (await aq.enqueue(aconn, "k", delay=timedelta(hours=1))).job_id
    assert await aq.claim(aconn, worker_id=uuid.uuid4()) == []
    assert await aq.travel(aconn, timedelta(hours=1)) is None
    assert [j.id for j in await aq.claim(aconn, worker_id=uuid.uuid4())] == [job_id]


@pytest.mark.asyncio
async def test_the_test_helpers(aconn: AsyncExecutor) -> None:
    await aq.enqueue(aconn, "mail", {"to": "a", "x": 1}, queue="q")
    (found,) = await aq.enqueued_jobs(aconn, "mail", payload={"to": "a"})
    assert found.queue == "q"
    row = await aq.assert_enqueued(aconn, "mail", payload={"x": 1}, count=1)
    assert row.id == found.id
    with pytest.raises(AssertionError, match="expected queued job"):
        await aq.assert_enqueued(aconn, "other")


# -- retention beside a host's foreign key: the savepoint, on both drivers ---------------------

host = MetaData()
invoices = Table(
    "test_async_invoices",
    host,
    Column("id", Integer, primary_key=True),
    Column("job_id", BigInteger, ForeignKey(sqlaq.jobs.c.id)),
)


@pytest.fixture
def host_table(committed: Engine) -> Iterator[None]:
    host.create_all(committed)
    try:
        yield
    finally:
        host.drop_all(committed)


@pytest.mark.asyncio
async def test_prune_spares_referenced_jobs(host_table: None, aconn: AsyncExecutor) -> None:
    ids = [r.job_id for r in await aq.enqueue_many(aconn, [NewJob("k")] * 5)]
    await aconn.execute(invoices.insert().values(id=1, job_id=ids[0]))
    sql = "UPDATE sqlaq_jobs SET status = 'done', finished_at = now() - interval '8 days'"
    await aconn.execute(text(sql))
    result = await aq.prune(aconn, older_than=timedelta(days=7))
    assert (int(result), result.skipped) == (4, 1)
    assert result.referenced_by == ("public.test_async_invoices",)
    assert [r[0] for r in await rows(aconn, "SELECT id FROM sqlaq_jobs")] == [ids[0]]


@pytest.mark.asyncio
async def test_a_violation_in_the_savepoint_leaves_the_transaction_usable(
    host_table: None, aconn: AsyncExecutor
) -> None:
    await aconn.execute(
        text(
            "CREATE TABLE test_async_default (job_id bigint DEFAULT -1"
            " REFERENCES sqlaq_jobs (id) ON DELETE SET DEFAULT)"  # gone with the rollback
        )
    )
    job_id = (await aq.enqueue(aconn, "k")).job_id
    await aconn.execute(invoices.insert().values(id=1, job_id=None))  # a blocking key exists
    await aconn.execute(text("INSERT INTO test_async_default VALUES (:id)"), {"id": job_id})
    sql = "UPDATE sqlaq_jobs SET status = 'done', finished_at = now() - interval '8 days'"
    await aconn.execute(text(sql))
    with pytest.raises(IntegrityError):
        await aq.prune(aconn, older_than=timedelta(days=7))
    assert await scalar(aconn, "SELECT count(*) FROM sqlaq_jobs") == 1


# -- commit, rollback and notifications --------------------------------------------------------


@pytest.fixture
def listener(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("LISTEN sqlaq_jobs")
        yield conn


def notified_until_marker(listener: psycopg.Connection[Any], engine: Engine) -> list[str]:
    """What the listener got, up to a marker sent now from another connection: every
    notification committed before the marker arrives before it."""
    with engine.connect() as other:
        other.execute(text("SELECT pg_notify('sqlaq_jobs', 'marker')"))
        other.commit()
    got: list[str] = []
    for notice in listener.notifies(timeout=10):
        # The queue: an enqueue's payload goes on with the jobs' position (sqlaq_0008).
        got.append(notice.payload.rsplit(" ", 2)[0])
        if notice.payload == "marker":
            return got
    raise AssertionError(f"the marker never came; got {got}")


@pytest.mark.parametrize("executor", ["connection", "session"])
@pytest.mark.asyncio
async def test_rollback_leaves_no_job_and_no_notification(
    async_engine: AsyncEngine,
    committed: Engine,
    listener: psycopg.Connection[Any],
    executor: str,
) -> None:
    if executor == "connection":
        async with async_engine.connect() as conn:
            await aq.enqueue(conn, "k", queue="rolled")
            await aq.enqueue_copy(conn, [NewJob("k", queue="rolled")])
            await conn.rollback()
    else:
        async with AsyncSession(async_engine) as session:
            await aq.enqueue(session, "k", queue="rolled")
            await aq.enqueue_many(session, [NewJob("k", queue="rolled")])
            await session.rollback()
    assert notified_until_marker(listener, committed) == ["marker"]
    with committed.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0
    async with AsyncSession(async_engine) as session:
        await aq.enqueue(session, "k", queue="kept")
        await session.commit()
    assert notified_until_marker(listener, committed) == ["kept", "marker"]


# -- the wrong kind of object ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_sync_operation_refuses_async_objects_naming_the_twin(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn, AsyncSession(async_engine) as session:
        for given in (conn, session, async_engine):
            with pytest.raises(ConfigError, match=r"use sqlaq\.asyncio\.enqueue \(awaited\)"):
                sqlaq.enqueue(given, "k")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"sqlaq\.asyncio\.notify_queues"):
            sqlaq.ops.notify_queues(conn, ["q"])  # type: ignore[arg-type]
        assert not conn.in_transaction()  # nothing ran


@pytest.mark.asyncio
async def test_an_async_operation_refuses_sync_objects_naming_the_original(
    engine: Engine,
) -> None:
    with engine.connect() as conn, Session(engine) as session:
        for given in (conn, session):
            with pytest.raises(ConfigError, match=r"use sqlaq\.complete \(not awaited\)$"):
                await aq.complete(given, [])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"use sqlaq\.testing\.enqueued_jobs \(not"):
            await aq.enqueued_jobs(conn)  # type: ignore[arg-type]
        assert not conn.in_transaction()
    with pytest.raises(
        ConfigError, match=r"given an Engine: use sqlaq\.enqueue \(not awaited\) on a"
    ):
        await aq.enqueue(engine, "k")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_sync_enqueue_copy_through_run_sync_names_the_async_twin(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn:
        with pytest.raises(ConfigError, match=r"use sqlaq\.asyncio\.enqueue_copy"):
            await conn.run_sync(sqlaq.enqueue_copy, [NewJob("k")])
        await conn.rollback()


@pytest.mark.asyncio
async def test_any_sync_operation_still_runs_through_run_sync(
    aconn: AsyncExecutor,
) -> None:
    result = await aconn.run_sync(sqlaq.enqueue, "k", {"via": "run_sync"})
    assert (await aq.enqueued_jobs(aconn))[0].id == result.job_id


# -- the documentation's sample ------------------------------------------------------------------


def documented_block(contains: str) -> tuple[str, str]:
    """The one python block of the documentation holding *contains*, and where it is."""
    (block,) = docsamples.find_blocks("python", contains)
    return block.code, block.path


@pytest.mark.asyncio
async def test_the_documented_async_sample_runs(async_engine: AsyncEngine) -> None:
    namespace: dict[str, Any] = {}
    code, path = documented_block("async def order_placed(")
    exec(compile(code, path, "exec"), namespace)  # noqa: S102
    await namespace["order_placed"](async_engine, 7)
    await namespace["order_placed"](async_engine, 7)  # the dedupe key holds the second
    async with async_engine.connect() as conn:
        kinds = await rows(conn, "SELECT kind, payload->>'to' FROM sqlaq_jobs ORDER BY id")
    assert [tuple(r) for r in kinds] == [
        ("ship_order", None),
        ("email", "buyer"),
        ("email", "seller"),
        ("email", "buyer"),
        ("email", "seller"),
    ]
    assert len(await namespace["run_some"](async_engine)) == 5


@pytest.mark.asyncio
async def test_scoped_sessions_go_to_their_own_kind_of_operation(
    async_engine: AsyncEngine, engine: Engine
) -> None:
    scoped = async_scoped_session(async_sessionmaker(async_engine), scopefunc=current_task)
    try:
        await aq.enqueue_copy(scoped, [NewJob("k")])
        limited = await aq.claim_limited(scoped, worker_id=uuid.uuid4(), kind="k")
        assert len(limited.jobs) == 1
        await scoped.rollback()
    finally:
        await scoped.remove()
    sync_scoped = scoped_session(sessionmaker(engine))
    try:
        assert not sqlaq.enqueue(sync_scoped, "k").duplicate
        with pytest.raises(ConfigError, match=r"use sqlaq\.enqueue \(not awaited\)$"):
            await aq.enqueue(sync_scoped, "k")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"use sqlaq\.asyncio\.enqueue \(awaited\)$"):
            sqlaq.enqueue(scoped, "k")  # type: ignore[arg-type]
        sync_scoped.rollback()
    finally:
        sync_scoped.remove()


HOUR = timedelta(hours=1)


@pytest_asyncio.fixture
async def async_conn(async_engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """An AsyncConnection per driver, in a transaction rolled back after the test."""
    async with async_engine.connect() as conn:
        await conn.begin()
        try:
            yield conn
        finally:
            await conn.rollback()


async def _scalar(conn: AsyncConnection, sql: str) -> Any:
    return (await conn.execute(text(sql))).scalar_one()


@pytest.mark.asyncio
async def test_debounce_unique_for_and_timeout(async_conn: AsyncConnection) -> None:
    first = await aq.enqueue(async_conn, "digest", {"n": 1}, debounce_key="k", debounce=HOUR)
    again = await aq.enqueue(
        async_conn, "digest", {"n": 2}, debounce_key="k", debounce=HOUR, max_wait=2 * HOUR
    )
    assert again == sqlaq.EnqueueResult(first.job_id, outcome=EnqueueOutcome.DEBOUNCED)
    assert await _scalar(async_conn, "SELECT payload FROM sqlaq_jobs") == {"n": 2}

    held = await aq.enqueue(async_conn, "report", dedupe_key="d", unique_for=HOUR, timeout=HOUR)
    assert held.inserted
    second = await aq.enqueue(async_conn, "report", dedupe_key="d", unique_for=HOUR)
    assert second == sqlaq.EnqueueResult(held.job_id, outcome=EnqueueOutcome.HELD)
    assert await _scalar(async_conn, "SELECT 1") == 1  # the transaction is still usable

    await async_conn.execute(text("UPDATE sqlaq_jobs SET run_at = now()"))
    claimed = await aq.claim(async_conn, worker_id=uuid.uuid4(), limit=5)
    assert {j.kind: j.timeout for j in claimed} == {"digest": None, "report": HOUR}


PACKAGE = Path(sqlaq.__file__).parent

#: What a parameter's annotation names when the function runs on the caller's database
#: objects (``Executor`` is ``Connection | Session``).
SYNC_OBJECTS = {"Connection", "Session", "Engine", "Executor"}

#: Alembic's scripts, run by Alembic (env.py reads Alembic's context at import): no
#: module of sqlaq's API.
NOT_MODULES = ("sqlaq.migrations.env", "sqlaq.migrations.versions")

#: Public functions that take a Connection, Session or Engine and have no async twin in
#: sqlaq.asyncio, each with its reason. Keep it short: a function left out here without
#: a twin fails test_every_public_function_on_a_connection_has_its_async_twin.
_ALEMBIC = "Alembic's migrations run on a sync Connection (async apps: run_sync)"
_DASHBOARD = "the dashboard is a server of its own, on its own sync Engine"
_CLI = "start-up checks of the sqlaq commands, on the command's sync Engine"
NO_TWIN: dict[str, str] = {
    "sqlaq.testing.drain": "its async twin is sqlaq.testing.drain_async",
    "sqlaq.drive.run": "the sync driver; sqlaq.asyncio holds the async one",
    "sqlaq.drive.per_engine": "the sync driver's PerEngine step; sqlaq.asyncio answers its own",
    **dict.fromkeys(
        (
            "sqlaq.citus.distribute",
            "sqlaq.citus.problems",
            "sqlaq.citus.is_distributed",
            "sqlaq.citus.forget",
        ),
        "the Citus conversion command's (sync); the operations detect Citus themselves",
    ),
    "sqlaq.dsn.connection_params": "reads an engine's URL, runs nothing on it",
    "sqlaq.worker.writer.write_outcomes": "the worker's own writer, on its sync connection",
    "sqlaq.commandline.check_database": _CLI,
    **dict.fromkeys(
        (
            "sqlaq.worker.startup.start_check",
            "sqlaq.worker.startup.check_database",
            "sqlaq.worker.startup.check_listen_url",
            "sqlaq.worker.startup.schema_mismatch",
            "sqlaq.worker.transaction.check_connection",
        ),
        "the worker's start and schema checks, on the worker's own sync Engine",
    ),
    **dict.fromkeys(
        (
            "sqlaq.migrations.check",
            "sqlaq.migrations.current_revision",
            "sqlaq.migrations.downgrade",
            "sqlaq.migrations.standalone_config",
            "sqlaq.migrations.standalone_revision",
            "sqlaq.migrations.upgrade",
            "sqlaq.migrations.drift.differences",
        ),
        _ALEMBIC,
    ),
    **dict.fromkeys(
        (
            "sqlaq.dashboard.serve",
            "sqlaq.dashboard.actions.cancel_job",
            "sqlaq.dashboard.actions.count_prunable",
            "sqlaq.dashboard.actions.pause_queue",
            "sqlaq.dashboard.actions.prune",
            "sqlaq.dashboard.actions.resume_queue",
            "sqlaq.dashboard.actions.retry_group",
            "sqlaq.dashboard.actions.retry_job",
            "sqlaq.dashboard.reads.failure_groups",
            "sqlaq.dashboard.reads.job",
            "sqlaq.dashboard.reads.job_value",
            "sqlaq.dashboard.reads.jobs_page",
            "sqlaq.dashboard.reads.overview",
            "sqlaq.dashboard.reads.schedules",
            "sqlaq.dashboard.reads.workers",
            "sqlaq.dashboard.reads.workflow",
        ),
        _DASHBOARD,
    ),
}
#: What sqlaq/asyncio.py exports that is no twin.
NOT_TWINS = {"AsyncExecutor", "asynchronous"}


def _modules() -> Iterator[Any]:
    yield sqlaq
    for info in pkgutil.walk_packages(sqlaq.__path__, "sqlaq."):
        if info.name != "sqlaq.asyncio" and not info.name.startswith(NOT_MODULES):
            yield importlib.import_module(info.name)


def _runs_on_sync_objects(function: Callable[..., Any]) -> bool:
    for parameter in inspect.signature(function).parameters.values():
        annotation = parameter.annotation
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        if {part.strip().rsplit(".", 1)[-1] for part in text.split("|")} & SYNC_OBJECTS:
            return True
    return False


def _found() -> dict[str, Callable[..., Any]]:
    """Every public function (named in its module's ``__all__``) that takes a sync
    Connection, Session or Engine, by where it is defined."""
    found: dict[str, Callable[..., Any]] = {}
    for module in _modules():
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            # A pytest fixture is no function to call (pytest before 8.4 leaves it one).
            fixture = hasattr(value, "_pytestfixturefunction")
            if inspect.isfunction(value) and not fixture and _runs_on_sync_objects(value):
                found.setdefault(f"{value.__module__}.{value.__name__}", value)
    return found


FOUND = _found()
#: The sync functions that must have a twin, by name.
SYNC = {where.rsplit(".", 1)[1]: f for where, f in FOUND.items() if where not in NO_TWIN}


def test_the_functions_are_found_by_their_signatures() -> None:
    """The scan finds what it must: the operations, the operators' controls, explain,
    the results, the test helpers, wait; and every allowed exception still exists."""
    assert set(SYNC) >= {
        "enqueue",
        "claim",
        "complete",
        "notify_queues",
        "enqueue_periodic",
        "pause",
        "resume",
        "paused_queues",
        "list_workers",
        "explain",
        "result",
        "complete_with_result",
        "wait",
        "travel",
        "enqueued_jobs",
        "assert_enqueued",
    }
    assert set(NO_TWIN) <= set(FOUND), set(NO_TWIN) - set(FOUND)
    assert len(SYNC) == len({f.__name__ for f in SYNC.values()})  # no two of one name


def test_every_public_function_on_a_connection_has_its_async_twin() -> None:
    missing = sorted(name for name in SYNC if not hasattr(aq, name))
    assert missing == [], f"no async twin in sqlaq.asyncio for {missing}"
    assert set(aq.__all__) - NOT_TWINS == set(SYNC), "sqlaq.asyncio exports a non-twin"
    assert aq.__all__ == sorted(aq.__all__, key=lambda n: (not n[0].isupper(), n))


def test_every_public_function_of_ops_is_an_operation_made_from_a_plan() -> None:
    for name in sqlaq.ops.__all__:
        value = getattr(sqlaq.ops, name)
        if inspect.isfunction(value):
            assert value in drive._PLANS, f"ops.{name} is not made by @operation"


def test_each_twin_runs_the_same_plan_with_the_same_signature() -> None:
    for name, sync in SYNC.items():
        twin = getattr(aq, name)
        assert inspect.iscoroutinefunction(twin), name
        sync_params = list(inspect.signature(sync).parameters.values())
        twin_params = list(inspect.signature(twin).parameters.values())
        assert sync_params[0].name == twin_params[0].name, name
        assert sync_params[1:] == twin_params[1:], name
        assert twin.__doc__
        assert sync.__doc__
        if name == "wait":  # its steps are shared; see the test below
            continue
        assert sync in drive._PLANS, f"{name} is not made from a plan by @operation"
        assert drive.plan_of(sync).__name__ == name
        assert sync_params[0].name == "conn"
        assert (
            inspect.signature(sync).return_annotation == inspect.signature(twin).return_annotation
        ), name
        assert sync.__doc__ in twin.__doc__


def _args_for(function: Callable[..., Any]) -> tuple[list[Any], dict[str, Any]]:
    """Placeholders for the required arguments after the first: the kind check comes
    before any of them is looked at."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for parameter in list(inspect.signature(function).parameters.values())[1:]:
        if parameter.default is inspect.Parameter.empty:
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
                kwargs[parameter.name] = 1
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
                args.append(1)
    return args, kwargs


_REFUSAL = re.compile(
    r"^(?P<called>[\w.]+)\(\) was given an? (?P<kind>\w+): use (?P<other>[\w.]+) "
    r"\((?P<how>awaited|not awaited)\)( on an? \w+ or \w+)?$"
)


def _refusal(error: pytest.ExceptionInfo[sqlaq.ConfigError]) -> dict[str, str]:
    message = str(error.value)
    match = _REFUSAL.match(message)
    assert match, message
    return match.groupdict()


@pytest.mark.asyncio
async def test_every_sync_function_refuses_async_objects_naming_its_twin(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn:
        given = {
            "AsyncConnection": conn,
            "AsyncSession": AsyncSession(async_engine),
            "AsyncEngine": async_engine,
        }
        for name, sync in SYNC.items():
            args, kwargs = _args_for(sync)
            for kind, target in given.items():
                with pytest.raises(sqlaq.ConfigError) as refused:
                    sync(target, *args, **kwargs)
                assert _refusal(refused) == {
                    "called": drive.public_name(name, sync.__module__),
                    "kind": kind,
                    "other": f"sqlaq.asyncio.{name}",
                    "how": "awaited",
                }, name
        assert not conn.in_transaction()  # nothing ran


@pytest.mark.asyncio
async def test_every_twin_refuses_sync_objects_naming_the_sync_function(engine: Engine) -> None:
    with engine.connect() as conn, Session(engine) as session:
        given = {"Connection": conn, "Session": session, "Engine": engine}
        for name, sync in SYNC.items():
            twin = getattr(aq, name)
            args, kwargs = _args_for(twin)
            for kind, target in given.items():
                with pytest.raises(sqlaq.ConfigError) as refused:
                    await twin(target, *args, **kwargs)
                assert _refusal(refused) == {
                    "called": f"sqlaq.asyncio.{name}",
                    "kind": kind,
                    "other": drive.public_name(name, sync.__module__),
                    "how": "not awaited",
                }, name
        assert not conn.in_transaction()
        assert not session.in_transaction()


def test_the_refusal_is_the_line_the_docs_promise() -> None:
    with pytest.raises(sqlaq.ConfigError) as refused:
        sqlaq.pause(AsyncConnection(_engine()), "q")  # type: ignore[arg-type]
    assert str(refused.value) == (
        "sqlaq.pause() was given an AsyncConnection: use sqlaq.asyncio.pause (awaited)"
    )


def _engine() -> AsyncEngine:
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine("postgresql+psycopg://nobody@localhost:1/none")


def _calls_named(node: ast.AST, attribute: str) -> list[ast.Call]:
    return [
        call
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == attribute
    ]


def test_sqlaq_asyncio_holds_a_driver_and_twins_only() -> None:
    tree = ast.parse((PACKAGE / "asyncio.py").read_text())
    driver = {"_run", "_special", "_copy"}  # the only code that may touch a connection
    plan_made = {name for name, sync in SYNC.items() if sync in drive._PLANS}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in driver:
            assert not _calls_named(node, "execute"), f"{node.name} executes SQL itself"
    for node in tree.body:  # module level: every operation is asynchronous(<the original>)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in plan_made:
                value = node.value
                assert isinstance(value, ast.Call), name
                assert isinstance(value.func, ast.Name)
                assert value.func.id == "asynchronous"
                (arg,) = value.args
                assert isinstance(arg, ast.Attribute | ast.Name)
                assert (arg.attr if isinstance(arg, ast.Attribute) else arg.id).endswith(name)
    for name in aq._LAZY:  # made on first use, by asynchronous too
        assert drive.plan_of(SYNC[name]).__name__ == name
        assert getattr(aq, name).__signature__ == aq.asynchronous(SYNC[name]).__signature__
    for node in tree.body:  # a class here is I/O only: the wait's listener, its LISTEN
        if isinstance(node, ast.ClassDef):
            for call in _calls_named(node, "execute"):
                (statement,) = call.args
                assert isinstance(statement, ast.Call), node.name
                assert isinstance(statement.func, ast.Attribute), node.name
                assert statement.func.attr == "listen_stmt", node.name


def test_the_async_wait_takes_its_steps_from_the_sync_waits_logic() -> None:
    """sqlaq.asyncio.wait and sqlaq.wait both run sqlaq.results.waiting's steps; the
    reads are plans run by each driver, the deadline and the timeout error are there."""
    for module, name in (("asyncio.py", "wait"), ("results.py", "wait")):
        tree = ast.parse((PACKAGE / module).read_text())
        (waiter,) = [
            n
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ]
        called = {
            c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(waiter)
            if isinstance(c, ast.Call)
        }
        assert "waiting" in called, module
        assert {"_run", "run"} & called, module  # the plans, through the driver
        assert "execute" not in called, module
        assert "WaitTimeoutError" not in called, module
    sync, twin = inspect.signature(sqlaq.wait), inspect.signature(aq.wait)
    assert list(sync.parameters)[1:] == list(twin.parameters)[1:]
    assert inspect.iscoroutinefunction(aq.wait)


def test_operations_never_touch_a_connection_themselves() -> None:
    modules = [
        *sorted((PACKAGE / "ops").glob("*.py")),
        *(PACKAGE / name for name in ("periodic.py", "explain.py", "control.py")),
    ]
    assert len(modules) > 2, "sqlaq/ops/ holds the operations' modules"
    for path in modules:
        module = path.name
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                assert "conn" not in names, f"{module}: {node.name} takes a connection"
        assert not _calls_named(tree, "execute"), module


def test_the_sync_driver_takes_a_session_and_a_connection(engine: Engine) -> None:
    with Session(engine) as session:
        assert not sqlaq.enqueue(session, "k").duplicate
        session.rollback()
    with engine.connect() as conn:
        assert isinstance(conn, Connection)
        assert sqlaq.complete(conn, []) == []


# -- workflows -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_workflow_shapes_run_in_order_and_the_callback_reads_results(
    aconn: AsyncExecutor,
) -> None:
    worker = uuid.uuid4()

    async def run_due() -> list[int]:
        jobs = await aq.claim(aconn, worker_id=worker, limit=50, lease=LEASE)
        for job in jobs:
            await aq.complete_with_result(aconn, job.lease, str(job.id))
        return sorted(j.id for j in jobs)

    a, b = (await aq.chain(aconn, [NewJob("a"), NewJob("b")])).job_ids
    fan = await aq.group(aconn, [NewJob("g"), NewJob("g")], after=[b])
    chord = await aq.chord(aconn, [NewJob("m")], then=NewJob("sum"), after=[b])
    done = await aq.batch(aconn, [NewJob("m")], on_complete=NewJob("cb"), after=[b])
    waiting = await aq.enqueue(aconn, "late", after=[chord.callback_id], on_parent_failure="run")
    assert await run_due() == [a]
    assert await run_due() == [b]
    assert await run_due() == sorted([*fan.job_ids, *chord.job_ids, *done.job_ids])
    assert await run_due() == sorted([chord.callback_id, done.callback_id])
    assert await run_due() == [waiting.job_id]
    assert chord.callback_id is not None
    parents = await aq.parent_results(aconn, chord.callback_id)
    assert [(p.job_id, p.status, p.result) for p in parents] == [
        (chord.job_ids[0], "done", chord.job_ids[0])
    ]
    assert await aq.release_waiting(aconn) == []


@pytest.mark.asyncio
async def test_a_workflow_is_read_and_cancelled_whole_from_any_job(aconn: AsyncExecutor) -> None:
    chord = await aq.chord(aconn, [NewJob("m"), NewJob("m")], then=NewJob("sum"))
    assert chord.callback_id is not None
    flow = await aq.read_workflow(aconn, chord.job_ids[0])
    assert [j.job_id for j in flow.jobs] == [*chord.job_ids, chord.callback_id]
    cancelled = await aq.cancel_workflow(aconn, chord.job_ids[1])
    assert sorted(cancelled) == [*chord.job_ids, chord.callback_id]
