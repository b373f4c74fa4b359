"""The shipped revisions: they walk up, down and up again, the head matches
``sqlaq.metadata``, the NOTIFY trigger behaves, the standalone path works, and a host
project consumes the revisions from an installed wheel through its own Alembic.

Every test that migrates gets a database of its own (``sqlaq_mig_<hex>``), dropped with
``WITH (FORCE)`` afterwards, so nothing here touches the suite's shared database.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import alembic.command
import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from conftest import ROOT, alembic_config, new_database
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    Table,
    create_engine,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

import sqlaq
import sqlaq.migrations
from sqlaq.queries import ClaimPosition
from sqlaq.schema import (
    DEPS_TRIGGER,
    FINISH_FUNCTION,
    FINISH_TRIGGER,
    NOTIFY_TRIGGER,
    STORAGE_PARAMETERS,
)
from sqlaq.worker.fetcher import parse_wake

HEAD = sqlaq.migrations.head_revision()
#: The revision that creates sqlaq_jobs: what a host revision with a foreign key to it
#: depends on, whatever sqlaq's head is later.
FIRST_REVISION = "sqlaq_0001"

#: Every catalog object the shipped revisions create, as (catalog, name).
SQLAQ_OBJECTS = frozenset(
    {
        ("pg_class", "sqlaq_jobs"),
        ("pg_class", "sqlaq_jobs_id_seq"),
        ("pg_class", "sqlaq_jobs_pkey"),
        ("pg_class", "sqlaq_jobs_claim_idx"),
        ("pg_class", "sqlaq_jobs_dedupe_idx"),
        ("pg_class", "sqlaq_jobs_finished_idx"),
        ("pg_class", "sqlaq_jobs_running_idx"),
        ("pg_class", "sqlaq_jobs_debounce_idx"),
        ("pg_class", "sqlaq_rates"),
        ("pg_class", "sqlaq_rates_pkey"),
        ("pg_class", "sqlaq_periodic"),
        ("pg_class", "sqlaq_periodic_pkey"),
        ("pg_class", "sqlaq_paused_queues"),
        ("pg_class", "sqlaq_paused_queues_pkey"),
        ("pg_class", "sqlaq_workers"),
        ("pg_class", "sqlaq_workers_pkey"),
        ("pg_class", "sqlaq_unique_holds"),
        ("pg_class", "sqlaq_unique_holds_pkey"),
        ("pg_class", "sqlaq_unique_holds_expires_at_idx"),
        ("pg_constraint", "sqlaq_rates_pkey"),
        ("pg_constraint", "sqlaq_periodic_pkey"),
        ("pg_constraint", "sqlaq_paused_queues_pkey"),
        ("pg_constraint", "sqlaq_workers_pkey"),
        ("pg_constraint", "sqlaq_unique_holds_pkey"),
        ("pg_constraint", "sqlaq_jobs_pkey"),
        ("pg_constraint", "sqlaq_jobs_status_check"),
        ("pg_constraint", "sqlaq_jobs_max_attempts_check"),
        ("pg_proc", "sqlaq_jobs_notify"),
        ("pg_proc", "sqlaq_jobs_notify_finish"),
        ("pg_proc", "sqlaq_jobs_schema_revision"),
        ("pg_trigger", "sqlaq_jobs_notify_trg"),
        ("pg_trigger", "sqlaq_jobs_finish_trg"),
        ("pg_type", "sqlaq_jobs"),
        ("pg_type", "_sqlaq_jobs"),
        ("pg_type", "sqlaq_rates"),
        ("pg_type", "_sqlaq_rates"),
        ("pg_type", "sqlaq_periodic"),
        ("pg_type", "_sqlaq_periodic"),
        ("pg_type", "sqlaq_paused_queues"),
        ("pg_type", "_sqlaq_paused_queues"),
        ("pg_type", "sqlaq_workers"),
        ("pg_type", "_sqlaq_workers"),
        ("pg_type", "sqlaq_unique_holds"),
        ("pg_type", "_sqlaq_unique_holds"),
        ("pg_class", "sqlaq_jobs_waiting_idx"),
        ("pg_class", "sqlaq_job_deps"),
        ("pg_class", "sqlaq_job_deps_pkey"),
        ("pg_class", "sqlaq_job_deps_child_id_idx"),
        ("pg_constraint", "sqlaq_job_deps_pkey"),
        ("pg_constraint", "sqlaq_jobs_on_parent_failure_check"),
        ("pg_proc", "sqlaq_jobs_settle_children"),
        ("pg_trigger", "sqlaq_jobs_deps_trg"),
        ("pg_type", "sqlaq_job_deps"),
        ("pg_type", "_sqlaq_job_deps"),
        ("pg_class", "sqlaq_jobs_key_idx"),
        ("pg_class", "sqlaq_jobs_fair_idx"),
        ("pg_class", "sqlaq_jobs_parents_idx"),
    }
)
# NOT NULL constraints are left out (contype 'n'): PostgreSQL 18 lists them in
# pg_constraint, 15 does not, and the table's columns already cover them.
_OBJECTS_SQL = text(
    """
    SELECT 'pg_class', relname::text FROM pg_class
        WHERE starts_with(relname::text, 'sqlaq_')
          AND NOT starts_with(relname::text, 'sqlaq_alembic_version')
    UNION ALL SELECT 'pg_constraint', conname::text FROM pg_constraint
        WHERE starts_with(conname::text, 'sqlaq_') AND contype <> 'n'
          AND NOT starts_with(conname::text, 'sqlaq_alembic_version')
    UNION ALL SELECT 'pg_proc', proname::text FROM pg_proc
        WHERE starts_with(proname::text, 'sqlaq_')
    UNION ALL SELECT 'pg_trigger', tgname::text FROM pg_trigger
        WHERE starts_with(tgname::text, 'sqlaq_')
    UNION ALL SELECT 'pg_type', typname::text FROM pg_type
        WHERE typname::text ~ '^_?sqlaq_' AND typname::text !~ '^_?sqlaq_alembic_version'
    """
)

#: PostgreSQL's own rendering of the indexes (pg_indexes.indexdef) on a fresh database.
EXPECTED_INDEXES = {
    "sqlaq_jobs_claim_idx": (
        "CREATE INDEX sqlaq_jobs_claim_idx ON public.sqlaq_jobs USING btree "
        "(queue, priority DESC, run_at, id) "
        "WHERE (status = ANY (ARRAY['queued'::text, 'running'::text]))"
    ),
    "sqlaq_jobs_dedupe_idx": (
        "CREATE UNIQUE INDEX sqlaq_jobs_dedupe_idx ON public.sqlaq_jobs USING btree "
        "(kind, dedupe_key) "
        "WHERE ((status = ANY (ARRAY['queued'::text, 'running'::text])) "
        "AND (dedupe_key IS NOT NULL))"
    ),
    "sqlaq_jobs_finished_idx": (
        "CREATE INDEX sqlaq_jobs_finished_idx ON public.sqlaq_jobs USING btree "
        "(finished_at) "
        "WHERE (status = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text]))"
    ),
    "sqlaq_jobs_debounce_idx": (
        "CREATE UNIQUE INDEX sqlaq_jobs_debounce_idx ON public.sqlaq_jobs USING btree "
        "(kind, debounce_key) WHERE ((status = 'queued'::text) AND (attempted_at IS NULL) "
        "AND (debounce_key IS NOT NULL))"
    ),
    "sqlaq_jobs_running_idx": (
        "CREATE INDEX sqlaq_jobs_running_idx ON public.sqlaq_jobs USING btree "
        "(kind, run_at) WHERE (status = 'running'::text)"
    ),
    "sqlaq_jobs_waiting_idx": (
        "CREATE INDEX sqlaq_jobs_waiting_idx ON public.sqlaq_jobs USING btree (id) "
        "WHERE ((status = 'queued'::text) AND (parent_ids IS NOT NULL))"
    ),
    "sqlaq_jobs_key_idx": (
        "CREATE INDEX sqlaq_jobs_key_idx ON public.sqlaq_jobs USING btree (kind, key, id) "
        "WHERE ((key IS NOT NULL) AND (status = ANY (ARRAY['queued'::text, 'running'::text, "
        "'failed'::text])))"
    ),
    "sqlaq_jobs_fair_idx": (
        "CREATE INDEX sqlaq_jobs_fair_idx ON public.sqlaq_jobs USING btree (queue, key, "
        "priority DESC, run_at, id) WHERE ((status = ANY (ARRAY['queued'::text, "
        "'running'::text])) AND (key IS NOT NULL))"
    ),
    "sqlaq_jobs_parents_idx": (
        "CREATE INDEX sqlaq_jobs_parents_idx ON public.sqlaq_jobs USING gin (parent_ids) "
        "WITH (fastupdate=off) WHERE (parent_ids IS NOT NULL)"
    ),
    "sqlaq_jobs_pkey": "CREATE UNIQUE INDEX sqlaq_jobs_pkey ON public.sqlaq_jobs USING btree (id)",
}

# A host's own model, as the design prescribes: a foreign key to sqlaq_jobs through the
# Column object, not a string (the two tables live in different MetaData).
host_metadata = MetaData()
orders = Table(
    "orders",
    host_metadata,
    Column("id", Integer, primary_key=True),
    Column("job_id", BigInteger, ForeignKey(sqlaq.jobs.c.id)),
)

#: How long a listener waits for a notification that must come, and for one that must not.
ARRIVAL_TIMEOUT = 10.0
ABSENCE_TIMEOUT = 0.5


# -- databases of our own -------------------------------------------------------------


@contextlib.contextmanager
def _connect(url: str) -> Iterator[Connection]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


@pytest.fixture
def fresh_url(server_url: str) -> Iterator[str]:
    with new_database(server_url, "sqlaq_mig") as url:
        yield url


@pytest.fixture(scope="module")
def migrated_url(server_url: str) -> Iterator[str]:
    """A database of this module's own, upgraded to heads through the repository's
    alembic.ini. Tests here read its catalog or commit jobs into it; none migrates it."""
    with new_database(server_url, "sqlaq_mig") as url:
        alembic.command.upgrade(alembic_config(url), "heads")
        yield url


@pytest.fixture(scope="module")
def migrated(migrated_url: str) -> Iterator[Engine]:
    # NullPool: a session setting such as `SET sqlaq.notify = off` dies with its
    # connection instead of riding a pooled one into the next test.
    engine = create_engine(migrated_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def _objects(conn: Connection) -> set[tuple[str, str]]:
    return {(row[0], row[1]) for row in conn.execute(_OBJECTS_SQL)}


def _versions(conn: Connection, version_table: str) -> list[str]:
    exists = conn.execute(text("SELECT to_regclass(:t)"), {"t": version_table}).scalar()
    if exists is None:
        return []
    return sorted(conn.execute(text(f"SELECT version_num FROM {version_table}")).scalars())


# -- the walk through the repository's alembic.ini -------------------------------------


def test_downgrade_removes_every_object(fresh_url: str) -> None:
    """upgrade heads creates every object, downgrade sqlaq@base removes every one, and
    upgrade heads works again."""
    cfg = alembic_config(fresh_url)

    alembic.command.upgrade(cfg, "heads")
    with _connect(fresh_url) as conn:
        assert _objects(conn) == SQLAQ_OBJECTS
        assert _versions(conn, "alembic_version") == [HEAD]

    alembic.command.downgrade(cfg, "sqlaq@base")
    with _connect(fresh_url) as conn:
        assert _objects(conn) == set()
        assert _versions(conn, "alembic_version") == []

    alembic.command.upgrade(cfg, "heads")
    with _connect(fresh_url) as conn:
        assert _objects(conn) == SQLAQ_OBJECTS
        assert _versions(conn, "alembic_version") == [HEAD]


def test_head_revision_is_the_sqlaq_head_of_alembic_ini() -> None:
    script = ScriptDirectory.from_config(alembic_config("postgresql://"))
    head = script.get_revision(f"{sqlaq.migrations.BRANCH}@head")
    first = script.get_revision(FIRST_REVISION)
    assert head is not None
    assert first is not None
    assert sqlaq.migrations.head_revision() == head.revision
    assert head.revision in script.get_heads()
    assert first.branch_labels == {sqlaq.migrations.BRANCH}
    standalone = ScriptDirectory.from_config(sqlaq.migrations.standalone_config())
    assert standalone.get_current_head() == sqlaq.migrations.HEAD


# -- head against sqlaq.metadata --------------------------------------------------------


def test_head_matches_metadata_per_autogenerate(migrated: Engine) -> None:
    """Autogenerate finds no difference, comparing types and server defaults too.

    Autogenerate is blind to partial-index predicates, CHECK constraint bodies, storage
    parameters and triggers (measured: changing any of them yields an empty diff); the
    catalog tests below pin those.
    """
    with migrated.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        assert compare_metadata(context, sqlaq.metadata) == []


def _table_catalog(conn: Connection) -> dict[str, list[tuple[Any, ...]]]:
    """sqlaq_jobs as PostgreSQL renders it: columns, constraints and indexes."""
    columns = conn.execute(
        text(
            """
            SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                   a.attidentity, pg_get_expr(d.adbin, d.adrelid)
            FROM pg_attribute a
            LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
            WHERE a.attrelid = 'sqlaq_jobs'::regclass AND a.attnum > 0
              AND NOT a.attisdropped
            ORDER BY a.attnum
            """
        )
    )
    constraints = conn.execute(
        text(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'sqlaq_jobs'::regclass ORDER BY conname"
        )
    )
    indexes = conn.execute(
        text(
            "SELECT indexname, indexdef FROM pg_indexes "
            "WHERE tablename = 'sqlaq_jobs' ORDER BY indexname"
        )
    )
    return {
        "columns": [tuple(row) for row in columns],
        "constraints": [tuple(row) for row in constraints],
        "indexes": [tuple(row) for row in indexes],
    }


def test_head_catalog_equals_metadata_create_all(migrated: Engine, fresh_url: str) -> None:
    """What autogenerate cannot see, compared exactly: the head revision and
    ``sqlaq.metadata.create_all`` give the same columns (in order, with types, defaults
    and identity), constraints (with CHECK bodies) and indexes (with predicates)."""
    with _connect(fresh_url) as conn:
        sqlaq.metadata.create_all(conn)
        conn.commit()
        from_metadata = _table_catalog(conn)
    with migrated.connect() as conn:
        from_head = _table_catalog(conn)
    assert from_head == from_metadata


# -- what autogenerate does not compare, from the catalog ------------------------------


def test_storage_parameters_equal_schema_constant(migrated: Engine) -> None:
    with migrated.connect() as conn:
        reloptions = conn.execute(
            text("SELECT reloptions FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
        ).scalar_one()
    assert dict(option.split("=", 1) for option in reloptions) == STORAGE_PARAMETERS


def test_indexes_hold_pending_or_finished_rows_only(migrated: Engine) -> None:
    with migrated.connect() as conn:
        rows = conn.execute(
            text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'sqlaq_jobs'")
        )
        indexdefs = {str(row.indexname): str(row.indexdef) for row in rows}
    assert indexdefs == EXPECTED_INDEXES


def _trigger(engine: Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text(
                """
                SELECT t.tgname, t.tgtype, t.tgenabled, p.proname,
                       pg_get_triggerdef(t.oid) AS definition
                FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
                WHERE t.tgrelid = 'sqlaq_jobs'::regclass AND NOT t.tgisinternal
                  AND t.tgname = :name
                """
            ),
            {"name": name},
        ).one()


def test_sqlaq_jobs_has_exactly_the_triggers_of_the_revisions(migrated: Engine) -> None:
    with migrated.connect() as conn:
        names = conn.execute(
            text(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = 'sqlaq_jobs'::regclass "
                "AND NOT tgisinternal ORDER BY tgname"
            )
        ).scalars()
        assert list(names) == [DEPS_TRIGGER, FINISH_TRIGGER, NOTIFY_TRIGGER]


def test_notify_trigger_runs_after_insert_once_per_statement(migrated: Engine) -> None:
    trigger = _trigger(migrated, NOTIFY_TRIGGER)
    assert trigger.tgname == "sqlaq_jobs_notify_trg"
    # tgtype bits (catalog/pg_trigger.h): ROW 1, BEFORE 2, INSERT 4, DELETE 8, UPDATE 16,
    # TRUNCATE 32, INSTEAD 64. INSERT alone: AFTER INSERT, FOR EACH STATEMENT.
    assert trigger.tgtype == 4
    assert trigger.tgenabled == "O"
    assert trigger.proname == "sqlaq_jobs_notify"
    assert "AFTER INSERT ON public.sqlaq_jobs" in trigger.definition
    assert "FOR EACH STATEMENT" in trigger.definition


def test_finish_trigger_runs_per_row_only_for_flagged_jobs_that_finish(migrated: Engine) -> None:
    """AFTER UPDATE OF status, FOR EACH ROW, with a WHEN clause: the function is called
    only for a flagged job entering a finished status (the catalog's own rendering)."""
    trigger = _trigger(migrated, FINISH_TRIGGER)
    # ROW 1 + UPDATE 16 (AFTER is the absence of BEFORE 2 and INSTEAD 64).
    assert trigger.tgtype == 17
    assert trigger.tgenabled == "O"
    assert trigger.proname == FINISH_FUNCTION
    assert trigger.definition == (
        "CREATE TRIGGER sqlaq_jobs_finish_trg AFTER UPDATE OF status ON public.sqlaq_jobs "
        "FOR EACH ROW WHEN ((new.awaited AND "
        "(new.status = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text])))) "
        "EXECUTE FUNCTION sqlaq_jobs_notify_finish()"
    )


# -- the trigger notifies ---------------------------------------------------------------


@pytest.fixture
def jobs_engine(migrated: Engine) -> Iterator[Engine]:
    """The migrated database for tests that commit jobs; emptied afterwards."""
    yield migrated
    with migrated.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_jobs"))


@pytest.fixture
def listener(migrated_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A raw autocommit connection that LISTENs on sqlaq's channel, as a worker's does."""
    conninfo = make_url(migrated_url).set(drivername="postgresql")
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute("LISTEN sqlaq_jobs")
        yield conn


def _received(listener: psycopg.Connection[Any], expected: int) -> list[str]:
    """Payloads of the *expected* notifications, plus any that follow within
    ABSENCE_TIMEOUT (which must be none)."""
    payloads = []
    if expected:
        for notify in listener.notifies(timeout=ARRIVAL_TIMEOUT, stop_after=expected):
            assert notify.channel == "sqlaq_jobs"
            payloads.append(notify.payload)
    payloads += [notify.payload for notify in listener.notifies(timeout=ABSENCE_TIMEOUT)]
    return payloads


def _queues(payloads: list[str]) -> list[str]:
    """The queues of positioned payloads (``'<queue> <priority> <microseconds>'``)."""
    return [payload.rsplit(" ", 2)[0] for payload in payloads]


def test_committed_enqueue_notifies_its_queue_and_position(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    with jobs_engine.begin() as conn:
        job_id = sqlaq.enqueue(conn, "send_email", {"user_id": 1}, queue="q1", priority=4).job_id
    with jobs_engine.connect() as conn:
        run_at = conn.execute(
            text("SELECT run_at FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
        ).scalar_one()
    [payload] = _received(listener, 1)
    assert parse_wake(payload, ["q1"]) == ("q1", ClaimPosition(4, run_at, -(2**63)))


def test_a_statements_notification_is_before_each_of_its_jobs(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    """One statement, several priorities and run_at: the highest priority and the
    earliest due run_at, a position no new job of the queue sits before."""
    with jobs_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (queue, kind, priority, run_at) VALUES "
                "('q1', 'k', 1, '2020-01-01 00:00:00.000001+00'), "
                "('q1', 'k', 5, '2021-06-01 12:00:00+00'), "
                "('q1', 'k', 9, now() + interval '1 hour'), "  # not due: not counted
                "('q2', 'k', -3, '2022-02-02 02:02:02.5+00')"
            )
        )
    received = dict(parse_wake(p, ["q1", "q2"]) or ("?", None) for p in _received(listener, 2))
    assert received == {
        "q1": ClaimPosition(5, datetime(2020, 1, 1, 0, 0, 0, 1, tzinfo=UTC), -(2**63)),
        "q2": ClaimPosition(-3, datetime(2022, 2, 2, 2, 2, 2, 500000, tzinfo=UTC), -(2**63)),
    }


def test_an_infinite_run_at_notifies_the_queue_alone(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    """No position to give (``-infinity`` is due, and no bigint): the queue alone, which
    a worker reads as "anywhere" (a full claim); the insert is never refused for it."""
    with jobs_engine.begin() as conn:
        conn.execute(
            text("INSERT INTO sqlaq_jobs (queue, kind, run_at) VALUES ('q1', 'k', '-infinity')")
        )
    assert _received(listener, 1) == ["q1"]


def test_rolled_back_enqueue_notifies_nothing(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    with jobs_engine.connect() as conn:
        sqlaq.enqueue(conn, "send_email", queue="q1")
        conn.rollback()
    assert _received(listener, 0) == []


def test_bulk_enqueue_notifies_once_per_due_queue(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    """1000 rows in one statement: one notification per queue with a due job, none for
    a queue whose jobs are all delayed."""
    due = [sqlaq.NewJob(kind="k", queue=f"q{i % 3 + 1}") for i in range(990)]
    later = [sqlaq.NewJob(kind="k", queue="later", delay=timedelta(hours=1)) for _ in range(10)]
    with jobs_engine.begin() as conn:
        results = sqlaq.enqueue_many(conn, due + later)
    assert len(results) == 1000
    assert sorted(_queues(_received(listener, 3))) == ["q1", "q2", "q3"]


def test_delayed_enqueue_notifies_nothing(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    with jobs_engine.begin() as conn:
        sqlaq.enqueue(conn, "send_email", queue="q1", delay=timedelta(hours=1))
    assert _received(listener, 0) == []


def test_notify_off_in_the_session_silences_the_trigger(
    jobs_engine: Engine, listener: psycopg.Connection[Any]
) -> None:
    with jobs_engine.connect() as conn:
        conn.execute(text("SET sqlaq.notify = off"))
        sqlaq.enqueue(conn, "send_email", queue="q1")
        conn.commit()
        assert _received(listener, 0) == []

        conn.execute(text("RESET sqlaq.notify"))  # the control: same session, switched back
        sqlaq.enqueue(conn, "send_email", queue="q1")
        conn.commit()
        assert _queues(_received(listener, 1)) == ["q1"]


# -- the standalone path (sqlaq migrate) --------------------------------------------------


def test_standalone_upgrade_creates_everything_and_records_head(fresh_url: str) -> None:
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn)
        assert not conn.in_transaction()  # committed, not left to the caller
    with _connect(fresh_url) as conn:
        assert _objects(conn) == SQLAQ_OBJECTS
        assert _versions(conn, "sqlaq_alembic_version") == [HEAD]
        assert _versions(conn, "alembic_version") == []
        assert sqlaq.migrations.check(conn) == HEAD


def test_standalone_downgrade_removes_every_object(fresh_url: str) -> None:
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn)
        sqlaq.migrations.downgrade(conn)
    with _connect(fresh_url) as conn:
        assert _objects(conn) == set()
        assert _versions(conn, "sqlaq_alembic_version") == []


#: What sqlaq_0003 adds to sqlaq_0002's objects.
RESULT_OBJECTS = frozenset(
    {("pg_proc", "sqlaq_jobs_notify_finish"), ("pg_trigger", "sqlaq_jobs_finish_trg")}
)


def _columns(conn: Connection) -> list[str]:
    return list(
        conn.execute(
            text(
                "SELECT attname FROM pg_attribute WHERE attrelid = 'sqlaq_jobs'::regclass "
                "AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
            )
        ).scalars()
    )


def test_results_revision_rewrites_nothing_and_walks_back_to_0002(fresh_url: str) -> None:
    """sqlaq_0003 on a table with rows keeps its file (no rewrite: the same relfilenode),
    the rows read NULL and false, and a downgrade to sqlaq_0002 removes exactly what it
    added."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0002")
        conn.execute(text("INSERT INTO sqlaq_jobs (kind) SELECT 'k' FROM generate_series(1, 100)"))
        conn.commit()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn, "sqlaq_0003")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0003"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert _objects(conn) == before | RESULT_OBJECTS
        assert _columns(conn) == [*columns_before, "result", "awaited"]
        rows = conn.execute(text("SELECT DISTINCT result, awaited FROM sqlaq_jobs")).all()
        assert [tuple(row) for row in rows] == [(None, False)]
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0002")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0002"
        assert _objects(conn) == before
        assert _columns(conn) == columns_before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()


