"""sqlaq quickstart: install the schema, enqueue beside your own rows, run the job.

Run it from a clean clone (see README.md):

    python3 -m pip install -e . && python3 examples/quickstart.py

It uses SQLAQ_DATABASE_URL if set, else creates (once) a database called
``sqlaq_quickstart`` on the local PostgreSQL server.
"""

from __future__ import annotations

import os
import uuid

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import sqlaq

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/sqlaq_quickstart"


def database_url() -> str:
    url = os.environ.get("SQLAQ_DATABASE_URL")
    if url:
        return url
    admin = create_engine(
        make_url(DEFAULT_URL).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        exists = conn.execute(
            text("SELECT 1 FROM pg_database WHERE datname = 'sqlaq_quickstart'")
        ).scalar()
        if not exists:
            conn.execute(text("CREATE DATABASE sqlaq_quickstart"))
    admin.dispose()
    return DEFAULT_URL


def main() -> None:
    engine = create_engine(database_url())

    # 1. Install sqlaq's schema. A project with its own Alembic includes sqlaq's
    #    revisions instead (README: "Host project integration").
    with engine.connect() as conn:
        sqlaq.migrations.upgrade(conn)

    # 2. Enqueue in your own transaction: the job exists only if the transaction commits.
    with engine.begin() as conn:
        job = sqlaq.enqueue(conn, "send_welcome_email", {"user_id": 42})
    print(f"enqueued job {job.job_id}")

    # 3. Claim, run and complete it (this is what `sqlaq-worker` does for you).
    worker_id = uuid.uuid4()
    with engine.begin() as conn:
        claimed = sqlaq.claim(conn, worker_id=worker_id, limit=10)
    for item in claimed:
        print(f"running {item.kind}({item.payload}) attempt {item.attempt}")
        with engine.begin() as conn:
            sqlaq.complete(conn, item.lease)
    with engine.connect() as conn:
        status = conn.execute(
            sqlaq.jobs.select()
            .with_only_columns(sqlaq.jobs.c.status)
            .where(sqlaq.jobs.c.id == job.job_id)
        ).scalar_one()
    print(f"job {job.job_id} is {status}")
    engine.dispose()


if __name__ == "__main__":
    main()
