"""Maintenance: the lease sweep, the cancel notification, and the leader election.

The election runs for real: three ``sqlaq-worker`` processes (and, in-process, three
maintenance threads) contend for the leader's advisory lock; the one holding it is
found in ``pg_locks`` and in the logs, and killed to see another take over.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import expire_lease, job_row
from sqlalchemy import Connection, Engine, text
from workerkit import (
    MANY_WORKERS,
    WorkerProcess,
    count_status,
    libpq_url,
    scalar,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq.config import WorkerConfig
from sqlaq.maintenance import Maintenance
from sqlaq.schema import CANCEL_CHANNEL, LEADER_LOCK

# -- statements ----------------------------------------------------------------------------


def claim_one(conn: Connection, **options: Any) -> sqlaq.ClaimedJob:
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), **options)
    return job


def test_sweep_fails_last_attempts_and_requeues_the_rest(conn: Connection) -> None:
    sqlaq.enqueue(conn, "last", max_attempts=1)
    last = claim_one(conn)
    sqlaq.enqueue(conn, "more", max_attempts=3)
    more = claim_one(conn)
    sqlaq.enqueue(conn, "live")
    live = claim_one(conn)
    expire_lease(conn, last.id)
    expire_lease(conn, more.id)
    assert sqlaq.sweep(conn) == 2
    failed, requeued = job_row(conn, last.id), job_row(conn, more.id)
    assert (failed.status, failed.lease_token, failed.finished_at is not None) == (
        "failed",
        None,
        True,
    )
    assert failed.last_error.startswith("lease expired on attempt 1 of 1")
    assert (requeued.status, requeued.attempts, requeued.lease_token) == ("queued", 1, None)
    assert requeued.last_error == "lease expired on attempt 1; queued again"
    assert job_row(conn, live.id).status == "running"
    assert sqlaq.sweep(conn) == 0
    with pytest.raises(sqlaq.LeaseLostError):  # the swept holder writes nothing
        sqlaq.complete(conn, more.lease)


def test_sweep_checks_its_limit(conn: Connection) -> None:
    with pytest.raises(sqlaq.ConfigError, match="limit must be a positive int"):
        sqlaq.sweep(conn, limit=0)


def test_cancel_notifies_for_running_jobs_only(committed: Engine, database_url: str) -> None:
    with committed.begin() as conn:
        queued = sqlaq.enqueue(conn, "k", priority=-1).job_id
        sqlaq.enqueue(conn, "k")
        running = claim_one(conn)
    dsn = libpq_url(database_url)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {CANCEL_CHANNEL}")
        with committed.begin() as conn:
            assert sorted(sqlaq.cancel(conn, [queued, running.id])) == sorted([queued, running.id])
        payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
        assert payloads == [str(running.id)]
        assert list(listener.notifies(timeout=0.3)) == []  # none for the queued one


# -- the election, in one process ---------------------------------------------------------


def leader_holders(engine: Engine) -> int:
    """How many sessions hold the leader's lock in this database (pg_locks, two-key
    advisory form). Advisory locks are per database: another sqlaq on the same server
    holds a lock of the same key in its own database, which is not counted."""
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = :a AND objid = :b AND objsubid = 2 AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())",
            a=LEADER_LOCK[0],
            b=LEADER_LOCK[1],
        )
    )


@pytest.fixture
def maintainers(committed: Engine) -> Iterator[list[Maintenance]]:
    config = WorkerConfig(maintenance_interval=timedelta(milliseconds=50))
    started = [Maintenance(committed, [], config, f"m{i}") for i in range(3)]
    for maintainer in started:
        maintainer.start()
    yield started
    for maintainer in started:
        maintainer.stop()


@pytest.mark.timeout(60)
def test_one_maintainer_leads_and_another_takes_over(
    committed: Engine, maintainers: list[Maintenance]
) -> None:
    def leaders() -> list[Maintenance]:
        return [m for m in maintainers if m.leading.is_set()]

    (leader,) = wait_until(leaders, 10, "a leader")
    # Many rounds later, still exactly one, and the lock is held once.
    wait_until(lambda: all(m.rounds >= 10 for m in maintainers), 10, "ten rounds each")
    assert leaders() == [leader]
    assert leader_holders(committed) == 1
    leader.stop()
    (successor,) = wait_until(leaders, 10, "another leader")
    assert successor is not leader
    assert leader_holders(committed) == 1


# -- the election, three worker processes ------------------------------------------------


def log_messages(process: WorkerProcess) -> list[dict[str, Any]]:
    """The JSON log records the process has written so far (complete lines only: the
    last one may still be being written)."""
    complete, _, _partial = process.output().rpartition("\n")
    return [json.loads(line) for line in complete.splitlines() if line.startswith("{")]


def elected(process: WorkerProcess) -> bool:
    return any(m["message"] == "maintenance leader elected" for m in log_messages(process))


def pruned_by(process: WorkerProcess) -> int:
    return sum(
        m.get("pruned", 0) for m in log_messages(process) if m["message"] == "maintenance ran"
    )


def add_old_done_jobs(engine: Engine, count: int) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("old") for _ in range(count)])
        conn.execute(
            text(
                "UPDATE sqlaq_jobs SET status = 'done', "
                "finished_at = now() - interval '2 hours' WHERE kind = 'old'"
            )
        )


@MANY_WORKERS
@pytest.mark.timeout(240)
def test_three_workers_elect_one_leader_that_prunes_and_a_new_one_after_a_kill(
    committed: Engine, database_url: str
) -> None:
    flags = [
        "--maintenance-interval", "0.2",
        "--retain-done", "1h",
        "--log-format", "json",
        "--log-level", "info",
    ]  # fmt: skip
    add_old_done_jobs(committed, 50)
    with worker_processes(database_url) as start:
        processes = [start(*flags) for _ in range(3)]
        # Three processes' start-up (imports, connections): not what is tested.
        wait_started(*processes)
        wait_until(lambda: count_status(committed, "done") == 0, 30, "the old jobs pruned")
        # The rows are gone once the leader's prune commits; its "maintenance ran" line
        # comes after: wait for the logs to account for all 50.
        wait_until(lambda: sum(pruned_by(p) for p in processes) >= 50, 10, "the prune in the logs")
        (leader,) = wait_until(
            lambda: [p for p in processes if elected(p)], 10, "one elected leader"
        )
        # One at a time: over many more rounds the lock has one holder, and only the
        # leader ever pruned.
        samples: list[int] = []

        def sampled() -> bool:
            samples.append(leader_holders(committed))
            return len(samples) >= 10  # two seconds: ten maintenance intervals

        wait_until(sampled, 10, "ten samples of the lock", interval=0.2)
        assert samples == [1] * 10
        assert [pruned_by(p) for p in processes] == [50 if p is leader else 0 for p in processes]
        assert sum(elected(p) for p in processes) == 1

        leader.signal(signal.SIGKILL)
        leader.wait(10)
        rest = [p for p in processes if p is not leader]
        (successor,) = wait_until(
            lambda: [p for p in rest if elected(p)], 20, "a new leader after the kill"
        )
        add_old_done_jobs(committed, 30)
        wait_until(lambda: count_status(committed, "done") == 0, 30, "the new old jobs pruned")
        wait_until(lambda: sum(pruned_by(p) for p in rest) >= 30, 10, "the prune in the logs")
        assert [pruned_by(p) for p in rest] == [30 if p is successor else 0 for p in rest]
        assert leader_holders(committed) == 1


def test_notify_queues_wakes_each_queue_on_commit(committed: Engine, database_url: str) -> None:
    dsn = libpq_url(database_url)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_jobs")
        with committed.begin() as conn:
            sqlaq.ops.notify_queues(conn, ["a", "b"])
        payloads = sorted(n.payload for n in listener.notifies(timeout=5, stop_after=2))
    assert payloads == ["a", "b"]


@pytest.mark.timeout(60)
def test_retention_by_status_and_forever(committed: Engine) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob(kind) for kind in ("d", "f", "f", "young")])
        conn.execute(
            text(
                "UPDATE sqlaq_jobs SET status = CASE kind WHEN 'd' THEN 'done' ELSE 'failed' END,"
                " finished_at = now() - CASE kind WHEN 'young' THEN interval '1 minute'"
                " ELSE interval '2 hours' END"
            )
        )
    config = WorkerConfig(
        maintenance_interval=timedelta(milliseconds=50),
        retain_done=None,
        retain_failed=timedelta(hours=1),
    )
    maintainer = Maintenance(committed, [], config, "m")
    maintainer.start()
    try:
        wait_until(lambda: count_status(committed, "failed") == 1, 10, "old failed jobs pruned")
        wait_until(lambda: maintainer.rounds >= 5, 10, "more rounds")
    finally:
        maintainer.stop()
    assert count_status(committed, "done") == 1  # kept for ever
    assert scalar(committed, "SELECT kind FROM sqlaq_jobs WHERE status = 'failed'") == "young"