#: What sqlaq_0004 adds to sqlaq_0003's objects: two tables and what they bring.
OPERATOR_OBJECTS = frozenset(
    (catalog, name)
    for table in ("sqlaq_paused_queues", "sqlaq_workers")
    for catalog, name in (
        ("pg_class", table),
        ("pg_class", f"{table}_pkey"),
        ("pg_constraint", f"{table}_pkey"),
        ("pg_type", table),
        ("pg_type", f"_{table}"),
    )
)


def test_operators_revision_rewrites_nothing_and_walks_back_to_0003(fresh_url: str) -> None:
    """sqlaq_0004 on a table with rows keeps its file (``headers`` is nullable without a
    default), adds its two tables, and a downgrade to sqlaq_0003 removes exactly what it
    added."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0003")
        conn.execute(text("INSERT INTO sqlaq_jobs (kind) SELECT 'k' FROM generate_series(1, 100)"))
        conn.commit()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn, "sqlaq_0004")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0004"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert (
            _objects(conn)
            == before | OPERATOR_OBJECTS
            == (
                SQLAQ_OBJECTS
                - DEBOUNCE_OBJECTS
                - WORKFLOW_OBJECTS
                - KEY_OBJECTS
                - FAIR_OBJECTS
                - CHILDREN_OBJECTS
            )
        )
        assert _columns(conn) == [*columns_before, "headers"]
        headers = conn.execute(text("SELECT DISTINCT headers FROM sqlaq_jobs")).all()
        assert [tuple(row) for row in headers] == [(None,)]
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0003")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0003"
        assert _objects(conn) == before
        assert _columns(conn) == columns_before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()


#: What sqlaq_0005 adds to sqlaq_0004's objects: the holds table and the debounce index.
DEBOUNCE_OBJECTS = frozenset(
    {
        ("pg_class", "sqlaq_jobs_debounce_idx"),
        ("pg_class", "sqlaq_unique_holds"),
        ("pg_class", "sqlaq_unique_holds_pkey"),
        ("pg_class", "sqlaq_unique_holds_expires_at_idx"),
        ("pg_constraint", "sqlaq_unique_holds_pkey"),
        ("pg_type", "sqlaq_unique_holds"),
        ("pg_type", "_sqlaq_unique_holds"),
    }
)


def test_debounce_revision_rewrites_nothing_and_walks_back_to_0004(fresh_url: str) -> None:
    """sqlaq_0005 on a table with rows keeps its file (``debounce_key`` and ``timeout``
    are nullable without a default), adds the holds table and the debounce index, and a
    downgrade to sqlaq_0004 removes exactly what it added."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0004")
        conn.execute(text("INSERT INTO sqlaq_jobs (kind) SELECT 'k' FROM generate_series(1, 100)"))
        conn.commit()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn, "sqlaq_0005")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0005"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert (
            _objects(conn)
            == before | DEBOUNCE_OBJECTS
            == SQLAQ_OBJECTS - WORKFLOW_OBJECTS - KEY_OBJECTS - FAIR_OBJECTS - CHILDREN_OBJECTS
        )
        assert _columns(conn) == [*columns_before, "debounce_key", "timeout"]
        added = conn.execute(text("SELECT DISTINCT debounce_key, timeout FROM sqlaq_jobs")).all()
        assert [tuple(row) for row in added] == [(None, None)]
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0004")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0004"
        assert _objects(conn) == before
        assert _columns(conn) == columns_before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()


