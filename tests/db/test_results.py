"""Job results (revision sqlaq_0003): a return value stored by the fenced completion,
read back by ``sqlaq.result`` and ``sqlaq show``, pruned with its job; ``sqlaq.wait``
woken by the finish trigger's NOTIFY (only for awaited jobs), with a poll fallback, a
clean timeout and no connection left behind.
"""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from workerkit import libpq_url, wait_until

import sqlaq
from sqlaq import admin, queries, results
from sqlaq.results import JobOutcome, complete_with_result, encode_result

#: Long enough that a test which returns sooner was not served by a poll.
POLL = timedelta(seconds=20)


def _enqueue_and_claim(conn: Connection, kind: str = "report", **kw: Any) -> sqlaq.ClaimedJob:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    job_id = sqlaq.enqueue(conn, kind, {"n": 1}, queue=queue, **kw).job_id
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), queue=queue, limit=1)
    assert job.id == job_id
    return job


def _awaited(conn: Connection, job_id: int) -> bool:
    return bool(
        conn.execute(text("SELECT awaited FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}).scalar()
    )


# -- storing and reading ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"total": 3, "rows": [1, 2.5, None, True, "é"]},
        [1, "two", {"three": 3}],
        "a plain string",
        42,
        1e20,  # spelt out with a fraction: comes back as a float, not an int
        -0.5,
        False,
        {},
    ],
    ids=repr,
)
def test_complete_with_result_stores_it_and_result_reads_it_back(
    conn: Connection, value: Any
) -> None:
    job = _enqueue_and_claim(conn)
    encoded = encode_result(value)
    assert encoded is not None
    assert complete_with_result(conn, job.lease, encoded) is True

    outcome = sqlaq.result(conn, job.id)
    assert outcome.job_id == job.id
    assert outcome.status is sqlaq.JobStatus.DONE
    assert outcome.finished
    assert outcome.result == value
    assert type(outcome.result) is type(value)
    assert outcome.error is None
    assert outcome.finished_at is not None


def test_plain_complete_stores_no_result(conn: Connection) -> None:
    job = _enqueue_and_claim(conn)
    sqlaq.complete(conn, job.lease)
    outcome = sqlaq.result(conn, job.id)
    assert (outcome.status, outcome.result) == ("done", None)


def test_result_of_a_pending_job_has_its_status_and_no_result(conn: Connection) -> None:
    job_id = sqlaq.enqueue(conn, "report").job_id
    outcome = sqlaq.result(conn, job_id)
    assert outcome == JobOutcome(job_id, sqlaq.JobStatus.QUEUED, None, None, None)
    assert not outcome.finished


def test_result_of_a_failed_job_carries_its_error(conn: Connection) -> None:
    job = _enqueue_and_claim(conn, max_attempts=1)
    sqlaq.fail(conn, job.lease, "ValueError: no such invoice")
    outcome = sqlaq.result(conn, job.id)
    assert (outcome.status, outcome.result) == ("failed", None)
    assert outcome.error == "ValueError: no such invoice"
    assert outcome.finished_at is not None


def test_result_of_an_unknown_id_raises_job_not_found(conn: Connection) -> None:
    with pytest.raises(sqlaq.JobNotFoundError, match="no job 987654321") as raised:
        sqlaq.result(conn, 987654321)
    assert isinstance(raised.value, LookupError)
    assert raised.value.job_id == 987654321


def test_complete_with_result_after_reclaim_writes_nothing(conn: Connection) -> None:
    """The stale holder's completion matches no row: no result, no status change; the
    new holder's attempt is untouched."""
    stale = _enqueue_and_claim(conn)
    conn.execute(
        text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 second' WHERE id = :id"),
        {"id": stale.id},
    )
    (fresh,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), queue=stale.queue, limit=1)
    assert fresh.lease.token != stale.lease.token

    with pytest.raises(sqlaq.LeaseLostError) as raised:
        complete_with_result(conn, stale.lease, '{"stale": true}')
    assert raised.value.job_ids == (stale.id,)
    assert complete_with_result(conn, stale.lease, '"stale"', raise_on_lost=False) is False

    outcome = sqlaq.result(conn, stale.id)
    assert (outcome.status, outcome.result, outcome.finished_at) == ("running", None, None)
    assert complete_with_result(conn, fresh.lease, '{"fresh": true}') is True
    assert sqlaq.result(conn, stale.id).result == {"fresh": True}


