"""The payload limit: a payload of more than the process's limit (1 MiB of JSON by
default) is refused at enqueue with one line, on every path (sync and async, one job
and a batch, the ORM's Job, the ``sqlaq enqueue`` command), and nothing is written."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import DEFAULT_MAX_PAYLOAD_BYTES, ConfigError, InvalidJobError, NewJob, admin, cli
from sqlaq.bounds import max_payload_bytes
from tests.helpers import count_jobs

#: ``{"x":"`` and ``"}``: what a payload of one string field adds to the string.
FRAME = len('{"x":""}')
LIMIT_MESSAGE = r"payload is {size:,} bytes of JSON; the limit is {limit:,}: store large data"


def sized(size: int, char: str = "a") -> dict[str, Any]:
    """A payload whose compact JSON is *size* bytes (*char*: one to four bytes)."""
    width = len(char.encode())
    assert (size - FRAME) % width == 0
    return {"x": char * ((size - FRAME) // width)}


def refused(size: int, limit: int = DEFAULT_MAX_PAYLOAD_BYTES) -> str:
    return LIMIT_MESSAGE.format(size=size, limit=limit)


@pytest.fixture(autouse=True)
def default_limit() -> Iterator[None]:
    """Each test starts and ends with the default limit."""
    sqlaq.set_max_payload_bytes(None)
    yield
    sqlaq.set_max_payload_bytes(None)


def test_the_default_limit_is_one_mib_of_json_in_utf8_bytes(conn: Connection) -> None:
    assert DEFAULT_MAX_PAYLOAD_BYTES == max_payload_bytes() == 1024 * 1024
    at_limit = sqlaq.enqueue(conn, "big", sized(DEFAULT_MAX_PAYLOAD_BYTES))
    assert at_limit.inserted
    with pytest.raises(InvalidJobError, match=refused(DEFAULT_MAX_PAYLOAD_BYTES + 1)):
        sqlaq.enqueue(conn, "big", sized(DEFAULT_MAX_PAYLOAD_BYTES + 1))
    # Bytes, not characters: 2-byte "é" and 4-byte emoji count as such.
    with pytest.raises(InvalidJobError, match=refused(DEFAULT_MAX_PAYLOAD_BYTES + 2)):
        sqlaq.enqueue(conn, "big", sized(DEFAULT_MAX_PAYLOAD_BYTES + 2, "é"))
    with pytest.raises(InvalidJobError, match=r"payload is [\d,]+ bytes of JSON"):
        NewJob("big", {"x": "\U0001f600" * (DEFAULT_MAX_PAYLOAD_BYTES // 4)})
    assert count_jobs(conn) == 1


def test_a_20_mb_payload_is_one_line_and_nothing_is_written(conn: Connection) -> None:
    with pytest.raises(InvalidJobError) as caught:
        sqlaq.enqueue(
            conn,
            "huge",
            {"blob": "x" * 20_000_000},
            debounce_key="k",
            debounce=timedelta(seconds=5),
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("payload is 20,000,011 bytes of JSON; the limit is 1,048,576")
    assert "sqlaq.set_max_payload_bytes()" in message
    assert count_jobs(conn) == 0


def test_batches_name_the_payload_over_the_limit_and_write_nothing(conn: Connection) -> None:
    sqlaq.set_max_payload_bytes(100)
    small, big = sized(100), sized(101)
    with pytest.raises(
        InvalidJobError, match=r"^payloads\[2\] is 101 bytes of JSON; the limit is 100"
    ):
        NewJob("b").with_payloads([small, small, big])
    with pytest.raises(InvalidJobError, match=refused(101, 100)):
        sqlaq.enqueue_many(conn, [NewJob("b", small), NewJob("b", big)])
    assert count_jobs(conn) == 0
    # The limit is per payload: a batch may hold more than the limit in all.
    results = sqlaq.enqueue_many(conn, NewJob("b").with_payloads([small] * 5))
    assert len(results) == 5
    assert count_jobs(conn) == 5


@pytest.mark.asyncio
async def test_async_enqueue_refuses_the_same(async_engine: AsyncEngine) -> None:
    sqlaq.set_max_payload_bytes(100)
    async with async_engine.begin() as aconn:
        with pytest.raises(InvalidJobError, match=refused(101, 100)):
            await aq.enqueue(aconn, "a", sized(101))
        with pytest.raises(InvalidJobError, match=r"payloads\[0\] is 101 bytes"):
            await aq.enqueue_many(aconn, NewJob("a").with_payloads([sized(101)]))
        assert await aq.enqueue(aconn, "a", sized(100))
        count = (await aconn.execute(text("SELECT count(*) FROM sqlaq_jobs"))).scalar_one()
    assert count == 1


def test_the_orm_job_refuses_it_before_the_flush(committed: Engine) -> None:
    sqlaq.set_max_payload_bytes(100)
    with Session(committed) as session:
        with pytest.raises(InvalidJobError, match=refused(101, 100)):
            session.add(sqlaq.Job(kind="orm", payload=sized(101)))
        job = sqlaq.Job(kind="orm", payload=sized(100))
        with pytest.raises(InvalidJobError, match=refused(101, 100)):
            job.payload = sized(101)
        session.add(job)
        session.commit()
    with committed.connect() as conn:
        assert count_jobs(conn) == 1


def test_the_limit_is_set_once_per_process_and_checked(conn: Connection) -> None:
    sqlaq.set_max_payload_bytes(2)
    assert sqlaq.enqueue(conn, "tiny", {}).inserted
    with pytest.raises(InvalidJobError, match=refused(7, 2)):
        sqlaq.enqueue(conn, "tiny", {"a": 1})
    sqlaq.set_max_payload_bytes(30 * 1024 * 1024)
    assert sqlaq.enqueue(conn, "large", sized(20 * 1024 * 1024)).inserted
    sqlaq.set_max_payload_bytes(None)
    assert max_payload_bytes() == DEFAULT_MAX_PAYLOAD_BYTES
    for bad, message in (
        (1, "from 2 to 267,386,880 bytes"),
        (256 * 1024 * 1024, "got 268,435,456"),
        (True, "must be an int"),
        ("1MB", "must be an int"),
    ):
        with pytest.raises(ConfigError, match=message):
            sqlaq.set_max_payload_bytes(bad)  # type: ignore[arg-type]
    assert max_payload_bytes() == DEFAULT_MAX_PAYLOAD_BYTES


def test_the_enqueue_command_is_one_line_exit_2(
    database_url: str, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = json.dumps(sized(101), separators=(",", ":"))
    env = {"SQLAQ_MAX_PAYLOAD_BYTES": "100"}
    argv = ["enqueue", "--database-url", database_url, "cli-big", "--payload", payload]
    assert admin.run(argv, env, out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("sqlaq: payload is 101 bytes of JSON; the limit is 100: ")
    for bad in ("1", "lots"):
        assert admin.run(argv, {"SQLAQ_MAX_PAYLOAD_BYTES": bad}, out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("sqlaq: SQLAQ_MAX_PAYLOAD_BYTES"), err
    with engine.connect() as conn:
        assert count_jobs(conn, "kind = 'cli-big'") == 0


def test_the_worker_command_takes_the_limit_from_its_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.run_worker(["no_such_module:registry"], {"SQLAQ_MAX_PAYLOAD_BYTES": "0"}) == 2
    assert capsys.readouterr().err == (
        "sqlaq-worker: error: SQLAQ_MAX_PAYLOAD_BYTES must be between 2 and 267386880, got 0\n"
    )
    env = {"SQLAQ_MAX_PAYLOAD_BYTES": "4096", "SQLAQ_DATABASE_URL": "postgresql://u@h/d"}
    assert cli.run_worker(["no_such_module:registry"], env) == 2  # the app does not load
    assert max_payload_bytes() == 4096