def test_standalone_upgrade_in_a_callers_transaction_commits_with_it(fresh_url: str) -> None:
    """On a connection already in a transaction (autobegun by any earlier statement,
    ``check`` included), Alembic runs the DDL inside it and commits nothing: the caller
    decides, and a rollback leaves no trace."""
    with _connect(fresh_url) as conn:
        conn.begin()
        sqlaq.migrations.upgrade(conn)
        assert conn.in_transaction()
        assert _objects(conn) == SQLAQ_OBJECTS
        conn.rollback()
        assert _objects(conn) == set()
        assert _versions(conn, "sqlaq_alembic_version") == []


def test_check_on_an_empty_database_names_the_commands(fresh_url: str) -> None:
    with (
        _connect(fresh_url) as conn,
        pytest.raises(sqlaq.SchemaOutOfDateError, match=HEAD) as raised,
    ):
        sqlaq.migrations.check(conn)
    assert "'alembic upgrade heads'" in str(raised.value)
    assert "'sqlaq migrate'" in str(raised.value)


@pytest.mark.parametrize(
    ("recorded", "fix"),
    [("sqlaq_0000", "run 'alembic upgrade heads'"), ("sqlaq_9999", "upgrade sqlaq")],
)
def test_check_on_another_revision_names_the_fix(fresh_url: str, recorded: str, fix: str) -> None:
    with _connect(fresh_url) as conn:
        conn.execute(
            text(
                "CREATE FUNCTION sqlaq_jobs_schema_revision() RETURNS text"
                f" LANGUAGE sql AS $$ SELECT '{recorded}'::text $$"
            )
        )
        with pytest.raises(sqlaq.SchemaOutOfDateError) as raised:
            sqlaq.migrations.check(conn)
        conn.rollback()
    assert f"database is at {recorded}" in str(raised.value)
    assert fix in str(raised.value)


