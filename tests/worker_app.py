"""Handlers for the worker processes the tests start (``sqlaq-worker worker_app:registry``).

Every handler that matters records its run in a ledger table (created and dropped by
the tests, see ``workerkit.ledger``) through an engine of its own, on the database named
by ``SQLAQ_DATABASE_URL``, the variable the worker command reads too. Ledger rows carry
the database clock, so tests measure delays between events on one clock.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from datetime import timedelta
from typing import Any

import tenacity
from sqlalchemy import Engine, create_engine, text

import sqlaq

LEDGER = "sqlaq_test_ledger"
#: The host table of the transactional handlers' effects (created by the tests).
EFFECTS = "sqlaq_test_effects"
HANDLER_APPLICATION_NAME = "sqlaq-test-handler"

registry = sqlaq.Registry()
#: For the test of an APP attribute that is not a Registry.
NOT_A_REGISTRY = {"kinds": []}

_engine: Engine | None = None


def _ledger_engine() -> Engine:
    global _engine
    if _engine is None:
        _engine = create_engine(
            os.environ["SQLAQ_DATABASE_URL"],
            pool_size=4,
            max_overflow=16,
            # Ledger rows need not survive a server crash: skip the wait for the WAL
            # flush so thousands of handler commits stay quick.
            connect_args={
                "application_name": HANDLER_APPLICATION_NAME,
                "options": "-c synchronous_commit=off",
            },
        )
    return _engine


def record(note: str = "") -> int:
    """Record this run of the current job; return how many runs the job has had."""
    job = sqlaq.current_job()
    with _ledger_engine().begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {LEDGER} (job_id, attempt, pid, note) "
                "VALUES (:job_id, :attempt, :pid, :note)"
            ),
            {"job_id": job.id, "attempt": job.attempt, "pid": os.getpid(), "note": note},
        )
        runs: int = conn.execute(
            text(f"SELECT count(*) FROM {LEDGER} WHERE job_id = :job_id"), {"job_id": job.id}
        ).scalar_one()
    return runs


@registry.handler("noop")
def noop(payload: dict[str, Any]) -> None:
    """Do nothing (throughput runs)."""


@registry.handler("record")
def record_run(payload: dict[str, Any]) -> None:
    """Record the run."""
    record()


@registry.handler("async_record")
async def async_record(payload: dict[str, Any]) -> None:
    """Record the run from an async handler (the ledger write runs in a thread)."""
    await asyncio.sleep(0)
    await asyncio.to_thread(record, "async")


@registry.handler("sleep")
def sleep(payload: dict[str, Any]) -> None:
    """Record the run, then take ``payload['seconds']``."""
    record()
    time.sleep(payload["seconds"])
    record("finished")


@registry.handler("gc_settings")
def gc_settings(payload: dict[str, Any]) -> None:
    """Record the garbage collector's settings in this process, as the note."""
    record(f"threshold={gc.get_threshold()[0]} frozen={gc.get_freeze_count() > 0}")


@registry.handler("block_first")
def block_first(payload: dict[str, Any]) -> None:
    """Block for ``payload['seconds']`` (default 60) on the job's first run only."""
    if record() == 1:
        time.sleep(payload.get("seconds", 60))


@registry.handler("exit")
def exit_process(payload: dict[str, Any]) -> None:
    """Kill the worker process, every attempt, like a segfault would."""
    record()
    os._exit(3)


# A retry due in ten minutes: a burst worker's last look for due jobs never finds it,
# however loaded the machine (at 100 ms, a loaded CI box's burst worker ran it again).
@registry.handler("flaky", wait=sqlaq.Backoff(base=timedelta(minutes=10)))
def flaky(payload: dict[str, Any]) -> None:
    """Fail until attempt ``payload['succeed_on']``."""
    record()
    if sqlaq.current_job().attempt < payload["succeed_on"]:
        raise OSError("flaky failure")


@registry.handler(
    "picky",
    retry=tenacity.retry_if_exception_type(OSError),
    wait=tenacity.wait_fixed(0.1),
)
def picky(payload: dict[str, Any]) -> None:
    """Raise OSError (retried) or ValueError (not retried), as the payload says."""
    record()
    raise (OSError if payload["error"] == "io" else ValueError)(payload["error"])


@registry.handler("video", concurrency=2)
def video(payload: dict[str, Any]) -> None:
    """At most two at once across every worker: record start and end around a sleep of
    ``payload['seconds']``."""
    record("start")
    time.sleep(payload["seconds"])
    record("end")


@registry.handler("tenant_job", key_concurrency=2)
def tenant_job(payload: dict[str, Any]) -> None:
    """At most two of one key at once across every worker: record start and end around a
    sleep of ``payload['seconds']``."""
    record("start")
    time.sleep(payload["seconds"])
    record("end")


@registry.handler("account_op", ordered=True)
def account_op(payload: dict[str, Any]) -> None:
    """One of a key at a time, in enqueue order: record start and end around a sleep of
    ``payload['seconds']``."""
    record("start")
    time.sleep(payload["seconds"])
    record("end")


@registry.handler("rated", rate="5/s")
def rated(payload: dict[str, Any]) -> None:
    """At most five starts a second across every worker: record the run."""
    record()


@registry.handler("txn_effect")
def txn_effect(payload: dict[str, Any], session: Any) -> None:
    """A transactional handler: write one effect row in the job's transaction; on the
    job's first attempt, then block for ``payload['seconds']`` before returning (the
    write not yet committed), so a test can kill the worker in between."""
    job = sqlaq.current_job()
    session.execute(
        text(f"INSERT INTO {EFFECTS} (job_id, attempt) VALUES (:job_id, :attempt)"),
        {"job_id": job.id, "attempt": job.attempt},
    )
    record("written")  # committed apart (the ledger): the test sees the write happened
    if job.attempt == 1:
        time.sleep(payload.get("seconds", 60))


#: Only the maintenance tests run this registry (``worker_app:periodic_registry``): a
#: periodic job in the main one would enqueue jobs into other tests.
periodic_registry = sqlaq.Registry()


@periodic_registry.periodic("* * * * *", kind="tick")
def tick(payload: dict[str, Any]) -> None:
    """Record the run of a periodic job."""
    record()


@registry.handler("until_cancelled")
def until_cancelled(payload: dict[str, Any]) -> None:
    """Record the run, then wait (up to a minute) until the job is cancelled."""
    record()
    deadline = time.monotonic() + 60
    while not sqlaq.current_job().cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    record("cancelled")
