"""Workers and enqueueing through PgBouncer in *transaction* pooling.

``nox -s pgbouncer`` runs this module: it starts PgBouncer (Debian's package) in
transaction pooling in front of a throwaway PostgreSQL, and sets
``SQLAQ_PGBOUNCER_URL`` (PgBouncer; the database name is replaced by the suite's) and
``SQLAQ_TEST_DATABASE_URL`` (the server itself). Without ``SQLAQ_PGBOUNCER_URL`` those
tests are skipped; the first ones, on the settings' wiring, run in the default suite.

What docs/how-to/pgbouncer.md prescribes, tested as written: the queue's
URL goes through PgBouncer with ``?prepare_threshold=none`` (or the Python API's
``connect_args={"prepare_threshold": None}``), and the LISTEN connection and the
maintenance leader reach the server directly through ``--listen-url``, or the workers
poll only (``--no-listen --no-maintenance``). PgBouncer keeps fewer server connections
than a worker has clients, so transactions of every client share them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from workerkit import (
    START_TIMEOUT,
    count_status,
    ledger_table,
    listener_backends,
    rows,
    scalar,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq.commandline import database_engine
from sqlaq.maintenance import LEADER_APPLICATION_NAME, direct_engine

BOUNCER = os.environ.get("SQLAQ_PGBOUNCER_URL", "")
needs_pgbouncer = pytest.mark.skipif(
    not BOUNCER, reason="SQLAQ_PGBOUNCER_URL is not set: run nox -s pgbouncer"
)
pytestmark = pytest.mark.timeout(120)

#: Threads enqueueing at once: more than PgBouncer's server connections per database.
THREADS = 8
#: What psycopg raises when a statement it prepared on one server connection is run,
#: or prepared again, on another.
PREPARED_ERRORS = ("DuplicatePreparedStatement", "InvalidSqlStatementName")


def _report(name: str, figures: dict[str, Any]) -> None:
    """Add *figures* to the report ``nox -s pgbouncer`` prints, and print them."""
    print(f"{name}: {figures}")
    given = os.environ.get("SQLAQ_PGBOUNCER_REPORT")
    if not given:
        return
    path = Path(given)
    report = json.loads(path.read_text()) if path.exists() else {}
    report[name] = figures
    path.write_text(json.dumps(report))


@pytest.fixture
def pooled_url(database_url: str) -> str:
    """The suite's database through PgBouncer, as the host application's URL."""
    database = make_url(database_url).database
    return make_url(BOUNCER).set(database=database).render_as_string(hide_password=False)


@pytest.fixture
def worker_url(pooled_url: str) -> str:
    """*pooled_url* as the docs tell workers to use it: prepared statements off."""
    url = make_url(pooled_url).update_query_dict({"prepare_threshold": "none"})
    return url.render_as_string(hide_password=False)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    """The handlers' ledger table (on an empty queue), dropped after the test."""
    yield from ledger_table(committed)


