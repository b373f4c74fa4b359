"""Vacuum during deep drains (sqlaq.worker.vacuum): when a worker looks, what it decides,
that it vacuums as the table's owner and refuses once, quietly, as any other role, and
that a draining worker does it by itself."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from helpers import login_role
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool
from workerkit import libpq_url, wait_until

import sqlaq
from sqlaq import NewJob, WorkerConfig
from sqlaq.worker import vacuum
from sqlaq.worker.vacuum import DrainVacuum, needs_vacuum

pytestmark = pytest.mark.timeout(120)


def test_a_vacuum_is_needed_for_many_dead_rows_that_are_a_tenth_of_the_live_ones() -> None:
    assert not needs_vacuum(0, 0)
    assert not needs_vacuum(vacuum.MIN_DEAD_ROWS - 1, 0)  # too few to bother
    assert needs_vacuum(vacuum.MIN_DEAD_ROWS, 10 * vacuum.MIN_DEAD_ROWS)
    assert not needs_vacuum(vacuum.MIN_DEAD_ROWS, 10 * vacuum.MIN_DEAD_ROWS + 1)  # < a tenth
    assert needs_vacuum(2_000_000, 1_000_000)  # a million-job drain, before any vacuum


@pytest.fixture
def any_dead_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every look finds a vacuum needed (the statistics lag behind a small test)."""
    monkeypatch.setattr(vacuum, "needs_vacuum", lambda dead, live: True)


