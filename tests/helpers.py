"""Small helpers shared by the tests (SQL for assertions and set-up only)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool


def job_row(conn: Connection, job_id: int) -> Any:
    """The job's row, every column, as a named tuple."""
    return conn.execute(text("SELECT * FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}).one()


def count_jobs(conn: Connection, where: str = "true", **params: Any) -> int:
    return conn.execute(text(f"SELECT count(*) FROM sqlaq_jobs WHERE {where}"), params).scalar_one()


def expire_lease(conn: Connection, job_id: int) -> None:
    """Back-date a running job's lease instead of sleeping until it ends."""
    conn.execute(
        text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 second' WHERE id = :id"),
        {"id": job_id},
    )


def finish_long_ago(conn: Connection, job_id: int, status: str, age: str) -> None:
    conn.execute(
        text(
            "UPDATE sqlaq_jobs SET status = :status, finished_at = now() - CAST(:age AS interval)"
            " WHERE id = :id"
        ),
        {"id": job_id, "status": status, "age": age},
    )


@contextmanager
def login_role(
    database_url: str, prefix: str, *, grant_all: bool = True
) -> Iterator[tuple[str, str]]:
    """A LOGIN role of the test's own (a unique name: roles are cluster-wide) owning
    none of sqlaq's tables; with *grant_all*, granted every privilege on the tables and
    sequences of the public schema (sqlaq's). Yields its name and *database_url* as
    that role. Afterwards its sessions are ended, its grants dropped and the role
    itself, whatever happened."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    password = uuid.uuid4().hex  # for a server with password authentication
    url = make_url(database_url).set(username=name, password=password)
    admin = create_engine(database_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE \"{name}\" LOGIN PASSWORD '{password}'"))
        if grant_all:
            conn.execute(text(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{name}"'))
            conn.execute(text(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{name}"'))
    try:
        yield name, url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                    " WHERE usename = :n"
                ),
                {"n": name},
            )
            conn.execute(text(f'DROP OWNED BY "{name}"'))  # its grants in this database
            conn.execute(text(f'DROP ROLE IF EXISTS "{name}"'))
        admin.dispose()
