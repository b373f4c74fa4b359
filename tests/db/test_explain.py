"""``sqlaq.explain`` and ``sqlaq explain``: each reason, produced by a real situation.

Every test builds the situation with sqlaq's own operations (enqueue, claim, fail,
cancel, pause, the limited claim) in a transaction rolled back afterwards; the heartbeat
rows it needs are inserted the way a worker's maintenance thread writes them.
"""

from __future__ import annotations

import io
import json
import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
from helpers import expire_lease
from sqlalchemy import Connection, Engine, text

import sqlaq
from sqlaq import ReasonCode, admin, queries

pytestmark = pytest.mark.timeout(60)


def _codes(conn: Connection, job_id: int, **options: Any) -> list[ReasonCode]:
    return [reason.code for reason in sqlaq.explain(conn, job_id, **options)]


def _only(conn: Connection, job_id: int, code: ReasonCode, **options: Any) -> str:
    reasons = sqlaq.explain(conn, job_id, **options)
    found = [r for r in reasons if r.code is code]
    assert len(found) == 1, reasons
    return found[0].message


def _serve(conn: Connection, *queues: str, ago: str = "0 seconds") -> uuid.UUID:
    """A worker's heartbeat row serving *queues*, last seen *ago*."""
    worker_id = uuid.uuid4()
    conn.execute(
        queries.heartbeat_stmt(
            worker_id=worker_id, hostname="host-a", pid=4242, queues=queues, concurrency=4
        )
    )
    conn.execute(
        text(
            "UPDATE sqlaq_workers SET last_seen_at = now() - CAST(:ago AS interval)"
            " WHERE worker_id = :w"
        ),
        {"ago": ago, "w": worker_id},
    )
    return worker_id


def _claim(
    conn: Connection, queue: str = "default", worker_id: uuid.UUID | None = None
) -> sqlaq.ClaimedJob:
    (job,) = sqlaq.claim(conn, worker_id=worker_id or uuid.uuid4(), queue=queue)
    return job


def test_a_job_that_is_not_due_yet_says_until_when(conn: Connection) -> None:
    _serve(conn, "default")
    job_id = sqlaq.enqueue(conn, "k", delay=timedelta(minutes=5)).job_id
    message = _only(conn, job_id, ReasonCode.NOT_DUE)
    assert message.startswith("not due until ")
    assert "(in 4m 59s)" in message or "(in 5m)" in message
    assert _codes(conn, job_id) == [ReasonCode.NOT_DUE]


def test_a_retry_waiting_for_its_backoff_names_the_failed_attempt(conn: Connection) -> None:
    _serve(conn, "default")
    job_id = sqlaq.enqueue(conn, "k").job_id
    sqlaq.fail(conn, _claim(conn).lease, "OSError: disk full", retry_in=timedelta(minutes=1))
    message = _only(conn, job_id, ReasonCode.NOT_DUE)
    assert message.endswith("(attempt 1 failed: OSError: disk full)")


def test_a_paused_queue(conn: Connection) -> None:
    _serve(conn, "videos")
    job_id = sqlaq.enqueue(conn, "k", queue="videos").job_id
    sqlaq.pause(conn, "videos", by="ada@ops")
    message = _only(conn, job_id, ReasonCode.PAUSED)
    assert message.startswith("its queue 'videos' is paused (since ")
    assert "by ada@ops" in message
    assert message.endswith("'sqlaq resume videos' resumes it")
    assert _codes(conn, job_id) == [ReasonCode.PAUSED]  # not "waiting": it is held