def test_check_finds_sqlaq_in_a_hosts_alembic_version(migrated: Engine) -> None:
    with migrated.connect() as conn:
        assert sqlaq.migrations.check(conn) == HEAD


def test_check_sees_sqlaq_behind_a_host_revision_that_depends_on_it(
    fresh_url: str, tmp_path: Path
) -> None:
    # Depending on sqlaq's head, the host's revision is the only row Alembic keeps.
    (tmp_path / "host_0001_orders.py").write_text(_host_revision("host_0001", HEAD))
    cfg = alembic_config(fresh_url)
    cfg.set_main_option("version_locations", f"{tmp_path} {sqlaq.migrations.VERSION_LOCATION}")
    alembic.command.upgrade(cfg, "heads")
    with _connect(fresh_url) as conn:
        assert _versions(conn, "alembic_version") == ["host_0001"]  # sqlaq's head is implied
        assert sqlaq.migrations.check(conn) == HEAD


def test_upgrade_sql_returns_the_ddl_without_a_database(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Offline mode (``sql=True``): the DDL comes back as text, no connection is made,
    and nothing is printed."""
    sql = sqlaq.migrations.upgrade_sql()
    assert capsys.readouterr().out == ""
    assert "CREATE TABLE sqlaq_jobs" in sql
    assert "CREATE TRIGGER sqlaq_jobs_notify_trg" in sql
    assert "CREATE TABLE sqlaq_periodic" in sql
    assert "CREATE TRIGGER sqlaq_jobs_finish_trg" in sql
    assert "CREATE TABLE sqlaq_paused_queues" in sql
    assert "CREATE TABLE sqlaq_workers" in sql
    assert "INSERT INTO sqlaq_alembic_version (version_num) VALUES ('sqlaq_0001')" in sql
    assert f"SET version_num='{HEAD}'" in sql


# -- include_name ---------------------------------------------------------------------------


def _parents(table: str) -> dict[str, str | None]:
    # What Alembic passes for a column, index or constraint of *table*.
    return {"schema_name": None, "table_name": table, "schema_qualified_table_name": table}


@pytest.mark.parametrize(
    ("name", "type_", "parent_names"),
    [
        ("sqlaq_jobs", "table", {"schema_name": None}),
        ("sqlaq_alembic_version", "table", {"schema_name": None}),
        ("sqlaq_jobs_claim_idx", "index", _parents("sqlaq_jobs")),
        ("sqlaq_jobs_dedupe_idx", "index", _parents("sqlaq_jobs")),
        ("sqlaq_jobs_finished_idx", "index", _parents("sqlaq_jobs")),
        ("sqlaq_paused_queues", "table", {"schema_name": None}),
        ("sqlaq_workers", "table", {"schema_name": None}),
        ("status", "column", _parents("sqlaq_jobs")),
        ("sqlaq_jobs_status_check", "check_constraint", _parents("sqlaq_jobs")),
        ("version_num", "column", _parents("sqlaq_alembic_version")),
    ],
)
def test_include_name_hides_sqlaq_objects(
    name: str, type_: str, parent_names: Mapping[str, Any]
) -> None:
    assert sqlaq.migrations.include_name(name, type_, parent_names) is False


@pytest.mark.parametrize(
    ("name", "type_", "parent_names"),
    [
        ("orders", "table", {"schema_name": None}),
        ("job_id", "column", _parents("orders")),
        ("orders_job_id_idx", "index", _parents("orders")),
        ("status", "column", _parents("orders")),
    ],
)
def test_include_name_keeps_host_objects(
    name: str, type_: str, parent_names: Mapping[str, Any]
) -> None:
    assert sqlaq.migrations.include_name(name, type_, parent_names) is True


def test_include_name_keeps_a_hosts_autogenerate_off_sqlaq(migrated: Engine) -> None:
    """A host's autogenerate over a database with sqlaq installed proposes only the
    host's own table; without the hook it would drop sqlaq_jobs."""
    with migrated.connect() as conn:
        hooked = MigrationContext.configure(
            conn, opts={"include_name": sqlaq.migrations.include_name}
        )
        diff = compare_metadata(hooked, host_metadata)
        assert [(op, obj.name) for op, obj in diff] == [("add_table", "orders")]

        bare = MigrationContext.configure(conn)
        bare_diff = [(d[0], d[1].name) for d in compare_metadata(bare, host_metadata)]
        assert ("remove_table", "sqlaq_jobs") in bare_diff


# -- a host project consuming sqlaq from a wheel -----------------------------------------


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from this checkout, unzipped: a directory that holds ``sqlaq`` as
    installed, for the front of a subprocess's PYTHONPATH."""
    dist = tmp_path_factory.mktemp("dist")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist)]
    if importlib.util.find_spec("hatchling") is not None:
        argv.append("--no-build-isolation")  # else pip fetches hatchling into an isolated env
    built = subprocess.run(
        [*argv, str(ROOT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("sqlaq-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _host_revision(revision: str, depends_on: str = FIRST_REVISION) -> str:
    """A host's first revision written by hand, as autogenerate writes it."""
    return textwrap.dedent(
        f"""\
        import sqlalchemy as sa
        from alembic import op

        revision = {revision!r}
        down_revision = None
        branch_labels = None
        depends_on = {depends_on!r}


        def upgrade():
            op.create_table(
                "orders",
                sa.Column("id", sa.Integer(), primary_key=True),
                sa.Column("job_id", sa.BigInteger(), sa.ForeignKey("sqlaq_jobs.id")),
            )


        def downgrade():
            op.drop_table("orders")
        """
    )


_HOST_MODELS = """\
from sqlalchemy import BigInteger, Column, ForeignKey, Integer, MetaData, Table

import sqlaq

metadata = MetaData()
orders = Table(
    "orders",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("job_id", BigInteger, ForeignKey(sqlaq.jobs.c.id)),
)
"""

_HOST_ENV = """\
from alembic import context
from sqlalchemy import create_engine

import host_models
import sqlaq
import sqlaq.migrations

print(f"sqlaq imported from {sqlaq.__file__}")

engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=host_models.metadata,
        include_name=sqlaq.migrations.include_name,
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""


def _host_ini(url: str, *, path_separator: str, version_locations: str) -> str:
    return textwrap.dedent(
        f"""\
        [alembic]
        script_location = %(here)s/alembic
        prepend_sys_path = %(here)s
        path_separator = {path_separator}
        version_locations = {version_locations}
        sqlalchemy.url = {url.replace("%", "%%")}
        """
    )


#: The docs' version_locations (how-to/migrations.md): the host's directory, then sqlaq's.
README_LOCATIONS = f"%(here)s/alembic/versions {sqlaq.migrations.VERSION_LOCATION}"


def _make_host(root: Path, url: str) -> Path:
    """A throwaway host project: alembic.ini as the docs say, an env.py with its own
    models and sqlaq's include_name, an empty versions directory."""
    (root / "alembic" / "versions").mkdir(parents=True)
    (root / "alembic" / "script.py.mako").write_text(
        (ROOT / "alembic" / "script.py.mako").read_text()
    )
    (root / "alembic" / "env.py").write_text(_HOST_ENV)
    (root / "host_models.py").write_text(_HOST_MODELS)
    (root / "alembic.ini").write_text(
        _host_ini(url, path_separator="space", version_locations=README_LOCATIONS)
    )
    return root


def _alembic(
    host: Path, site: Path, *args: str, ok: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python -m alembic ARGS`` in *host*, importing sqlaq from *site* only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SQLAQ_"))}
    env["PYTHONPATH"] = str(site)  # first on sys.path after the host directory itself
    done = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=host,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if ok:
        assert done.returncode == 0, f"alembic {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done


@pytest.mark.timeout(240)
def test_host_project_consumes_sqlaq_from_a_wheel(
    wheel_site: Path, fresh_url: str, tmp_path: Path
) -> None:
    host = _make_host(tmp_path / "host", fresh_url)
    wheel_versions = wheel_site / "sqlaq" / "migrations" / "versions"

    # sqlaq's branch is found through the wheel, not the source tree.
    heads = _alembic(host, wheel_site, "heads", "--verbose")
    assert f"Rev: {HEAD} (head)" in heads.stdout
    assert f"Path: {wheel_versions}" in heads.stdout
    assert str(ROOT) not in heads.stdout

    upgraded = _alembic(host, wheel_site, "upgrade", "heads")
    assert f"sqlaq imported from {wheel_site / 'sqlaq' / '__init__.py'}" in upgraded.stdout

    # The host's first own revision. --head=base starts the host's own branch: without it
    # Alembic would stack the revision on sqlaq_0001, inside sqlaq's branch. With several
    # version locations Alembic also needs --version-path to know where to write it. And
    # since orders.job_id references sqlaq_jobs, the revision depends on the sqlaq revision
    # that creates that table: otherwise nothing orders the two branches on a fresh
    # database and `upgrade heads` may create orders before sqlaq_jobs.
    _alembic(
        host,
        wheel_site,
        "revision",
        "--autogenerate",
        "--head=base",
        "--version-path=alembic/versions",
        f"--depends-on={FIRST_REVISION}",
        "-m",
        "orders",
    )
    (revision_file,) = (host / "alembic" / "versions").glob("*_orders.py")
    source = revision_file.read_text()
    host_rev = re.search(r"^revision: str = '(\w+)'$", source, re.MULTILINE)
    assert host_rev is not None
    assert "down_revision: Union[str, Sequence[str], None] = None" in source
    assert f"depends_on: Union[str, Sequence[str], None] = '{FIRST_REVISION}'" in source
    assert "op.create_table('orders'" in source
    # sqlaq's objects appear only as the foreign key's target: nothing creates or drops them.
    assert source.count("sqlaq_jobs") == 1
    assert "['sqlaq_jobs.id']" in source

    heads = _alembic(host, wheel_site, "heads")
    assert sorted(line.split()[0] for line in heads.stdout.splitlines()) == sorted(
        [host_rev[1], HEAD]
    )

    _alembic(host, wheel_site, "upgrade", "heads")
    checked = _alembic(host, wheel_site, "check")
    assert "No new upgrade operations detected" in checked.stdout

    # From nothing to both branches in one `upgrade heads`, sqlaq's first.
    _alembic(host, wheel_site, "downgrade", "base")
    with _connect(fresh_url) as conn:
        assert _objects(conn) == set()
        assert conn.execute(text("SELECT to_regclass('orders')")).scalar() is None
    _alembic(host, wheel_site, "upgrade", "heads")
    with _connect(fresh_url) as conn:
        assert _objects(conn) == SQLAQ_OBJECTS
        referenced = conn.execute(
            text(
                "SELECT confrelid::regclass::text FROM pg_constraint "
                "WHERE conrelid = 'orders'::regclass AND contype = 'f'"
            )
        ).scalar_one()
        assert referenced == "sqlaq_jobs"
        # depends_on makes sqlaq_0001 implied by the host's revision: Alembic records
        # the host's and sqlaq's later head, never sqlaq_0001 (see
        # test_check_sees_sqlaq_behind_a_host_revision_that_depends_on_it).
        assert _versions(conn, "alembic_version") == sorted([host_rev[1], HEAD])


@pytest.mark.timeout(240)
def test_os_path_separator_loses_the_sqlaq_branch(wheel_site: Path, tmp_path: Path) -> None:
    """With ``path_separator = os`` (":" on POSIX) the docs' version_locations line
    is split on ":" only: neither half is a directory, so `alembic heads` silently lists
    nothing at all and exits 0. Written the os way (":"-joined), "sqlaq:migrations/versions"
    is cut in two and sqlaq's branch vanishes; a host revision that depends on it then
    breaks Alembic with a KeyError."""
    host = _make_host(tmp_path / "host", "")  # `alembic heads` needs no database
    (host / "alembic" / "versions" / "host_0001_orders.py").write_text(_host_revision("host_0001"))
    ini = host / "alembic.ini"

    # The control: the docs' configuration finds both branches.
    assert _alembic(host, wheel_site, "heads").stdout.split() == [
        "host_0001",
        "(head)",
        HEAD,
        "(sqlaq)",
        "(head)",
    ]

    ini.write_text(_host_ini("", path_separator="os", version_locations=README_LOCATIONS))
    assert _alembic(host, wheel_site, "heads").stdout == ""

    colon_list = f"%(here)s/alembic/versions:{sqlaq.migrations.VERSION_LOCATION}"
    ini.write_text(_host_ini("", path_separator="os", version_locations=colon_list))
    broken = _alembic(host, wheel_site, "heads", ok=False)
    assert broken.returncode != 0
    assert f"KeyError: '{FIRST_REVISION}'" in broken.stderr


#: What sqlaq_0006 adds to sqlaq_0005's objects: the edges table, the waiting index, the
#: failure policy's CHECK, and the trigger that settles a finished parent's children.
WORKFLOW_OBJECTS = frozenset(
    {
        ("pg_class", "sqlaq_jobs_waiting_idx"),
        ("pg_class", "sqlaq_job_deps"),
        ("pg_class", "sqlaq_job_deps_pkey"),
        ("pg_class", "sqlaq_job_deps_child_id_idx"),
        ("pg_constraint", "sqlaq_job_deps_pkey"),
        ("pg_constraint", "sqlaq_jobs_on_parent_failure_check"),
        ("pg_proc", "sqlaq_jobs_settle_children"),
        ("pg_trigger", "sqlaq_jobs_deps_trg"),
        ("pg_type", "sqlaq_job_deps"),
        ("pg_type", "_sqlaq_job_deps"),
    }
)


def test_workflow_revision_rewrites_nothing_and_walks_back_to_0005(fresh_url: str) -> None:
    """sqlaq_0006 on a table with rows keeps its file (the new columns are nullable or
    have a constant default), adds the workflow objects, and a downgrade to sqlaq_0005
    removes exactly what it added."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0005")
        conn.execute(text("INSERT INTO sqlaq_jobs (kind) SELECT 'k' FROM generate_series(1, 100)"))
        conn.commit()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn, "sqlaq_0006")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0006"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert (
            _objects(conn)
            == before | WORKFLOW_OBJECTS
            == SQLAQ_OBJECTS - KEY_OBJECTS - FAIR_OBJECTS - CHILDREN_OBJECTS
        )
        assert _columns(conn) == [
            *columns_before,
            "has_dependents",
            "on_parent_failure",
            "parent_ids",
        ]
        added = conn.execute(
            text("SELECT DISTINCT has_dependents, on_parent_failure, parent_ids FROM sqlaq_jobs")
        ).all()
        assert [tuple(row) for row in added] == [(False, None, None)]
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0005")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0005"
        assert _objects(conn) == before
        assert _columns(conn) == columns_before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()


def test_claim_bounds_revision_changes_the_payload_alone_and_walks_back_to_0007(
    fresh_url: str,
) -> None:
    """sqlaq_0008 replaces the insert trigger's function only: the payload gains the
    position (``'<queue> <priority> <microseconds>'``); a downgrade to sqlaq_0007
    restores the queue alone, and the same objects."""
    conninfo = make_url(fresh_url).set(drivername="postgresql").render_as_string(False)
    insert = text("INSERT INTO sqlaq_jobs (queue, kind, priority) VALUES ('q1', 'k', 2)")
    with _connect(fresh_url) as conn, psycopg.connect(conninfo, autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_jobs")
        sqlaq.migrations.upgrade(conn, "sqlaq_0007")
        before = _objects(conn)
        conn.execute(insert)
        conn.commit()
        assert _received(listener, 1) == ["q1"]

        sqlaq.migrations.upgrade(conn, "sqlaq_0008")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0008"
        assert _objects(conn) == before
        conn.execute(insert)
        conn.commit()
        [payload] = _received(listener, 1)
        assert re.fullmatch(r"q1 2 [0-9]{16}", payload), payload

        sqlaq.migrations.downgrade(conn, "sqlaq_0007")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0007"
        assert _objects(conn) == before
        conn.execute(insert)
        conn.commit()
        assert _received(listener, 1) == ["q1"]


# -- downgrading one branch of a host's project ---------------------------------------------


def _labelled_host_revisions(versions: Path) -> tuple[str, str]:
    """A host's own branch, labelled ``host``: host_0001 creates ``orders`` (referencing
    sqlaq_jobs, so it depends on sqlaq_0001), host_0002 creates ``invoices``."""
    first = _host_revision("host_0001").replace("branch_labels = None", "branch_labels = ('host',)")
    (versions / "host_0001_orders.py").write_text(first)
    (versions / "host_0002_invoices.py").write_text(
        textwrap.dedent(
            """\
            import sqlalchemy as sa
            from alembic import op

            revision = "host_0002"
            down_revision = "host_0001"
            branch_labels = None
            depends_on = None


            def upgrade():
                op.create_table("invoices", sa.Column("id", sa.Integer(), primary_key=True))


            def downgrade():
                op.drop_table("invoices")
            """
        )
    )
    return "host_0001", "host_0002"


def _tables(conn: Connection, *names: str) -> dict[str, bool]:
    exists = "SELECT to_regclass(:t) IS NOT NULL"
    return {name: conn.execute(text(exists), {"t": name}).scalar_one() for name in names}


@pytest.mark.timeout(240)
def test_a_branch_label_downgrades_one_branch_and_leaves_the_other(
    fresh_url: str, tmp_path: Path
) -> None:
    """In a host's Alembic project with sqlaq's branch beside its own, ``downgrade
    sqlaq@-1`` steps back sqlaq's branch only (the host's tables stay), and ``downgrade
    host@-1`` the host's only (sqlaq's objects stay). A bare ``downgrade -1`` with two
    heads names no branch: Alembic warns and steps back a branch of its choosing."""
    host = _make_host(tmp_path / "host", fresh_url)
    host_first, host_head = _labelled_host_revisions(host / "alembic" / "versions")
    head_script = ScriptDirectory.from_config(alembic_config("")).get_revision(HEAD)
    assert head_script is not None
    assert isinstance(head_script.down_revision, str)
    _alembic(host, ROOT, "upgrade", "heads")
    with _connect(fresh_url) as conn:
        assert _versions(conn, "alembic_version") == sorted([host_head, HEAD])

    # A bare relative step with two heads: Alembic only warns that it is ambiguous (and
    # that a future release will refuse it), then steps back one of the branches, its
    # choice: here it may be sqlaq's while the host meant its own. Hence the labels.
    bare = _alembic(host, ROOT, "downgrade", "-1")
    assert "downgrade -1 from multiple heads is ambiguous" in bare.stderr, bare.stderr
    with _connect(fresh_url) as conn:
        assert _versions(conn, "alembic_version") in (
            sorted([host_head, head_script.down_revision]),  # sqlaq's branch stepped back
            sorted([host_first, HEAD]),  # or the host's
        )
    _alembic(host, ROOT, "upgrade", "heads")

    # sqlaq's branch one step back: its last revision's objects go, the host's stay.
    _alembic(host, ROOT, "downgrade", f"{sqlaq.migrations.BRANCH}@-1")
    with _connect(fresh_url) as conn:
        previous = head_script.down_revision
        assert _versions(conn, "alembic_version") == sorted([host_head, previous])
        left = _objects(conn)
        assert ("pg_class", "sqlaq_jobs") in left
        # The head revision's downgrade ran (it may add no object: sqlaq_0008 replaces
        # a function).
        assert left <= SQLAQ_OBJECTS
        revision = conn.execute(text("SELECT sqlaq_jobs_schema_revision()")).scalar_one()
        assert revision == previous
        assert _tables(conn, "orders", "invoices") == {"orders": True, "invoices": True}

    # The host's branch one step back: invoices go; orders and every sqlaq object stay.
    _alembic(host, ROOT, "upgrade", "heads")
    _alembic(host, ROOT, "downgrade", "host@-1")
    with _connect(fresh_url) as conn:
        assert _versions(conn, "alembic_version") == sorted([host_first, HEAD])
        assert _objects(conn) == SQLAQ_OBJECTS
        assert _tables(conn, "orders", "invoices") == {"orders": True, "invoices": False}


#: What sqlaq_0007 adds to sqlaq_0006's objects: the key index.
KEY_OBJECTS = frozenset({("pg_class", "sqlaq_jobs_key_idx")})


def test_keys_revision_rewrites_nothing_and_walks_back_to_0006(fresh_url: str) -> None:
    """sqlaq_0007 on a table with rows keeps its file (``key`` is nullable without a
    default), adds the key index only, and a downgrade to sqlaq_0006 removes exactly
    what it added."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0006")
        conn.execute(text("INSERT INTO sqlaq_jobs (kind) SELECT 'k' FROM generate_series(1, 100)"))
        conn.commit()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn, "sqlaq_0007")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0007"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert (
            _objects(conn)
            == before | KEY_OBJECTS
            == SQLAQ_OBJECTS - FAIR_OBJECTS - CHILDREN_OBJECTS
        )
        assert _columns(conn) == [*columns_before, "key"]
        keys = conn.execute(text("SELECT DISTINCT key FROM sqlaq_jobs")).scalars().all()
        assert keys == [None]
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0006")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0006"
        assert _objects(conn) == before
        assert _columns(conn) == columns_before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()


