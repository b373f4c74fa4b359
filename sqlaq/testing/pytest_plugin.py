"""pytest fixtures for testing an application's jobs against a real PostgreSQL.

Enable it in your ``conftest.py``::

    pytest_plugins = ["sqlaq.testing.pytest_plugin"]

Fixtures:

``sqlaq_database_url`` (session)
    A database of its own, created on the server named by ``--sqlaq-database-url``,
    ``SQLAQ_TEST_DATABASE_URL`` or ``DATABASE_URL`` (the database in that URL is only
    used to create and drop it), migrated to sqlaq's head, and dropped at the end of
    the session. Its URL names psycopg (sync), whatever driver the given one names:
    an async application's ``postgresql+asyncpg://`` is fine. Override this fixture to
    use a database your own migrations built.
``sqlaq_engine`` (session)
    An Engine on it.
``sqlaq_connection``
    A connection in a transaction that is rolled back after the test: nothing a test
    enqueues, drains or writes survives it.
``sqlaq_session``
    A Session on ``sqlaq_connection`` whose commits are SAVEPOINTs of the test's
    transaction (``join_transaction_mode="create_savepoint"``): application code that
    commits still leaves nothing behind.

The plugin is not registered as an entry point on purpose: installing sqlaq must not add
fixtures or options to every pytest run of the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from uuid import uuid4

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from sqlaq import migrations
from sqlaq.dsn import sync_url

__all__ = [
    "sqlaq_connection",
    "sqlaq_database_url",
    "sqlaq_engine",
    "sqlaq_session",
]

_URL_VARIABLES = ("SQLAQ_TEST_DATABASE_URL", "DATABASE_URL")


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--sqlaq-database-url``: the server the test database is created on."""
    parser.addoption(
        "--sqlaq-database-url",
        default=None,
        help="PostgreSQL URL of the server sqlaq's test database is created on "
        "(default: $SQLAQ_TEST_DATABASE_URL, then $DATABASE_URL)",
    )


def _server_url(config: pytest.Config) -> str:
    url = config.getoption("--sqlaq-database-url")
    for name in _URL_VARIABLES:
        url = url or os.environ.get(name)
    if not url:
        raise pytest.UsageError(
            "sqlaq's pytest plugin needs a PostgreSQL server: pass --sqlaq-database-url "
            "or set SQLAQ_TEST_DATABASE_URL"
        )
    return str(url)


@pytest.fixture(scope="session")
def sqlaq_database_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """A migrated database of the session's own; dropped at the end."""
    # The fixtures are synchronous: an async URL (an application's DATABASE_URL often
    # names asyncpg) is used with psycopg, as the commands do.
    server = sync_url(make_url(_server_url(pytestconfig)))
    name = f"sqlaq_pytest_{uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = server.set(database=name)
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                migrations.upgrade(conn)
        finally:
            engine.dispose()
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlaq_engine(sqlaq_database_url: str) -> Iterator[Engine]:
    """An Engine on the test database."""
    engine = create_engine(sqlaq_database_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def sqlaq_connection(sqlaq_engine: Engine) -> Iterator[Connection]:
    """A connection in a transaction rolled back after the test."""
    with sqlaq_engine.connect() as conn:
        transaction = conn.begin()
        try:
            yield conn
        finally:
            if transaction.is_active:
                transaction.rollback()


@pytest.fixture
def sqlaq_session(sqlaq_connection: Connection) -> Iterator[Session]:
    """A Session on the test's connection; its commits are SAVEPOINTs."""
    with Session(bind=sqlaq_connection, join_transaction_mode="create_savepoint") as session:
        yield session