def test_a_kind_at_its_concurrency_limit(conn: Connection) -> None:
    registry = sqlaq.Registry()
    registry.handler("video", concurrency=1)(lambda payload: None)
    _serve(conn, "default")
    sqlaq.enqueue_many(conn, [sqlaq.NewJob("video"), sqlaq.NewJob("video")])
    claimed = sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="video", concurrency=1)
    (running,) = claimed.jobs
    (waiting,) = conn.execute(text("SELECT id FROM sqlaq_jobs WHERE status = 'queued'")).scalars()
    message = _only(conn, waiting, ReasonCode.CONCURRENCY, registry=registry)
    assert message == "its kind 'video' is at its concurrency limit (1 running, limit 1)"
    # Without the registry the limit is unknown: the job looks merely due.
    assert _codes(conn, waiting) == [ReasonCode.WAITING]
    assert _codes(conn, running.id, registry=registry) == [ReasonCode.RUNNING]


def test_a_kind_whose_rate_window_is_full(conn: Connection) -> None:
    registry = sqlaq.Registry()
    registry.handler("geocode", rate="1/h")(lambda payload: None)
    _serve(conn, "default")
    sqlaq.enqueue_many(conn, [sqlaq.NewJob("geocode"), sqlaq.NewJob("geocode")])
    claimed = sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="geocode", rate="1/h")
    assert len(claimed.jobs) == 1
    (held,) = conn.execute(text("SELECT id FROM sqlaq_jobs WHERE status = 'queued'")).scalars()
    message = _only(conn, held, ReasonCode.RATE, registry=registry)
    assert message.startswith("its kind 'geocode' used its rate (1 per 3600s): the window is full")
    assert "(in 59m 59s)" in message or "(in 1h)" in message


def test_a_kind_without_a_handler_in_the_registry(conn: Connection) -> None:
    registry = sqlaq.Registry()
    registry.handler("known")(lambda payload: None)
    _serve(conn, "default")
    job_id = sqlaq.enqueue(conn, "unknown").job_id
    message = _only(conn, job_id, ReasonCode.NO_HANDLER, registry=registry)
    assert message.startswith("the registry has no handler for kind 'unknown' (it has: 'known')")


def test_a_running_job_names_the_worker_holding_its_lease(conn: Connection) -> None:
    worker_id = _serve(conn, "default")
    job_id = sqlaq.enqueue(conn, "k").job_id
    _claim(conn, worker_id=worker_id)
    message = _only(conn, job_id, ReasonCode.RUNNING)
    assert message.startswith(
        f"running: attempt 1 of 5, leased by worker {worker_id} (host-a, pid 4242) until "
    )
    assert "(in 29s)" in message or "(in 30s)" in message


def test_a_running_job_whose_lease_ended(conn: Connection) -> None:
    worker_id = uuid.uuid4()  # a worker with no heartbeat row (killed, pruned)
    job_id = sqlaq.enqueue(conn, "k").job_id
    _claim(conn, worker_id=worker_id)
    expire_lease(conn, job_id)
    message = _only(conn, job_id, ReasonCode.LEASE_EXPIRED)
    assert message.startswith(f"its lease, held by worker {worker_id} for attempt 1 of 5, ended ")
    assert "takes it back" in message


def test_no_worker_serves_the_queue(conn: Connection) -> None:
    queue = f"lonely-{uuid.uuid4().hex[:8]}"
    job_id = sqlaq.enqueue(conn, "k", queue=queue).job_id
    message = _only(conn, job_id, ReasonCode.NO_WORKER)
    assert message == (
        f"no worker has served queue '{queue}' in the last 5 minutes (none has a heartbeat "
        f"row serving it): start one with --queue {queue}"
    )
    # Due and no one to claim it: both said.
    assert _codes(conn, job_id) == [ReasonCode.WAITING, ReasonCode.NO_WORKER]

    _serve(conn, queue, "other", ago="10 minutes")  # stale: killed ten minutes ago
    message = _only(conn, job_id, ReasonCode.NO_WORKER)
    assert "(one was last seen at " in message
    assert _codes(conn, job_id, stale_after=timedelta(minutes=15)) == [ReasonCode.WAITING]

    _serve(conn, queue)  # a live one
    assert _codes(conn, job_id) == [ReasonCode.WAITING]


