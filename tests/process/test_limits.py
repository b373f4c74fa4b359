"""Per-kind concurrency and rate limits: the arithmetic, the claim, and real workers.

The claim-level tests race real connections against each other (a barrier releases
them together); the worker tests run three ``sqlaq-worker`` processes and read what
happened from the ledger and the jobs' ``attempted_at``, both on the database's clock.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from workerkit import (
    MANY_WORKERS,
    count_status,
    ledger_table,
    rows,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq.limits import MAX_RATE_COUNT, Rate, allowance

FAST = ["--poll-interval", "0.2", "--log-level", "info"]
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    yield from ledger_table(committed)


def enqueue(engine: Engine, kind: str, count: int, **options: Any) -> list[int]:
    with engine.begin() as conn:
        results = sqlaq.enqueue_many(conn, [sqlaq.NewJob(kind, **options) for _ in range(count)])
    return [r.job_id for r in results]


def claim_limited(engine: Engine, kind: str, limit: int = 10, **limits: Any) -> sqlaq.LimitedClaim:
    with engine.begin() as conn:
        return sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind=kind, limit=limit, **limits)


# -- Rate and the arithmetic -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text_", "count", "period"),
    [
        ("1/s", 1, timedelta(seconds=1)),
        ("5/s", 5, timedelta(seconds=1)),
        (" 100 / m ", 100, timedelta(minutes=1)),
        ("1000/h", 1000, timedelta(hours=1)),
        ("10/d", 10, timedelta(days=1)),
        ("10/30s", 10, timedelta(seconds=30)),
        ("3/2.5m", 3, timedelta(minutes=2.5)),
        ("2/500ms", 2, timedelta(milliseconds=500)),
    ],
)
def test_rate_parses_count_per_period(text_: str, count: int, period: timedelta) -> None:
    assert Rate.parse(text_) == Rate(count, period)


@pytest.mark.parametrize("text_", ["", "5", "5/", "/s", "0/s", "5/y", "-1/s", "1.5/s", "5/0s"])
def test_rate_rejects_what_is_not_a_rate(text_: str) -> None:
    with pytest.raises(sqlaq.ConfigError, match="rate"):
        Rate.parse(text_)


def test_rate_bounds_its_count() -> None:
    with pytest.raises(sqlaq.ConfigError, match=str(MAX_RATE_COUNT)):
        Rate(MAX_RATE_COUNT + 1, timedelta(hours=1))
    with pytest.raises(sqlaq.ConfigError, match="count must be an int"):
        Rate(True, timedelta(seconds=1))


def test_allowance_takes_the_tightest_limit() -> None:
    def allow(wanted: int, **state: Any) -> tuple[int, bool, timedelta | None]:
        given = {"concurrency": None, "running": 0, "rate": None, "recent": 0, "pivot": None}
        got = allowance(wanted, now=T0, **(given | state))
        return got.count, got.full, got.rate_wait

    assert allow(10, concurrency=2) == (2, True, None)
    assert allow(10, concurrency=2, running=2) == (0, True, None)
    assert allow(1, concurrency=5, running=3) == (1, False, None)
    rate = Rate(3, timedelta(seconds=1))
    # Two starts count; one place left; after it the log is full, and the oldest start
    # (the pivot) leaves the window 100 ms from now.
    oldest = T0 - timedelta(milliseconds=900)
    assert allow(10, concurrency=5, rate=rate, recent=2, pivot=oldest) == (
        1,
        False,
        timedelta(milliseconds=100),
    )
    assert allow(2, rate=rate) == (2, False, None)  # the rate does not bind
    assert allow(5, rate=rate) == (3, False, timedelta(seconds=1))  # an empty log fills
    # A log fuller than the rate (it was lowered): nothing, until the pivot leaves.
    assert allow(5, rate=rate, recent=4, pivot=T0 - timedelta(milliseconds=500)) == (
        0,
        False,
        timedelta(milliseconds=500),
    )


def test_registry_checks_limits() -> None:
    registry = sqlaq.Registry()
    with pytest.raises(sqlaq.ConfigError, match="concurrency of 'a' must be between 1 and"):
        registry.add("a", print, concurrency=0)
    with pytest.raises(sqlaq.ConfigError, match="rate of 'a': invalid rate '5 per s'"):
        registry.add("a", print, rate="5 per s")
    with pytest.raises(sqlaq.ConfigError, match="rate of 'a' must be a str"):
        registry.add("a", print, rate=5)  # type: ignore[arg-type]
    handler = registry.add("a", print, concurrency=2, rate="1/s")
    assert (handler.concurrency, handler.rate, handler.limited) == (2, Rate.parse("1/s"), True)
    assert not registry.add("b", print).limited


# -- the claim -----------------------------------------------------------------------------


def test_concurrency_counts_live_leases(committed: Engine) -> None:
    enqueue(committed, "video", 5)
    first = claim_limited(committed, "video", concurrency=2)
    assert (len(first.jobs), first.full) == (2, True)
    assert claim_limited(committed, "video", concurrency=2).jobs == []
    with committed.begin() as conn:
        sqlaq.complete(conn, first.jobs[0].lease)
    assert len(claim_limited(committed, "video", concurrency=2).jobs) == 1
    # A lease that expired holds no slot: its job is due again and is claimed back.
    with committed.begin() as conn:
        conn.execute(
            text("UPDATE sqlaq_jobs SET run_at = now() - interval '1s' WHERE id = :id"),
            {"id": first.jobs[1].id},
        )
    again = claim_limited(committed, "video", concurrency=2)
    assert [job.id for job in again.jobs] == [first.jobs[1].id]
    assert again.jobs[0].attempt == 2
    assert count_status(committed, "queued") == 2


def test_jobs_over_the_rate_stay_queued_with_their_attempts(committed: Engine) -> None:
    ids = enqueue(committed, "api", 5)
    first = claim_limited(committed, "api", rate="3/h")
    assert len(first.jobs) == 3
    held = claim_limited(committed, "api", rate="3/h")
    assert held.jobs == []
    assert held.rate_wait is not None
    assert timedelta(minutes=59) < held.rate_wait <= timedelta(hours=1)
    waiting = rows(
        committed,
        "SELECT status, attempts FROM sqlaq_jobs WHERE id = ANY(:ids) AND status = 'queued'",
        ids=ids,
    )
    assert [tuple(row) for row in waiting] == [("queued", 0), ("queued", 0)]
    (starts,) = rows(committed, "SELECT starts FROM sqlaq_rates WHERE kind = 'api'")[0]
    assert sorted(starts) == sorted(job.attempted_at for job in first.jobs)
    # A start later than a claim's clock counts too: a transaction that began before
    # another took the lock sees that one's starts "in its future".
    with committed.begin() as conn:
        conn.execute(text("UPDATE sqlaq_rates SET starts = ARRAY[now() + interval '1 minute']"))
    assert len(claim_limited(committed, "api", rate="3/h").jobs) == 2


def test_the_start_log_keeps_only_the_rates_count(committed: Engine) -> None:
    enqueue(committed, "api", 6)
    for _ in range(3):
        assert len(claim_limited(committed, "api", limit=3, rate="2/h").jobs) == 2
        with committed.begin() as conn:  # an hour passes, as far as the log can tell
            conn.execute(
                text(
                    "UPDATE sqlaq_rates SET starts = "
                    "ARRAY(SELECT s - interval '2 hours' FROM unnest(starts) AS s)"
                )
            )
    (starts,) = rows(committed, "SELECT starts FROM sqlaq_rates WHERE kind = 'api'")[0]
    assert len(starts) == 2  # the last claim's; each claim dropped the older ones


def test_plain_claim_skips_limited_kinds(committed: Engine) -> None:
    enqueue(committed, "video", 3, priority=5)
    enqueue(committed, "email", 3)
    with committed.begin() as conn:
        claimed = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=10, exclude_kinds=["video"])
    assert sorted(job.kind for job in claimed) == ["email"] * 3
    assert count_status(committed, "queued", "video") == 3


def test_claim_limited_refuses_autocommit_and_bad_limits(committed: Engine) -> None:
    with committed.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(sqlaq.ConfigError, match="needs a transaction"):
            sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="v", concurrency=1)
    with committed.begin() as conn:
        with pytest.raises(sqlaq.ConfigError, match="concurrency must be a positive int"):
            sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="v", concurrency=0)
        with pytest.raises(sqlaq.ConfigError, match="invalid rate"):
            sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="v", rate="often")
        with pytest.raises(sqlaq.InvalidJobError, match="kind"):
            sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="", concurrency=1)


def _race(engine: Engine, claims: int, **limits: Any) -> list[int]:
    """*claims* connections claim the same kind at the same moment; what each got."""
    barrier = threading.Barrier(claims)
    got: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with engine.begin() as conn:
                conn.execute(text("SELECT 1"))  # connected before the barrier
                barrier.wait(10)
                claimed = sqlaq.claim_limited(
                    conn, worker_id=uuid.uuid4(), kind="race", limit=3, **limits
                )
            got.append(len(claimed.jobs))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(claims)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return got


@pytest.mark.timeout(60)
def test_racing_claims_never_exceed_the_concurrency_limit(committed: Engine) -> None:
    enqueue(committed, "race", 40)
    got = _race(committed, 8, concurrency=4)
    assert sum(got) == 4
    assert count_status(committed, "running", "race") == 4


@pytest.mark.timeout(60)
def test_racing_claims_never_exceed_the_rate(committed: Engine) -> None:
    enqueue(committed, "race", 40)
    got = _race(committed, 8, rate="5/h")
    assert sum(got) == 5
    assert count_status(committed, "running", "race") == 5


# -- real workers ---------------------------------------------------------------------------


def _overlaps(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant (an end before a start at equal times)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


@MANY_WORKERS
@pytest.mark.timeout(210)
def test_three_workers_never_run_more_than_two_of_a_kind_limited_to_two(
    ledger: Engine, database_url: str
) -> None:
    """30 jobs of a kind with concurrency=2, three worker processes of 4 slots each:
    never more than 2 run at once, while another kind keeps flowing."""
    with worker_processes(database_url) as start:
        workers = [start("--concurrency", "4", *FAST) for _ in range(3)]
        # The jobs come once the three have started: a process slow to start (imports,
        # connections, on a loaded machine) could otherwise find the videos all done by
        # the first one, and the limit would not be tested across processes.
        wait_started(*workers)
        videos = enqueue(ledger, "video", 30, payload={"seconds": 0.15})
        # Once videos are running, other work still gets through.
        wait_until(lambda: count_status(ledger, "running", "video") > 0, 30, "videos to run")
        others = enqueue(ledger, "record", 30)
        wait_until(lambda: count_status(ledger, "done") == 60, 90, "all 60 jobs done")
    assert all(w.proc.returncode is not None for w in workers)
    ledger_rows = rows(
        ledger,
        "SELECT job_id, note, at, pid FROM sqlaq_test_ledger WHERE job_id = ANY(:ids)",
        ids=videos,
    )
    starts = {r.job_id: r.at for r in ledger_rows if r.note == "start"}
    ends = {r.job_id: r.at for r in ledger_rows if r.note == "end"}
    assert len(starts) == len(ends) == 30
    assert _overlaps([(starts[i], ends[i]) for i in videos]) == 2
    assert len({r.pid for r in ledger_rows}) >= 2  # the limit held across processes
    other_runs = rows(
        ledger, "SELECT max(at) FROM sqlaq_test_ledger WHERE job_id = ANY(:ids)", ids=others
    )
    # Every other job ran before the videos were through (each pair takes 0.15 s).
    assert other_runs[0][0] < max(ends.values())


@pytest.mark.timeout(120)
def test_three_workers_start_at_most_five_a_second_of_a_kind_rated_5_per_s(
    ledger: Engine, database_url: str
) -> None:
    """25 jobs with rate="5/s" over three worker processes. A job starts when it is
    claimed, on the database's clock (``attempted_at``): no 1-second window holds more
    than 5 starts, so the 25 take at least 4 seconds."""
    ids = enqueue(ledger, "rated", 25)
    with worker_processes(database_url) as start:
        for _ in range(3):
            start("--concurrency", "10", *FAST)
        wait_until(lambda: count_status(ledger, "done") == 25, 60, "all 25 jobs done")
    attempted = sorted(
        r[0]
        for r in rows(ledger, "SELECT attempted_at FROM sqlaq_jobs WHERE id = ANY(:ids)", ids=ids)
    )
    assert len(attempted) == 25
    # Six starts within less than a second would be a window with more than five.
    assert min(attempted[i + 5] - attempted[i] for i in range(20)) >= timedelta(seconds=1)
    assert attempted[-1] - attempted[0] >= timedelta(seconds=4)
    # Each job ran once, and none used more than its one attempt while held back.
    runs = rows(ledger, "SELECT count(*), max(attempt) FROM sqlaq_test_ledger")
    assert tuple(runs[0]) == (25, 1)


def test_claimed_jobs_carry_their_start_on_the_database_clock(conn: Connection) -> None:
    sqlaq.enqueue(conn, "x")
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    now = conn.execute(text("SELECT now()")).scalar_one()
    assert job.attempted_at == now


@pytest.mark.timeout(60)
def test_a_burst_worker_waits_out_the_rate_then_exits(committed: Engine) -> None:
    """Burst runs what is due, limited kinds included: jobs the rate holds back are
    waited for (they are due), then the worker stops."""
    registry = sqlaq.Registry()
    registry.add("rated", lambda payload: None, rate="4/s")
    registry.add("capped", lambda payload: None, concurrency=1)
    ids = enqueue(committed, "rated", 9) + enqueue(committed, "capped", 3)
    worker = sqlaq.Worker(committed, registry, burst=True, poll_interval=timedelta(seconds=0.1))
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(30)
    assert worker.stopped.is_set()
    assert count_status(committed, "done") == len(ids)
    attempted = sorted(
        r[0]
        for r in rows(
            committed,
            "SELECT attempted_at FROM sqlaq_jobs WHERE kind = 'rated' ORDER BY attempted_at",
        )
    )
    assert attempted[8] - attempted[0] >= timedelta(seconds=2)  # 9 starts at 4/s


def test_kind_gates_remember_why_a_kind_is_not_worth_claiming() -> None:
    from sqlaq.worker.gates import KindGates

    registry = sqlaq.Registry()
    registry.add("plain", print)
    registry.add("capped", print, concurrency=1)
    registry.add("rated", print, rate="1/s")
    gates = KindGates(registry)
    assert gates.kinds == ["capped", "rated"]

    def open_(queue: str, now: float) -> list[str]:
        return [h.kind for h in gates.open(queue, now)]

    gates.record("q", "capped", sqlaq.LimitedClaim([], full=True), 5, now=0.0, poll=5.0)
    gates.record("q", "rated", sqlaq.LimitedClaim([], rate_wait=timedelta(seconds=1)), 5, 0.0, 5.0)
    gates.record("r", "rated", sqlaq.LimitedClaim([]), 5, now=0.0, poll=5.0)  # none due
    assert open_("q", 0.5) == []
    assert gates.next_try() == 1.0
    assert gates.finished("capped")  # a job of it ended here: open again
    assert not gates.finished("plain")
    assert open_("q", 0.5) == ["capped"]
    assert gates.expire(1.0)
    assert open_("q", 1.0) == ["capped", "rated"]
    assert open_("r", 1.0) == ["capped"]  # nothing was due in r
    gates.woken(["r"])
    assert open_("r", 1.0) == ["capped", "rated"]
    assert not gates.blocked
