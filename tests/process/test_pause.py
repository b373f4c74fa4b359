"""Pausing and resuming a queue, and the workers' heartbeat rows.

The pause lives in the database: every claim probes ``sqlaq_paused_queues``, so it holds
across worker processes from its commit on; a resume wakes the queue's workers through
NOTIFY. Running jobs finish; enqueueing into a paused queue still works.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import count_jobs
from sqlalchemy import Connection, Engine, text
from workerkit import (
    START_TIMEOUT,
    count_status,
    ledger_runs,
    ledger_table,
    libpq_url,
    rows,
    scalar,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq import admin, queries
from sqlaq.config import WorkerConfig
from sqlaq.maintenance import STALE_INTERVALS, Maintenance

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    yield from ledger_table(committed)


@pytest.fixture
def no_pauses(committed: Engine) -> Iterator[Engine]:
    """Committed data on an empty queue, with no paused queue and no worker row left."""
    with committed.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_paused_queues, sqlaq_workers"))
    try:
        yield committed
    finally:
        with committed.begin() as conn:
            conn.execute(text("TRUNCATE sqlaq_paused_queues, sqlaq_workers"))


def _claim(conn: Connection, queue: str, limit: int = 10) -> list[sqlaq.ClaimedJob]:
    return sqlaq.claim(conn, worker_id=uuid.uuid4(), queue=queue, limit=limit)


# -- the statements ----------------------------------------------------------------------


def test_a_paused_queue_gives_no_claim_until_resumed(conn: Connection) -> None:
    sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", queue="q"), sqlaq.NewJob("k", queue="other")])
    assert sqlaq.pause(conn, "q", by="ops@example") is True

    assert _claim(conn, "q") == []
    assert [job.queue for job in _claim(conn, "other")] == ["other"]  # others flow
    # Enqueueing into a paused queue works: the job waits, due.
    waiting = sqlaq.enqueue(conn, "k", queue="q").job_id
    assert count_jobs(conn, "queue = 'q' AND status = 'queued'") == 2
    (paused,) = sqlaq.paused_queues(conn)
    assert (paused.queue, paused.paused_by) == ("q", "ops@example")

    assert sqlaq.resume(conn, "q") is True
    assert sqlaq.paused_queues(conn) == []
    assert waiting in {job.id for job in _claim(conn, "q")}


def test_pausing_twice_keeps_the_first_pause_and_resuming_twice_says_so(conn: Connection) -> None:
    assert sqlaq.pause(conn, "q", by="first") is True
    assert sqlaq.pause(conn, "q", by="second") is False
    assert [p.paused_by for p in sqlaq.paused_queues(conn)] == ["first"]
    assert sqlaq.resume(conn, "q") is True
    assert sqlaq.resume(conn, "q") is False


def test_a_pause_is_not_seen_before_it_commits(committed: Engine, no_pauses: Engine) -> None:
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "k", queue="q")
    with committed.connect() as pausing:
        sqlaq.pause(pausing, "q")
        with committed.begin() as other:  # another worker, before the commit
            assert len(_claim(other, "q")) == 1
            other.rollback()
        pausing.commit()
    with committed.begin() as other:
        assert _claim(other, "q") == []


def test_the_limited_claim_skips_a_paused_queue_too(conn: Connection) -> None:
    sqlaq.enqueue(conn, "video", queue="q")
    sqlaq.pause(conn, "q")
    claimed = sqlaq.claim_limited(
        conn, worker_id=uuid.uuid4(), kind="video", queue="q", limit=1, concurrency=2
    )
    assert claimed.jobs == []
    sqlaq.resume(conn, "q")
    claimed = sqlaq.claim_limited(
        conn, worker_id=uuid.uuid4(), kind="video", queue="q", limit=1, concurrency=2
    )
    assert len(claimed.jobs) == 1


def test_the_pause_check_is_one_probe_before_the_claim_index_is_read(conn: Connection) -> None:
    """An uncorrelated NOT EXISTS: an InitPlan run once, and a one-time filter that
    skips the claim index's walk altogether while the queue is paused."""
    sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", queue="q") for _ in range(20)])
    sqlaq.pause(conn, "q")
    stmt = queries.claim_stmt(
        queue="q", worker_id=uuid.uuid4(), limit=10, lease=timedelta(seconds=30)
    )
    compiled = stmt.compile(dialect=conn.dialect)
    plan = conn.exec_driver_sql(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, FORMAT JSON) " + str(compiled), compiled.params
    ).scalar_one()
    text_plan = json.dumps(plan)
    assert "One-Time Filter" in text_plan
    assert "sqlaq_paused_queues" in text_plan
    nodes = _nodes(plan[0]["Plan"])
    (scan,) = [n for n in nodes if n.get("Index Name") == "sqlaq_jobs_claim_idx"]
    assert scan["Actual Loops"] == 0  # never executed: the queue is paused


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(_nodes(child))
    return found