def _enqueue_in_threads(engine: Engine, total: int, stop_on_error: bool = False) -> list[str]:
    """*total* single-job transactions on :data:`THREADS` threads; the names of the
    errors raised (a thread stops at its first when *stop_on_error*)."""
    errors: list[str] = []

    def enqueue(count: int) -> None:
        for i in range(count):
            try:
                with engine.begin() as conn:
                    sqlaq.enqueue(conn, "noop", {"i": i})
            except Exception as exc:
                errors.append(type(getattr(exc, "orig", None) or exc).__name__)
                if stop_on_error:
                    return

    threads = [threading.Thread(target=enqueue, args=(total // THREADS,)) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


# -- the settings' wiring, in the default suite -----------------------------------------


def _threshold(engine: Engine) -> int | None:
    try:
        with engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert driver is not None
            return driver.prepare_threshold  # type: ignore[no-any-return]
    finally:
        engine.dispose()


def test_prepare_threshold_in_a_url_is_psycopg_s_connect_argument(database_url: str) -> None:
    """The commands' engine and the direct (listen_url) engine read ?prepare_threshold=
    as psycopg's prepare_threshold (none: off), and leave it out of the URL (SQLAlchemy
    would hand psycopg the text)."""

    def url(value: str) -> str:
        return (
            make_url(database_url)
            .update_query_dict({"prepare_threshold": value})
            .render_as_string(hide_password=False)
        )

    for given, expected in (("none", None), ("None", None), ("0", 0), ("7", 7)):
        engine = database_engine(url(given), application_name="sqlaq-test", notice=print)
        assert "prepare_threshold" not in engine.url.query
        assert _threshold(engine) == expected, given
        assert _threshold(direct_engine(url(given), "sqlaq-test")) == expected, given
    default = database_engine(database_url, application_name="sqlaq-test", notice=print)
    assert _threshold(default) == 5  # psycopg's own default, untouched


@pytest.mark.timeout(60)
def test_a_worker_s_listener_and_leader_connect_to_its_listen_url(
    committed: Engine, database_url: str
) -> None:
    """Worker(listen_url=...): the LISTEN connection and the leader's lock use that URL
    (here the same server, told apart by the application_name in its query)."""
    name = "sqlaq-test-direct"
    listen_url = make_url(database_url).update_query_dict({"application_name": name})
    # Only backends this test starts: an earlier test's listener, closed, may still be
    # listed while its backend exits.
    started = scalar(committed, "SELECT clock_timestamp()")
    worker = sqlaq.Worker(
        committed,
        sqlaq.Registry(),
        listen_url=listen_url,
        maintenance_interval=timedelta(milliseconds=100),
        grace_period=timedelta(0),
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: worker.listening, 20, "the worker listening")
        listening = rows(
            committed,
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN%' AND backend_start >= :started",
            started=started,
        )
        assert [row[0] for row in listening] == [name]
        wait_until(lambda: _leader_application_names(committed) == [name], 20, "the leader's lock")
    finally:
        worker.stop()
        thread.join(20)
    assert not thread.is_alive()


# -- through PgBouncer -------------------------------------------------------------------


@needs_pgbouncer
def test_prepared_statements_through_pgbouncer_fail_without_the_setting(
    committed: Engine, pooled_url: str
) -> None:
    """The hazard is real here: psycopg's default (prepare after 5 executions) breaks on
    server connections that PgBouncer hands from client to client."""
    engine = create_engine(pooled_url, pool_size=THREADS)
    try:
        errors = _enqueue_in_threads(engine, 2000, stop_on_error=True)
    finally:
        engine.dispose()
    assert errors, "no prepared-statement error: PgBouncer is not in transaction pooling?"
    assert set(errors) <= set(PREPARED_ERRORS), errors


@needs_pgbouncer
@pytest.mark.parametrize("how", ["url", "connect_args"])
def test_1000_single_job_transactions_through_pgbouncer(
    committed: Engine, pooled_url: str, worker_url: str, how: str
) -> None:
    """The docs' two ways: the commands' URL parameter, the Python API's connect_args."""
    if how == "url":
        engine = database_engine(
            worker_url, application_name="sqlaq-test", notice=print, pool_size=THREADS
        )
    else:
        engine = create_engine(
            pooled_url, pool_size=THREADS, connect_args={"prepare_threshold": None}
        )
    try:
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
        errors = _enqueue_in_threads(engine, 1000)
    finally:
        engine.dispose()
    assert errors == []
    assert count_status(committed, "queued") == 1000


def _leader_application_names(engine: Engine) -> list[str]:
    """application_name of each backend holding the maintenance leader's lock."""
    return [
        row[0]
        for row in rows(
            engine,
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())",
        )
    ]


def _stop(worker: Any) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.output()[-3000:]
    output = worker.output()
    for name in (*PREPARED_ERRORS, "prepared statement"):
        assert name not in output, output[-3000:]


@needs_pgbouncer
@pytest.mark.timeout(600)
def test_drain_of_20000_jobs_through_pgbouncer_with_a_direct_listen_url(
    committed: Engine, database_url: str, worker_url: str
) -> None:
    """One worker, its pool through PgBouncer, LISTEN and the leader's lock direct."""
    total = 20_000
    with committed.begin() as conn:
        sqlaq.enqueue_copy(conn, [sqlaq.NewJob("noop") for _ in range(total)])
    with worker_processes(database_url) as start:
        began = time.monotonic()
        worker = start(
            "--database-url", worker_url, "--listen-url", database_url,
            "--concurrency", "50", "--log-level", "warning",
        )  # fmt: skip
        wait_until(
            lambda: count_status(committed, "done") == total or not worker.alive(),
            timeout=480,
            message=f"{total} jobs done",
            interval=0.1,
        )
        elapsed = time.monotonic() - began
        assert worker.alive(), worker.output()[-3000:]
        # LISTEN and the leader's lock hold sessions of their own on the server itself.
        assert listener_backends(committed)
        assert wait_until(
            lambda: LEADER_APPLICATION_NAME in _leader_application_names(committed),
            timeout=30,
            message="the leader's lock on its direct connection",
        )
        _stop(worker)
    counts = dict(rows(committed, "SELECT status, count(*) FROM sqlaq_jobs GROUP BY status"))
    assert counts == {"done": total}, counts  # none queued, running or failed
    # On the database's clock, from the first claim to the last outcome: without the
    # process's start-up (imports, connections, the schema check).
    working = scalar(
        committed,
        "SELECT extract(epoch FROM max(finished_at) - min(attempted_at)) FROM sqlaq_jobs",
    )
    _report(
        "PgBouncer drain",
        {
            "jobs": total,
            "seconds": round(elapsed, 2),
            "jobs_per_second": round(total / elapsed),
            "seconds_first_claim_to_last_outcome": round(float(working), 2),
            "jobs_per_second_working": round(total / float(working)),
            "worker": "1 process, --concurrency 50, --listen-url direct, maintenance on",
            "pgbouncer": "transaction pooling, default_pool_size 4",
        },
    )


@needs_pgbouncer
@pytest.mark.timeout(300)
def test_polling_workers_without_listen_or_maintenance_drain_through_pgbouncer(
    ledger: Engine, database_url: str, worker_url: str
) -> None:
    """The issue's own case: --no-listen --no-maintenance through PgBouncer, which used
    to exit 1 after 60-80 jobs (DuplicatePreparedStatement). Two workers; handlers
    write their ledger rows directly."""
    with ledger.begin() as conn:
        sqlaq.enqueue_copy(conn, [sqlaq.NewJob("noop") for _ in range(5000)])
        sqlaq.enqueue_copy(conn, [sqlaq.NewJob("record") for _ in range(200)])
    with worker_processes(database_url) as start:
        args = ["--database-url", worker_url, "--no-listen", "--no-maintenance"]
        args += ["--poll-interval", "100ms", "--log-level", "warning"]
        workers = [start(*args) for _ in range(2)]
        wait_until(
            lambda: count_status(ledger, "done") == 5200 or not all(w.alive() for w in workers),
            timeout=240,
            message="5,200 jobs done",
            interval=0.1,
        )
        for worker in workers:
            assert worker.alive(), worker.output()[-3000:]
        assert not listener_backends(ledger)
        for worker in workers:
            _stop(worker)
    counts = dict(rows(ledger, "SELECT status, count(*) FROM sqlaq_jobs GROUP BY status"))
    assert counts == {"done": 5200}, counts
    runs = scalar(ledger, "SELECT count(DISTINCT job_id) FROM sqlaq_test_ledger")
    assert runs == 200


@needs_pgbouncer
@pytest.mark.timeout(180)
def test_a_job_enqueued_through_pgbouncer_wakes_a_worker_listening_directly(
    ledger: Engine, database_url: str, worker_url: str
) -> None:
    """NOTIFY is sent on commit of the enqueuing transaction, whatever pooler carried
    it; the listener on --listen-url hears it (the worker would otherwise poll once in
    10 minutes)."""
    engine = database_engine(worker_url, application_name="sqlaq-test", notice=print)
    try:
        with worker_processes(database_url) as start:
            worker = start(
                "--database-url", worker_url, "--listen-url", database_url,
                "--poll-interval", "10m", "--no-maintenance",
            )  # fmt: skip
            # After the process's start-up (imports, connections): not what is tested.
            wait_until(lambda: listener_backends(ledger), START_TIMEOUT, "the worker's LISTEN")
            time.sleep(0.5)  # its first look (after LISTEN) found nothing: now it waits
            with engine.begin() as conn:
                job_id = sqlaq.enqueue(conn, "record").job_id
            enqueued = time.monotonic()
            wait_until(lambda: count_status(ledger, "done") == 1, 10, "the job done")
            assert time.monotonic() - enqueued < 10
            _stop(worker)
    finally:
        engine.dispose()
    assert scalar(ledger, "SELECT count(*) FROM sqlaq_test_ledger WHERE job_id = :id", id=job_id)


@needs_pgbouncer
@pytest.mark.timeout(180)
def test_the_leader_sweeps_through_its_direct_connection(
    committed: Engine, database_url: str, worker_url: str
) -> None:
    """With --listen-url the leader's advisory lock and its upkeep use a connection to
    the server itself: an expired lease in a queue nobody claims from is swept."""
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "noop", queue="orphans", max_attempts=1).job_id
        sqlaq.claim(
            conn, worker_id=uuid.uuid4(), queue="orphans", lease=timedelta(milliseconds=100)
        )
    with worker_processes(database_url) as start:
        worker = start(
            "--database-url", worker_url, "--listen-url", database_url,
            "--queue", "elsewhere", "--maintenance-interval", "200ms",
        )  # fmt: skip
        wait_started(worker)  # its start-up (imports, connections) is not what is tested
        wait_until(lambda: count_status(committed, "failed") == 1, 30, "the expired lease swept")
        # Other advisory locks come and go (a transaction's own); the leader's stays.
        wait_until(
            lambda: _leader_application_names(committed) == [LEADER_APPLICATION_NAME],
            10,
            "only the leader's direct connection holding an advisory lock",
        )
        _stop(worker)
    error = scalar(committed, "SELECT last_error FROM sqlaq_jobs WHERE id = :id", id=job_id)
    assert error.startswith("lease expired on attempt 1 of 1")
