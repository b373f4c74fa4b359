"""A worker's start and end, whichever way it runs (``sqlaq-worker``, ``async with
Worker``, ``run_async``, ``run``): the start check, a schema changed under it, a database
away at start, a second cancel."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool
from workerkit import START_TIMEOUT, enqueue, job, wait_started, wait_until, worker_processes

import sqlaq
from sqlaq import migrations
from sqlaq.config import WORKER_OPTIONS

pytestmark = pytest.mark.timeout(60)

FAST: dict[str, Any] = {"poll_interval": timedelta(milliseconds=100), "maintenance": False}
PG_BIN = Path("/usr/lib/postgresql/15/bin")


@pytest.fixture
def empty_engine(empty_database_url: str) -> Iterator[Engine]:
    """An engine on a database without sqlaq's tables."""
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def own_engine(empty_database_url: str) -> Iterator[Engine]:
    """An engine on a migrated database of the test's own (its schema may be changed)."""
    engine = create_engine(empty_database_url, pool_size=5, max_overflow=5)
    with engine.connect() as conn:
        migrations.upgrade(conn)
        conn.commit()
    try:
        yield engine
    finally:
        engine.dispose()


def worker_threads() -> list[str]:
    names = ("sqlaq-maintenance", "sqlaq-listener", "sqlaq-writer")
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


# -- the start check -------------------------------------------------------------------


def test_async_with_worker_on_a_database_without_the_schema_fails_at_start(
    empty_engine: Engine,
) -> None:
    registry = sqlaq.Registry()
    registry.handler("noop")(lambda payload: None)
    entered = []

    async def app() -> None:
        async with sqlaq.Worker(empty_engine, registry, **FAST):
            entered.append(True)

    with pytest.raises(sqlaq.SchemaOutOfDateError, match="schema is not installed"):
        asyncio.run(app())
    assert not entered
    assert not worker_threads()


def test_run_async_and_run_fail_at_start_with_the_same_error(empty_engine: Engine) -> None:
    registry = sqlaq.Registry()
    with pytest.raises(sqlaq.SchemaOutOfDateError, match="alembic upgrade heads") as in_async:
        asyncio.run(sqlaq.Worker(empty_engine, registry, **FAST).run_async())
    worker = sqlaq.Worker(empty_engine, registry, **FAST)
    with pytest.raises(sqlaq.SchemaOutOfDateError) as in_run:
        worker.run()
    assert str(in_run.value) == str(in_async.value)
    assert worker.stopped.is_set()
    assert not worker.started.is_set()


def test_a_database_away_at_start_is_retried_for_start_timeout_then_unavailable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/x", poolclass=NullPool)
    worker = sqlaq.Worker(engine, sqlaq.Registry(), start_timeout=timedelta(seconds=1), **FAST)
    with (
        caplog.at_level(logging.WARNING, "sqlaq.worker"),
        pytest.raises(sqlaq.DatabaseUnavailableError, match="after 1s"),
    ):
        worker.run()
    assert "database unavailable at start (attempt 1)" in caplog.text
    # Stopped while waiting for the database: it never started, and says nothing.
    waiting = sqlaq.Worker(engine, sqlaq.Registry(), **FAST)  # 30 s by default
    thread = threading.Thread(target=waiting.run)
    thread.start()
    wait_until(lambda: caplog.text.count("attempt 1)") >= 2, 10, "a retry")
    waiting.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert not waiting.started.is_set()
    engine.dispose()


def test_an_unknown_option_names_the_closest_and_every_declared_one(committed: Engine) -> None:
    with pytest.raises(sqlaq.ConfigError) as raised:
        sqlaq.Worker(committed, sqlaq.Registry(), concurency=4)
    message = str(raised.value)
    assert "'concurency' (did you mean 'concurrency'?)" in message
    for option in WORKER_OPTIONS:
        assert option.name in message
    with pytest.raises(sqlaq.ConfigError, match="did you mean 'on_job_finished'"):
        sqlaq.Worker(committed, sqlaq.Registry(), on_job_finish=print)


# -- the schema changed under a running worker -----------------------------------------


#: What a worker says of a schema downgraded to sqlaq_0004 under it (see below).
_DOWNGRADED = r"database is at sqlaq_000[4-7]\b"


@pytest.mark.timeout(60)
def test_a_schema_downgraded_under_a_running_worker_stops_it_gracefully(
    own_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = sqlaq.Registry()
    started, release = threading.Event(), threading.Event()

    @registry.handler("slow")
    def slow(payload: dict[str, Any]) -> None:
        started.set()
        release.wait(30)

    job_id = enqueue(own_engine, "slow")
    worker = sqlaq.Worker(own_engine, registry, concurrency=2, **FAST)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run)
    with caplog.at_level(logging.INFO, "sqlaq"):
        thread.start()
        assert started.wait(20)
        with own_engine.connect() as conn:  # alembic downgrade sqlaq@-1
            migrations.downgrade(conn, "sqlaq_0004")
            conn.commit()
        wait_until(lambda: "schema changed under the worker" in caplog.text, 20, "the stop")
        release.set()  # the running job finishes within the grace period
        thread.join(20)
    assert not thread.is_alive()
    assert len(failure) == 1
    assert isinstance(failure[0], sqlaq.SchemaOutOfDateError)
    # The revision the worker read when its claim broke: the downgrade commits each step,
    # and the claim breaks at the first step that drops what it uses (the key column).
    assert re.search(_DOWNGRADED, str(failure[0])), failure[0]
    changed = [r for r in caplog.records if "schema changed" in r.getMessage()]
    assert len(changed) == 1
    assert re.search(_DOWNGRADED, changed[0].getMessage())
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
    assert job(own_engine, job_id).status == "done"  # nothing lost


