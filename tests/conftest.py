"""Fixtures: a database of the suite's own on a real PostgreSQL, migrated to heads.

Where the server comes from, in order:
1. ``SQLAQ_TEST_DATABASE_URL`` when set (any URL: TCP or a Unix socket in ``?host=``,
   with or without a password);
2. else the local server, ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``
   (skipped when ``SQLAQ_TEST_EMBEDDED=1``);
3. else, with ``sqlaq[embedded]`` installed (the ``test`` extra brings it), an embedded
   PostgreSQL 18 (:mod:`sqlaq.embedded`) in a temporary folder, stopped and deleted at
   the end of the session;
4. only if none of these and a Docker engine answers, a throwaway PostgreSQL started
   with testcontainers (not exercised on the project's CI machine, which has no Docker).

The tests sit in folders by what they need: ``unit/`` no database, ``db/`` a database
(a rolled-back connection or committed rows), ``worker/`` workers in this process,
``process/`` commands, worker processes and servers, ``docs/`` the documentation's
samples. Shared tools live here: ``helpers``, ``workerkit`` (workers, the ledger,
waiting), ``cmdkit`` (the commands). ``nox -s tests`` runs them in parallel
(pytest-xdist), each process with a database of its own.

The suite never touches the database it connects to first: it creates
``sqlaq_test_<random>`` there, runs everything in it, and drops it at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_fixed

# Hypothesis keeps its example database and caches outside the working tree (read when
# it first needs them, after this module is imported).
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "sqlaq-hypothesis")
)

ROOT = Path(__file__).resolve().parent.parent
LOCAL_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _answers(url: str) -> bool:
    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect():
            return True
    except OperationalError:
        return False
    finally:
        engine.dispose()


@contextlib.contextmanager
def embedded_server(prefix: str = "sqlaq-test-pg-") -> Iterator[str]:
    """An embedded PostgreSQL in a new temporary folder; yield its URL; stop it and
    delete the folder, whatever happened."""
    from sqlaq import embedded

    folder = tempfile.mkdtemp(prefix=prefix)
    os.chmod(folder, 0o755)  # noqa: S103 - as root, the server runs as another OS user
    try:
        yield embedded.database_url(folder)
    finally:
        try:
            embedded.stop(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _server_url() -> Iterator[str]:
    given = os.environ.get("SQLAQ_TEST_DATABASE_URL")
    if given:
        yield given
        return
    force_embedded = os.environ.get("SQLAQ_TEST_EMBEDDED") == "1"
    if not force_embedded and _answers(LOCAL_URL):
        yield LOCAL_URL
        return
    try:
        import sqlaq.embedded  # noqa: F401 - is the extra installed?
    except ImportError:
        if force_embedded:
            pytest.exit("SQLAQ_TEST_EMBEDDED=1 but sqlaq[embedded] is not installed", 3)
    else:
        with embedded_server() as url:
            yield url
        return
    try:  # pragma: no cover - needs Docker, which the CI machine does not have
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver="psycopg") as pg:
            yield pg.get_connection_url()
    except Exception as exc:  # pragma: no cover
        pytest.exit(
            f"no PostgreSQL: {LOCAL_URL} does not answer, SQLAQ_TEST_DATABASE_URL is not set, "
            f"sqlaq[embedded] is not installed, and testcontainers could not start one ({exc})",
            returncode=3,
        )


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    yield from _server_url()


@contextlib.contextmanager
def new_database(server_url: str, prefix: str = "sqlaq_test") -> Iterator[str]:
    """Create a uniquely named empty database on the server; yield its URL; drop it
    (``WITH (FORCE)``, so a leftover connection cannot keep it alive)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop_database(admin, name)
        admin.dispose()


# A server at max_connections refuses the drop's connection too ("too many clients"):
# keep trying for a while rather than leave the database behind.
@retry(
    retry=retry_if_exception_type(OperationalError),
    wait=wait_fixed(0.5),
    stop=stop_after_delay(60),
    reraise=True,
)
def _drop_database(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """URL of a fresh database of the suite's own, dropped at the end."""
    with new_database(server_url) as url:
        yield url


@pytest.fixture
def empty_database_url(server_url: str) -> Iterator[str]:
    """A database of the test's own with no sqlaq schema, dropped after the test."""
    with new_database(server_url, "sqlaq_empty") as url:
        yield url


def alembic_config(url: str) -> Config:
    """The repository's own alembic.ini, pointed at *url*."""
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[Engine]:
    """An engine on the suite's database, migrated to heads through alembic.ini."""
    command.upgrade(alembic_config(database_url), "heads")
    eng = create_engine(database_url, pool_size=10, max_overflow=20)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def conn(engine: Engine) -> Iterator[Connection]:
    """A connection inside a transaction that is rolled back after the test."""
    with engine.connect() as connection:
        trans = connection.begin()
        try:
            yield connection
        finally:
            trans.rollback()


#: Empties every table of sqlaq's (the queue, the rate logs, the periodic slots, the
#: unique_for holds, the workflow edges, the heartbeats, the paused queues): without the
#: heartbeats, a worker an earlier test ran on this database (xdist gives each process
#: one) still "serves" its queues for ``sqlaq.explain`` a few minutes later.
TRUNCATE = (
    "TRUNCATE sqlaq_jobs, sqlaq_rates, sqlaq_periodic, sqlaq_unique_holds, sqlaq_job_deps,"
    " sqlaq_workers, sqlaq_paused_queues"
)


@pytest.fixture
def committed(engine: Engine) -> Iterator[Engine]:
    """For tests that need committed data on several connections: empties the table
    before and after the test."""
    with engine.begin() as c:
        c.execute(text(TRUNCATE))
    try:
        yield engine
    finally:
        with engine.begin() as c:
            c.execute(text(TRUNCATE))


@pytest_asyncio.fixture(params=["psycopg", "asyncpg"])
async def async_engine(
    request: pytest.FixtureRequest, committed: Engine, database_url: str
) -> AsyncIterator[AsyncEngine]:
    """An async engine on the suite's (migrated, emptied) database, once per async
    driver: psycopg's async connection and asyncpg."""
    url = make_url(database_url).set(drivername=f"postgresql+{request.param}")
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture(autouse=True)
def _root_logger_as_found() -> Iterator[None]:
    """Leave the root logger as the test found it. A command run in process
    (``sqlaq-worker``'s ``configure_logging``) gives it a handler on the stderr that the
    test captured; a later test's logging would write to that closed stream, and
    "--- Logging error ---" would land in whatever that test captures."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
