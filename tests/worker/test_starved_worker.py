"""A worker the server will not give a connection: it must not sit on claimed jobs.

The server refuses the worker's connections the way a server at ``max_connections``
does (SQLSTATE 53300, too many connections), but deterministically: the worker's role
has a ``CONNECTION LIMIT`` (a per-role cap the server enforces at connect time), so the
test decides which of the worker's connections gets through.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import login_role
from sqlalchemy import Engine, create_engine, text
from workerkit import libpq_url, rows, scalar, wait_until

import sqlaq
from sqlaq import NewJob


@pytest.fixture
def limited_role(committed: Engine, database_url: str) -> Iterator[tuple[str, str]]:
    """A LOGIN role of the test's own with every privilege sqlaq's tables need; yields
    its name and the suite's database URL as that role; dropped afterwards (roles are
    cluster-wide), whatever happened. Set its limit with ``ALTER ROLE``."""
    with login_role(database_url, "sqlaq_test_starved") as role:
        yield role


def limit_connections(engine: Engine, role: str, limit: int) -> None:
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f'ALTER ROLE "{role}" CONNECTION LIMIT {limit}')
        )


class Seen(logging.Handler):
    """Sets an event when the worker logs a message containing *needle*."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.WARNING)
        self.needle = needle
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


@pytest.fixture
def unavailable() -> Iterator[threading.Event]:
    """Set once a worker logs that the database is unavailable (a backoff began)."""
    seen = Seen("database unavailable")
    logger = logging.getLogger("sqlaq.worker")
    logger.addHandler(seen)
    try:
        yield seen.event
    finally:
        logger.removeHandler(seen)


def enqueue(engine: Engine, kind: str, count: int) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_many(conn, [NewJob(kind, {"n": n}) for n in range(count)])


def drain_healthy(engine: Engine, registry: sqlaq.Registry) -> None:
    """Everything due, drained by a worker with connections to spare."""
    sqlaq.Worker(engine, registry, burst=True, poll_interval=timedelta(milliseconds=100)).run()


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_get_its_writers_connection_claims_nothing(
    committed: Engine, limited_role: tuple[str, str], unavailable: threading.Event
) -> None:
    role, url = limited_role
    limit_connections(committed, role, 1)  # the writer's, or the claims': not both
    ran: list[int] = []
    registry = sqlaq.Registry()

    @registry.handler("noop")
    def noop(_payload: dict[str, Any]) -> None:
        ran.append(sqlaq.current_job().id)

    enqueue(committed, "noop", 20)
    starved_engine = create_engine(url)
    starved = sqlaq.Worker(
        starved_engine, registry, burst=True, concurrency=4, prefetch=8, listen=False
    )
    thread = threading.Thread(target=starved.run, name="starved-worker", daemon=True)
    thread.start()
    try:
        # The worker got one connection and was refused the other: it backs off.
        assert unavailable.wait(30), "the starved worker never backed off"
        held = scalar(committed, "SELECT count(*) FROM sqlaq_jobs WHERE status <> 'queued'")
        assert held == 0, f"a worker that cannot write outcomes claimed {held} job(s)"
        drain_healthy(committed, registry)
        assert Counter(ran) == Counter(
            job_id for (job_id,) in rows(committed, "SELECT id FROM sqlaq_jobs")
        )
        assert scalar(committed, "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'") == 20
    finally:
        starved.stop(now=True)
        thread.join(30)
        starved_engine.dispose()
    assert not thread.is_alive()


@pytest.mark.timeout(90)
def test_a_worker_whose_writer_loses_its_connection_hands_prefetched_jobs_back(
    committed: Engine, limited_role: tuple[str, str], unavailable: threading.Event
) -> None:
    role, url = limited_role
    limit_connections(committed, role, 2)  # the writer's and the claims'
    first_started, release_first, release_rest = (threading.Event() for _ in range(3))
    started: list[int] = []
    ran: list[int] = []
    registry = sqlaq.Registry()

    @registry.handler("hold")
    def hold(_payload: dict[str, Any]) -> None:
        job_id = sqlaq.current_job().id
        started.append(job_id)
        if len(started) == 1:
            first_started.set()
            assert release_first.wait(60)
        else:
            assert release_rest.wait(60)
        ran.append(job_id)

    enqueue(committed, "hold", 6)
    starved_engine = create_engine(url)
    worker = sqlaq.Worker(
        starved_engine, registry, burst=True, concurrency=1, prefetch=5, listen=False
    )
    thread = threading.Thread(target=worker.run, name="starved-worker", daemon=True)
    thread.start()
    squatter: psycopg.Connection[Any] | None = None
    try:
        assert first_started.wait(30)
        wait_until(
            lambda: (
                scalar(committed, "SELECT count(*) FROM sqlaq_jobs WHERE status = 'running'") == 6
            ),
            30,
            "one job running and five prefetched",
        )
        # The writer's connection (it has written nothing yet: the claims' has) ends,
        # and the slot it held is taken at once: the writer cannot get one back.
        ((writer_pid,),) = wait_until(
            lambda: rows(
                committed,
                "SELECT pid FROM pg_stat_activity WHERE usename = :role"
                " AND query NOT LIKE '%sqlaq_jobs%'",
                role=role,
            ),
            30,
            "the writer's connection",
        )
        assert scalar(committed, "SELECT pg_terminate_backend(:pid, 5000)", pid=writer_pid)
        squatter = wait_until(lambda: _connect(libpq_url(url)), 30, "the writer's slot")
        release_first.set()  # its outcome cannot be written: the writer has no connection
        # Every job not started goes back to the queue at once, through the claims'
        # connection, for another worker to take.
        wait_until(
            lambda: (
                len(started) >= 1
                and scalar(
                    committed,
                    "SELECT count(*) FROM sqlaq_jobs WHERE status = 'queued' AND locked_by IS NULL",
                )
                == 6 - len(started)
            ),
            30,
            "the prefetched jobs handed back",
        )
        assert unavailable.is_set()
        squatter.close()  # the writer gets its connection back and writes what finished
        release_rest.set()
        thread.join(60)
        assert not thread.is_alive()
        drain_healthy(committed, registry)
        assert scalar(committed, "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'") == 6
        assert sorted(Counter(ran).values()) == [1] * 6, Counter(ran)
    finally:
        release_first.set()
        release_rest.set()
        if squatter is not None:
            squatter.close()
        worker.stop(now=True)
        thread.join(30)
        starved_engine.dispose()


def _connect(conninfo: str) -> psycopg.Connection[Any] | None:
    try:
        return psycopg.connect(conninfo)
    except psycopg.OperationalError:
        return None
