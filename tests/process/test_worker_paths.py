"""The worker's paths between its parts: a sync handler's deadline however its job was
claimed, cancels reaching async handlers, the pool connections each part holds, the
async engine of transactional handlers, and leases found gone at a renewal."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
import test_transactional
from helpers import login_role
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import sessionmaker
from workerkit import (
    START_TIMEOUT,
    Recorder,
    enqueue,
    job,
    ledger_runs,
    running,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq.outcome import Verdict
from sqlaq.worker.leases import Leases
from sqlaq.worker.run import Finished, Run
from sqlaq.worker.runner import Runner

pytestmark = pytest.mark.timeout(90)

ledger = test_transactional.ledger  # the fixtures: the ledger table, the effects table
effects = test_transactional.effects


def _queue() -> str:
    return f"paths-{uuid.uuid4().hex[:8]}"


def _failed_by_timeout(engine: Engine, job_id: int) -> bool:
    row = job(engine, job_id)
    return row.status == "failed" and "JobTimeoutError" in (row.last_error or "")


def test_a_sync_handler_is_written_timed_out_at_its_deadline(committed: Engine) -> None:
    # A poll of a minute and a lease renewed every 40 s: within the 30 s the test waits,
    # only the deadline can wake the worker (a loaded machine still has room). The
    # handler blocks until the test has seen the outcome.
    registry = sqlaq.Registry()
    queue = _queue()
    release: dict[int, threading.Event] = {}

    @registry.handler("sleepy", timeout=timedelta(seconds=1))
    def sleepy(payload: dict[str, Any]) -> None:
        release[payload["n"]].wait(60)  # made before the job is enqueued

    worker = sqlaq.Worker(
        committed,
        registry,
        queues=[queue],
        concurrency=1,
        prefetch=0,
        poll_interval=timedelta(seconds=60),
        lease=timedelta(seconds=120),
    )
    with running(worker):
        for n in range(3):
            release[n] = threading.Event()
            job_id = enqueue(committed, "sleepy", {"n": n}, queue=queue, max_attempts=1)
            try:
                wait_until(
                    lambda job_id=job_id: _failed_by_timeout(committed, job_id),
                    30,
                    "the attempt written timed out at its deadline",
                )
            finally:
                release[n].set()


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
def test_a_sync_handler_returning_past_its_deadline_is_timed_out_not_done(
    committed: Engine, transactional: bool
) -> None:
    # The runner alone: no worker looks at the deadline meanwhile.
    registry = sqlaq.Registry()
    queue = _queue()

    def late(payload: dict[str, Any]) -> None:
        if transactional:
            sqlaq.current_job().session.execute(text("SELECT 1"))
        threading.Event().wait(1.2)  # past its 1 s deadline, then returns

    handler = registry.add("late", late, timeout=timedelta(seconds=1), transaction=transactional)
    job_id = enqueue(committed, "late", queue=queue, max_attempts=1)
    with committed.begin() as conn:
        (claimed,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), queue=queue)
    leases = Leases(committed, [timedelta(seconds=30)])
    run = Run.of(claimed, handler, timedelta(seconds=30), leases.renew_now)
    finished: list[Finished] = []
    reported = threading.Event()

    def on_finished(item: Finished) -> None:
        finished.append(item)
        reported.set()

    runner = Runner(1, on_finished, sessions=sessionmaker(bind=committed))
    try:
        runner.submit([run])
        assert reported.wait(10)
    finally:
        runner.close()
    (result,) = finished
    assert result.outcome.verdict is Verdict.FAILED
    assert "JobTimeoutError: timed out after 1s" in (result.outcome.error or "")
    assert not result.committed
    assert job(committed, job_id).status == "running"  # nothing committed by the handler


def _waits_until_cancelled(registry: sqlaq.Registry) -> tuple[threading.Event, threading.Event]:
    """Register kind "waits": an async handler that sleeps a minute unless its task is
    cancelled. Returns the events it sets: started, and cancelled."""
    started, cancelled = threading.Event(), threading.Event()

    @registry.handler("waits")
    async def waits(payload: dict[str, Any]) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return started, cancelled


def test_cancelling_a_running_async_job_cancels_its_task(committed: Engine) -> None:
    registry = sqlaq.Registry()
    queue = _queue()
    recorder = Recorder()
    started, cancelled = _waits_until_cancelled(registry)

    @registry.handler("after")
    async def after(payload: dict[str, Any]) -> None:
        pass

    job_id = enqueue(committed, "waits", queue=queue)
    worker = sqlaq.Worker(
        committed,
        registry,
        queues=[queue],
        concurrency=1,
        poll_interval=timedelta(milliseconds=100),
        on_job_finished=recorder.finished,
    )
    with running(worker):
        assert started.wait(10)
        with committed.begin() as conn:
            sqlaq.cancel(conn, job_id)
        assert cancelled.wait(10), "the handler's task was not cancelled"
        next_id = enqueue(committed, "after", queue=queue)
        wait_until(lambda: job(committed, next_id).status == "done", 10, "the slot freed")
    assert job(committed, job_id).status == "cancelled"


def test_a_cancel_sent_while_the_listener_was_down_is_found_when_it_reconnects(
    committed: Engine, database_url: str
) -> None:
    # The listener connects as a role of its own, refused logins while the test cancels
    # the job: the cancel's NOTIFY reaches no one. A lease of 120 s is renewed every
    # 40 s, so within the 20 s the test waits only the listener's reconnection can
    # make the worker look for cancels it missed.
    registry = sqlaq.Registry()
    queue = _queue()
    started, cancelled = _waits_until_cancelled(registry)

    admin = create_engine(database_url, isolation_level="AUTOCOMMIT")
    with login_role(database_url, "listener") as (role, role_url):
        worker = sqlaq.Worker(
            committed,
            registry,
            queues=[queue],
            concurrency=1,
            poll_interval=timedelta(milliseconds=100),
            lease=timedelta(seconds=120),
            listen_url=role_url,
        )
        try:
            with running(worker):
                wait_until(lambda: worker.listening, 10, "the listener connected")
                job_id = enqueue(committed, "waits", queue=queue)
                assert started.wait(10)
                with admin.connect() as conn:
                    conn.execute(text(f'ALTER ROLE "{role}" NOLOGIN'))
                    conn.execute(
                        text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE usename = :role"
                        ),
                        {"role": role},
                    )
                wait_until(lambda: not worker.listening, 10, "the listener noticed")
                with committed.begin() as conn:
                    sqlaq.cancel(conn, job_id)
                with admin.connect() as conn:
                    conn.execute(text(f'ALTER ROLE "{role}" LOGIN'))
                wait_until(lambda: worker.listening, 15, "the listener reconnected")
                assert cancelled.wait(20), "the cancel was not found after the reconnection"
        finally:
            admin.dispose()
    assert job(committed, job_id).status == "cancelled"


def test_after_a_cancel_the_cli_workers_slot_runs_the_next_job_at_once(
    ledger: Engine, database_url: str
) -> None:
    queue = _queue()
    with worker_processes(database_url) as start:
        worker = start("--queue", queue, "--concurrency", "1")
        first = enqueue(ledger, "until_cancelled", queue=queue)
        # The first job runs after the process's start-up; what is tested runs from there.
        wait_until(lambda: ledger_runs(ledger, first), START_TIMEOUT, "the first job running")
        with ledger.begin() as conn:
            sqlaq.cancel(conn, first)
        wait_until(lambda: len(ledger_runs(ledger, first)) == 2, 10, "the handler saw it")
        second = enqueue(ledger, "record", queue=queue)
        wait_until(lambda: job(ledger, second).status == "done", 8, "the next job done")
        assert "QueuePool limit" not in worker.output()


def test_the_cli_pool_holds_every_transactional_handler_and_the_workers_parts(
    ledger: Engine, effects: Engine, database_url: str
) -> None:
    queue = _queue()
    with worker_processes(database_url) as start:
        start("--queue", queue, "--concurrency", "3")
        ids = [enqueue(ledger, "txn_effect", {"seconds": 20}, queue=queue) for _ in range(3)]
        # Each handler records once it holds its session's connection. The process's start
        # (imports, connections) takes what the box's load makes it take: the deadline that
        # matters runs from the first handler, and a pool short of a session would keep the
        # third waiting for a 20 s handler to end.
        wait_until(
            lambda: any(ledger_runs(ledger, i) for i in ids), START_TIMEOUT, "the first handler"
        )
        wait_until(lambda: all(ledger_runs(ledger, i) for i in ids), 12, "three sessions at once")


def test_async_transactional_handlers_get_a_connection_each_and_close_cleanly(
    committed: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = sqlaq.Registry()
    queue = _queue()
    inside = 0
    lock = threading.Lock()
    release = threading.Event()

    @registry.handler("holds")
    async def holds(payload: dict[str, Any], session: Any) -> None:
        nonlocal inside
        await session.execute(text("SELECT 1"))
        with lock:
            inside += 1
        while not release.is_set():
            await asyncio.sleep(0.05)

    ids = [enqueue(committed, "holds", queue=queue) for _ in range(20)]
    worker = sqlaq.Worker(committed, registry, queues=[queue], concurrency=20)
    caplog.set_level(logging.ERROR)
    try:
        with running(worker):
            # The first session comes with the async engine's first connection; a pool short
            # of a session would keep the twentieth waiting for ever (the handlers hold on).
            wait_until(lambda: inside > 0, START_TIMEOUT, "the first session")
            wait_until(lambda: inside == 20, 15, "twenty sessions at once")
            release.set()
            wait_until(lambda: all(job(committed, i).status == "done" for i in ids), 15, "done")
            worker.stop()
    finally:
        release.set()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def test_a_clean_stop_closes_the_async_sessions_connections_without_errors(
    committed: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = sqlaq.Registry()
    queue = _queue()

    @registry.handler("selects")
    async def selects(payload: dict[str, Any], session: Any) -> None:
        await session.execute(text("SELECT 1"))

    ids = [enqueue(committed, "selects", queue=queue) for _ in range(3)]
    worker = sqlaq.Worker(committed, registry, queues=[queue], concurrency=3)
    caplog.set_level(logging.ERROR)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        # From the thread's start: the worker's start-up, then three quick jobs.
        wait_until(
            lambda: all(job(committed, i).status == "done" for i in ids), START_TIMEOUT, "done"
        )
    finally:
        worker.stop()
        thread.join(15)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_renewal_overlapping_a_transactional_completion_warns_of_nothing(
    committed: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = sqlaq.Registry()
    queue = _queue()
    handler = registry.add("txn", lambda payload, session: None)
    enqueue(committed, "txn", queue=queue)
    with committed.begin() as conn:
        (claimed,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), queue=queue)
    leases = Leases(committed, [timedelta(seconds=30)])
    run = Run.of(claimed, handler, timedelta(seconds=30), leases.renew_now)
    leases.hold(run)
    with committed.begin() as conn:  # its own transaction completes it...
        sqlaq.complete(conn, claimed.lease)
    with committed.begin() as conn:  # ...as the heartbeat renews it
        renewed = Leases.extend(conn, [run])
    caplog.set_level(logging.INFO, logger="sqlaq")
    leases.apply([run], renewed)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_user_engine_too_small_names_the_parts(database_url: str) -> None:
    registry = sqlaq.Registry()
    registry.handler("p")(lambda payload: None)
    small = create_engine(database_url, pool_size=2, max_overflow=1)
    try:
        with pytest.raises(sqlaq.ConfigError, match=r"holds at most 3 connections.*claims 2"):
            sqlaq.Worker(small, registry, concurrency=1)
    finally:
        small.dispose()