def test_a_due_job_waits_behind_the_jobs_a_claim_takes_first(conn: Connection) -> None:
    _serve(conn, "default")
    first, second, third = (r.job_id for r in sqlaq.enqueue_many(conn, [sqlaq.NewJob("k")] * 3))
    urgent = sqlaq.enqueue(conn, "k", priority=10).job_id
    assert _only(conn, third, ReasonCode.WAITING).endswith(
        "waiting to be claimed: 3 due job(s) of queue 'default' come first"
    )
    assert "0 due job(s)" in _only(conn, urgent, ReasonCode.WAITING)
    assert "1 due job(s)" in _only(conn, first, ReasonCode.WAITING)  # behind the urgent one
    assert second != third


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        ("done", r"^done at \S+ \S+ \(\d+s ago\)$"),
        ("failed", r"^failed at .* on attempt 1 of 1; last error: ValueError: bad input$"),
        ("cancelled", r"^cancelled at \S+ \S+ \(\d+s ago\)$"),
    ],
)
def test_a_finished_job_says_how_and_when(conn: Connection, finish: str, expected: str) -> None:
    job_id = sqlaq.enqueue(conn, "k", max_attempts=1).job_id
    if finish == "cancelled":
        sqlaq.cancel(conn, [job_id])
    else:
        lease = _claim(conn).lease
        if finish == "done":
            sqlaq.complete(conn, [lease])
        else:
            sqlaq.fail(conn, lease, "ValueError: bad input\n  File ...")
    (reason,) = sqlaq.explain(conn, job_id)
    assert reason.code is ReasonCode.FINISHED
    assert re.match(expected, reason.message), reason.message


def test_a_failed_job_whose_dedupe_key_a_pending_twin_holds(conn: Connection) -> None:
    failed = sqlaq.enqueue(conn, "sync", dedupe_key="acct-7", max_attempts=1).job_id
    sqlaq.fail(conn, _claim(conn).lease, "IOError: timeout")
    twin = sqlaq.enqueue(conn, "sync", dedupe_key="acct-7").job_id
    message = _only(conn, failed, ReasonCode.DEDUPE_TWIN)
    assert message == (
        f"job {twin} (queued) holds its dedupe key 'acct-7': a retry leaves this job alone "
        "while that one is pending"
    )
    assert sqlaq.retry(conn, [failed]) == []  # what the reason says


def test_an_unknown_job_raises_job_not_found(conn: Connection) -> None:
    with pytest.raises(sqlaq.JobNotFoundError):
        sqlaq.explain(conn, 987_654_321)
    with pytest.raises(sqlaq.ConfigError):
        sqlaq.explain(conn, 0)


def test_sqlaq_explain_prints_each_reason_with_the_apps_limits(
    committed: Engine, database_url: str
) -> None:
    with committed.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_workers, sqlaq_paused_queues"))
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("video") for _ in range(3)])
        for _ in range(2):  # worker_app's "video" kind allows 2 at once
            sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="video", concurrency=2)
        (held,) = conn.execute(text("SELECT id FROM sqlaq_jobs WHERE status = 'queued'")).scalars()
        sqlaq.pause(conn, "default")
    try:
        out = io.StringIO()
        argv = [
            "explain",
            str(held),
            "--app",
            "worker_app:registry",
            "--database-url",
            database_url,
        ]
        assert admin.run(argv, {}, out=out) == 0
        lines = out.getvalue().splitlines()
        assert [line.split(":")[0] for line in lines] == ["paused", "concurrency", "no_worker"]
        assert (
            lines[1]
            == "concurrency: its kind 'video' is at its concurrency limit (2 running, limit 2)"
        )

        out = io.StringIO()
        assert admin.run([*argv, "--json"], {}, out=out) == 0
        assert [r["code"] for r in json.loads(out.getvalue())] == [
            "paused",
            "concurrency",
            "no_worker",
        ]
        err = io.StringIO()
        assert admin.run(["explain", "987654321", "--database-url", database_url], {}, out=err) == 1
    finally:
        with committed.begin() as conn:
            conn.execute(text("TRUNCATE sqlaq_paused_queues"))
