"""``sqlaq.wait`` and ``sqlaq.asyncio.wait`` when the database refuses connections for a
while ("too many connections for role"): each read is retried, not raised."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool
from workerkit import wait_until

import sqlaq
import sqlaq.asyncio as aq

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_connection_role(committed: Engine, database_url: str) -> Iterator[str]:
    """The URL of a role that may hold one connection at a time; dropped after."""
    role = f"sqlaq_one_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex  # servers with password authentication (nox -s matrix)
    with committed.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1 PASSWORD '{password}'"))
        conn.execute(text(f"GRANT SELECT, UPDATE ON sqlaq_jobs TO {role}"))
    try:
        url = make_url(database_url).set(username=role, password=password)
        yield url.render_as_string(hide_password=False)
    finally:
        with committed.begin() as conn:
            conn.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              f"WHERE usename = '{role}'"))  # fmt: skip
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


def finished_job(engine: Engine) -> int:
    with engine.begin() as conn:
        job_id = sqlaq.enqueue(conn, "noop").job_id
        conn.execute(
            text("UPDATE sqlaq_jobs SET status = 'done', finished_at = now() WHERE id = :id"),
            {"id": job_id},
        )
    return job_id


def test_wait_retries_a_read_refused_for_too_many_connections(
    committed: Engine, one_connection_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = finished_job(committed)
    engine = create_engine(one_connection_role, poolclass=NullPool)
    got: list[Any] = []
    with caplog.at_level(logging.WARNING, "sqlaq"):
        holder = engine.connect()  # the role's only connection
        try:
            thread = threading.Thread(
                target=lambda: got.append(sqlaq.wait(engine, job_id, timeout=30))
            )
            thread.start()
            wait_until(lambda: "reading again" in caplog.text, 20, "a retried read")
        finally:
            holder.close()
        thread.join(30)
    engine.dispose()
    assert got
    assert got[0].status == sqlaq.JobStatus.DONE
    assert "too many connections for role" in caplog.text


def test_async_wait_retries_a_read_refused_for_too_many_connections(
    committed: Engine, one_connection_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = finished_job(committed)
    sync = create_engine(one_connection_role, poolclass=NullPool)
    url = make_url(one_connection_role).set(drivername="postgresql+asyncpg")

    async def app() -> Any:
        engine = create_async_engine(url, poolclass=NullPool)
        holder = sync.connect()
        try:
            task = asyncio.create_task(aq.wait(engine, job_id, timeout=30))
            await asyncio.to_thread(
                wait_until, lambda: "reading again" in caplog.text, 20, "a retried read"
            )
        finally:
            holder.close()
        try:
            return await task
        finally:
            await engine.dispose()

    with caplog.at_level(logging.WARNING, "sqlaq"):
        outcome = asyncio.run(app())
    sync.dispose()
    assert outcome.status == sqlaq.JobStatus.DONE
