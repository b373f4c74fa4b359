"""Transactional handlers: the handler's writes commit with the job's completion, or
not at all, against a real PostgreSQL."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import uuid4

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.orm import Session
from worker_app import EFFECTS
from workerkit import (
    FAST,
    START_TIMEOUT,
    Recorder,
    enqueue,
    fast_worker,
    job,
    ledger_runs,
    ledger_table,
    rows,
    running,
    scalar,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq.testing import drain

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def effects(committed: Engine) -> Iterator[Engine]:
    """The host's table the handlers write to, dropped after the test."""
    with committed.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {EFFECTS}"))
        conn.execute(
            text(
                f"CREATE TABLE {EFFECTS} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                "job_id bigint NOT NULL, attempt int NOT NULL DEFAULT 0, note text)"
            )
        )
    try:
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {EFFECTS}"))


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    yield from ledger_table(committed)


def effect_rows(engine: Engine) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in rows(engine, f"SELECT job_id, note FROM {EFFECTS} ORDER BY id")]


def write_effect(session: Session, note: str) -> None:
    session.execute(
        text(f"INSERT INTO {EFFECTS} (job_id, note) VALUES (:id, :note)"),
        {"id": sqlaq.current_job().id, "note": note},
    )


def test_the_handlers_write_and_the_jobs_done_commit_together(effects: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    seen: list[Any] = []

    @registry.handler("charge")
    def charge(payload: dict[str, Any], session: Session) -> None:
        seen.append(sqlaq.current_job().session is session)
        write_effect(session, "charged")
        sqlaq.enqueue(session, "receipt", {"for": payload["order"]})  # commits with it

    registry.handler("receipt")(lambda payload: None)
    job_id = enqueue(effects, "charge", {"order": 7})
    with running(fast_worker(effects, registry, recorder)):
        recorder.wait_for(2)
    assert seen == [True]
    assert job(effects, job_id).status == "done"
    assert effect_rows(effects) == [(job_id, "charged")]
    assert scalar(effects, "SELECT count(*) FROM sqlaq_jobs WHERE kind = 'receipt'") == 1


def test_a_raising_handler_leaves_no_write_and_is_retried(effects: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("flaky", wait=sqlaq.Backoff(base=timedelta(milliseconds=10)))
    def flaky(payload: dict[str, Any], session: Session) -> None:
        write_effect(session, f"attempt {sqlaq.current_job().attempt}")
        if sqlaq.current_job().attempt == 1:
            raise OSError("card declined")

    job_id = enqueue(effects, "flaky")
    with running(fast_worker(effects, registry, recorder)):
        first, second = recorder.wait_for(2)
    assert (first.status, second.status) == (sqlaq.JobStatus.QUEUED, sqlaq.JobStatus.DONE)
    assert "card declined" in (first.error or "")
    assert effect_rows(effects) == [(job_id, "attempt 2")]


def _steal(engine: Engine, job_id: int) -> sqlaq.ClaimedJob:
    """Expire the job's lease and claim it as another worker would."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 s' WHERE id = :id"),
            {"id": job_id},
        )
        (claimed,) = sqlaq.claim(conn, worker_id=uuid4())
    return claimed


@pytest.mark.parametrize("fate", ["claimed elsewhere", "cancelled"])
def test_a_stale_holder_commits_nothing(effects: Engine, fate: str) -> None:
    """The handler finishes after its lease was lost: its write rolls back with the
    completion that matched no row; what the new holder (or the cancel) wrote stays."""
    registry = sqlaq.Registry()
    recorder = Recorder()
    entered, release = threading.Event(), threading.Event()

    @registry.handler("slow")
    def slow(payload: dict[str, Any], session: Session) -> None:
        write_effect(session, "stale holder")
        entered.set()
        assert release.wait(20)

    job_id = enqueue(effects, "slow")
    with running(fast_worker(effects, registry, recorder)):
        assert entered.wait(20)
        if fate == "cancelled":
            with effects.begin() as conn:
                assert sqlaq.cancel(conn, job_id) == [job_id]
        else:
            claimed = _steal(effects, job_id)
            with effects.begin() as conn:
                conn.execute(
                    text(f"INSERT INTO {EFFECTS} (job_id, note) VALUES (:id, 'new holder')"),
                    {"id": job_id},
                )
                sqlaq.complete(conn, claimed.lease)
        release.set()
        (result,) = recorder.wait_for(1)
    assert result.status is None
    expected = "cancelled" if fate == "cancelled" else "done"
    assert job(effects, job_id).status == expected
    new = [(job_id, "new holder")] if fate != "cancelled" else []
    assert effect_rows(effects) == new


def test_the_pool_must_hold_a_connection_per_transactional_handler(database_url: str) -> None:
    registry = sqlaq.Registry()
    registry.handler("t")(lambda payload, session: None)
    # The worker's own parts: claims 2, writer 1, maintenance 2, vacuum 1.
    small = create_engine(database_url, pool_size=7, max_overflow=0)
    try:
        with pytest.raises(
            sqlaq.ConfigError,
            match=r"holds at most 7 connections.* need 16 at once \(claims 2, writer 1, "
            r"maintenance 2, vacuum 1, transactional handlers 10\)",
        ):
            sqlaq.Worker(small, registry, concurrency=10)
        sqlaq.Worker(small, registry, concurrency=1)  # 1 + 6 fit
        fitted = sqlaq.Worker(small, registry)  # the default is lowered to fit the pool
        assert fitted.config.concurrency == 1
        plain = sqlaq.Registry()
        plain.handler("p")(lambda payload: None)
        sqlaq.Worker(small, plain, concurrency=10)  # plain handlers: the parts alone
    finally:
        small.dispose()


def test_a_pool_too_small_for_the_workers_own_parts_is_refused(database_url: str) -> None:
    plain = sqlaq.Registry()
    plain.handler("p")(lambda payload: None)
    small = create_engine(database_url, pool_size=3, max_overflow=0)
    try:
        with pytest.raises(
            sqlaq.ConfigError,
            match=r"holds at most 3 connections.* need 6 at once \(claims 2, writer 1, "
            r"maintenance 2, vacuum 1\)",
        ):
            sqlaq.Worker(small, plain, concurrency=1)
        # Without maintenance's lock (burst) and vacuum: claims and writer alone.
        sqlaq.Worker(small, plain, concurrency=1, burst=True, vacuum=False)
    finally:
        small.dispose()


def test_registry_options_of_transactional_handlers() -> None:
    registry = sqlaq.Registry()
    detected = registry.add("a", lambda payload, session: None)
    assert (detected.transaction, detected.takes_session) == (True, True)
    explicit = registry.add("b", lambda payload: None, transaction=True)
    assert (explicit.transaction, explicit.takes_session) == (True, False)
    plain = registry.add("c", lambda payload: None)
    assert plain.transaction is False
    with pytest.raises(sqlaq.ConfigError, match="takes a session parameter but transaction"):
        registry.add("d", lambda payload, session: None, transaction=False)


@pytest.mark.timeout(180)
def test_sigkill_between_the_write_and_the_commit_leaves_neither(
    effects: Engine, ledger: Engine, database_url: str
) -> None:
    """A real worker writes the effect, then is killed before its commit: the write is
    gone with it; the job runs again elsewhere, and the effect exists exactly once."""
    with worker_processes(database_url) as start:
        doomed = start("--lease", "2", *FAST)
        job_id = enqueue(effects, "txn_effect", {"seconds": 60})
        # The write is the process's first sign of life, after its start-up (imports,
        # connections): neither start-up is what is tested.
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the first attempt's write")
        assert effect_rows(effects) == []  # written, not committed
        doomed.signal(signal.SIGKILL)
        doomed.wait(10)
        wait_started(start("--lease", "2", *FAST))
        wait_until(lambda: job(effects, job_id).status == "done", 30, "the job done again")
    assert [tuple(r) for r in rows(effects, f"SELECT job_id, attempt FROM {EFFECTS}")] == [
        (job_id, 2)
    ]
    assert [r.attempt for r in ledger_runs(ledger, job_id)] == [1, 2]


def test_drain_runs_transactional_handlers_in_the_tests_transaction(effects: Engine) -> None:
    """drain: the test sees the handler's writes, a raising handler leaves none, the
    test holding the same row does not deadlock, and the test's rollback undoes it all."""
    registry = sqlaq.Registry()

    @registry.handler("rename")
    def rename(payload: dict[str, Any], session: Session) -> None:
        session.execute(
            text(f"UPDATE {EFFECTS} SET note = :note WHERE id = :id"),
            {"note": payload["note"], "id": payload["row"]},
        )
        if payload.get("fail"):
            raise sqlaq.PermanentError("refused")

    with effects.connect() as conn:
        _drain_in_a_transaction_then_roll_back(conn, registry)
    assert effect_rows(effects) == []
    assert scalar(effects, "SELECT count(*) FROM sqlaq_jobs") == 0


def _drain_in_a_transaction_then_roll_back(conn: Connection, registry: sqlaq.Registry) -> None:
    # The test holds the row: inserted (and so locked) in its own open transaction.
    row_id = conn.execute(
        text(f"INSERT INTO {EFFECTS} (job_id, note) VALUES (0, 'old') RETURNING id")
    ).scalar_one()
    sqlaq.enqueue(conn, "rename", {"row": row_id, "note": "new"})
    sqlaq.enqueue(conn, "rename", {"row": row_id, "note": "never", "fail": True}, priority=-1)
    results = drain(conn, registry)
    assert [r.status for r in results] == [sqlaq.JobStatus.DONE, sqlaq.JobStatus.FAILED]
    note = conn.execute(text(f"SELECT note FROM {EFFECTS} WHERE id = :id"), {"id": row_id})
    assert note.scalar_one() == "new"
    conn.rollback()


def test_return_values_are_stored_as_results(effects: Engine) -> None:
    """Plain and transactional handlers' return values land in ``result``; a value that
    is not JSON fails the job (no retry) with a clear last_error, and a transactional
    handler's writes roll back with it."""
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("plain")
    def plain(payload: dict[str, Any]) -> Any:
        return {"total": 42, "items": [1, 2]}

    @registry.handler("in_txn")
    def in_txn(payload: dict[str, Any], session: Session) -> Any:
        write_effect(session, "kept")
        return "receipt-7"

    @registry.handler("not_json")
    def not_json(payload: dict[str, Any], session: Session) -> Any:
        write_effect(session, "rolled back")
        return {1, 2}

    ids = [enqueue(effects, kind) for kind in ("plain", "in_txn", "not_json")]
    with running(fast_worker(effects, registry, recorder)):
        recorder.wait_for(3)
    with effects.connect() as conn:
        outcomes = [sqlaq.result(conn, job_id) for job_id in ids]
    assert [o.status for o in outcomes] == ["done", "done", "failed"]
    assert outcomes[0].result == {"total": 42, "items": [1, 2]}
    assert outcomes[1].result == "receipt-7"
    assert outcomes[2].result is None
    assert "return value cannot be stored" in (outcomes[2].error or "")
    assert job(effects, ids[2]).attempts == 1
    assert effect_rows(effects) == [(ids[1], "kept")]


def test_an_async_transactional_handler_commits_with_its_job(effects: Engine) -> None:
    """An ``async def`` handler with a session gets an AsyncSession (on an AsyncEngine
    the worker opens on the same URL), and its write commits with the job's done."""
    registry = sqlaq.Registry()
    recorder = Recorder()
    kinds: list[str] = []

    @registry.handler("async_charge")
    async def async_charge(payload: dict[str, Any], session: Any) -> str:
        kinds.append(type(session).__name__)
        await session.execute(
            text(f"INSERT INTO {EFFECTS} (job_id, note) VALUES (:id, 'async')"),
            {"id": sqlaq.current_job().id},
        )
        return "ok"

    job_id = enqueue(effects, "async_charge")
    with running(fast_worker(effects, registry, recorder)):
        (result,) = recorder.wait_for(1)
    assert result.status is sqlaq.JobStatus.DONE
    assert kinds == ["AsyncSession"]
    assert effect_rows(effects) == [(job_id, "async")]
    with effects.connect() as conn:
        assert sqlaq.result(conn, job_id).result == "ok"


@pytest.mark.timeout(60)
def test_a_session_connection_lost_before_the_handler_costs_no_attempt(
    effects: Engine, database_url: str
) -> None:
    """A pooled connection killed while idle (a server restart, a backend kill) is found
    before the handler runs: the job goes back without using an attempt, and runs on a
    fresh connection."""
    name = f"sqlaq-sessions-{uuid4().hex[:8]}"
    sessions_engine = create_engine(
        database_url, pool_size=4, connect_args={"application_name": name}
    )
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("tx")
    def tx(payload: dict[str, Any], session: Session) -> None:
        write_effect(session, "ran")

    from sqlalchemy.orm import sessionmaker

    worker = fast_worker(
        effects, registry, recorder, concurrency=1, sessionmaker=sessionmaker(sessions_engine)
    )
    try:
        with running(worker):
            first = enqueue(effects, "tx")
            recorder.wait_for(1)
            idle = rows(
                effects,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = :name",
                name=name,
            )
            assert idle  # the session's pooled connection, idle
            wait_until(
                lambda: (
                    not rows(
                        effects,
                        "SELECT 1 FROM pg_stat_activity WHERE application_name = :n",
                        n=name,
                    )
                ),
                10,
                "the backend to go",
            )
            second = enqueue(effects, "tx")
            wait_until(lambda: job(effects, second).status == "done", 20, "the second job")
    finally:
        sessions_engine.dispose()
    assert job(effects, first).attempts == 1
    assert job(effects, second).attempts == 1  # handed back: not charged
    assert [r[1] for r in effect_rows(effects)] == ["ran", "ran"]
