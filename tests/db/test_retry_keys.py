"""Retrying jobs whose keys collide: of several failed (or never-started cancelled) jobs
of one dedupe or debounce key, one is queued again and the others are reported as
skipped, never an IntegrityError that fails the whole call; the same through the async
twin, ``sqlaq retry`` and the dashboard; and a retry racing an enqueue of the same key."""

from __future__ import annotations

import io
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import admin
from sqlaq.dashboard import app as dashboard_app
from sqlaq.dashboard import csrf
from tests.helpers import job_row

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from starlette.testclient import TestClient

HOUR = timedelta(hours=1)
#: Rounds of the race between a retry and an enqueue of the same key.
RACE_ROUNDS = 300


def failed_job(conn: Connection, kind: str = "sync", **keys: Any) -> int:
    """A job of *kind* (with *keys*, e.g. ``dedupe_key``) that ran and failed for good."""
    job_id = sqlaq.enqueue(conn, kind, max_attempts=1, **keys).job_id
    (claimed,) = sqlaq.claim(conn, worker_id=uuid.uuid4(), where=sqlaq.jobs.c.id == job_id)
    sqlaq.fail(conn, claimed.lease, "IOError: down")
    return job_id


def debounced_then_cancelled(conn: Connection, key: str, kind: str = "digest") -> int:
    """A never-started job of debounce key *key*, cancelled."""
    job_id = sqlaq.enqueue(conn, kind, debounce_key=key, debounce=HOUR).job_id
    assert sqlaq.cancel(conn, job_id) == [job_id]
    return job_id


def status(conn: Connection, job_id: int) -> str:
    return str(job_row(conn, job_id).status)


def usable(conn: Connection) -> None:
    assert conn.execute(text("SELECT 1")).scalar_one() == 1


# -- the operation -----------------------------------------------------------------


def test_failed_twins_of_one_dedupe_key_retry_one_and_skip_the_other(conn: Connection) -> None:
    first = failed_job(conn, dedupe_key="acct-7")
    second = failed_job(conn, dedupe_key="acct-7")
    unrelated = [failed_job(conn) for _ in range(10)]
    other_key = failed_job(conn, dedupe_key="acct-8")
    other_kind = failed_job(conn, "mail", dedupe_key="acct-7")  # keys are per kind

    result = sqlaq.retry(conn, [second, *unrelated, first, other_key, other_kind])

    assert isinstance(result, sqlaq.RetryResult)
    assert result == sorted([first, *unrelated, other_key, other_kind])
    assert result.skipped == [sqlaq.SkippedRetry(second, "acct-7", first, "dedupe_key")]
    assert result.skipped[0].reason == (
        f"job {second} not retried: job {first} holds its dedupe key 'acct-7'"
    )
    assert status(conn, first) == "queued"
    assert status(conn, second) == "failed"
    assert {status(conn, i) for i in unrelated} == {"queued"}
    usable(conn)
    # Once the retried twin has finished, the other one can be retried.
    sqlaq.cancel(conn, first)
    again = sqlaq.retry(conn, second)
    assert (again, again.skipped) == ([second], [])


def test_a_key_held_by_a_pending_job_skips_every_twin_naming_that_job(conn: Connection) -> None:
    first = failed_job(conn, dedupe_key="k")
    second = failed_job(conn, dedupe_key="k")
    pending = sqlaq.enqueue(conn, "sync", dedupe_key="k").job_id
    result = sqlaq.retry(conn, [first, second])
    assert result == []
    assert result.skipped == [
        sqlaq.SkippedRetry(first, "k", pending, "dedupe_key"),
        sqlaq.SkippedRetry(second, "k", pending, "dedupe_key"),
    ]
    assert {status(conn, first), status(conn, second)} == {"failed"}