def test_resume_wakes_the_queues_workers_and_pause_commits_silently(
    committed: Engine, no_pauses: Engine, database_url: str
) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_jobs")
        with committed.begin() as conn:
            sqlaq.pause(conn, "q")
        assert [n.payload for n in listener.notifies(timeout=0.5)] == []
        with committed.begin() as conn:
            sqlaq.resume(conn, "q")
        (woken,) = listener.notifies(timeout=10, stop_after=1)
        assert (woken.channel, woken.payload) == ("sqlaq_jobs", "q")


@pytest.mark.parametrize("bad", ["", "x" * 256, "a\x00b"])
def test_pause_refuses_what_is_not_a_queue_name(conn: Connection, bad: str) -> None:
    with pytest.raises(sqlaq.InvalidJobError):
        sqlaq.pause(conn, bad)


# -- worker processes ----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_pause_stops_claims_across_two_worker_processes_and_resume_restarts_them(
    ledger: Engine, no_pauses: Engine, database_url: str
) -> None:
    """Two real workers on the same queue: a pause stops every claim from its commit on
    (nothing to wait for: claims read the pause), running jobs finish undisturbed, and a
    resume wakes both at once through NOTIFY, well within their 30 s poll."""
    engine = ledger
    poll = 30.0
    with worker_processes(database_url) as start:
        workers = [
            start("--concurrency", "2", "--poll-interval", f"{poll}s", "--log-level", "info")
            for _ in range(2)
        ]
        # Two processes' start-up (imports, connections): not what is tested.
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM sqlaq_workers") == 2,
            START_TIMEOUT,
            "both workers' heartbeat rows",
        )
        with engine.begin() as conn:
            running = [sqlaq.enqueue(conn, "sleep", {"seconds": 1.5}).job_id for _ in range(2)]
        wait_until(lambda: all(ledger_runs(engine, j) for j in running), 20, "both sleepers")

        with engine.begin() as conn:
            sqlaq.pause(conn, "default")
        with engine.begin() as conn:  # notified on commit: every worker looks, none claims
            held = [sqlaq.enqueue(conn, "record").job_id for _ in range(6)]
        wait_until(lambda: count_status(engine, "done", "sleep") == 2, 20, "the sleepers")
        time.sleep(1.0)  # a claim round or two on each worker, after the notification
        assert count_status(engine, "queued", "record") == 6
        assert not any(ledger_runs(engine, j) for j in held)
        for job_id in running:  # undisturbed: one run each, finished
            assert [r.note for r in ledger_runs(engine, job_id)] == ["", "finished"]

        resumed_at = time.monotonic()
        with engine.begin() as conn:
            sqlaq.resume(conn, "default")
        wait_until(lambda: count_status(engine, "done", "record") == 6, 20, "the held jobs")
        assert time.monotonic() - resumed_at < poll / 3  # woken, not polled
        pids = {r.pid for j in held for r in ledger_runs(engine, j)}
        assert pids <= {w.pid for w in workers}
        assert all(w.alive() for w in workers)


# -- the command -----------------------------------------------------------------------


def _sqlaq(database_url: str, *argv: str, environ: dict[str, str] | None = None) -> tuple[int, str]:
    out = io.StringIO()
    code = admin.run([*argv, "--database-url", database_url], environ or {}, out=out)
    return code, out.getvalue()


