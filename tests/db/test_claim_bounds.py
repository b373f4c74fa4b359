"""The worker's bounded claims (sqlaq.worker.fetcher, ``claim_stmt(bounded=True)``):
each claim starts at the claim index's position of the last job the worker claimed, so
the dead entries behind it, which a snapshot held elsewhere keeps, are never walked; a
job that becomes due behind that position is claimed after its NOTIFY (which moves the
bound back), at the next poll (a listening worker's look behind its bound, on another
connection; a full claim for one that does not listen), or at once by a worker no
NOTIFY reaches once its bounded claim comes back empty."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url

import sqlaq
from sqlaq import NewJob, WorkerConfig, queries
from sqlaq.drive import run
from sqlaq.ops.claiming import claim_bounded
from sqlaq.worker.fetcher import SLOW_WALK, Fetcher, parse_wake

pytestmark = pytest.mark.timeout(120)

QUEUE = "default"


def _fetcher(engine: Engine, found: Any = None, **options: Any) -> Fetcher:
    registry = sqlaq.Registry()
    registry.handler("k")(lambda payload: None)

    def back_off(exc: BaseException) -> None:
        raise exc

    options.setdefault("poll_interval", timedelta(minutes=10))  # no poll unless asked
    config = WorkerConfig(**options)
    return Fetcher(engine, registry, config, uuid.uuid4(), back_off, lambda: None, found=found)


@contextmanager
def _fetching(engine: Engine, found: Any = None, **options: Any) -> Iterator[Fetcher]:
    fetcher = _fetcher(engine, found, **options)
    try:
        yield fetcher
    finally:
        fetcher.stop()


def _ids(engine: Engine, count: int, **fields: Any) -> list[int]:
    with engine.begin() as conn:
        return [r.job_id for r in sqlaq.enqueue_many(conn, [NewJob("k", **fields)] * count)]


def _dsn(engine: Engine) -> str:
    return make_url(engine.url).set(drivername="postgresql").render_as_string(False)


@contextmanager
def _listening(engine: Engine) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(_dsn(engine), autocommit=True) as conn:
        conn.execute("LISTEN sqlaq_jobs")
        yield conn


def _notifications(listener: psycopg.Connection[Any], count: int) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=10, stop_after=count)]


@contextmanager
def _late_job(engine: Engine, **fields: Any) -> Iterator[int]:
    """A job inserted by a transaction that started first (its run_at is that
    transaction's now()) and commits when the block ends: after the jobs enqueued and
    claimed inside the block, so it lands behind the worker's bound."""
    with engine.connect() as conn:
        conn.execute(text("SELECT now()")).one()  # the transaction's clock starts here
        yield sqlaq.enqueue(conn, "k", queue=QUEUE, **fields).job_id
        conn.commit()


@contextmanager
def _held_snapshot(engine: Engine) -> Iterator[None]:
    """A REPEATABLE READ transaction holding its snapshot: nothing dead after it can be
    cleaned up, in the heap or the claim index."""
    with psycopg.connect(_dsn(engine)) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1").fetchall()
        try:
            yield
        finally:
            conn.rollback()


def _claimed(fetcher: Fetcher, room: int) -> list[int]:
    return [job.id for job in fetcher.fetch(room, room, lambda: False)]


def test_a_late_commit_behind_the_bound_is_claimed_once_its_notify_arrives(
    committed: Engine,
) -> None:
    with _listening(committed) as listener, _fetching(committed) as fetcher:
        with _late_job(committed) as late:
            early = _ids(committed, 5)
            assert _claimed(fetcher, 3) == early[:3]  # a full claim: the bound is set
            assert _claimed(fetcher, 10) == early[3:]  # from the bound
        payloads = _notifications(listener, 2)
        woken = parse_wake(payloads[-1], [QUEUE])
        assert woken is not None
        assert woken[1] is not None  # the trigger's position
        fetcher.notified(*woken)
        assert fetcher.due
        assert _claimed(fetcher, 10) == [late]


def test_a_notify_after_the_bound_leaves_it_where_it_is(committed: Engine) -> None:
    """A position after the bound does not move it back: the claim after it still
    starts at the bound (the late job behind it stays for the poll)."""
    with _listening(committed) as listener, _fetching(committed) as fetcher:
        with _late_job(committed) as late:
            early = _ids(committed, 3)
            assert _claimed(fetcher, 10) == early
        _notifications(listener, 2)
        after = _ids(committed, 2)
        woken = parse_wake(_notifications(listener, 1)[0], [QUEUE])
        assert woken is not None
        fetcher.notified(*woken)
        assert _claimed(fetcher, 10) == after
        fetcher.woken([QUEUE])  # the poll: a full claim
        assert _claimed(fetcher, 10) == [late]


def test_a_higher_priority_job_enqueued_behind_the_bound_goes_first(committed: Engine) -> None:
    """Priority order holds across the bound: a later job of a higher priority sits
    before the bound in the index; its NOTIFY moves the bound back to it, and the next
    claim takes it, then the rest of the lower priority from where it was."""
    with _listening(committed) as listener, _fetching(committed) as fetcher:
        low = _ids(committed, 6, priority=0)
        assert _claimed(fetcher, 2) == low[:2]
        high = _ids(committed, 2, priority=5)
        payloads = _notifications(listener, 2)
        woken = parse_wake(payloads[-1], [QUEUE])
        assert woken is not None
        assert woken[1] is not None
        assert woken[1].priority == 5
        fetcher.notified(*woken)
        assert _claimed(fetcher, 3) == [*high, low[2]]
        assert _claimed(fetcher, 10) == low[3:]


def test_a_notification_without_a_position_means_a_full_claim(committed: Engine) -> None:
    with _fetching(committed) as fetcher:
        with _late_job(committed) as late:
            early = _ids(committed, 2)
            assert _claimed(fetcher, 10) == early
        woken = parse_wake(QUEUE, [QUEUE])  # sqlaq.notify_queues, an older trigger
        assert woken == (QUEUE, None)
        fetcher.notified(*woken)
        assert _claimed(fetcher, 10) == [late]


@pytest.mark.parametrize("options", [{"burst": True}, {"listen": False}])
def test_where_no_notify_comes_an_empty_bounded_claim_looks_at_the_whole_queue(
    committed: Engine, options: dict[str, Any]
) -> None:
    """A burst worker stops on an empty claim, and one that only polls waits for its
    poll: their empty claim is a full one, so nothing behind the bound is left."""
    with _fetching(committed, **options) as fetcher:
        with _late_job(committed) as late:
            early = _ids(committed, 2)
            assert _claimed(fetcher, 10) == early
        assert fetcher.due
        assert _claimed(fetcher, 10) == [late]
        assert _claimed(fetcher, 10) == []
        assert not fetcher.due


def test_without_listen_a_late_job_waits_at_most_one_poll_while_the_worker_drains(
    committed: Engine,
) -> None:
    """Busy draining (each bounded claim gives jobs), a worker without LISTEN claims a
    job that landed behind its bound at its next poll, ahead of the rest (a full
    claim, in the index's order)."""
    poll = 0.5
    with _fetching(committed, listen=False, poll_interval=timedelta(seconds=poll)) as fetcher:
        with _late_job(committed) as late:
            first = _ids(committed, 1)
            started = time.monotonic()
            assert _claimed(fetcher, 1) == first  # the poll's full claim; the bound is set
        rest = _ids(committed, 5000)
        taken: list[int] = []
        while late not in taken:
            taken += _claimed(fetcher, 1)
            assert time.monotonic() - started < poll + 10, "the late job was never claimed"
        # Only at the poll: jobs after the bound came first, then the late one.
        assert taken[:-1] == rest[: len(taken) - 1]
        assert len(taken) > 1
        assert time.monotonic() - started >= poll


def _expired_behind_the_bound(engine: Engine, fetcher: Fetcher) -> tuple[int, list[int]]:
    """A job of a higher priority whose lease expires after *fetcher* moved on to a
    lower priority: it sits before the bound. Returns it and the lower jobs (two of
    five claimed)."""
    [high] = _ids(engine, 1, priority=5)
    low = _ids(engine, 5, priority=0)
    assert _claimed(fetcher, 2) == [high, low[0]]  # the bound: low[0]'s position
    with engine.begin() as conn:  # its worker died: the lease ran out
        conn.execute(
            text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 second' WHERE id = :i"),
            {"i": high},
        )
    return high, low


def test_an_expired_lease_behind_the_bound_is_claimed_again_by_a_full_claim(
    committed: Engine,
) -> None:
    """The bounded claims pass an expired lease behind the bound by; a full claim (after
    a notification without a position) takes it again."""
    with _fetching(committed) as fetcher:
        high, low = _expired_behind_the_bound(committed, fetcher)
        assert _claimed(fetcher, 1) == [low[1]]  # bounded: not seen
        fetcher.woken([QUEUE])  # a notification without a position, a reconnection
        reclaimed = fetcher.fetch(2, 2, lambda: False)
        assert [(j.id, j.attempt) for j in reclaimed] == [(high, 2), (low[2], 1)]


class _Found:
    """What a fetcher's looks behind its bounds reported."""

    def __init__(self) -> None:
        self.positions: list[tuple[str, sqlaq.queries.ClaimPosition]] = []
        self.event = threading.Event()

    def __call__(self, queue: str, position: sqlaq.queries.ClaimPosition) -> None:
        self.positions.append((queue, position))
        self.event.set()


def test_a_listening_workers_poll_looks_behind_its_bound_on_a_connection_of_its_own(
    committed: Engine,
) -> None:
    """The poll of a listening worker keeps its bound: its claims go on from there while
    another connection looks behind it, and what the look finds moves the bound back
    as a NOTIFY with a position would."""
    found = _Found()
    with _fetching(committed, found) as fetcher:
        high, low = _expired_behind_the_bound(committed, fetcher)
        fetcher._poll((QUEUE,), float("inf"))  # the poll, whenever the last look was
        assert _claimed(fetcher, 1) == [low[1]]  # still from the bound
        assert found.event.wait(10), "the look behind the bound reported nothing"
        [(queue, position)] = found.positions
        # Just before the job: a bounded claim starts after its position.
        assert (queue, position.priority, position.id) == (QUEUE, 5, high - 1)
        fetcher.notified(queue, position)  # what the worker's run thread does with it
        reclaimed = fetcher.fetch(2, 2, lambda: False)
        assert [(j.id, j.attempt) for j in reclaimed] == [(high, 2), (low[2], 1)]


def test_a_look_behind_the_bound_keeps_to_the_workers_where(committed: Engine) -> None:
    """A worker's ``where`` narrows its looks as it narrows its claims: a job it would
    not claim is not reported."""
    found = _Found()
    with _fetching(committed, found, where=sqlaq.jobs.c.priority == 0) as fetcher:
        low = _ids(committed, 3, priority=0)
        [high] = _ids(committed, 1, priority=5)
        assert _claimed(fetcher, 1) == [low[0]]
        fetcher._poll((QUEUE,), float("inf"))
        assert found.event.wait(10), "the look behind the bound reported nothing"
        [(_, position)] = found.positions
        assert (position.priority, position.id) == (0, low[1] - 1)
        assert high not in _claimed(fetcher, 10)


def test_a_look_behind_the_bound_is_spaced_by_its_own_length(committed: Engine) -> None:
    """A poll looks behind the bounds only once FULL_CLAIM_SPACING times the last look's
    length has passed: a look walks what a held snapshot keeps, however long that is."""
    found = _Found()
    with _fetching(committed, found) as fetcher:
        _ids(committed, 3)
        assert len(_claimed(fetcher, 1)) == 1  # a full claim: the bound is set
        fetcher._poll((QUEUE,), float("inf"))
        assert found.event.wait(10)
        fetcher.stop()  # the look has ended
        found.event.clear()
        spaced = fetcher._next_full  # its end, plus FULL_CLAIM_SPACING times its length
        fetcher._poll((QUEUE,), spaced - 0.001)  # just before: no look
        fetcher.stop()
        assert not found.event.is_set()
        assert fetcher.due  # the poll still made the queue due
        fetcher._poll((QUEUE,), spaced)
        assert found.event.wait(10)
        assert len(found.positions) == 2


def test_after_a_slow_walk_a_notification_without_a_position_looks_behind_the_bound(
    committed: Engine,
) -> None:
    """Once a walk of the claim index was slow (a held snapshot keeps dead entries at its
    start), a listening worker answers a notification without a position (a workflow's
    release, ``notify_queues``) with a look behind its bound, not a full claim on its
    claiming thread."""
    found = _Found()
    with _fetching(committed, found) as fetcher:
        high, low = _expired_behind_the_bound(committed, fetcher)
        fetcher._walk = 2 * SLOW_WALK  # what a held snapshot made the last walk take
        fetcher.notified(QUEUE, None)
        assert _claimed(fetcher, 1) == [low[1]]  # the bound holds
        assert found.event.wait(10), "no look behind the bound"
        [(queue, position)] = found.positions
        assert position.id == high - 1
        fetcher.notified(queue, position)
        reclaimed = fetcher.fetch(2, 2, lambda: False)
        assert [(j.id, j.attempt) for j in reclaimed] == [(high, 2), (low[2], 1)]


def test_while_walks_are_quick_a_notification_without_a_position_is_a_full_claim(
    committed: Engine,
) -> None:
    found = _Found()
    with _fetching(committed, found) as fetcher:
        high, low = _expired_behind_the_bound(committed, fetcher)
        fetcher._walk = SLOW_WALK / 2
        fetcher.notified(QUEUE, None)
        assert _claimed(fetcher, 2) == [high, low[1]]  # from the queue's first entry
        assert found.positions == []


def test_a_look_asked_for_while_one_runs_is_taken_by_it(committed: Engine) -> None:
    """One look runs at a time; what is asked meanwhile, it looks at before it ends."""
    release, both = threading.Event(), threading.Event()
    seen: list[str] = []

    def found(queue: str, position: sqlaq.queries.ClaimPosition) -> None:
        seen.append(queue)
        if len(seen) == 1:
            assert release.wait(10)  # the look's thread waits here: it is running
        else:
            both.set()

    with _fetching(committed, found, queues=(QUEUE, "other")) as fetcher:
        _ids(committed, 2)
        _ids(committed, 2, queue="other")
        assert len(_claimed(fetcher, 1) + _claimed(fetcher, 1)) == 2  # a bound in each
        fetcher._look([QUEUE])
        fetcher._look(["other"])  # while the first runs (or before it took QUEUE)
        release.set()
        assert both.wait(10), seen
    assert sorted(seen) == [QUEUE, "other"]


def test_a_worker_that_does_not_listen_drops_its_bounds_at_the_poll(committed: Engine) -> None:
    """No look behind for a worker no NOTIFY reaches: its poll's claim is a full one."""
    found = _Found()
    with _fetching(committed, found, listen=False) as fetcher:
        with _late_job(committed) as late:
            early = _ids(committed, 2)
            assert _claimed(fetcher, 2) == early
        fetcher._poll((QUEUE,), float("inf"))
        assert _claimed(fetcher, 10) == [late]
        assert found.positions == []


def _entries_read(conn: Connection) -> int:
    """Claim-index entries the scans of this transaction returned so far (counted by
    the server whether their rows are live or dead)."""
    return conn.execute(
        text("SELECT pg_stat_get_xact_tuples_returned('sqlaq_jobs_claim_idx'::regclass)")
    ).scalar_one()


def test_with_a_snapshot_held_a_bounded_claim_reads_only_entries_after_its_bound(
    committed: Engine,
) -> None:
    """What the bound is for: behind it, 900 claimed-and-done jobs whose dead index
    entries a held snapshot keeps. A full claim of 10 walks them all; a claim from the
    bound reads about the 10 it takes."""
    worker = uuid.uuid4()
    lease = timedelta(seconds=30)
    _ids(committed, 1000)
    with _held_snapshot(committed):
        position = None
        for _ in range(9):
            with committed.begin() as conn:
                plan = claim_bounded(
                    worker_id=worker, queue=QUEUE, limit=100, lease=lease, after=position
                )
                jobs, position = run(conn, plan)
                sqlaq.complete(conn, [j.lease for j in jobs])
        assert position is not None
        reads = {}
        for label, after in (("full", None), ("bounded", position)):
            with committed.connect() as conn:
                before = _entries_read(conn)
                plan = claim_bounded(
                    worker_id=worker, queue=QUEUE, limit=10, lease=lease, after=after
                )
                jobs, _ = run(conn, plan)
                assert len(jobs) == 10
                reads[label] = _entries_read(conn) - before
                conn.rollback()
        assert reads["full"] >= 900
        assert reads["bounded"] <= 20


def test_racing_fetchers_with_late_arrivals_take_every_job_exactly_once(
    committed: Engine,
) -> None:
    """Four fetchers, each with its own bound, claim while jobs of mixed priorities
    keep arriving (some from transactions that commit late, behind the bounds), their
    notifications delivered to every fetcher: each job is claimed once, none is left."""
    stop = threading.Event()
    enqueued: list[int] = []
    fetchers = [_fetcher(committed, poll_interval=timedelta(milliseconds=200)) for _ in range(4)]
    locks = [threading.Lock() for _ in fetchers]

    def enqueuer() -> None:
        for round_ in range(40):
            with committed.connect() as slow:  # a late commit: started first
                slow.execute(text("SELECT now()")).one()
                late = sqlaq.enqueue(slow, "k", priority=round_ % 3).job_id
                enqueued.extend(_ids(committed, 20, priority=(round_ + 1) % 3))
                slow.commit()
            enqueued.append(late)
        stop.set()

    def notifier() -> None:
        with _listening(committed) as listener:
            while not stop.is_set():
                for notify in listener.notifies(timeout=0.05):
                    woken = parse_wake(notify.payload, [QUEUE])
                    if woken is not None:
                        for fetcher, lock in zip(fetchers, locks, strict=True):
                            with lock:
                                fetcher.notified(*woken)

    def claimer(index: int) -> list[int]:
        fetcher, lock = fetchers[index], locks[index]
        seen: list[int] = []
        while True:
            done = stop.is_set()
            with lock:
                jobs = fetcher.fetch(7, 7, lambda: False)
            if jobs:
                with committed.begin() as conn:
                    sqlaq.complete(conn, [j.lease for j in jobs])
                seen += [j.id for j in jobs]
            elif not done:
                stop.wait(0.005)  # nothing due here until a NOTIFY or the poll
            else:
                with lock:
                    fetcher.woken([QUEUE])  # one last full claim
                    jobs = fetcher.fetch(7, 7, lambda: False)
                if not jobs:
                    return seen
                with committed.begin() as conn:
                    sqlaq.complete(conn, [j.lease for j in jobs])
                seen += [j.id for j in jobs]

    try:
        with ThreadPoolExecutor(6) as pool:
            listening = pool.submit(notifier)
            claims = [pool.submit(claimer, i) for i in range(4)]
            pool.submit(enqueuer).result()
            results = [c.result() for c in claims]
            listening.result()
    finally:
        for fetcher in fetchers:
            fetcher.close()
    counts = Counter(job_id for seen in results for job_id in seen)
    assert sorted(counts) == sorted(enqueued)
    assert set(counts.values()) == {1}


def test_the_bounded_claim_uses_the_claim_index_for_both_ranges(committed: Engine) -> None:
    """Both ranges are index conditions of the claim index (not filters after a walk
    from the queue's first entry)."""
    _ids(committed, 50)
    params = queries.claim_params(
        queue=QUEUE,
        worker_id=uuid.uuid4(),
        limit=5,
        lease=timedelta(seconds=30),
        after=queries.ClaimPosition(0, queries.FULL_CLAIM.run_at, 0),
    )
    stmt = queries.claim_stmt(
        queue=QUEUE, worker_id=uuid.uuid4(), limit=5, lease=timedelta(seconds=30), bounded=True
    )
    with committed.connect() as conn:
        sql = str(stmt.compile(dialect=conn.dialect))
        driver = conn.connection.driver_connection
        assert driver is not None
        cursor = driver.cursor()
        cursor.execute("EXPLAIN (COSTS OFF) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        conn.rollback()
    conditions = [line.strip() for line in plan.splitlines() if "Index Cond" in line]
    assert any("priority = " in c and "ROW(run_at, id) > ROW(" in c for c in conditions), plan
    assert any("priority < " in c for c in conditions), plan


def test_with_a_snapshot_held_a_complete_probes_the_primary_key_not_the_running_index(
    committed: Engine,
) -> None:
    """The fence of a complete (and of every statement fenced by leases) finds its rows
    by id: the partial running index, which a held snapshot fills with the dead entry
    of every job that ran, is never walked (the planner took it for tiny: its
    statistics count live rows)."""
    worker = uuid.uuid4()
    lease = timedelta(seconds=30)
    _ids(committed, 3000)
    with committed.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE sqlaq_jobs")  # statistics without a running row
        )
    with _held_snapshot(committed):
        position = None
        for _ in range(29):
            with committed.begin() as conn:
                plan = claim_bounded(
                    worker_id=worker, queue=QUEUE, limit=100, lease=lease, after=position
                )
                jobs, position = run(conn, plan)
                sqlaq.complete(conn, [j.lease for j in jobs])
        with committed.connect() as conn:
            plan = claim_bounded(
                worker_id=worker, queue=QUEUE, limit=100, lease=lease, after=position
            )
            jobs, _ = run(conn, plan)
            assert len(jobs) == 100
            conn.commit()
            before = conn.execute(
                text("SELECT pg_stat_get_xact_tuples_returned('sqlaq_jobs_running_idx'::regclass)")
            ).scalar_one()
            assert sorted(sqlaq.complete(conn, [j.lease for j in jobs])) == sorted(
                j.id for j in jobs
            )
            after = conn.execute(
                text("SELECT pg_stat_get_xact_tuples_returned('sqlaq_jobs_running_idx'::regclass)")
            ).scalar_one()
            conn.rollback()
    assert after - before == 0