def test_complete_with_result_refuses_what_is_not_json_text(conn: Connection) -> None:
    job = _enqueue_and_claim(conn)
    with pytest.raises(sqlaq.InvalidJobError, match="result_json must be JSON text"):
        complete_with_result(conn, job.lease, {"not": "encoded"})  # type: ignore[arg-type]
    assert sqlaq.result(conn, job.id).status == "running"


def test_prune_deletes_results_with_their_jobs(conn: Connection) -> None:
    job = _enqueue_and_claim(conn)
    complete_with_result(conn, job.lease, encode_result({"big": "x" * 10_000}) or "")
    conn.execute(
        text("UPDATE sqlaq_jobs SET finished_at = now() - interval '8 days' WHERE id = :id"),
        {"id": job.id},
    )
    assert sqlaq.prune(conn, older_than=timedelta(days=7)) == 1
    with pytest.raises(sqlaq.JobNotFoundError):
        sqlaq.result(conn, job.id)


# -- encode_result ------------------------------------------------------------------------


def test_encode_result_of_none_is_none_and_of_values_compact_json() -> None:
    assert encode_result(None) is None
    assert encode_result({"a": [1, (2, 3)]}) == '{"a":[1,[2,3]]}'
    assert encode_result("é") == '"é"'
    assert encode_result(True) == "true"


_DEEP: list[Any] = []
_node = _DEEP
for _ in range(600):
    _node.append([])
    _node = _node[0]
_CYCLE: dict[str, Any] = {}
_CYCLE["self"] = _CYCLE


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, "result is a set, not JSON-serialisable; use a list"),
        ({"rows": [1, {2}]}, r"result\['rows'\]\[1\] is a set"),
        (b"bytes", "result is a bytes, not JSON-serialisable"),
        (object(), "result is a object, not JSON-serialisable"),
        (float("nan"), "result is nan; JSON has no NaN or Infinity"),
        ({"x": float("inf")}, r"result\['x'\] is inf; JSON has no NaN or Infinity"),
        ("a\x00b", "result contains a NUL character"),
        (["\ud800"], r"result\[0\] contains a lone surrogate"),
        ({1: "a"}, "result has a key 1 of type int; JSON object keys must be str"),
        (10**5000, "result is an int of more than 4300 digits"),
        (_DEEP, "nests deeper than 500 levels"),
        (_CYCLE, r"result\['self'\] is result again"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v[:30],
)
def test_encode_result_refuses_values_json_cannot_hold_naming_them(
    value: object, message: str
) -> None:
    with pytest.raises(sqlaq.InvalidJobError, match=message) as raised:
        encode_result(value)
    assert str(raised.value).startswith("result")


# -- the CLI --------------------------------------------------------------------------------


def test_sqlaq_show_prints_the_result(committed: Engine, database_url: str) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
        complete_with_result(conn, job.lease, encode_result({"total": 3, "ok": True}) or "")
        string_job = _enqueue_and_claim(conn)
        complete_with_result(conn, string_job.lease, encode_result("42") or "")

    out = io.StringIO()
    assert admin.run(["show", str(job.id), "--database-url", database_url], {}, out=out) == 0
    # jsonb orders an object's keys (shorter first): what was stored is what is shown.
    assert 'result        {"ok": true, "total": 3}\n' in out.getvalue()

    out = io.StringIO()
    assert admin.run(["show", str(string_job.id), "--database-url", database_url], {}, out) == 0
    assert 'result        "42"\n' in out.getvalue()  # a string, not the number 42

    out = io.StringIO()
    argv = ["show", str(job.id), "--json", "--database-url", database_url]
    assert admin.run(argv, {}, out=out) == 0
    shown = json.loads(out.getvalue())
    assert (shown["status"], shown["result"]) == ("done", {"total": 3, "ok": True})


# -- the finish trigger ---------------------------------------------------------------------


