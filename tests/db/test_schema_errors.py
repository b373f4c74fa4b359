"""On a database without sqlaq's schema (or with a table of it behind this sqlaq), every
operation, sync or awaited, raises SchemaOutOfDateError naming the fix, not the driver's
UndefinedTable; any other database error passes through as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
from conftest import new_database
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import NewJob, SchemaOutOfDateError, drive
from sqlaq.testing import enqueued_jobs, travel

FIX = "run 'alembic upgrade heads'"


@pytest.fixture(scope="module")
def bare_url(server_url: str) -> Iterator[str]:
    """A database of this module's own, without sqlaq's schema, dropped at the end."""
    with new_database(server_url, "sqlaq_noschema") as url:
        yield url


@pytest.fixture(scope="module")
def bare(bare_url: str) -> Iterator[Engine]:
    engine = create_engine(bare_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def bare_conn(bare: Engine) -> Iterator[Connection]:
    with bare.connect() as conn:
        conn.begin()
        try:
            yield conn
        finally:
            conn.rollback()


@pytest_asyncio.fixture(params=["psycopg", "asyncpg"])
async def bare_async(request: pytest.FixtureRequest, bare_url: str) -> AsyncIterator[AsyncEngine]:
    url = make_url(bare_url).set(drivername=f"postgresql+{request.param}")
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


WORKER = uuid.uuid4()
#: One call of each kind of operation: an INSERT, a COPY, a claim, the operators' and
#: the readers', and the test helpers'.
CALLS: dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = {
    "enqueue": (sqlaq.enqueue, ("k",), {}),
    "enqueue_many": (sqlaq.enqueue_many, ([NewJob("k"), NewJob("k")],), {}),
    "enqueue_copy": (sqlaq.enqueue_copy, ([NewJob("k")],), {}),
    "claim": (sqlaq.claim, (), {"worker_id": WORKER}),
    "pause": (sqlaq.pause, ("q",), {}),
    "list_workers": (sqlaq.list_workers, (), {}),
    "explain": (sqlaq.explain, (1,), {}),
    "result": (sqlaq.result, (1,), {}),
    "travel": (travel, (timedelta(hours=1),), {}),
    "enqueued_jobs": (enqueued_jobs, (), {}),
}


def _assert_names_the_fix(error: pytest.ExceptionInfo[SchemaOutOfDateError]) -> None:
    message = str(error.value)
    assert FIX in message, message
    assert "sqlaq_" in message, message  # what is missing
    assert "\n" not in message
    cause = error.value.__cause__  # the driver's error, kept
    assert getattr(getattr(cause, "orig", cause), "sqlstate", None) in ("42P01", "42703")


@pytest.mark.parametrize("name", CALLS)
def test_every_sync_operation_names_the_fix(bare_conn: Connection, name: str) -> None:
    function, args, kwargs = CALLS[name]
    with pytest.raises(SchemaOutOfDateError) as error:
        function(bare_conn, *args, **kwargs)
    _assert_names_the_fix(error)


def test_on_a_session_too(bare: Engine) -> None:
    from sqlalchemy.orm import Session

    with Session(bare) as session, pytest.raises(SchemaOutOfDateError, match=FIX):
        sqlaq.enqueue(session, "k")


def test_wait_names_the_fix(bare: Engine) -> None:
    with pytest.raises(SchemaOutOfDateError, match=FIX):
        sqlaq.wait(bare, 1, timeout=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", CALLS)
async def test_every_async_operation_names_the_fix(bare_async: AsyncEngine, name: str) -> None:
    twin = getattr(aq, name)
    _, args, kwargs = CALLS[name]
    async with bare_async.connect() as conn:
        await conn.begin()
        with pytest.raises(SchemaOutOfDateError) as error:
            await twin(conn, *args, **kwargs)
        _assert_names_the_fix(error)
        await conn.rollback()


@pytest.mark.asyncio
async def test_the_async_wait_names_the_fix(bare_async: AsyncEngine) -> None:
    with pytest.raises(SchemaOutOfDateError, match=FIX):
        await aq.wait(bare_async, 1, timeout=0)


def test_a_table_behind_this_sqlaq_names_the_fix_too(bare_conn: Connection) -> None:
    # An sqlaq_jobs of an older sqlaq (here: a bare one): its columns are missing.
    bare_conn.execute(text("CREATE TABLE sqlaq_jobs (id bigserial PRIMARY KEY)"))
    with pytest.raises(SchemaOutOfDateError, match=rf'column "\w+" .*sqlaq_jobs.*{FIX}'):
        sqlaq.enqueue(bare_conn, "k")


@drive.operation
def _select(sql: str) -> drive.Plan[Any]:
    """A plan of the test's own: one statement."""
    return (yield text(sql), None).all()


NOT_SQLAQS = {
    "another table": "SELECT * FROM host_orders",
    "another table's column": "SELECT nope FROM pg_class",
    "another error": "SELECT 1/0",
}


@pytest.mark.parametrize("sql", NOT_SQLAQS.values(), ids=NOT_SQLAQS)
def test_any_other_error_passes_through(bare_conn: Connection, sql: str) -> None:
    with pytest.raises(DBAPIError) as error:
        _select(bare_conn, sql)
    assert not isinstance(error.value, SchemaOutOfDateError)


@pytest.mark.asyncio
async def test_any_other_error_passes_through_the_async_driver(bare_async: AsyncEngine) -> None:
    select = aq.asynchronous(_select)
    async with bare_async.connect() as conn:
        with pytest.raises(ProgrammingError, match="host_orders"):
            await select(conn, NOT_SQLAQS["another table"])
        await conn.rollback()
