"""Nothing one job does can take a worker down, against a real PostgreSQL.

Each test reproduces a defect seen before the rebuild: an outcome the server refuses in
a batch of good ones, a snooze "for ever", a retry delay too large to store, a worker
stalled past its leases that claims its own jobs again, an async handler whose awaited
sub-task was cancelled.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from workerkit import (
    FAST,
    Recorder,
    count_status,
    enqueue,
    enqueue_many,
    fast_worker,
    job,
    ledger_table,
    rows,
    running,
    scalar,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    yield from ledger_table(committed)


@pytest.fixture
def refusing_trigger(committed: Engine) -> Iterator[Engine]:
    """A host trigger that refuses to mark done any job whose payload has ``refuse``:
    a value the server refuses, for one row of a batch."""
    with committed.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION sqlaq_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN IF NEW.status = 'done' AND NEW.payload ? 'refuse' THEN "
                "RAISE EXCEPTION 'refused by the host''s trigger' "
                "USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER sqlaq_test_refuse BEFORE UPDATE ON sqlaq_jobs "
                "FOR EACH ROW EXECUTE FUNCTION sqlaq_test_refuse()"
            )
        )
    try:
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS sqlaq_test_refuse ON sqlaq_jobs"))
            conn.execute(text("DROP FUNCTION IF EXISTS sqlaq_test_refuse()"))


@pytest.mark.timeout(180)
def test_one_refused_outcome_among_fifty_good_ones_fails_alone(
    ledger: Engine, refusing_trigger: Engine, database_url: str
) -> None:
    """A real worker process: the 50 land, the refused one fails with its reason, and
    the worker keeps running (it takes a job enqueued afterwards)."""
    good = enqueue_many(ledger, "record", 25)
    bad = enqueue(ledger, "record", {"refuse": True})
    good += enqueue_many(ledger, "record", 25)
    with worker_processes(database_url) as start:
        worker = start("--concurrency", "60", *FAST)
        wait_started(worker)  # its start-up (imports, connections) is not what is tested
        wait_until(lambda: count_status(ledger, "done") == 50, 30, "the 50 good jobs done")
        wait_until(lambda: job(ledger, bad).status == "failed", 30, "the refused job failed")
        later = enqueue(ledger, "record")
        wait_until(lambda: job(ledger, later).status == "done", 30, "a later job done")
        assert worker.alive()
        worker.signal(signal.SIGTERM)
        assert worker.wait(20) == 0
        output = worker.output()
    row = job(ledger, bad)
    assert "could not be written" in row.last_error
    assert "refused by the host's trigger" in row.last_error
    assert "Traceback" not in output
    assert scalar(ledger, "SELECT count(*) FROM sqlaq_jobs WHERE status = 'running'") == 0
    assert {r[0] for r in rows(ledger, "SELECT id FROM sqlaq_jobs WHERE status = 'done'")} == {
        *good,
        later,
    }


@pytest.mark.timeout(30)
def test_snooze_for_ever_is_clamped_and_its_batch_lands(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("for_ever")
    def for_ever(payload: dict[str, Any]) -> None:
        raise sqlaq.Snooze(timedelta.max)

    @registry.handler("ok")
    def ok(payload: dict[str, Any]) -> None:
        pass

    sleeper = enqueue(committed, "for_ever")
    others = enqueue_many(committed, "ok", 20)
    with running(fast_worker(committed, registry, recorder, concurrency=30)):
        recorder.wait_for(21)
        later = enqueue(committed, "ok")
        recorder.wait_for(22)
    assert all(job(committed, i).status == "done" for i in [*others, later])
    row = job(committed, sleeper)
    assert (row.status, row.attempts) == ("queued", 0)
    years = scalar(
        committed,
        "SELECT extract(year FROM run_at) - extract(year FROM now()) "
        "FROM sqlaq_jobs WHERE id = :id",
        id=sleeper,
    )
    assert years == 100


@pytest.mark.timeout(30)
def test_a_retry_delay_too_large_to_store_is_clamped(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("far", wait=lambda state: 1e30)
    def far(payload: dict[str, Any]) -> None:
        raise OSError("later, much later")

    job_id = enqueue(committed, "far")
    with running(fast_worker(committed, registry, recorder)):
        (result,) = recorder.wait_for(1)
    assert result.status is sqlaq.JobStatus.QUEUED
    row = job(committed, job_id)
    assert (row.status, row.attempts) == ("queued", 1)
    assert "later, much later" in row.last_error
    # Readable back (year < 10000), and listed by the operator command's query.
    assert row.run_at.year - row.created_at.year == 100


@pytest.mark.timeout(30)
def test_an_async_handler_whose_sub_task_was_cancelled_fails_and_is_retried(
    committed: Engine,
) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("sub_task", wait=sqlaq.Backoff(base=timedelta(milliseconds=10)))
    async def sub_task(payload: dict[str, Any]) -> None:
        task = asyncio.create_task(asyncio.sleep(30))
        await asyncio.sleep(0)
        task.cancel()
        await task  # CancelledError escapes the handler

    job_id = enqueue(committed, "sub_task", max_attempts=2)
    with running(fast_worker(committed, registry, recorder)):
        first, second = recorder.wait_for(2)
    assert (first.status, second.status) == (sqlaq.JobStatus.QUEUED, sqlaq.JobStatus.FAILED)
    row = job(committed, job_id)
    assert (row.status, row.attempts) == ("failed", 2)
    assert "CancelledError" in row.last_error


@pytest.mark.timeout(210)
def test_a_worker_stopped_past_its_leases_carries_on_when_resumed(
    ledger: Engine, database_url: str
) -> None:
    """SIGSTOP a real worker until every lease it holds has expired, then SIGCONT, three
    times: it claims its own jobs again, the stale runs write nothing, nothing crashes,
    no good job fails, and every job ends done."""
    # Fewer jobs than slots: a resumed worker has room, so it claims its own expired
    # jobs again at once (the stale runs go on in their threads).
    ids = enqueue_many(ledger, "sleep", 6, payload={"seconds": 5})
    stops = 0
    with worker_processes(database_url) as start:
        worker = start("--concurrency", "8", "--lease", "1", "--no-maintenance", *FAST)
        wait_started(worker)  # its start-up (imports, connections) is not what is tested
        # At least 3 stops, and on until one made the worker claim its own job again.
        while stops < 12 and not (stops >= 3 and scalar(ledger, _MAX_ATTEMPTS) > 1):
            wait_until(
                lambda: count_status(ledger, "running") or count_status(ledger, "done") == len(ids),
                30,
                "jobs running",
                interval=0.02,
            )
            if count_status(ledger, "done") == len(ids):
                break
            worker.signal(signal.SIGSTOP)
            stops += 1
            try:
                wait_until(
                    lambda: (
                        scalar(
                            ledger,
                            "SELECT count(*) FROM sqlaq_jobs "
                            "WHERE status = 'running' AND run_at > now()",
                        )
                        == 0
                    ),
                    10,
                    "every lease expired",
                )
            finally:
                worker.signal(signal.SIGCONT)
            # Resumed: wait until it acted (a lease renewed, or a job claimed again).
            wait_until(
                lambda: (
                    scalar(
                        ledger,
                        "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done' "
                        "OR (status = 'running' AND run_at > now())",
                    )
                    > 0
                ),
                30,
                "the resumed worker to renew or claim",
                interval=0.02,
            )
        wait_until(lambda: count_status(ledger, "done") == len(ids), 60, "every job done", 0.1)
        assert worker.alive()
        worker.signal(signal.SIGTERM)
        assert worker.wait(20) == 0
        output = worker.output()
    assert "Traceback" not in output
    assert count_status(ledger, "failed") == 0
    finished = rows(
        ledger,
        "SELECT count(DISTINCT job_id) FROM sqlaq_test_ledger WHERE note = 'finished'",
    )[0][0]
    assert finished == len(ids)
    # On resume the worker's claim of its own expired jobs races its lease renewal; the
    # claim wins most stops (up to 12 are made until one does). Leases keyed by claim
    # are also tested without the race: test_a_job_claimed_again_here_keeps_both_runs_apart.


_MAX_ATTEMPTS = "SELECT max(attempts) FROM sqlaq_jobs"


def test_a_job_claimed_again_here_keeps_both_runs_apart(committed: Engine) -> None:
    """The stale run of a job this worker claimed again is lost; it neither replaces nor
    removes the new run (before: keyed by job id, the new run lost its renewals and the
    worker died with KeyError)."""
    from datetime import UTC, datetime
    from uuid import uuid4

    from sqlaq.outcome import LOST
    from sqlaq.worker.leases import Leases
    from sqlaq.worker.run import Run

    def run_of(token: Any, attempt: int) -> Run:
        lease = sqlaq.Lease(5, uuid4(), token, attempt, datetime.now(UTC))
        job = sqlaq.ClaimedJob(5, "default", "k", {}, 0, attempt, 9, lease.expires_at, lease)
        return Run.of(job, None, timedelta(seconds=30), lambda context, length: lease)

    leases = Leases(committed, [timedelta(seconds=30)])
    stale, fresh = run_of(uuid4(), 1), run_of(uuid4(), 2)
    leases.hold(stale)
    leases.hold(fresh)
    assert leases.verdict(stale) is LOST
    assert leases.verdict(fresh) is None
    assert leases.renewable(set()) == [fresh]
    leases.release(stale)  # the stale run settles first
    assert leases.renewable(set()) == [fresh]
    assert len(leases) == 1
    leases.cancelled(5)  # a cancel reaches the newest run
    assert fresh.context.cancelled
