"""Job results (revision sqlaq_0003): a return value stored by the fenced completion,
read back by ``sqlaq.result`` and ``sqlaq show``, pruned with its job; ``sqlaq.wait``
woken by the finish trigger's NOTIFY (only for awaited jobs), with a poll fallback, a
clean timeout and no connection left behind.

``sqlaq.asyncio.wait``: the same waiting (sqlaq.results.waiting) with async I/O, on both
async drivers: woken by the finish notification without blocking the event loop, at once
for a finished job, on time at its timeout, through a lost listening connection, and
closing what it opened. Both waits when the database refuses connections for a while
("too many connections for role"): each read is retried, not raised.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool
from workerkit import libpq_url, wait_until

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import admin, queries, results
from sqlaq.results import JobOutcome, complete_with_result, encode_result

pytestmark = pytest.mark.timeout(120)

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


@pytest.fixture
def async_listening(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set when a wait starts listening for the job's notification (a spy on sqlaq's
    own code; the database untouched)."""
    event = asyncio.Event()
    original = aq._FinishListener.wait_for

    async def spy(self: aq._FinishListener, job_id: int, seconds: float) -> bool:
        event.set()
        return await original(self, job_id, seconds)

    monkeypatch.setattr(aq._FinishListener, "wait_for", spy)
    return event


def _awaited_committed(engine: Engine, job_id: int) -> bool:
    with engine.connect() as conn:
        sql = "SELECT awaited FROM sqlaq_jobs WHERE id = :id"
        return bool(conn.execute(text(sql), {"id": job_id}).scalar_one())