@pytest.mark.timeout(120)
def test_the_command_exits_2_when_the_schema_changes_under_it(
    own_engine: Engine, empty_database_url: str
) -> None:
    with own_engine.begin() as conn:
        sqlaq.enqueue(conn, "noop")
    with worker_processes(empty_database_url) as start:
        worker = start("--poll-interval", "0.1", "--no-maintenance")
        wait_started(worker)  # its start-up (imports, connections) is not what is tested
        with own_engine.connect() as conn:
            migrations.downgrade(conn, "sqlaq_0004")
            conn.commit()
        assert worker.wait(30) == 2, worker.output()
        output = worker.output()
    assert "Traceback" not in output
    assert "schema changed under the worker" in output
    assert re.search("sqlaq-worker: error: " + _DOWNGRADED, output), output


# -- a second cancel -------------------------------------------------------------------


def test_a_second_cancel_of_run_async_hands_running_jobs_back_at_once(committed: Engine) -> None:
    registry = sqlaq.Registry()
    started = threading.Event()

    @registry.handler("forever")
    async def forever(payload: dict[str, Any]) -> None:
        started.set()
        await asyncio.Event().wait()

    job_id = enqueue(committed, "forever")

    async def app() -> tuple[sqlaq.Worker, float]:
        worker = sqlaq.Worker(committed, registry, grace_period=timedelta(minutes=5), **FAST)
        task = asyncio.create_task(worker.run_async())
        await asyncio.to_thread(started.wait, 20)
        task.cancel()  # Ctrl-C: the grace period starts
        await asyncio.to_thread(wait_until, lambda: worker._stopping.is_set(), 10, "the stop")
        await asyncio.sleep(0.2)
        assert not task.done()  # waiting for the running job
        began = time.monotonic()
        task.cancel()  # Ctrl-C again: hand it back now
        with pytest.raises(asyncio.CancelledError):
            await task
        return worker, time.monotonic() - began

    worker, took = asyncio.run(app())
    assert worker.stopped.is_set()
    assert took < 20
    row = job(committed, job_id)
    assert (row.status, row.attempts) == ("queued", 0)


# -- a database restarting at start ----------------------------------------------------


@pytest.fixture
def restartable_server() -> Iterator[tuple[str, Any]]:
    """A PostgreSQL 15 of the test's own, initialised and migrated, then stopped; yield
    its URL and a function starting it; stopped and deleted at the end."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip("needs PostgreSQL 15's initdb")
    folder = tempfile.mkdtemp(prefix="sqlaq-restart-")
    if os.geteuid() == 0:  # the server runs as postgres: its socket and log go here
        shutil.chown(folder, user="postgres")
    data = os.path.join(folder, "data")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def pg_ctl(*args: str) -> None:
        subprocess.run(
            [*as_postgres, str(PG_BIN / "pg_ctl"), "-D", data, "-s", *args],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start_server() -> None:
        pg_ctl(
            "-l", os.path.join(folder, "log"), "-w", "start",
            "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1",
        )  # fmt: skip

    subprocess.run(
        [*as_postgres, str(PG_BIN / "initdb"), "-D", data, "-U", "postgres", "-A", "trust"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    try:
        start_server()
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as conn:
            migrations.upgrade(conn)
            conn.commit()
        engine.dispose()
        pg_ctl("-m", "fast", "-w", "stop")
        yield url, start_server
    finally:
        subprocess.run(
            [*as_postgres, str(PG_BIN / "pg_ctl"), "-D", data, "-s", "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(240)
def test_the_command_waits_for_a_server_restarting_at_start(
    restartable_server: tuple[str, Any],
) -> None:
    url, start_server = restartable_server
    with worker_processes(url) as start:
        worker = start("--poll-interval", "0.2", "--start-timeout", "60")
        # Its first attempt comes after the process's imports (as slow as the load).
        wait_until(lambda: "unavailable at start" in worker.output(), START_TIMEOUT, "a retry")
        assert worker.alive()
        start_server()
        wait_until(lambda: "worker started" in worker.output(), 30, "the start")
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.output()


@pytest.mark.timeout(180)
def test_the_command_gives_up_after_start_timeout_with_exit_1(
    restartable_server: tuple[str, Any],
) -> None:
    url, _ = restartable_server
    with worker_processes(url) as start:
        worker = start("--start-timeout", "0.5")
        # The process's imports, then half a second of attempts: the exit's code and
        # message say it gave up after start_timeout, not this deadline.
        assert worker.wait(START_TIMEOUT) == 1, worker.output()
        last = worker.output().strip().splitlines()[-1]
    assert last.startswith("sqlaq-worker: error: the database at")
    assert "unavailable after 0.5s (start_timeout)" in last
    assert make_url(url).port is not None
    assert str(make_url(url).port) in last