def test_never_started_cancelled_twins_of_one_debounce_key(conn: Connection) -> None:
    first = debounced_then_cancelled(conn, "doc-7")
    second = debounced_then_cancelled(conn, "doc-7")
    # One that started once is out of the debounce index: it collides with nothing.
    started = sqlaq.enqueue(conn, "digest", debounce_key="doc-7", debounce=HOUR).job_id
    conn.execute(text("UPDATE sqlaq_jobs SET run_at = now() WHERE id = :id"), {"id": started})
    assert sqlaq.claim(conn, worker_id=uuid.uuid4(), where=sqlaq.jobs.c.id == started)
    assert sqlaq.cancel(conn, started) == [started]
    unrelated = failed_job(conn)

    result = sqlaq.retry(conn, [first, second, started, unrelated])

    assert result == [first, started, unrelated]
    assert result.skipped == [sqlaq.SkippedRetry(second, "doc-7", first, "debounce_key")]
    assert result.skipped[0].reason == (
        f"job {second} not retried: job {first} holds its debounce key 'doc-7'"
    )
    assert [status(conn, i) for i in (first, second, started)] == ["queued", "cancelled", "queued"]
    # A later enqueue of the key debounces the retried job, as for any queued one.
    again = sqlaq.enqueue(conn, "digest", debounce_key="doc-7", debounce=HOUR)
    assert again == sqlaq.EnqueueResult(first, outcome=sqlaq.EnqueueOutcome.DEBOUNCED)
    usable(conn)


def test_a_key_taken_after_the_snapshot_skips_that_job_only(engine: Engine) -> None:
    """The statement cannot see a holder committed after its snapshot (here a repeatable
    read transaction's): the unique violation rolls back its savepoint only, the jobs are
    retried one by one, and the one whose key is taken is skipped, holder unknown."""
    with engine.begin() as setup:
        keyed = failed_job(setup, "snap", dedupe_key="late")
        others = [failed_job(setup, "snap") for _ in range(3)]
    try:
        with engine.connect() as conn:
            conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                usable(conn)  # the snapshot is taken here
                with engine.begin() as other:
                    holder = sqlaq.enqueue(other, "snap", dedupe_key="late")
                assert holder.inserted
                result = sqlaq.retry(conn, [keyed, *others])
                assert result == others
                assert result.skipped == [sqlaq.SkippedRetry(keyed, "late", None, "dedupe_key")]
                assert result.skipped[0].reason == (
                    f"job {keyed} not retried: another pending job holds its dedupe key 'late'"
                )
                usable(conn)
    finally:
        with engine.begin() as cleanup:
            cleanup.execute(text("DELETE FROM sqlaq_jobs WHERE kind = 'snap'"))


def test_retry_result_is_still_a_list_of_ids(conn: Connection) -> None:
    job = failed_job(conn)
    result = sqlaq.retry(conn, job)
    assert result == [job]
    assert isinstance(result, list)
    assert repr(result) == f"RetryResult([{job}], skipped=[])"
    assert sqlaq.retry(conn, []) == []
    assert sqlaq.retry(conn, []).skipped == []


# -- the async twin ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_async_twin_skips_colliding_keys(
    async_engine: AsyncEngine, committed: Engine
) -> None:
    with committed.begin() as setup:
        first = failed_job(setup, dedupe_key="a")
        second = failed_job(setup, dedupe_key="a")
        calm = debounced_then_cancelled(setup, "d")
        twin = debounced_then_cancelled(setup, "d")
        late = failed_job(setup, dedupe_key="late")
    async with async_engine.connect() as conn:
        result = await aq.retry(conn, [first, second, calm, twin])
        assert result == [first, calm]
        assert result.skipped == [
            sqlaq.SkippedRetry(second, "a", first, "dedupe_key"),
            sqlaq.SkippedRetry(twin, "d", calm, "debounce_key"),
        ]
        await conn.commit()
        # The fallback after a unique violation, through both async drivers.
        await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            await conn.execute(text("SELECT 1"))
            with committed.begin() as other:
                sqlaq.enqueue(other, "sync", dedupe_key="late")
            result = await aq.retry(conn, [late])
            assert result == []
            assert result.skipped == [sqlaq.SkippedRetry(late, "late", None, "dedupe_key")]
            assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1