@pytest.mark.asyncio
async def test_wait_is_woken_by_the_finish_while_the_loop_runs_on(
    committed: Engine, async_engine: AsyncEngine, async_listening: asyncio.Event
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiting = asyncio.ensure_future(aq.wait(async_engine, job.id, timeout=60, poll_interval=POLL))
    # This coroutine runs while the wait waits: a wait that blocked the loop would
    # return only at its timeout, and this test would time out first.
    await asyncio.wait_for(async_listening.wait(), 10)
    assert not waiting.done()
    assert _awaited_committed(committed, job.id)

    def finish() -> None:
        with committed.begin() as conn:
            complete_with_result(conn, job.lease, encode_result({"rows": 7}) or "")

    await asyncio.to_thread(finish)
    finished_at = asyncio.get_running_loop().time()
    outcome = await asyncio.wait_for(waiting, 30)
    # Woken by the notification, not by the poll 20 s later.
    assert asyncio.get_running_loop().time() - finished_at < 2.0
    assert (outcome.status, outcome.result) == ("done", {"rows": 7})
    _no_wait_backend_left(committed)


@pytest.mark.asyncio
async def test_wait_on_a_finished_job_returns_at_once_given_a_connection_or_session(
    committed: Engine, async_engine: AsyncEngine
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
        complete_with_result(conn, job.lease, '"ready"')
    async with async_engine.connect() as conn:
        await conn.execute(text("SELECT 1"))  # a transaction of the caller's, left alone
        outcome = await aq.wait(conn, job.id, timeout=timedelta(seconds=30), poll_interval=POLL)
        assert conn.in_transaction()
    assert (outcome.status, outcome.result) == ("done", "ready")
    async with AsyncSession(async_engine) as session:
        again = await aq.wait(session, job.id, timeout=5, poll_interval=POLL)
    assert again == outcome
    assert not _awaited_committed(committed, job.id)  # finished already: nothing written
    _no_wait_backend_left(committed)


@pytest.mark.asyncio
async def test_wait_times_out_with_the_job_as_last_read(
    committed: Engine, async_engine: AsyncEngine
) -> None:
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "report").job_id
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(sqlaq.WaitTimeoutError) as raised:
        await aq.wait(async_engine, job_id, timeout=0.5, poll_interval=0.2)
    assert 0.5 <= loop.time() - started < 5
    assert isinstance(raised.value, TimeoutError)
    assert raised.value.outcome.status == "queued"
    assert _awaited_committed(committed, job_id)  # flagged: a later wait is notified all the same
    _no_wait_backend_left(committed)


@pytest.mark.asyncio
async def test_wait_reads_on_after_losing_its_listening_connection(
    committed: Engine, async_engine: AsyncEngine, async_listening: asyncio.Event
) -> None:
    with committed.begin() as conn:
        job = _enqueue_and_claim(conn)
    waiting = asyncio.ensure_future(aq.wait(async_engine, job.id, timeout=60, poll_interval=0.5))
    await asyncio.wait_for(async_listening.wait(), 10)

    def kill_then_finish() -> None:
        with committed.begin() as conn:
            sql = (
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = :name"
            )
            killed = conn.execute(text(sql), {"name": results.APPLICATION_NAME}).scalar_one()
            assert killed == 1
        with committed.begin() as conn:
            complete_with_result(conn, job.lease, "true")

    await asyncio.to_thread(kill_then_finish)
    outcome = await asyncio.wait_for(waiting, 30)
    assert (outcome.status, outcome.result) == ("done", True)
    _no_wait_backend_left(committed)


@pytest.mark.asyncio
async def test_async_wait_on_an_unknown_job_raises_and_closes_its_connection(
    committed: Engine, async_engine: AsyncEngine
) -> None:
    with pytest.raises(sqlaq.JobNotFoundError, match="or is not committed yet"):
        await aq.wait(async_engine, 987654321, timeout=5)
    _no_wait_backend_left(committed)


@pytest.mark.parametrize(
    ("target", "job_id", "kw", "error", "message"),
    [
        ("engine", 1, {"timeout": -1}, sqlaq.InvalidJobError, "timeout must be zero or more"),
        ("engine", 1, {"timeout": 1, "poll_interval": 0}, sqlaq.InvalidJobError, "more than zero"),
        ("engine", "1", {"timeout": 1}, sqlaq.ConfigError, "a job id must be an int"),
        (
            "sync",
            1,
            {"timeout": 1},
            sqlaq.ConfigError,
            r"^sqlaq\.asyncio\.wait\(\) was given an Engine: use sqlaq\.wait \(not awaited\)$",
        ),
    ],
)
@pytest.mark.asyncio
async def test_wait_refuses_bad_input_before_connecting(
    committed: Engine,
    async_engine: AsyncEngine,
    target: str,
    job_id: Any,
    kw: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    given: Any = async_engine if target == "engine" else committed
    with pytest.raises(error, match=message):
        await aq.wait(given, job_id, **kw)
    assert _wait_backends(committed) == 0


@pytest.mark.asyncio
async def test_the_sync_wait_given_async_objects_names_the_async_wait(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn:
        for given, kind in ((async_engine, "AsyncEngine"), (conn, "AsyncConnection")):
            with pytest.raises(sqlaq.ConfigError) as refused:
                sqlaq.wait(given, 1, timeout=1)  # type: ignore[arg-type]
            assert str(refused.value) == (
                f"sqlaq.wait() was given an {kind}: use sqlaq.asyncio.wait (awaited)"
            )
        assert not conn.in_transaction()  # nothing ran


@pytest.fixture
def one_connection_role(committed: Engine, database_url: str) -> Iterator[str]:
    """The URL of a role that may hold one connection at a time; dropped after."""
    role = f"sqlaq_one_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex  # servers with password authentication (nox -s matrix)
    with committed.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1 PASSWORD '{password}'"))
        conn.execute(text(f"GRANT SELECT, UPDATE ON sqlaq_jobs TO {role}"))
    try:
        url = make_url(database_url).set(username=role, password=password)
        yield url.render_as_string(hide_password=False)
    finally:
        with committed.begin() as conn:
            conn.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              f"WHERE usename = '{role}'"))  # fmt: skip
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


def finished_job(engine: Engine) -> int:
    with engine.begin() as conn:
        job_id = sqlaq.enqueue(conn, "noop").job_id
        conn.execute(
            text("UPDATE sqlaq_jobs SET status = 'done', finished_at = now() WHERE id = :id"),
            {"id": job_id},
        )
    return job_id


def test_wait_retries_a_read_refused_for_too_many_connections(
    committed: Engine, one_connection_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = finished_job(committed)
    engine = create_engine(one_connection_role, poolclass=NullPool)
    got: list[Any] = []
    with caplog.at_level(logging.WARNING, "sqlaq"):
        holder = engine.connect()  # the role's only connection
        try:
            thread = threading.Thread(
                target=lambda: got.append(sqlaq.wait(engine, job_id, timeout=30))
            )
            thread.start()
            wait_until(lambda: "reading again" in caplog.text, 20, "a retried read")
        finally:
            holder.close()
        thread.join(30)
    engine.dispose()
    assert got
    assert got[0].status == sqlaq.JobStatus.DONE
    assert "too many connections for role" in caplog.text


def test_async_wait_retries_a_read_refused_for_too_many_connections(
    committed: Engine, one_connection_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = finished_job(committed)
    sync = create_engine(one_connection_role, poolclass=NullPool)
    url = make_url(one_connection_role).set(drivername="postgresql+asyncpg")

    async def app() -> Any:
        engine = create_async_engine(url, poolclass=NullPool)
        holder = sync.connect()
        try:
            task = asyncio.create_task(aq.wait(engine, job_id, timeout=30))
            await asyncio.to_thread(
                wait_until, lambda: "reading again" in caplog.text, 20, "a retried read"
            )
        finally:
            holder.close()
        try:
            return await task
        finally:
            await engine.dispose()

    with caplog.at_level(logging.WARNING, "sqlaq"):
        outcome = asyncio.run(app())
    sync.dispose()
    assert outcome.status == sqlaq.JobStatus.DONE
