"""``sqlaq.migrations.check(conn, deep=True)`` and ``sqlaq check --deep``.

The shallow check reads the revision marker only: with the claim index and the NOTIFY
trigger dropped it still says all is well. The deep one compares every object the head
revision creates with the catalog, names each difference and its fix; here each fix is
run as given and the schema checks clean again. The expected definitions it compares
with (``sqlaq.migrations.drift``) are pinned to a freshly migrated head, so they cannot
drift from the revisions.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import alembic.command
import pytest
from conftest import alembic_config, new_database
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.pool import NullPool

import sqlaq.migrations
from sqlaq import admin
from sqlaq.migrations import Difference, SchemaDriftError, drift

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def url(server_url: str) -> Iterator[str]:
    """A database of the test's own at sqlaq's head (the test may break its schema)."""
    with new_database(server_url, "sqlaq_deep") as database:
        engine = create_engine(database, poolclass=NullPool)
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
        engine.dispose()
        yield database


@pytest.fixture
def db(url: str) -> Iterator[Connection]:
    """An autocommit connection to it (CONCURRENTLY cannot run in a transaction)."""
    engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        yield conn
    engine.dispose()


def _drifted(conn: Connection, *statements: str) -> list[Difference]:
    """Run *statements*; the deep check must fail, then its fixes must make it pass."""
    for statement in statements:
        conn.execute(text(statement))
    assert sqlaq.migrations.check(conn) == sqlaq.migrations.HEAD  # the marker is fine
    with pytest.raises(SchemaDriftError) as raised:
        sqlaq.migrations.check(conn, deep=True)
    found = raised.value.differences
    assert found == sqlaq.migrations.differences(conn)
    for difference in found:
        assert str(difference) in str(raised.value)
        for fix in difference.statements:
            conn.execute(text(fix))
    assert sqlaq.migrations.differences(conn) == []
    return found


def test_a_fresh_head_checks_clean(db: Connection) -> None:
    assert sqlaq.migrations.check(db, deep=True) == sqlaq.migrations.HEAD
    assert sqlaq.migrations.differences(db) == []


def test_a_head_migrated_through_alembic_ini_checks_clean_too(server_url: str) -> None:
    with new_database(server_url, "sqlaq_deep") as database:
        alembic.command.upgrade(alembic_config(database), "heads")
        engine = create_engine(database, poolclass=NullPool)
        with engine.connect() as conn:
            assert sqlaq.migrations.differences(conn) == []
        engine.dispose()


def test_the_expected_definitions_are_every_object_of_a_fresh_head(db: Connection) -> None:
    """Pinned to the catalog exactly: a revision that adds or changes an index,
    constraint, trigger or trigger function must say so in drift.py."""
    tables = list(drift.EXPECTED_TABLES)
    indexes = {
        row.name: (row.table, drift._plain(row.definition, row.schema))
        for row in db.execute(sqlaq.queries.catalog_indexes_stmt(tables=tables))
        if not row.constraint
    }
    assert indexes == drift.EXPECTED_INDEXES
    constraints = {
        row.name: (row.table, drift._plain(row.definition, row.schema))
        for row in db.execute(sqlaq.queries.catalog_constraints_stmt(tables=tables))
    }
    assert constraints == drift.EXPECTED_CONSTRAINTS
    triggers = {
        row.name: (row.table, drift._plain(row.definition, row.schema))
        for row in db.execute(sqlaq.queries.catalog_triggers_stmt(tables=tables))
    }
    assert triggers == drift.EXPECTED_TRIGGERS
    functions = db.execute(
        text(
            "SELECT proname FROM pg_proc WHERE proname LIKE 'sqlaq\\_%' "
            "AND proname <> 'sqlaq_jobs_schema_revision'"
        )
    ).scalars()
    assert set(functions) == set(drift.EXPECTED_FUNCTIONS)


def test_a_dropped_index_is_found_and_recreated(db: Connection) -> None:
    (difference,) = _drifted(db, "DROP INDEX sqlaq_jobs_claim_idx")
    assert (difference.kind, difference.name, difference.problem) == (
        "index",
        "sqlaq_jobs_claim_idx",
        "missing",
    )
    assert difference.statements == (
        "CREATE INDEX CONCURRENTLY sqlaq_jobs_claim_idx ON sqlaq_jobs USING btree "
        "(queue, priority DESC, run_at, id) "
        "WHERE (status = ANY (ARRAY['queued'::text, 'running'::text]))",
    )


def test_an_altered_index_is_found_and_rebuilt_beside_the_old_one(db: Connection) -> None:
    (difference,) = _drifted(
        db,
        "DROP INDEX sqlaq_jobs_running_idx",
        "CREATE INDEX sqlaq_jobs_running_idx ON sqlaq_jobs (kind) WHERE status = 'running'",
    )
    assert difference.problem.startswith(
        'differs: found "CREATE INDEX sqlaq_jobs_running_idx ON sqlaq_jobs USING btree (kind) '
    )
    assert [fix.split(" ON ")[0] for fix in difference.statements] == [
        "CREATE INDEX CONCURRENTLY sqlaq_jobs_running_idx_new",
        "DROP INDEX CONCURRENTLY sqlaq_jobs_running_idx",
        "ALTER INDEX sqlaq_jobs_running_idx_new RENAME TO sqlaq_jobs_running_idx",
    ]


def test_a_dropped_trigger_is_found_and_recreated(db: Connection) -> None:
    (difference,) = _drifted(db, "DROP TRIGGER sqlaq_jobs_notify_trg ON sqlaq_jobs")
    assert (difference.kind, difference.name, difference.problem) == (
        "trigger",
        "sqlaq_jobs_notify_trg",
        "missing",
    )


def test_changed_storage_settings_are_found_and_reset(db: Connection) -> None:
    (difference,) = _drifted(
        db,
        "ALTER TABLE sqlaq_jobs SET (autovacuum_vacuum_scale_factor = 0.2, fillfactor = 90)",
        "ALTER TABLE sqlaq_jobs RESET (autovacuum_vacuum_cost_limit)",
    )
    assert (difference.kind, difference.name) == ("storage", "sqlaq_jobs")
    assert difference.problem == (
        "autovacuum_vacuum_scale_factor is 0.2, expected 0.01; "
        "autovacuum_vacuum_cost_limit is not set, expected 2000; fillfactor is 90, expected not set"
    )
    assert difference.statements == (
        "ALTER TABLE sqlaq_jobs SET (autovacuum_vacuum_scale_factor = 0.01, "
        "autovacuum_vacuum_cost_limit = 2000)",
        "ALTER TABLE sqlaq_jobs RESET (fillfactor)",
    )


def test_the_rest_of_what_can_drift_is_found_and_fixed(db: Connection) -> None:
    """An index left invalid, a disabled trigger, a replaced trigger function, a
    dropped CHECK constraint, and an index sqlaq did not create."""
    found = _drifted(
        db,
        "UPDATE pg_index SET indisvalid = false "
        "WHERE indexrelid = 'sqlaq_jobs_finished_idx'::regclass",
        "ALTER TABLE sqlaq_jobs DISABLE TRIGGER sqlaq_jobs_finish_trg",
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_notify() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN RETURN NULL; END $$",
        "ALTER TABLE sqlaq_jobs DROP CONSTRAINT sqlaq_jobs_max_attempts_check",
        "CREATE INDEX sqlaq_jobs_payload_idx ON sqlaq_jobs USING gin (payload)",
    )
    assert [(d.kind, d.name, d.problem.split(" (")[0].split(":")[0]) for d in found] == [
        ("index", "sqlaq_jobs_finished_idx", "invalid"),
        ("index", "sqlaq_jobs_payload_idx", "on sqlaq_jobs, not created by sqlaq"),
        ("constraint", "sqlaq_jobs_max_attempts_check", "missing"),
        ("trigger", "sqlaq_jobs_finish_trg", "disabled"),
        ("function", "sqlaq_jobs_notify()", "differs"),
    ]
    assert found[1].note.startswith("unless it is yours on purpose")


def test_a_dropped_table_is_named(db: Connection) -> None:
    db.execute(text("DROP TABLE sqlaq_workers"))
    (difference,) = sqlaq.migrations.differences(db)
    assert (difference.kind, difference.name, difference.problem) == (
        "table",
        "sqlaq_workers",
        "missing",
    )
    assert difference.statements == ()
    assert "sqlaq migrate --sql" in difference.fix


def test_sqlaq_check_deep_prints_each_difference_and_exits_1(
    db: Connection, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()
    assert admin.run(["check", "--deep", "--database-url", url], {}, out=out) == 0
    assert out.getvalue().splitlines() == [
        f"sqlaq schema is at {sqlaq.migrations.HEAD} (head)",
        "its tables, indexes, constraints, triggers, functions and storage settings are as "
        f"{sqlaq.migrations.HEAD} creates them",
    ]
    db.execute(text("DROP INDEX sqlaq_jobs_claim_idx"))
    db.execute(text("DROP TRIGGER sqlaq_jobs_notify_trg ON sqlaq_jobs"))
    capsys.readouterr()
    assert admin.run(["check", "--database-url", url], {}, out=io.StringIO()) == 0  # shallow
    assert admin.run(["check", "--deep", "--database-url", url], {}, out=io.StringIO()) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"sqlaq: the schema is at {sqlaq.migrations.HEAD} but differs")
    assert err[1].startswith(
        "- index sqlaq_jobs_claim_idx: missing; fix: CREATE INDEX CONCURRENTLY"
    )
    assert err[2].startswith("- trigger sqlaq_jobs_notify_trg: missing; fix: CREATE TRIGGER")
    assert len(err) == 3