@pytest.fixture
def finish_listener(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute(queries.listen_stmt(channel="sqlaq_finished"))
        yield listener


def test_finish_trigger_notifies_only_awaited_jobs_that_finish(
    committed: Engine, finish_listener: psycopg.Connection[Any]
) -> None:
    """Finishing an unawaited job notifies nothing; an awaited job notifies when it
    finishes (done, or cancelled), not when it is claimed. The last one is the sentinel:
    everything before it has been delivered when it arrives."""
    with committed.begin() as conn:
        unawaited = _enqueue_and_claim(conn)
        claimed_later = sqlaq.enqueue(conn, "report", queue="later").job_id
        cancelled = sqlaq.enqueue(conn, "report", queue="cancelled").job_id
        sentinel = _enqueue_and_claim(conn)
        for job_id in (claimed_later, cancelled, sentinel.id):
            assert conn.execute(queries.watch_job_stmt(job_id=job_id)).first() is not None

    with committed.begin() as conn:  # awaited, but only claimed: queued -> running
        assert len(sqlaq.claim(conn, worker_id=uuid.uuid4(), queue="later", limit=1)) == 1
    with committed.begin() as conn:
        complete_with_result(conn, unawaited.lease, "1")
    with committed.begin() as conn:
        assert sqlaq.cancel(conn, cancelled) == [cancelled]
    with committed.begin() as conn:
        complete_with_result(conn, sentinel.lease, "2")

    payloads = []
    for notify in finish_listener.notifies(timeout=10):
        assert notify.channel == "sqlaq_finished"
        payloads.append(notify.payload)
        if notify.payload == str(sentinel.id):
            break
    assert payloads == [str(cancelled), str(sentinel.id)]


def test_watch_writes_nothing_on_a_finished_or_already_awaited_job(conn: Connection) -> None:
    done = _enqueue_and_claim(conn)
    sqlaq.complete(conn, done.lease)
    assert conn.execute(queries.watch_job_stmt(job_id=done.id)).first() is None
    assert not _awaited(conn, done.id)

    pending = sqlaq.enqueue(conn, "report").job_id
    row = conn.execute(queries.watch_job_stmt(job_id=pending)).one()
    assert (row.id, row.status) == (pending, "queued")
    assert _awaited(conn, pending)
    assert conn.execute(queries.watch_job_stmt(job_id=pending)).first() is None


# -- wait -------------------------------------------------------------------------------------


def _wait_backends(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = :name"
                ),
                {"name": results.APPLICATION_NAME},
            ).scalar_one()
        )


def _no_wait_backend_left(engine: Engine) -> None:
    # The server ends a backend a moment after its client closed the connection.
    wait_until(lambda: _wait_backends(engine) == 0, 5, "the wait's connection to close")


