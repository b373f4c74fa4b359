"""Debounce, unique_for and the per-job timeout through :mod:`sqlaq.asyncio`, on both
async drivers (the same plans as the sync API: the arguments flow through)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import EnqueueOutcome

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

HOUR = timedelta(hours=1)


@pytest_asyncio.fixture
async def aconn(async_engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """An AsyncConnection per driver, in a transaction rolled back after the test."""
    async with async_engine.connect() as conn:
        await conn.begin()
        try:
            yield conn
        finally:
            await conn.rollback()


async def _scalar(conn: AsyncConnection, sql: str) -> Any:
    return (await conn.execute(text(sql))).scalar_one()


async def test_debounce_unique_for_and_timeout(aconn: AsyncConnection) -> None:
    first = await aq.enqueue(aconn, "digest", {"n": 1}, debounce_key="k", debounce=HOUR)
    again = await aq.enqueue(
        aconn, "digest", {"n": 2}, debounce_key="k", debounce=HOUR, max_wait=2 * HOUR
    )
    assert again == sqlaq.EnqueueResult(first.job_id, outcome=EnqueueOutcome.DEBOUNCED)
    assert await _scalar(aconn, "SELECT payload FROM sqlaq_jobs") == {"n": 2}

    held = await aq.enqueue(aconn, "report", dedupe_key="d", unique_for=HOUR, timeout=HOUR)
    assert held.inserted
    second = await aq.enqueue(aconn, "report", dedupe_key="d", unique_for=HOUR)
    assert second == sqlaq.EnqueueResult(held.job_id, outcome=EnqueueOutcome.HELD)
    assert await _scalar(aconn, "SELECT 1") == 1  # the transaction is still usable

    await aconn.execute(text("UPDATE sqlaq_jobs SET run_at = now()"))
    claimed = await aq.claim(aconn, worker_id=uuid.uuid4(), limit=5)
    assert {j.kind: j.timeout for j in claimed} == {"digest": None, "report": HOUR}
