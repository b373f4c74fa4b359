"""Vacuum during deep drains (sqlaq.worker.vacuum): when a worker looks, what it decides,
that it vacuums as the table's owner and refuses once, quietly, as any other role, and
that a draining worker does it by itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import login_role
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool
from workerkit import wait_until

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
