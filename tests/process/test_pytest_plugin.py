"""sqlaq's pytest plugin: the documentation's complete test modules, run under pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import docsamples
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

MARKER = 'pytest_plugins = ["sqlaq.testing.pytest_plugin"]'
THIS_FILE = "tests/process/test_pytest_plugin.py::"


def documented_test_modules() -> list[str]:
    """The documentation's complete test modules that enable the plugin, the sync and the
    async one, wherever they are (README.md or a page under docs/): the python blocks
    holding the plugin's line whose skip marker says this file runs them. (A tutorial's
    test module that runs in tests/docs/test_docs.py, in its prelude, is not one.)"""
    modules = [
        block.code
        for block in docsamples.find_blocks("python", MARKER)
        if "skip" in block.options and THIS_FILE in block.options.get("reason", "")
    ]
    assert len(modules) == 2, "expected the sync and the async test module in the docs"
    return modules


#: The tests that run the plugin create its databases (``sqlaq_pytest_*``) on the same
#: server: one after another on one xdist process, or one would count the other's
#: database, still in use, as left behind.
PLUGIN_DATABASES = pytest.mark.xdist_group("pytest_plugin_databases")


#: A conftest.py beside the documented modules: it writes the name of the database the
#: plugin made for the run, so the test checks that one was dropped (another run of the
#: plugin on the same server, such as a developer's, may have one of its own meanwhile).
RECORD_DATABASE = """
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url


@pytest.fixture(scope="session", autouse=True)
def _record_the_database(sqlaq_database_url):
    Path("database.txt").write_text(make_url(sqlaq_database_url).database)
"""


def leftover_databases(server_url: str) -> list[str]:
    engine = create_engine(server_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            names = conn.execute(
                text("SELECT datname FROM pg_database WHERE datname LIKE 'sqlaq_pytest_%'")
            )
            return list(names.scalars())
    finally:
        engine.dispose()


@PLUGIN_DATABASES
@pytest.mark.timeout(120)
def test_the_documented_test_modules_pass_with_the_plugin(server_url: str, tmp_path: Path) -> None:
    sync, async_ = documented_test_modules()
    (tmp_path / "test_jobs.py").write_text(sync)
    (tmp_path / "test_async_jobs.py").write_text(async_)
    (tmp_path / "conftest.py").write_text(RECORD_DATABASE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLAQ_", "PYTEST_"))}
    env["SQLAQ_TEST_DATABASE_URL"] = server_url
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    made = (tmp_path / "database.txt").read_text()
    assert made.startswith("sqlaq_pytest_")
    assert made not in leftover_databases(server_url)  # its database was dropped


def test_without_a_server_the_plugin_says_what_to_set(tmp_path: Path) -> None:
    (tmp_path / "test_jobs.py").write_text(documented_test_modules()[0])
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SQLAQ_", "PYTEST_")) and k != "DATABASE_URL"
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_jobs.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode != 0
    assert "--sqlaq-database-url or set SQLAQ_TEST_DATABASE_URL" in done.stdout + done.stderr


@PLUGIN_DATABASES
@pytest.mark.timeout(120)
def test_an_async_database_url_is_used_with_psycopg(server_url: str, tmp_path: Path) -> None:
    """An async application's ``DATABASE_URL`` (asyncpg) works as it is."""
    sync, async_ = documented_test_modules()
    (tmp_path / "test_jobs.py").write_text(sync)
    (tmp_path / "test_async_jobs.py").write_text(async_)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLAQ_", "PYTEST_"))}
    env["DATABASE_URL"] = (
        make_url(server_url)
        .set(drivername="postgresql+asyncpg")
        .render_as_string(hide_password=False)
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
