"""sqlaq.testing from async tests: drain_async on an AsyncConnection or AsyncSession,
inside the test's transaction, on both async drivers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import sqlaq
from sqlaq.testing import drain, drain_async

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
