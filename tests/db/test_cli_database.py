"""What the commands do with the database they are given: async URLs, the role's
privileges, a schema older than this sqlaq. Each ends in one line, never a traceback.

Before: an async app's ``DATABASE_URL`` (``postgresql+asyncpg://``) printed a 64-line
MissingGreenlet traceback; a role with SELECT and INSERT only passed the start-up check
and died at its first claim; ``sqlaq list`` on a schema one revision behind said
"column attempted_at does not exist" with no hint of the fix.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from cmdkit import assert_one_line, run_process
from helpers import login_role
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool
from workerkit import count_status

import sqlaq
from sqlaq import admin, migrations

pytestmark = pytest.mark.timeout(60)


def _with_driver(url: str, driver: str) -> str:
    return make_url(url).set(drivername=driver).render_as_string(hide_password=False)


# -- async URLs ------------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg_async"])
def test_async_urls_run_on_psycopg_with_a_notice(
    committed: Engine, database_url: str, driver: str
) -> None:
    url = _with_driver(database_url, driver)
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "noop").job_id

    worker = run_process("cli", "worker_app:registry", "--burst", DATABASE_URL=url)
    assert worker.returncode == 0, worker.stderr
    assert "Traceback" not in worker.stderr
    assert f"{driver} is an async driver" in worker.stderr
    assert count_status(committed, "done") == 1

    shown = run_process("admin", "show", str(job_id), "--json", SQLAQ_DATABASE_URL=url)
    assert shown.returncode == 0, shown.stderr
    assert f'"id": {job_id}' in shown.stdout
    assert shown.stderr.splitlines() == [
        f"sqlaq: notice: {driver} is an async driver; this command is synchronous and "
        "uses postgresql+psycopg (psycopg) on the same URL"
    ]


# -- privileges ------------------------------------------------------------------------


@pytest.fixture
def role(engine: Engine, database_url: str) -> Iterator[tuple[str, str]]:
    """A LOGIN role of the test's own (roles are cluster-wide: a unique name) and the
    suite's database URL as that role; dropped after the test, whatever happened."""
    with login_role(database_url, "sqlaq_test_role", grant_all=False) as made:
        yield made


def _grant(engine: Engine, role: str, grants: dict[str, str]) -> None:
    with engine.begin() as conn:
        for table, privileges in grants.items():
            conn.execute(text(f'GRANT {privileges} ON {table} TO "{role}"'))


def test_a_role_without_update_or_delete_is_refused_at_start_naming_what_is_missing(
    committed: Engine, role: tuple[str, str]
) -> None:
    name, url = role
    _grant(
        committed,
        name,
        {"sqlaq_jobs": "SELECT, INSERT", "sqlaq_rates": "SELECT", "sqlaq_periodic": "SELECT"},
    )
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "noop")
    result = run_process("cli", "worker_app:registry", SQLAQ_DATABASE_URL=url)
    assert_one_line(
        result,
        "sqlaq-worker: error: ",
        "lacks privileges the worker needs",
        "UPDATE, DELETE on sqlaq_jobs",
        "INSERT, UPDATE on sqlaq_rates",
        "INSERT, UPDATE on sqlaq_periodic",
        "GRANT UPDATE, DELETE ON sqlaq_jobs TO <role>",
    )
    assert count_status(committed, "queued") == 1  # nothing was claimed


def test_a_role_with_the_privileges_the_worker_needs_runs_it(
    committed: Engine, role: tuple[str, str]
) -> None:
    name, url = role
    _grant(
        committed,
        name,
        {
            "sqlaq_jobs": "SELECT, INSERT, UPDATE, DELETE",
            "sqlaq_rates": "SELECT, INSERT, UPDATE",
            "sqlaq_periodic": "SELECT, INSERT, UPDATE",
            "sqlaq_paused_queues": "SELECT",
            "sqlaq_workers": "SELECT, INSERT, UPDATE, DELETE",
            "sqlaq_unique_holds": "SELECT, INSERT, UPDATE, DELETE",
        },
    )
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "noop")
    result = run_process("cli", "worker_app:registry", "--burst", SQLAQ_DATABASE_URL=url)
    assert result.returncode == 0, result.stderr
    assert count_status(committed, "done") == 1


# -- a schema behind this sqlaq --------------------------------------------------------


def _sqlaq(url: str, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return admin.run([argv[0], "--database-url", url, *argv[1:]], {}, out=out), out.getvalue()


def test_admin_on_a_schema_behind_this_sqlaq_says_to_migrate(
    empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            migrations.upgrade(conn, "sqlaq_0001")
        for argv in (["list"], ["show", "1"], ["list", "--status", "failed", "--json"]):
            code, _ = _sqlaq(empty_database_url, *argv)
            err: Any = capsys.readouterr().err
            assert (code, err.count("\n")) == (2, 1), err
            assert "Traceback" not in err
            assert f"database is at sqlaq_0001, this sqlaq needs {migrations.HEAD}" in err, err
            assert "'sqlaq migrate'" in err
        code, _ = _sqlaq(empty_database_url, "migrate")
        assert code == 0
        assert _sqlaq(empty_database_url, "list") == (0, "(none)\n")
    finally:
        engine.dispose()