#: What sqlaq_0009 adds to sqlaq_0008's objects: the fair index.
FAIR_OBJECTS = frozenset({("pg_class", "sqlaq_jobs_fair_idx")})


def test_fair_revision_rewrites_nothing_and_walks_back_to_0008(fresh_url: str) -> None:
    """sqlaq_0009 on a table with rows keeps its file, adds the fair index only (a
    partial index over the pending keyed rows), and a downgrade to sqlaq_0008 removes exactly
    what it added."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0008")
        conn.execute(
            text("INSERT INTO sqlaq_jobs (kind, key) SELECT 'k', 't' FROM generate_series(1, 100)")
        )
        conn.commit()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn, "sqlaq_0009")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0009"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert _objects(conn) == before | FAIR_OBJECTS == SQLAQ_OBJECTS - CHILDREN_OBJECTS
        assert _columns(conn) == columns_before
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0008")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0008"
        assert _objects(conn) == before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()


#: What sqlaq_0010 adds to sqlaq_0009's objects: the parents index.
CHILDREN_OBJECTS = frozenset({("pg_class", "sqlaq_jobs_parents_idx")})


def test_children_revision_rewrites_nothing_and_walks_back_to_0009(fresh_url: str) -> None:
    """sqlaq_0010 on a table with workflow jobs keeps its file, adds the parents index
    only (GIN over the rows that have parents; the walks' plans are tested in
    tests/db/test_workflow_operators.py) and replaces the settle function, and a
    downgrade to sqlaq_0009 removes exactly what it added and puts the function back."""
    relfilenode = text("SELECT relfilenode FROM pg_class WHERE oid = 'sqlaq_jobs'::regclass")
    settle = text("SELECT pg_get_functiondef('sqlaq_jobs_settle_children'::regproc)")
    with _connect(fresh_url) as conn:
        sqlaq.migrations.upgrade(conn, "sqlaq_0009")
        flows = [sqlaq.chain(conn, [sqlaq.NewJob("step"), sqlaq.NewJob("step")]) for _ in range(50)]
        conn.commit()
        settle_before = conn.execute(settle).scalar_one()
        before = _objects(conn)
        columns_before = _columns(conn)
        file_before = conn.execute(relfilenode).scalar_one()
        conn.commit()

        sqlaq.migrations.upgrade(conn)
        assert sqlaq.migrations.check(conn, deep=True) == "sqlaq_0010"
        assert conn.execute(relfilenode).scalar_one() == file_before
        assert _objects(conn) == before | CHILDREN_OBJECTS == SQLAQ_OBJECTS
        assert _columns(conn) == columns_before
        read = sqlaq.read_workflow(conn, flows[7].job_ids[0])
        assert [job.job_id for job in read.jobs] == list(flows[7].job_ids)
        conn.commit()

        assert conn.execute(settle).scalar_one() != settle_before
        conn.commit()

        sqlaq.migrations.downgrade(conn, "sqlaq_0009")
        assert sqlaq.migrations.current_revision(conn) == "sqlaq_0009"
        assert _objects(conn) == before
        assert conn.execute(settle).scalar_one() == settle_before
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 100
        conn.commit()