def _vacuum_count(engine: Engine) -> int:
    """The jobs table's vacuum count by the statistics (a new snapshot each call)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT vacuum_count FROM pg_stat_user_tables"
                    " WHERE relid = 'sqlaq_jobs'::regclass"
                )
            ).scalar_one()
        )


def test_a_look_counts_claimed_jobs_and_vacuums_as_the_owner(
    committed: Engine, any_dead_rows: None
) -> None:
    drain = DrainVacuum(committed, check_every=100)
    before = _vacuum_count(committed)
    drain.claimed(99)
    assert drain.idle.is_set()  # 99 < 100: no look yet
    drain.claimed(1)
    assert drain.idle.wait(30)
    assert drain.vacuums == 1
    # PostgreSQL 14 reports through its collector, a moment after the vacuum.
    wait_until(lambda: _vacuum_count(committed) > before, 10, "the vacuum in the statistics")
    assert _vacuum_count(committed) == before + 1
    drain.claimed(50)  # the count starts again after a look
    assert drain.idle.is_set()
    assert drain.vacuums == 1


#: The application_name of this file's one-off connections that only read.
_READER = "sqlaq-test-vacuum-reader"


def _one_off(engine: Engine, name: str) -> Engine:
    """An engine on *engine*'s database whose every connection is a new one, closed at
    its end (a backend of its own each time), named *name* in pg_stat_activity."""
    return create_engine(engine.url, poolclass=NullPool, connect_args={"application_name": name})


def _backends(engine: Engine) -> set[int]:
    """The pids of the database's backends but this file's readers."""
    reader = _one_off(engine, _READER)
    try:
        with reader.connect() as conn:
            pids = conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name <> :reader"
                ),
                {"reader": _READER},
            ).scalars()
            return set(pids)
    finally:
        reader.dispose()


def _close_pool(engine: Engine) -> None:
    """Close the idle connections of *engine*'s pool and wait until their backends have
    exited: a backend reports its pending statistics as it exits, before it leaves
    pg_stat_activity, so what they did (a TRUNCATE, which zeroes the counts) is in the
    statistics from then on, and no later report of theirs can undo ours."""
    closing = engine.pool.checkedin()  # type: ignore[attr-defined]
    before = _backends(engine)
    engine.dispose()
    wait_until(
        lambda: len(before - _backends(engine)) >= closing, 10, "the pool's backends to exit"
    )


def _write(engine: Engine, sql: str, times: int = 1) -> None:
    """Run *sql* *times*, each in a transaction, on a connection of its own; return once
    its backend has exited (its statistics reported)."""
    writer = _one_off(engine, "sqlaq-test-vacuum-writer")
    try:
        with writer.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            for _ in range(times):
                conn.execute(text(sql))
                conn.commit()
    finally:
        writer.dispose()
    wait_until(lambda: pid not in _backends(engine), 10, "the writer's backend to exit")


def _dead_rows(engine: Engine) -> int:
    reader = _one_off(engine, _READER)
    try:
        with reader.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT n_dead_tup FROM pg_stat_user_tables"
                        " WHERE relid = 'sqlaq_jobs'::regclass"
                    )
                ).scalar_one()
            )
    finally:
        reader.dispose()


def _update_every_job(engine: Engine, times: int = 1) -> None:
    """A new version of every job, *times* over: the old ones die."""
    _write(engine, "UPDATE sqlaq_jobs SET payload = payload", times)


@pytest.fixture
def jobs_300(committed: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """300 jobs, no dead row version; a vacuum is needed from 100 dead versions on;
    autovacuum kept off the table meanwhile (a test counts the vacuums and the dead
    versions)."""
    if _server_version(committed) < 150000:
        # PostgreSQL 14's backends send their statistics to a collector process over
        # UDP, which reports them when it gets to them: no wait makes the counts exact.
        pytest.skip("exact dead-row counts need PostgreSQL 15's shared statistics")
    monkeypatch.setattr(vacuum, "MIN_DEAD_ROWS", 100)
    _close_pool(committed)
    # Every other backend of the database gone (an earlier test's, which reports its
    # statistics as it exits, after the suite's TRUNCATE: 2 dead rows on CI's
    # PostgreSQL 18 run), then the table emptied again: its counts start from zero.
    wait_until(lambda: not _backends(committed), 20, "the database's other backends to exit")
    _write(
        committed,
        "TRUNCATE sqlaq_jobs; ALTER TABLE sqlaq_jobs SET (autovacuum_enabled = off);"
        " INSERT INTO sqlaq_jobs (queue, kind, payload)"
        " SELECT 'default', 'v', '{}' FROM generate_series(1, 300)",
    )
    try:
        assert _dead_rows(committed) == 0
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(text("ALTER TABLE sqlaq_jobs RESET (autovacuum_enabled)"))


def _look(drain: DrainVacuum) -> None:
    drain.claimed(1)
    assert drain.idle.wait(30)


def test_after_a_vacuum_a_held_snapshot_made_useless_the_next_waits_for_twice_as_many_dead(
    jobs_300: Engine, database_url: str
) -> None:
    """While a snapshot held elsewhere keeps every dead version, a vacuum removes nothing
    and reads the whole table: the next waits until the dead versions have doubled. The
    first vacuum after the snapshot is gone removes them, and the wait ends."""
    drain = DrainVacuum(jobs_300, check_every=1)
    with psycopg.connect(libpq_url(database_url)) as held:
        held.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        held.execute("SELECT 1")  # its snapshot taken, held until the rollback
        _update_every_job(jobs_300)  # 300 dead versions, kept by the snapshot
        _look(drain)
        assert drain.vacuums == 1
        assert drain.waits_for == 2 * 300  # none removed
        _look(drain)
        assert drain.vacuums == 1  # 300 dead < 600: no vacuum
        _update_every_job(jobs_300)  # 600 dead
        _look(drain)
        assert drain.vacuums == 2
        assert drain.waits_for == 2 * 600
        _update_every_job(jobs_300, 2)  # 1,200 dead
        held.rollback()  # (nothing has touched the pages since: none pruned yet)
    _look(drain)
    assert drain.vacuums == 3
    assert drain.waits_for == 0
    assert _dead_rows(jobs_300) == 0


def test_a_vacuum_that_removed_the_dead_rows_lets_the_next_look_vacuum_again(
    jobs_300: Engine,
) -> None:
    drain = DrainVacuum(jobs_300, check_every=1)
    for vacuums in (1, 2):
        _update_every_job(jobs_300)
        _look(drain)
        assert drain.vacuums == vacuums
        assert drain.waits_for == 0


def _grant(database_url: str, privileges: str, role: str) -> None:
    admin = create_engine(database_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'GRANT {privileges} ON ALL TABLES IN SCHEMA public TO "{role}"'))
            conn.execute(text(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"'))
    finally:
        admin.dispose()


def _server_version(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SHOW server_version_num")).scalar_one())


#: What a worker's role needs to run jobs, and not MAINTAIN (which ALL includes on 17+).
USE = "SELECT, INSERT, UPDATE, DELETE"


@pytest.fixture
def other_role(committed: Engine, database_url: str) -> Iterator[str]:
    """The suite's database URL as a LOGIN role that may use sqlaq's tables but neither
    owns them nor holds MAINTAIN on them (dropped afterwards)."""
    with login_role(database_url, "sqlaq_test_vacuum", grant_all=False) as (name, url):
        _grant(database_url, USE, name)
        yield url


def test_a_role_that_does_not_own_the_table_looks_once_and_leaves_it_to_autovacuum(
    other_role: str, any_dead_rows: None, caplog: pytest.LogCaptureFixture
) -> None:
    engine = create_engine(other_role, poolclass=NullPool)
    try:
        drain = DrainVacuum(engine, check_every=1)
        with caplog.at_level("INFO", logger="sqlaq.worker.vacuum"):
            drain.claimed(1)
            assert drain.idle.wait(30)
        assert drain.vacuums == 0
        assert "this role neither owns it nor holds MAINTAIN on it" in caplog.text
        caplog.clear()
        drain.claimed(10)  # refused for good: no second look, no second line
        assert drain.idle.is_set()
        assert caplog.text == ""
    finally:
        engine.dispose()


def test_a_role_granted_maintain_vacuums_without_owning_the_table(
    committed: Engine, database_url: str, any_dead_rows: None
) -> None:
    """PostgreSQL 17's MAINTAIN privilege lets a role vacuum a table it does not own."""
    if _server_version(committed) < 170000:
        pytest.skip("MAINTAIN is PostgreSQL 17's (nox -s matrix runs 18)")
    with login_role(database_url, "sqlaq_test_maintain", grant_all=False) as (name, url):
        _grant(database_url, f"{USE}, MAINTAIN", name)
        engine = create_engine(url, poolclass=NullPool)
        try:
            drain = DrainVacuum(engine, check_every=1)
            drain.claimed(1)
            assert drain.idle.wait(30)
            assert drain.vacuums == 1
        finally:
            engine.dispose()


def test_a_draining_worker_vacuums_by_itself_and_not_with_vacuum_off(
    committed: Engine, any_dead_rows: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vacuum, "CHECK_EVERY", 200)
    registry = sqlaq.Registry()
    registry.handler("v")(lambda payload: None)
    for on in (False, True):
        with committed.begin() as conn:
            sqlaq.enqueue_many(conn, NewJob("v").with_payloads([{"i": i} for i in range(1000)]))
        config = WorkerConfig(burst=True, concurrency=10, prefetch=100, vacuum=on)
        worker = sqlaq.Worker(committed, registry, config)
        worker.run()
        if on:
            assert worker.vacuum is not None
            assert worker.vacuum.idle.wait(30)
            assert worker.vacuum.vacuums >= 1  # 1,000 jobs claimed, a look every 200
        else:
            assert worker.vacuum is None
