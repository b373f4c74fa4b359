"""A scratch database for a probe: created on the local server, migrated to sqlaq's
head, dropped at the end (with its connections, even after a failure)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from sqlalchemy import create_engine

import sqlaq

ADMIN = "host=127.0.0.1 user=postgres dbname=postgres"


@contextmanager
def scratch_database(name: str) -> Iterator[str]:
    """The database *name*, made anew and migrated; yields its SQLAlchemy URL."""
    database = sql.Identifier(name)
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(database))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(database))
    try:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        engine = create_engine(url)
        with engine.connect() as conn:
            sqlaq.migrations.upgrade(conn)
            conn.commit()
        engine.dispose()
        yield url
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} (FORCE)").format(database))