@pytest.fixture
def listening(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when a wait starts waiting for a notification: it listens and the job is
    flagged. A spy on sqlaq's own code, the database untouched."""
    event = threading.Event()
    original = results._FinishListener.wait_for

    def spy(self: results._FinishListener, job_id: int, seconds: float) -> bool:
        event.set()
        return original(self, job_id, seconds)

    monkeypatch.setattr(results._FinishListener, "wait_for", spy)
    return event


class _Waiter(threading.Thread):
    def __init__(self, target: Any, job_id: int, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.args_ = (target, job_id)
        self.kw = kw
        self.outcome: JobOutcome | None = None
        self.error: BaseException | None = None
        self.returned_at = 0.0

    def run(self) -> None:
        try:
            self.outcome = sqlaq.wait(*self.args_, **self.kw)
        except BaseException as exc:
            self.error = exc
        self.returned_at = time.monotonic()


def test_wait_returns_as_soon_as_the_job_finishes(
    committed: Engine, listening: threading.Event
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiter = _Waiter(committed, job.id, timeout=60, poll_interval=POLL)
    waiter.start()
    assert listening.wait(10), "wait never started listening"

    with committed.begin() as conn:
        assert _awaited(conn, job.id)
        complete_with_result(conn, job.lease, encode_result({"rows": 7}) or "")
    committed_at = time.monotonic()
    waiter.join(30)

    assert not waiter.is_alive()
    assert waiter.error is None, waiter.error
    assert waiter.outcome is not None
    assert (waiter.outcome.status, waiter.outcome.result) == ("done", {"rows": 7})
    # Woken by the notification, not by the poll 20 s later.
    assert waiter.returned_at - committed_at < 2.0
    _no_wait_backend_left(committed)


def test_wait_on_a_failed_or_cancelled_job_returns_its_outcome(
    committed: Engine, listening: threading.Event
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiter = _Waiter(committed, job.id, timeout=60, poll_interval=POLL)
    waiter.start()
    assert listening.wait(10)
    with committed.begin() as conn:
        sqlaq.cancel(conn, job.id)
    waiter.join(30)
    assert waiter.error is None, waiter.error
    assert waiter.outcome is not None
    assert (waiter.outcome.status, waiter.outcome.result) == ("cancelled", None)


def test_wait_on_a_finished_job_returns_at_once_without_writing(committed: Engine) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
        complete_with_result(conn, job.lease, '"ready"')
    started = time.monotonic()
    outcome = sqlaq.wait(committed, job.id, timeout=timedelta(seconds=30), poll_interval=POLL)
    assert time.monotonic() - started < 2.0
    assert (outcome.status, outcome.result) == ("done", "ready")
    with committed.connect() as conn:
        assert not _awaited(conn, job.id)
    _no_wait_backend_left(committed)


def test_wait_times_out_cleanly(committed: Engine) -> None:
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "report").job_id
    started = time.monotonic()
    with pytest.raises(sqlaq.WaitTimeoutError) as raised:
        sqlaq.wait(committed, job_id, timeout=0.5, poll_interval=0.2)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 5
    assert isinstance(raised.value, TimeoutError)
    assert raised.value.outcome.status == "queued"
    assert f"job {job_id} did not finish within 0:00:00.500000" in str(raised.value)
    with committed.connect() as conn:
        assert _awaited(conn, job_id)  # flagged: a later wait is notified all the same
    _no_wait_backend_left(committed)
    assert committed.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_wait_on_an_unknown_job_raises_and_closes_its_connection(committed: Engine) -> None:
    with pytest.raises(sqlaq.JobNotFoundError, match="or is not committed yet"):
        sqlaq.wait(committed, 987654321, timeout=5)
    _no_wait_backend_left(committed)


def test_wait_given_a_connection_uses_its_engine_and_leaves_its_transaction(
    committed: Engine,
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
        complete_with_result(conn, job.lease, "[1]")
    with committed.connect() as conn:
        transaction = conn.begin()
        conn.execute(text("SELECT 1"))
        assert sqlaq.wait(conn, job.id, timeout=5).result == [1]
        assert transaction.is_active
        transaction.rollback()


def test_wait_survives_the_loss_of_its_listening_connection(
    committed: Engine, listening: threading.Event
) -> None:
    """Notifications are lost with the connection: the poll (or the read after
    reconnecting) still sees the job finish."""
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiter = _Waiter(committed, job.id, timeout=60, poll_interval=0.5)
    waiter.start()
    assert listening.wait(10)
    with committed.begin() as conn:
        killed = conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = :name"
            ),
            {"name": results.APPLICATION_NAME},
        ).scalar_one()
        assert killed == 1
    with committed.begin() as conn:
        complete_with_result(conn, job.lease, "true")
    waiter.join(30)
    assert waiter.error is None, waiter.error
    assert waiter.outcome is not None
    assert (waiter.outcome.status, waiter.outcome.result) == ("done", True)
    _no_wait_backend_left(committed)


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"timeout": -1}, sqlaq.InvalidJobError, "timeout must be zero or more"),
        ({"timeout": float("inf")}, sqlaq.InvalidJobError, "timeout must be at most 100 years"),
        ({"timeout": "5"}, sqlaq.InvalidJobError, "timeout must be a datetime.timedelta"),
        ({"timeout": 1, "poll_interval": 0}, sqlaq.InvalidJobError, "more than zero"),
    ],
)
def test_wait_refuses_bad_durations_before_connecting(
    committed: Engine, kw: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        sqlaq.wait(committed, 1, **kw)


def test_wait_refuses_what_has_no_engine_and_ids_that_are_not_ints(committed: Engine) -> None:
    with pytest.raises(
        sqlaq.ConfigError, match=r"^sqlaq\.wait\(\) was given a str: pass a Connection"
    ):
        sqlaq.wait("postgresql://", 1, timeout=1)  # type: ignore[arg-type]
    with pytest.raises(sqlaq.ConfigError, match="a job id must be an int"):
        sqlaq.wait(committed, "1", timeout=1)  # type: ignore[arg-type]
