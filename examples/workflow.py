"""sqlaq workflow example: a fan-out of jobs and a fan-in job that sums their results.

    python3 examples/workflow.py

Which database it uses, in order (as examples/quickstart.py):

- ``SQLAQ_DATABASE_URL`` (or ``DATABASE_URL``), if set;
- else, with ``sqlaq[embedded]`` installed, sqlaq's embedded PostgreSQL (data in
  ``.sqlaq/``, or ``$SQLAQ_EMBEDDED_DIR``);
- else a database ``sqlaq_quickstart``, created once, on the local server at
  127.0.0.1:5432.

It installs the schema, enqueues a chord (five ``square`` jobs in parallel and one
``total`` job that waits for them all), runs a worker in this process until nothing is
left to run (the squares, then the ``total`` they release), prints the sum and exits 0
(1 if the fan-in did not end done).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import sqlaq

LOCAL_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/sqlaq_quickstart"
NUMBERS = [1, 2, 3, 4, 5]


def database_url() -> str:
    url = os.environ.get("SQLAQ_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if url:
        return url
    try:
        from sqlaq import embedded
    except ImportError:  # without the extra: the local server
        return local_database_url()
    return embedded.database_url(os.environ.get("SQLAQ_EMBEDDED_DIR"))


def local_database_url() -> str:
    admin = create_engine(
        make_url(LOCAL_URL).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        exists = conn.execute(
            text("SELECT 1 FROM pg_database WHERE datname = 'sqlaq_quickstart'")
        ).scalar()
        if not exists:
            conn.execute(text("CREATE DATABASE sqlaq_quickstart"))
    admin.dispose()
    return LOCAL_URL


registry = sqlaq.Registry()


@registry.handler("square")
def square(payload: dict[str, Any]) -> int:
    """A member of the fan-out: its return value is its result."""
    return int(payload["n"]) ** 2


@registry.handler("total")
def total(payload: dict[str, Any], session: Session) -> int:
    """The fan-in: a transactional handler, so it reads its parents on its own session."""
    parents = sqlaq.parent_results(session, sqlaq.current_job().id)
    return sum(parent.result for parent in parents)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    engine = create_engine(database_url())
    with engine.connect() as conn:
        sqlaq.migrations.upgrade(conn)

    # The whole workflow exists once this transaction commits, or not at all.
    with engine.begin() as conn:
        workflow = sqlaq.chord(
            conn,
            [sqlaq.NewJob("square", {"n": n}) for n in NUMBERS],
            sqlaq.NewJob("total"),
        )
    assert workflow.callback_id is not None
    print(f"enqueued squares {list(workflow.job_ids)} and total {workflow.callback_id}")

    # Run what is due until nothing is left: the squares, then the total they release
    # (`sqlaq-worker examples.workflow:registry --burst` does the same from the shell).
    sqlaq.Worker(engine, registry, burst=True, concurrency=2).run()
    with engine.connect() as conn:
        outcome = sqlaq.result(conn, workflow.callback_id)
    engine.dispose()
    if outcome.status != sqlaq.JobStatus.DONE:
        print(f"total {workflow.callback_id} ended {outcome.status}: {outcome.error}")
        return 1
    print(f"sum of squares of {NUMBERS}: {outcome.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
