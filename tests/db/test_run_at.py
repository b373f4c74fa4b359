"""Absolute times: enqueue(..., run_at=aware datetime), in enqueue, enqueue_many, the
async twin and the operator command; naive datetimes refused."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from uuid import uuid4

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import create_async_engine

import sqlaq
from sqlaq import NewJob


def run_at_of(conn: Connection, job_id: int) -> datetime:
    return conn.execute(
        text("SELECT run_at FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
    ).scalar_one()


def test_enqueue_at_an_absolute_time(conn: Connection) -> None:
    at = datetime(2031, 5, 4, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    job_id = sqlaq.enqueue(conn, "later", run_at=at).job_id
    assert run_at_of(conn, job_id) == at
    past = datetime(2001, 1, 1, tzinfo=UTC)
    due = sqlaq.enqueue(conn, "now", run_at=past).job_id
    assert run_at_of(conn, due) == past  # in the past: due at once
    (claimed,) = sqlaq.claim(conn, worker_id=uuid4())
    assert claimed.id == due


def test_enqueue_many_mixes_run_at_and_delay(conn: Connection) -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    results = sqlaq.enqueue_many(
        conn,
        [NewJob("a", run_at=at), NewJob("b", delay=timedelta(hours=1)), NewJob("c")],
    )
    first, second, third = (run_at_of(conn, r.job_id) for r in results)
    now = conn.execute(text("SELECT now()")).scalar_one()
    assert (first, second - now, third - now) == (at, timedelta(hours=1), timedelta(0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"run_at": datetime(2030, 1, 1)}, "run_at must be an aware datetime"),
        ({"run_at": "2030-01-01"}, "run_at must be a datetime"),
        ({"run_at": datetime(9950, 1, 1, tzinfo=UTC)}, "run_at must be no later than"),
        (
            {"run_at": datetime(2030, 1, 1, tzinfo=UTC), "delay": timedelta(1)},
            "pass delay or run_at, not both",
        ),
    ],
)
def test_bad_run_at_is_refused_before_any_sql(
    conn: Connection, options: dict[str, object], message: str
) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match=message):
        sqlaq.enqueue(conn, "k", **options)  # type: ignore[arg-type]
    with pytest.raises(sqlaq.InvalidJobError, match=message):
        NewJob("k", **options)  # type: ignore[arg-type]
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


@pytest.mark.parametrize("driver", ["postgresql+psycopg_async", "postgresql+asyncpg"])
def test_the_async_twin_takes_run_at(committed: Engine, driver: str) -> None:
    from sqlaq.asyncio import enqueue, enqueue_many

    at = datetime(2032, 2, 2, tzinfo=UTC)

    async def go() -> list[int]:
        engine = create_async_engine(committed.url.set(drivername=driver))
        try:
            async with engine.begin() as conn:
                one = await enqueue(conn, "a", run_at=at)
                many = await enqueue_many(conn, [NewJob("b", run_at=at)])
                return [one.job_id, many[0].job_id]
        finally:
            await engine.dispose()

    ids = asyncio.run(go())
    with committed.connect() as conn:
        assert [run_at_of(conn, i) for i in ids] == [at, at]


def test_the_operator_command_takes_run_at(
    committed: Engine, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cmdkit import one_line_error, sqlaq_cmd

    code, out = sqlaq_cmd(database_url, "enqueue", "k", "--run-at", "2030-01-01T09:00+02:00")
    assert code == 0, out
    job_id = int(out.split()[1])
    with committed.connect() as conn:
        assert run_at_of(conn, job_id) == datetime(2030, 1, 1, 7, 0, tzinfo=UTC)
    for bad, message in [
        ("2030-01-01T09:00", "has no time zone"),
        ("soon", "is not an ISO 8601 time"),
    ]:
        code, _ = sqlaq_cmd(database_url, "enqueue", "k", "--run-at", bad)
        assert code == 2
        assert message in one_line_error(capsys)
