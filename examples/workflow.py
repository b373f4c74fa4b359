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
import sys
from typing import Any

from _database import database_url  # the examples' shared choice of database
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import sqlaq

NUMBERS = [1, 2, 3, 4, 5]


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