def test_sqlaq_pause_resume_and_stats_show_paused_queues(
    no_pauses: Engine, database_url: str
) -> None:
    code, out = _sqlaq(database_url, "pause", "reports", environ={"USER": "ada"})
    assert code == 0, out
    assert out == "queue 'reports' paused: no worker claims its jobs until it is resumed\n"
    assert _sqlaq(database_url, "pause", "reports")[1].startswith("queue 'reports' was paused")

    code, out = _sqlaq(database_url, "stats")
    assert code == 0
    by = f"ada@{socket.gethostname()}"
    assert re.search(r"^paused queue +since +by$", out, re.MULTILINE), out
    assert re.search(rf"^reports +\d{{4}}-\S+ \S+ +{re.escape(by)}$", out, re.MULTILINE), out
    code, out = _sqlaq(database_url, "stats", "--json")
    (paused,) = json.loads(out)["paused"]
    assert (paused["queue"], paused["paused_by"]) == ("reports", by)

    code, out = _sqlaq(database_url, "resume", "reports")
    assert (code, out) == (0, "queue 'reports' resumed: its workers were woken\n")
    assert _sqlaq(database_url, "resume", "reports")[1] == "queue 'reports' was not paused\n"
    assert "paused queue" not in _sqlaq(database_url, "stats")[1]


# -- heartbeat rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("maintenance", [True, False])
def test_a_worker_keeps_a_heartbeat_row_and_deletes_it_when_it_stops(
    no_pauses: Engine, database_url: str, maintenance: bool
) -> None:
    registry = sqlaq.Registry()
    worker = sqlaq.Worker(
        no_pauses,
        registry,
        queues=["a", "b"],
        concurrency=3,
        maintenance=maintenance,
        maintenance_interval=timedelta(milliseconds=100),
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert worker.started.wait(START_TIMEOUT)  # its start-up: not what is tested
        wait_until(lambda: rows(no_pauses, "SELECT * FROM sqlaq_workers"), 10, "the heartbeat row")
        first = rows(no_pauses, "SELECT last_seen_at FROM sqlaq_workers")[0][0]
        wait_until(
            lambda: rows(no_pauses, "SELECT last_seen_at FROM sqlaq_workers")[0][0] > first,
            10,
            "a later heartbeat",
        )
        with no_pauses.connect() as conn:
            (seen,) = sqlaq.list_workers(conn)
        assert (seen.worker_id, seen.hostname, seen.pid) == (
            worker.worker_id,
            socket.gethostname(),
            os.getpid(),
        )
        assert (seen.queues, seen.concurrency) == (("a", "b"), 3)
        assert seen.started_at <= seen.last_seen_at
        code, out = _sqlaq(database_url, "workers")
        assert code == 0
        assert str(worker.worker_id) in out
        assert " a,b " in out
        code, out = _sqlaq(database_url, "workers", "--json")
        assert json.loads(out)[0]["queues"] == ["a", "b"]
    finally:
        worker.stop()
        thread.join(10)
    assert scalar(no_pauses, "SELECT count(*) FROM sqlaq_workers") == 0


def test_the_leader_deletes_the_rows_of_workers_not_seen_for_ten_intervals(
    no_pauses: Engine,
) -> None:
    interval = timedelta(seconds=1)
    with no_pauses.begin() as conn:
        for age in (STALE_INTERVALS * 3, STALE_INTERVALS // 2):
            conn.execute(
                text(
                    "INSERT INTO sqlaq_workers (worker_id, hostname, pid, queues, concurrency,"
                    " last_seen_at) VALUES (gen_random_uuid(), 'gone', :age, '{default}', 1,"
                    " now() - :age * interval '1 second')"
                ),
                {"age": age},
            )
    maintainer = Maintenance(no_pauses, [], WorkerConfig(maintenance_interval=interval), "m")
    maintainer.start()
    try:
        wait_until(lambda: maintainer.leading.is_set(), 10, "leadership")
        wait_until(
            lambda: scalar(no_pauses, "SELECT count(*) FROM sqlaq_workers") == 1,
            10,
            "the stale row deleted",
        )
    finally:
        maintainer.stop()
    # The fresh one (5 intervals old when inserted) outlived the first rounds.
    assert scalar(no_pauses, "SELECT pid FROM sqlaq_workers") == STALE_INTERVALS // 2
