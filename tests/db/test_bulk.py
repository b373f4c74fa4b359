"""Bulk enqueue with COPY (``sqlaq.enqueue_copy``), against a real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import sqlaq
from sqlaq import InvalidJobError, NewJob, queries
from sqlaq.schema import CHANNEL

pytestmark = pytest.mark.timeout(60)


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT queue, kind, payload, priority, max_attempts, status, attempts,"
                    " dedupe_key, run_at <= now() AS due, created_at = run_at AS same_clock"
                    " FROM sqlaq_jobs ORDER BY id"
                )
            ).all()
        )


def _listener(engine: Engine) -> psycopg.Connection[Any]:
    url = make_url(engine.url).set(drivername="postgresql")
    conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
    conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(CHANNEL)))
    return conn


def test_enqueue_copy_writes_every_job_with_its_fields(committed: Engine) -> None:
    jobs = [
        NewJob("copy", {"n": n, "tags": ["a", "é"], "nested": {"ok": True}}, priority=n % 3)
        for n in range(500)
    ]
    jobs.append(NewJob("other", queue="emails", max_attempts=2))
    with committed.begin() as conn:
        assert sqlaq.enqueue_copy(conn, jobs) == 501
    rows = _rows(committed)
    assert len(rows) == 501
    for n, row in enumerate(rows[:500]):
        assert (row.queue, row.kind, row.payload) == (
            "default",
            "copy",
            {"n": n, "tags": ["a", "é"], "nested": {"ok": True}},
        )
        assert (row.priority, row.max_attempts, row.status, row.attempts) == (n % 3, 5, "queued", 0)
        assert row.dedupe_key is None
        assert row.due  # run_at is the database's now(), the same as created_at
        assert row.same_clock
    assert tuple(rows[500])[:7] == ("emails", "other", {}, 0, 2, "queued", 0)


def test_copied_jobs_are_claimed_in_priority_order(committed: Engine) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue_copy(conn, [NewJob("copy", {"p": p}, priority=p) for p in (0, 5, 1)])
    with committed.begin() as conn:
        claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=3)
    assert [job.payload for job in claimed] == [{"p": 5}, {"p": 1}, {"p": 0}]


def test_enqueue_copy_notifies_once_per_queue_on_commit_only(committed: Engine) -> None:
    listener = _listener(committed)
    try:
        with committed.begin() as conn:
            sqlaq.enqueue_copy(
                conn, [NewJob("copy") for _ in range(100)] + [NewJob("copy", queue="q2")]
            )
            # Not committed yet: nothing may be heard.
            assert list(listener.notifies(timeout=0.2)) == []
        heard = sorted(n.payload for n in listener.notifies(timeout=2.0, stop_after=2))
        # '<queue> <priority> <run_at in microseconds>': the queue first (sqlaq_0008).
        assert [payload.rsplit(" ", 2)[0] for payload in heard] == ["default", "q2"]
        with committed.connect() as conn:
            sqlaq.enqueue_copy(conn, [NewJob("copy")])
            conn.rollback()
        assert list(listener.notifies(timeout=0.3)) == []
    finally:
        listener.close()


def test_enqueue_copy_rolls_back_with_the_callers_transaction(committed: Engine) -> None:
    with committed.connect() as conn:
        assert not conn.in_transaction()
        sqlaq.enqueue_copy(conn, [NewJob("copy"), NewJob("copy")])
        assert conn.in_transaction()  # begun as any operation would: the caller decides
        conn.rollback()
    assert _rows(committed) == []


def test_enqueue_copy_works_on_a_session(committed: Engine) -> None:
    with Session(committed) as session:
        session.execute(text("SELECT 1"))
        assert sqlaq.enqueue_copy(session, [NewJob("copy", {"via": "session"})]) == 1
        session.commit()
    assert [row.payload for row in _rows(committed)] == [{"via": "session"}]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (NewJob("copy", dedupe_key="k"), "has a dedupe_key; COPY cannot skip duplicates"),
        (
            NewJob("copy", delay=timedelta(seconds=5)),
            "has a delay or run_at; COPY writes run_at = now()",
        ),
        ({"kind": "copy"}, "jobs\\[1\\] must be a sqlaq.NewJob, got dict"),
    ],
)
def test_enqueue_copy_rejects_bad_input_and_writes_nothing(
    committed: Engine, bad: Any, message: str
) -> None:
    with committed.begin() as conn:
        with pytest.raises(InvalidJobError, match=message):
            sqlaq.enqueue_copy(conn, [NewJob("copy"), bad, NewJob("copy")])
        # Raised before any SQL: the caller's transaction is still usable.
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0
    assert _rows(committed) == []


def test_enqueue_copy_of_nothing_writes_nothing(conn: Connection) -> None:
    assert sqlaq.enqueue_copy(conn, []) == 0
    assert sqlaq.enqueue_copy(conn, iter([])) == 0


def test_enqueue_copy_statement_names_the_loaded_columns() -> None:
    rendered = queries.enqueue_copy_stmt().as_string(None)
    assert rendered == (
        'COPY "sqlaq_jobs" ("queue", "kind", "payload", "priority", "max_attempts", "key") '
        "FROM STDIN"
    )