# -- sqlaq retry -------------------------------------------------------------------


def sqlaq_cmd(url: str, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return admin.run([argv[0], "--database-url", url, *argv[1:]], {}, out=out), out.getvalue()


def test_the_command_retries_the_rest_and_prints_each_skipped_job(
    database_url: str, committed: Engine
) -> None:
    with committed.begin() as setup:
        first = failed_job(setup, dedupe_key="k")
        second = failed_job(setup, dedupe_key="k")
        unrelated = [failed_job(setup) for _ in range(10)]
    code, out = sqlaq_cmd(database_url, "retry", str(first), str(second), *map(str, unrelated))
    assert code == 0
    assert out.splitlines() == [
        f"job {second} not retried: job {first} holds its dedupe key 'k'",
        "retried 11 of 12 job(s), skipped 1 whose key another job holds",
    ]
    with committed.connect() as conn:
        assert {status(conn, i) for i in [first, *unrelated]} == {"queued"}
        assert status(conn, second) == "failed"
        sqlaq.cancel(conn, [first, *unrelated])
        conn.commit()
    code, out = sqlaq_cmd(database_url, "retry", "--failed")
    assert code == 0
    assert out.splitlines() == ["retried 1 of 1 job(s)"]

    # first and the unrelated jobs are cancelled; second, queued, holds the key.
    code, out = sqlaq_cmd(database_url, "retry", "--all", "--kind", "sync")
    assert code == 0
    assert out.splitlines() == [
        f"job {first} not retried: job {second} holds its dedupe key 'k'",
        "retried 10 of 11 job(s), skipped 1 whose key another job holds",
    ]


# -- the dashboard -----------------------------------------------------------------


@pytest.fixture
def client(committed: Engine) -> Iterator[TestClient]:
    # The dashboard answers only its own host names (localhost by default).
    with TestClient(dashboard_app(committed), base_url="http://localhost") as c:
        yield c


def test_the_dashboard_retry_all_names_the_skipped_jobs(
    client: TestClient, committed: Engine
) -> None:
    with committed.begin() as setup:
        first = failed_job(setup, dedupe_key="k")
        second = failed_job(setup, dedupe_key="k")
        unrelated = failed_job(setup)
    client.get("/")
    form = {
        "kind": "sync",
        "error": "IOError: down",
        "since": "7d",
        "confirm": "yes",
        csrf.FIELD: client.cookies[csrf.COOKIE],
    }
    done = client.post("/failures/retry", data=form)
    assert done.status_code == 200
    assert "Retried 2 of 3 job(s)." in done.text
    assert f"job {second} not retried: job {first} holds its dedupe key &#39;k&#39;" in done.text
    with committed.connect() as conn:
        assert [status(conn, i) for i in (first, second, unrelated)] == [
            "queued",
            "failed",
            "queued",
        ]


def test_the_dashboard_retry_of_one_job_says_its_key_is_taken(
    client: TestClient, committed: Engine
) -> None:
    with committed.begin() as setup:
        job = failed_job(setup, dedupe_key="k")
        sqlaq.enqueue(setup, "sync", dedupe_key="k")
    client.get("/")
    form = {csrf.FIELD: client.cookies[csrf.COOKIE]}
    response = client.post(f"/jobs/{job}/retry", data=form, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == f"/jobs/{job}?did=key-taken"
    page = client.get(response.headers["location"]).text
    assert "Not retried: another pending job holds its dedupe or debounce key" in page


# -- a retry racing an enqueue of the same key -------------------------------------


def race(
    engine: Engine, rounds: int, make: Callable[[Connection, str], int], **enqueue: Any
) -> None:
    """*rounds* times: a fresh job of a new key (made by *make*), then its retry and an
    enqueue of the same key, released together by a barrier on two connections. Every
    retry must succeed, and exactly one job of the key must be pending after."""
    barrier = threading.Barrier(2)
    failures = 0
    outcomes: list[tuple[bool, int]] = []  # (consistent, round) of each round without error

    def retry(job_id: int) -> Any:
        with engine.connect() as conn:
            usable(conn)
            barrier.wait()
            try:
                result = sqlaq.retry(conn, [job_id])
            except IntegrityError:
                return None
            conn.commit()
            return result

    def enqueue_(key: str) -> Any:
        with engine.connect() as conn:
            usable(conn)
            barrier.wait()
            result = sqlaq.enqueue(conn, "race", **{enqueue["key"]: key}, **enqueue["more"])
            conn.commit()
            return result

    with ThreadPoolExecutor(2) as pool:
        for n in range(rounds):
            key = f"r{n}-{uuid.uuid4().hex[:6]}"
            with engine.begin() as setup:
                job_id = make(setup, key)
            retried = pool.submit(retry, job_id)
            enqueued = pool.submit(enqueue_, key)
            result, added = retried.result(), enqueued.result()
            if result is None:
                failures += 1
                continue
            if result == [job_id]:  # the retry went first: the enqueue found its job
                outcomes.append((added.job_id == job_id and not added.inserted, n))
            else:  # the enqueue went first: the retry names its job
                skipped = [(s.job_id, s.key, s.holder_id) for s in getattr(result, "skipped", [])]
                outcomes.append((added.inserted and skipped == [(job_id, key, added.job_id)], n))
    with engine.connect() as conn:
        doubles = conn.execute(
            text(
                "SELECT count(*) FROM (SELECT 1 FROM sqlaq_jobs WHERE kind = 'race'"
                " AND status = 'queued' GROUP BY coalesce(dedupe_key, debounce_key)"
                " HAVING count(*) > 1) AS d"
            )
        ).scalar_one()
    print(f"race: {failures} of {rounds} retries failed")
    assert failures == 0, f"{failures} of {rounds} retries failed with a unique violation"
    assert [n for ok, n in outcomes if not ok] == []
    assert len(outcomes) == rounds
    assert doubles == 0


def test_a_retry_racing_a_dedupe_enqueue_never_fails(committed: Engine) -> None:
    def make(conn: Connection, key: str) -> int:
        job_id = sqlaq.enqueue(conn, "race", dedupe_key=key).job_id
        sqlaq.cancel(conn, job_id)
        return job_id

    race(committed, RACE_ROUNDS, make, key="dedupe_key", more={})


def test_a_retry_racing_a_debounce_enqueue_never_fails(committed: Engine) -> None:
    def make(conn: Connection, key: str) -> int:
        return debounced_then_cancelled(conn, key, "race")

    race(committed, RACE_ROUNDS, make, key="debounce_key", more={"debounce": HOUR})


def test_two_retries_of_twins_racing_retry_one_and_name_it(committed: Engine) -> None:
    """Two operators retrying the two failed jobs of one key at once: one is queued
    again, the other call skips its job naming it; neither fails."""
    barrier = threading.Barrier(2)

    def retry(job_id: int) -> Any:
        with engine.connect() as conn:
            usable(conn)
            barrier.wait()
            try:
                result = sqlaq.retry(conn, [job_id])
            except IntegrityError:
                return None
            conn.commit()
            return result

    engine = committed
    failures = 0
    wrong = []
    with ThreadPoolExecutor(2) as pool:
        for n in range(RACE_ROUNDS // 3):
            with engine.begin() as setup:
                first = failed_job(setup, "twin", dedupe_key=f"t{n}")
                second = failed_job(setup, "twin", dedupe_key=f"t{n}")
            one, two = pool.submit(retry, first), pool.submit(retry, second)
            results = [one.result(), two.result()]
            if None in results:
                failures += 1
                continue
            done = sorted(i for r in results for i in r)
            names = sorted(
                (s.job_id, s.holder_id) for r in results for s in getattr(r, "skipped", [])
            )
            if not (
                (done, names) == ([first], [(second, first)])
                or (done, names) == ([second], [(first, second)])
            ):
                wrong.append((n, results))
    assert failures == 0, f"{failures} of {RACE_ROUNDS // 3} retries failed"
    assert wrong == []
