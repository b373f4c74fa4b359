"""The worker, against a real PostgreSQL.

Crash, signal and multi-process behaviour runs real ``sqlaq-worker`` processes (see
``workerkit``); the Python API runs ``Worker.run()`` in a thread. Tests wait on database
state or worker events with deadlines, never on a bare sleep.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import tenacity
from sqlalchemy import Engine, text
from workerkit import (
    FAST,
    MANY_WORKERS,
    START_TIMEOUT,
    Recorder,
    WorkerProcess,
    backends,
    count_status,
    enqueue,
    enqueue_many,
    fast_worker,
    job,
    ledger_runs,
    ledger_table,
    listener_backends,
    rows,
    running,
    scalar,
    terminate,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq.config import WorkerConfig
from sqlaq.outcome import describe_error
from sqlaq.transient import is_transient

# Each test that starts processes or threads sets its own, tighter bound.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    """The ledger table (on a truncated queue), dropped after the test."""
    yield from ledger_table(committed)


def status_is(engine: Engine, job_id: int, *statuses: str) -> bool:
    return job(engine, job_id).status in statuses


# -- several worker processes ----------------------------------------------------------


@MANY_WORKERS
@pytest.mark.timeout(390)
def test_four_workers_times_4000_jobs_each_run_exactly_once(
    ledger: Engine, database_url: str
) -> None:
    """4 worker processes x 4,000 jobs each: 16,000 jobs, every one run exactly once."""
    total = 4 * 4000
    with worker_processes(database_url) as start:
        workers = [start("--concurrency", "8", "--log-level", "warning") for _ in range(4)]
        # Four processes starting at once on a loaded machine: their start-up is not
        # what is tested.
        wait_until(
            lambda: len(listener_backends(ledger)) == 4, START_TIMEOUT, "four listening workers"
        )
        ids = enqueue_many(ledger, "record", total)
        # Generous: about 90 s on a calm 2-core box, much more on a loaded one.
        wait_until(lambda: count_status(ledger, "done") == total, 300, "all jobs done", 0.2)
        assert all(w.alive() for w in workers)
    runs = rows(
        ledger,
        "SELECT count(*), count(DISTINCT job_id), count(DISTINCT pid), max(attempt) "
        "FROM sqlaq_test_ledger",
    )[0]
    retried = rows(ledger, "SELECT id, attempts, last_error FROM sqlaq_jobs WHERE attempts > 1")
    assert tuple(runs) == (total, total, 4, 1), retried[:5]
    per_worker = rows(ledger, "SELECT count(*) FROM sqlaq_test_ledger GROUP BY pid")
    assert all(row[0] > 0 for row in per_worker)
    assert scalar(ledger, "SELECT count(*) FROM sqlaq_jobs WHERE status <> 'done'") == 0
    assert scalar(ledger, "SELECT count(*) FROM sqlaq_jobs WHERE id = ANY(:ids)", ids=ids) == total


@pytest.mark.timeout(180)
def test_sigkilled_worker_job_runs_again_elsewhere_after_its_lease(
    ledger: Engine, database_url: str
) -> None:
    with worker_processes(database_url) as start:
        doomed = start("--lease", "2", *FAST)
        job_id = enqueue(ledger, "block_first", {"seconds": 60})
        # The first run is the process's first sign of life: its start-up (imports,
        # connections) takes what the machine's load makes it take.
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the first run to start")
        doomed.signal(signal.SIGKILL)
        doomed.wait(10)
        wait_started(start("--lease", "2", *FAST))
        wait_until(lambda: status_is(ledger, job_id, "done"), 20, "the job done by the survivor")
    row = job(ledger, job_id)
    assert (row.status, row.attempts) == ("done", 2)
    assert "lease expired on attempt 1" in row.last_error
    runs = ledger_runs(ledger, job_id)
    assert [r.attempt for r in runs] == [1, 2]
    assert runs[0].pid != runs[1].pid


@pytest.mark.timeout(240)
def test_job_that_kills_its_worker_every_time_ends_failed(
    ledger: Engine, database_url: str
) -> None:
    others = enqueue_many(ledger, "record", 20)
    killer = enqueue(ledger, "exit", max_attempts=2, priority=1)
    processes: list[WorkerProcess] = []
    with worker_processes(database_url) as start:

        def restarted(condition: Callable[[], Any]) -> Callable[[], Any]:
            def check() -> Any:
                # Restart workers as the job kills them, two alive at a time.
                for _ in range(2 - sum(p.alive() for p in processes)):
                    processes.append(start("--lease", "1", "--concurrency", "2", *FAST))
                return condition()

            return check

        # Each step waits for a worker process started meanwhile (the first ones, then
        # the killed ones' replacements): a start-up takes what the machine's load makes
        # it take, and none of these deadlines is what is tested.
        wait_until(
            restarted(lambda: ledger_runs(ledger, killer)),
            START_TIMEOUT,
            "the killer's first run",
            0.1,
        )
        wait_until(
            restarted(lambda: len(ledger_runs(ledger, killer)) >= 2),
            START_TIMEOUT,
            "the killer's second run",
            0.1,
        )
        wait_until(
            restarted(
                lambda: status_is(ledger, killer, "failed") and count_status(ledger, "done") == 20
            ),
            START_TIMEOUT,
            "the killer failed and the others done",
            0.1,
        )
    row = job(ledger, killer)
    assert row.attempts == 2
    assert "lease expired on attempt 2 of 2" in row.last_error
    assert len(ledger_runs(ledger, killer)) == 2
    assert all(status_is(ledger, i, "done") for i in others)
    assert sum(p.proc.returncode == 3 for p in processes) == 2


@pytest.mark.timeout(120)
def test_heartbeat_keeps_a_slow_job_from_running_twice(ledger: Engine, database_url: str) -> None:
    # A lease of 3 s (renewed each second) for a job of 7 s: more than two leases long,
    # and a renewal may come late by up to 2 s on a loaded machine (a lease of 1 s,
    # renewed every third of a second, ran out once in a CI rehearsal on PostgreSQL 18).
    with worker_processes(database_url) as start:
        start("--lease", "3", *FAST)
        job_id = enqueue(ledger, "sleep", {"seconds": 7})
        # The job's start is the process's first sign of life (after its start-up).
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the slow job to start")
        start("--lease", "3", *FAST)  # would take the job if its lease ran out
        wait_until(lambda: status_is(ledger, job_id, "done"), 20, "the slow job done")
    row = job(ledger, job_id)
    assert (row.attempts, row.last_error) == (1, None)
    assert [r.note for r in ledger_runs(ledger, job_id)] == ["", "finished"]


# -- waking up -------------------------------------------------------------------------


def start_delay(engine: Engine, job_id: int) -> float:
    """Seconds from enqueue to the handler's start, on the database clock."""
    return float(
        scalar(
            engine,
            "SELECT extract(epoch FROM min(l.at) - j.created_at) FROM sqlaq_test_ledger l "
            "JOIN sqlaq_jobs j ON j.id = l.job_id WHERE j.id = :id GROUP BY j.created_at",
            id=job_id,
        )
    )


@pytest.mark.timeout(150)
def test_idle_worker_wakes_on_notify_and_again_after_its_listener_is_killed(
    ledger: Engine, database_url: str
) -> None:
    with worker_processes(database_url) as start:
        # A poll of 30 s: a job started well within that was woken by a notification (or
        # the listener's catch-up on reconnecting), not by the poll. The bounds leave a
        # loaded machine room and stay far from the poll; they run from the LISTEN, after
        # the process's start-up.
        start("--poll-interval", "30", "--log-level", "info")
        wait_until(lambda: listener_backends(ledger), START_TIMEOUT, "the worker to LISTEN")
        first = enqueue(ledger, "record")
        wait_until(lambda: ledger_runs(ledger, first), 15, "the first job to start")
        assert start_delay(ledger, first) < 10

        killed = listener_backends(ledger)
        terminate(ledger, killed)
        second = enqueue(ledger, "record")  # possibly while the listener is down
        wait_until(lambda: ledger_runs(ledger, second), 15, "the job enqueued meanwhile")
        assert start_delay(ledger, second) < 10

        wait_until(lambda: set(listener_backends(ledger)) - set(killed), 15, "a new listener")
        third = enqueue(ledger, "record")
        wait_until(lambda: ledger_runs(ledger, third), 15, "a job after reconnecting")
        assert start_delay(ledger, third) < 10


# -- database trouble ------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_worker_recovers_when_every_connection_is_killed(ledger: Engine, database_url: str) -> None:
    with worker_processes(database_url) as start:
        # A short lease: a claim whose COMMIT went through just as its connection was
        # killed is unknown to the worker, and is claimed again once its lease ends.
        worker = start("--concurrency", "4", "--lease", "3", *FAST)
        wait_until(lambda: listener_backends(ledger), START_TIMEOUT, "the worker to start")
        with ledger.begin() as conn:
            sqlaq.enqueue_many(conn, [sqlaq.NewJob("sleep", {"seconds": 0.02}) for _ in range(400)])
        for _ in range(3):
            done = count_status(ledger, "done")
            wait_until(lambda: backends(ledger, "sqlaq-worker"), 10, "worker connections")
            terminate(ledger, backends(ledger, "sqlaq-worker") + listener_backends(ledger))
            wait_until(lambda: count_status(ledger, "done") >= done + 20, 10, "progress")  # noqa: B023
        wait_until(lambda: count_status(ledger, "done") == 400, 40, "every job done", 0.2)
        assert worker.alive()
        assert "database unavailable" in worker.output()
    finished = "SELECT count(DISTINCT job_id) FROM sqlaq_test_ledger WHERE note = 'finished'"
    assert scalar(ledger, finished) == 400
    assert count_status(ledger, "failed") == 0


# -- stopping --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sigterm_lets_the_running_job_finish_then_exits_0(
    ledger: Engine, database_url: str
) -> None:
    with worker_processes(database_url) as start:
        worker = start(*FAST)
        job_id = enqueue(ledger, "sleep", {"seconds": 1.5})
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the job to start")
        worker.signal(signal.SIGTERM)
        assert worker.wait(15) == 0
    row = job(ledger, job_id)
    assert (row.status, row.attempts) == ("done", 1)
    assert [r.note for r in ledger_runs(ledger, job_id)] == ["", "finished"]


@pytest.mark.timeout(180)
def test_sigterm_after_the_grace_period_hands_the_job_to_another_worker(
    ledger: Engine, database_url: str
) -> None:
    with worker_processes(database_url) as start:
        first = start("--grace-period", "0.5", *FAST)
        job_id = enqueue(ledger, "block_first", {"seconds": 60})
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the job to start")
        first.signal(signal.SIGTERM)
        assert first.wait(15) == 0
        row = job(ledger, job_id)
        assert (row.status, row.attempts, row.locked_by) == ("queued", 0, None)
        assert "job handed back" in first.output()
        # Polling every 30 s, it finds the handed-back job when it starts: 15 s from its
        # start (after its start-up), well before its first poll.
        wait_started(start("--poll-interval", "30"))
        wait_until(lambda: status_is(ledger, job_id, "done"), 15, "the job done elsewhere")
    row = job(ledger, job_id)
    assert (row.status, row.attempts) == ("done", 1)  # the hand-back refunded attempt 1
    assert len(ledger_runs(ledger, job_id)) == 2


@pytest.mark.timeout(120)
def test_second_signal_hands_back_at_once(ledger: Engine, database_url: str) -> None:
    with worker_processes(database_url) as start:
        worker = start("--grace-period", "60", *FAST)
        job_id = enqueue(ledger, "block_first", {"seconds": 60})
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the job to start")
        worker.signal(signal.SIGINT)
        wait_until(lambda: "send it again" in worker.output(), 5, "the first signal noticed")
        worker.signal(signal.SIGINT)
        assert worker.wait(10) == 1
    assert (job(ledger, job_id).status, job(ledger, job_id).attempts) == ("queued", 0)


# -- the Python API, in process ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_sync_and_async_handlers_see_their_job(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    loops: set[int] = set()

    @registry.handler("sync")
    def sync_handler(payload: dict[str, Any]) -> None:
        recorder.saw(payload)

    @registry.handler("async")
    async def async_handler(payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.01)  # other jobs' tasks run meanwhile: contexts stay apart
        recorder.saw(payload)
        loops.add(id(asyncio.get_running_loop()))

    ids = {
        enqueue(committed, kind, {"n": n}): (kind, n)
        for n in range(5)
        for kind in ("sync", "async")
    }
    with running(fast_worker(committed, registry, recorder)):
        results = recorder.wait_for(10)
    assert {r.job_id for r in results} == set(ids)
    assert all(r.status is sqlaq.JobStatus.DONE and r.error is None for r in results)
    for kind, job_id, attempt, thread, payload in recorder.seen:
        assert (kind, payload["n"]) == ids[job_id]
        assert attempt == 1
        assert thread == "sqlaq-asyncio" if kind == "async" else thread.startswith("sqlaq-slot-")
    assert len(loops) == 1  # one loop for every async job
    assert count_status(committed, "done") == 10
    with pytest.raises(RuntimeError, match="outside a job handler"):
        sqlaq.current_job()


@pytest.mark.timeout(30)
def test_a_job_due_behind_the_claim_bound_without_a_notify_runs_at_a_poll(
    committed: Engine,
) -> None:
    """A listening worker's claims start at its bound (the last job it claimed); at a
    poll it looks behind the bound on another connection. A job of a higher priority
    enqueued with the trigger's NOTIFY turned off, after the worker moved on, sits
    behind the bound: that look finds it."""
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.handler("k")(recorder.saw)
    worker = fast_worker(committed, registry, recorder)
    fetcher = worker._fetcher
    report, looked = fetcher._found, []
    assert report is not None

    def found(queue: str, position: sqlaq.queries.ClaimPosition) -> None:
        looked.append(position.priority)
        report(queue, position)

    fetcher._found = found
    with running(worker):
        # The listener's first connection drops the bounds (a look at the whole queue):
        # a job claimed after that, and done, leaves its position as the bound.
        wait_until(lambda: worker.listening, 10, "the listener")
        enqueue(committed, "k", {"n": 1})
        recorder.wait_for(1)
        enqueue(committed, "k", {"n": 1})
        recorder.wait_for(2)
        with committed.begin() as conn:
            conn.execute(text("SET LOCAL sqlaq.notify = off"))
            late = sqlaq.enqueue(conn, "k", {"n": 2}, priority=5).job_id
        recorder.wait_for(3)
    assert [(r.job_id, r.status) for r in recorder.results][2:] == [(late, "done")]
    assert 5 in looked  # found by a look behind the bound, not by a full claim


@pytest.mark.timeout(30)
def test_current_job_can_extend_its_lease(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    ends: list[Any] = []
    async_ends: list[Any] = []

    @registry.handler("long", lease=timedelta(seconds=20))
    def long_handler(payload: dict[str, Any]) -> None:
        job = sqlaq.current_job()
        ends.append((job.lease_length, job.lease.expires_at))
        renewed = job.extend_lease(timedelta(minutes=10))
        ends.append((job.lease_length, renewed.expires_at))

    @registry.handler("along")
    async def async_long_handler(payload: dict[str, Any]) -> None:
        job = sqlaq.current_job()
        renewed = await job.extend_lease_async(timedelta(minutes=5))
        async_ends.append(renewed.expires_at - job.lease.expires_at)

    enqueue(committed, "long")
    enqueue(committed, "along")
    with running(fast_worker(committed, registry, recorder, lease=timedelta(seconds=3))):
        recorder.wait_for(2)
    (first_length, first_end), (second_length, second_end) = ends
    assert (first_length, second_length) == (timedelta(seconds=20), timedelta(minutes=10))
    assert second_end - first_end > timedelta(minutes=9)
    # The context holds the renewed lease (of five minutes), not the worker's 3 s one: a
    # heartbeat renewing it at the same instant may leave its own expiry, microseconds
    # apart (its transaction's now()), so the two are compared to a second.
    (difference,) = async_ends
    assert abs(difference) < timedelta(seconds=1)
    assert count_status(committed, "done") == 2


@pytest.mark.timeout(30)
def test_failing_twice_then_succeeding_ends_done_on_attempt_3(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    backoff = sqlaq.Backoff(base=timedelta(milliseconds=200), jitter=0)
    started: list[float] = []

    @registry.handler("flaky", wait=backoff)
    def flaky(payload: dict[str, Any]) -> None:
        started.append(time.monotonic())
        if sqlaq.current_job().attempt < 3:
            raise OSError("not yet")

    job_id = enqueue(committed, "flaky")
    waits: list[tuple[float, float]] = []

    def finished(result: sqlaq.JobResult) -> None:
        # Called after the outcome committed: run_at holds the backoff, counted from the
        # failure's now(), which is after the attempt's start (attempted_at) and before
        # this query's now() (how long after depends on the machine's load).
        if result.status is sqlaq.JobStatus.QUEUED:
            sql = (
                "SELECT extract(epoch FROM run_at - now()), extract(epoch FROM run_at -"
                " attempted_at) FROM sqlaq_jobs WHERE id = :id"
            )
            left, since_start = rows(committed, sql, id=result.job_id)[0]
            waits.append((float(left), float(since_start)))
        recorder.finished(result)

    worker = sqlaq.Worker(
        committed, registry, poll_interval=timedelta(milliseconds=50), on_job_finished=finished
    )
    with running(worker):
        results = recorder.wait_for(3)
    assert [r.status for r in results] == [sqlaq.JobStatus.QUEUED] * 2 + [sqlaq.JobStatus.DONE]
    row = job(committed, job_id)
    assert (row.status, row.attempts) == ("done", 3)
    assert row.last_error.startswith("OSError: not yet")
    # The backoff (200 ms, then 400 ms) was written to run_at, and honoured.
    (left_1, since_1), (left_2, since_2) = waits
    assert left_1 <= 0.2 <= since_1
    assert left_2 <= 0.4 <= since_2
    assert started[1] - started[0] >= 0.2
    assert started[2] - started[1] >= 0.4


@pytest.mark.timeout(30)
def test_snoozing_handler_runs_again_later_without_using_attempts(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    attempts_seen: list[int] = []

    @registry.handler("not_yet")
    def not_yet(payload: dict[str, Any]) -> None:
        attempts_seen.append(sqlaq.current_job().attempt)
        if len(attempts_seen) < 3:
            raise sqlaq.Snooze(timedelta(milliseconds=100))

    job_id = enqueue(committed, "not_yet", max_attempts=1)
    worker = sqlaq.Worker(
        committed,
        registry,
        poll_interval=timedelta(milliseconds=50),
        on_job_finished=recorder.finished,
    )
    with running(worker):
        results = recorder.wait_for(3)
    assert [r.status for r in results] == [sqlaq.JobStatus.QUEUED] * 2 + [sqlaq.JobStatus.DONE]
    # Every run was attempt 1: a snooze gives the attempt back (max_attempts=1 still ran).
    assert attempts_seen == [1, 1, 1]
    row = job(committed, job_id)
    assert (row.status, row.attempts, row.last_error) == ("done", 1, None)


@pytest.mark.timeout(30)
def test_retry_decisions_follow_the_handler_policy(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()

    @registry.handler("permanent")
    def permanent(payload: dict[str, Any]) -> None:
        raise sqlaq.PermanentError("the payload can never work")

    @registry.handler("picky", retry=tenacity.retry_if_exception_type(OSError))
    def picky(payload: dict[str, Any]) -> None:
        raise ValueError("not an OSError")

    @registry.handler("waity", retry=OSError, wait=tenacity.wait_fixed(30))
    def waity(payload: dict[str, Any]) -> None:
        raise OSError("try later")

    ids = {kind: enqueue(committed, kind) for kind in ("permanent", "picky", "waity")}
    with running(fast_worker(committed, registry, recorder)):
        recorder.wait_for(3)
    for kind in ("permanent", "picky"):
        row = job(committed, ids[kind])
        assert (row.status, row.attempts) == ("failed", 1), kind
    assert (
        "PermanentError: the payload can never work" in job(committed, ids["permanent"]).last_error
    )
    assert (
        "in permanent\n    raise sqlaq.PermanentError"
        in job(committed, ids["permanent"]).last_error
    )
    waity_row = job(committed, ids["waity"])
    assert waity_row.status == "queued"
    delay = scalar(
        committed,
        "SELECT extract(epoch FROM run_at - now()) FROM sqlaq_jobs WHERE id = :id",
        id=ids["waity"],
    )
    assert 25 < delay <= 30


@pytest.mark.timeout(30)
def test_unknown_kind_fails_permanently_and_the_worker_carries_on(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.add("known", lambda payload: None)
    unknown = enqueue(committed, "nobody_handles_this", max_attempts=5)
    with running(fast_worker(committed, registry, recorder)) as worker:
        recorder.wait_for(1)
        known = enqueue(committed, "known")
        recorder.wait_for(2)
        assert not worker.stopped.is_set()
    row = job(committed, unknown)
    assert (row.status, row.attempts) == ("failed", 1)
    assert "no handler for kind 'nobody_handles_this'" in row.last_error
    assert job(committed, known).status == "done"


@pytest.mark.timeout(180)
def test_stop_hands_back_a_job_still_running_after_the_grace_period(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    release = threading.Event()
    started = threading.Event()

    @registry.handler("stuck")
    def stuck(payload: dict[str, Any]) -> None:
        started.set()
        release.wait(90)  # stuck for longer than the stop may take

    job_id = enqueue(committed, "stuck")
    worker = fast_worker(committed, registry, recorder, grace_period=timedelta(milliseconds=200))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert started.wait(START_TIMEOUT)  # the worker's start-up, then its first claim
        worker.stop()
        # The stop joins the listener and the maintenance thread (up to 5 s each) and
        # writes its hand-back: room for a slow machine, and still far from the 90 s
        # the handler stays stuck, so a stop that waited for it fails here.
        assert worker.stopped.wait(45)
        row = job(committed, job_id)
        assert (row.status, row.attempts, row.lease_token) == ("queued", 0, None)
        # Another worker takes it; the first handler's late return writes nothing.
        other = fast_worker(committed, registry, recorder)
        release.set()
        with running(other):
            recorder.wait_for(1)
        assert recorder.results[0].status is sqlaq.JobStatus.DONE
        assert (job(committed, job_id).status, job(committed, job_id).attempts) == ("done", 1)
    finally:
        release.set()
        worker.stop(now=True)
        thread.join(10)


@pytest.mark.timeout(30)
def test_burst_worker_stops_when_nothing_is_due_and_idle_is_set(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.add("noop", lambda payload: None)
    enqueue_many(committed, "noop", 250)
    enqueue(committed, "noop", delay=timedelta(hours=1))  # not due: must not be waited for
    worker = sqlaq.Worker(
        committed, registry, burst=True, concurrency=7, on_job_finished=recorder.finished
    )
    worker.run()
    assert worker.idle.is_set()
    assert worker.stopped.is_set()
    assert len(recorder.results) == 250
    assert count_status(committed, "done") == 250
    assert count_status(committed, "queued") == 1


@pytest.mark.timeout(30)
def test_worker_serves_several_queues_in_turn(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.add("noop", lambda payload: None)
    for queue in ("a", "b", "c"):
        enqueue_many(committed, "noop", 20, queue=queue)
    enqueue_many(committed, "noop", 5, queue="not-served")
    worker = sqlaq.Worker(
        committed,
        registry,
        queues=["a", "b", "c"],
        concurrency=3,
        burst=True,
        on_job_finished=recorder.finished,
    )
    worker.run()
    order = [r.queue for r in recorder.results]
    assert sorted(order) == ["a"] * 20 + ["b"] * 20 + ["c"] * 20
    assert set(order[:9]) == {"a", "b", "c"}  # no queue waited for another to drain
    assert count_status(committed, "queued") == 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "heartbeat"])
def test_cancel_of_a_running_job_reaches_its_handler_and_nothing_is_written(
    committed: Engine, listen: bool
) -> None:
    """The worker learns of the cancel from its NOTIFY or, without a listener, from its
    next lease renewal; the handler sees ``current_job().cancelled``; its result is not
    written over the cancel."""
    registry = sqlaq.Registry()
    recorder = Recorder()
    seen: list[bool] = []

    @registry.handler("slow")
    def slow(payload: dict[str, Any]) -> None:
        job = sqlaq.current_job()
        seen.append(job.cancelled)
        wait_until(lambda: job.cancelled, 20, "the handler to see the cancel")
        seen.append(job.cancelled)

    job_id = enqueue(committed, "slow")
    # A lease long enough that, with the listener on, the NOTIFY arrives well before the
    # first renewal (a third of it): what is tested is the notification. Without it,
    # the renewal every second tells: a lease of 0.3 s expired once under a loaded CI
    # run (its renewals, 0.1 s apart, all late) and the worker claimed the job again,
    # so the handler ran twice.
    lease = timedelta(seconds=9 if listen else 3)
    with running(fast_worker(committed, registry, recorder, lease=lease, listen=listen)) as w:
        if listen:
            wait_until(lambda: w.listening, 10, "the listener")
        wait_until(lambda: status_is(committed, job_id, "running"), 10, "the job to run")
        started = time.monotonic()
        with committed.begin() as conn:
            assert sqlaq.cancel(conn, job_id) == [job_id]
        results = recorder.wait_for(1)
        told_after = time.monotonic() - started
    assert seen == [False, True]
    assert results[0].status is sqlaq.JobStatus.CANCELLED
    assert job(committed, job_id).status == "cancelled"
    if listen:
        assert told_after < 3.0  # the NOTIFY, not the renewal due after 3 s


@pytest.mark.timeout(30)
def test_idle_worker_is_woken_by_notify_not_by_its_poll(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.add("noop", lambda payload: None)
    worker = fast_worker(committed, registry, recorder, poll_interval=timedelta(seconds=30))
    with running(worker):
        wait_until(lambda: worker.listening and worker.idle.is_set(), 10, "listening and idle")
        enqueued = time.monotonic()
        enqueue(committed, "noop")
        recorder.wait_for(1, timeout=5)
        assert time.monotonic() - enqueued < 1.0
        assert worker.idle.wait(5)


@pytest.mark.timeout(30)
def test_a_full_worker_waits_without_spinning(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    started = threading.Event()
    release = threading.Event()

    @registry.handler("block")
    def block(payload: dict[str, Any]) -> None:
        started.set()
        release.wait(10)

    enqueue_many(committed, "block", 2)
    worker = fast_worker(
        committed, registry, recorder, concurrency=1, poll_interval=timedelta(milliseconds=10)
    )
    with running(worker):
        assert started.wait(10)
        cpu = time.process_time()
        release.wait(0.5)  # a measuring window: no free slot, nothing to do but wait
        spent = time.process_time() - cpu
        release.set()
        recorder.wait_for(2)
    assert spent < 0.15, f"the worker burnt {spent:.2f}s of CPU in 0.5s with nothing to do"


# -- units -----------------------------------------------------------------------------


def test_worker_config_rejects_bad_options() -> None:
    for options, message in [
        ({"concurrency": 0}, "concurrency must be between 1"),
        ({"concurrency": True}, "concurrency must be an int"),
        ({"lease": 30}, "lease must be a datetime.timedelta"),
        ({"lease": timedelta(0)}, "lease must be at least"),
        ({"queues": []}, "at least one queue"),
        ({"queues": ["ok", ""]}, "queue must be a non-empty name"),
        ({"queues": {"a": 1}}, "queues must be a queue name or names, not a mapping"),
        ({"fair": {"q": {"vip": 3}}}, "fair must be a queue name or names, not a mapping"),
        ({"grace_period": timedelta(seconds=-1)}, "grace_period must be at least 0s"),
        ({"burst": "yes"}, "burst must be a bool"),
        ({"colour": "blue"}, "unknown worker option"),
    ]:
        with pytest.raises(sqlaq.ConfigError, match=message):
            WorkerConfig.from_options(**options)
    config = WorkerConfig(queues="only")
    assert config.queues == ("only",)
    assert WorkerConfig(queues=("a", "b", "a")).queues == ("a", "b")
    assert WorkerConfig(lease=timedelta(seconds=3)).heartbeat_interval == timedelta(seconds=1)


def test_registry_rejects_bad_handlers() -> None:
    registry = sqlaq.Registry()
    registry.add("taken", lambda payload: None)
    for kind, options, message in [
        ("taken", {}, "already has a handler"),
        ("", {}, "non-empty name"),
        ("x", {"max_attempts": 0}, "max_attempts of 'x'"),
        ("x", {"lease": 5}, "lease of 'x'"),
        ("x", {"retry": "always"}, "retry of 'x'"),
        ("x", {"wait": 3}, "wait of 'x'"),
    ]:
        with pytest.raises(sqlaq.ConfigError, match=message):
            registry.add(kind, lambda payload: None, **options)
    with pytest.raises(sqlaq.ConfigError, match="no handler for kind 'missing'"):
        registry.new_job("missing")
    assert registry.kinds == ["taken"]
    assert "taken" in registry
    assert len(registry) == 1


def test_registry_enqueue_uses_the_kinds_max_attempts(conn: Any) -> None:
    registry = sqlaq.Registry()
    registry.add("seven", lambda payload: None, max_attempts=7)
    job_id = registry.enqueue(conn, "seven", {"a": 1}).job_id
    assert (
        conn.execute(
            text("SELECT max_attempts FROM sqlaq_jobs WHERE id = :i"), {"i": job_id}
        ).scalar_one()
        == 7
    )
    assert registry.new_job("seven", max_attempts=2).max_attempts == 2


def test_retry_policy_speaks_tenacity() -> None:
    registry = sqlaq.Registry()
    handler = registry.add(
        "k",
        lambda payload: None,
        retry=tenacity.retry_if_exception_type(OSError),
        wait=tenacity.wait_exponential(multiplier=1, max=60),
    )
    assert handler.retry_in(1, OSError()) == timedelta(seconds=1)
    assert handler.retry_in(4, OSError()) == timedelta(seconds=8)
    assert handler.retry_in(1, ValueError()) is None
    assert handler.retry_in(1, sqlaq.PermanentError()) is None
    default = registry.add("d", lambda payload: None)
    assert default.retry_in(1, ValueError()) is not None
    assert default.retry_in(1, sqlaq.PermanentError()) is None
    by_class = registry.add("c", lambda payload: None, retry=(OSError, KeyError))
    assert by_class.retry_in(1, KeyError()) is not None
    assert by_class.retry_in(1, ValueError()) is None


def test_describe_error_puts_the_error_first_then_the_innermost_frames() -> None:
    def inner(depth: int) -> None:
        if depth == 0:
            raise ValueError("boom")
        inner(depth - 1)

    try:
        inner(20)
    except ValueError as exc:
        text_ = describe_error(exc)
    first, _, rest = text_.partition("\n")
    assert first == "ValueError: boom"
    assert "in test_describe_error" not in rest  # the outermost frames are cut
    assert 'raise ValueError("boom")' in rest


def test_transient_errors_are_classified_in_one_place() -> None:
    import psycopg
    from sqlalchemy import exc as sa_exc

    assert is_transient(sa_exc.OperationalError("SELECT 1", {}, psycopg.OperationalError("gone")))
    assert is_transient(sa_exc.InterfaceError("SELECT 1", {}, psycopg.InterfaceError("closed")))
    assert is_transient(sa_exc.TimeoutError("pool"))
    assert not is_transient(
        sa_exc.ProgrammingError("SELECT 1", {}, psycopg.ProgrammingError("no table"))
    )
    assert not is_transient(ValueError("bug"))


# -- prefetch --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_prefetch_holds_jobs_ahead_but_runs_no_more_than_concurrency(committed: Engine) -> None:
    """concurrency=2, prefetch=3, sync and async handlers side by side: five jobs are
    claimed, two run, and a stop hands the three that never started straight back
    (attempt refunded) while the two running finish within the grace period."""
    registry = sqlaq.Registry()
    release = threading.Event()
    lock = threading.Lock()
    now_running: list[int] = [0]
    most: list[int] = [0]

    def enter() -> None:
        with lock:
            now_running[0] += 1
            most[0] = max(most[0], now_running[0])

    def leave() -> None:
        with lock:
            now_running[0] -= 1

    @registry.handler("sync")
    def sync_job(payload: dict[str, Any]) -> None:
        enter()
        release.wait(20)
        leave()

    @registry.handler("async")
    async def async_job(payload: dict[str, Any]) -> None:
        enter()
        await asyncio.to_thread(release.wait, 20)
        leave()

    ids = enqueue_many(committed, "sync", 4) + enqueue_many(committed, "async", 4)
    worker = fast_worker(
        committed, registry, Recorder(), concurrency=2, prefetch=3, grace_period=timedelta(5)
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # The first claim comes after the worker's start-up (its connections).
        wait_until(
            lambda: count_status(committed, "running") == 5, START_TIMEOUT, "five jobs claimed"
        )
        wait_until(lambda: now_running[0] == 2, 10, "two handlers running")
        assert count_status(committed, "running") == 5  # no more claimed meanwhile
        worker.stop()
        # The three prefetched jobs go back at once, not after the grace period.
        wait_until(lambda: count_status(committed, "queued") == 6, 5, "three handed back")
        release.set()
        assert worker.stopped.wait(10)
    finally:
        release.set()
        worker.stop(now=True)
        thread.join(10)
    assert most[0] == 2
    assert count_status(committed, "done") == 2
    handed = rows(
        committed,
        "SELECT attempts FROM sqlaq_jobs WHERE id = ANY(:ids) AND status = 'queued'",
        ids=ids,
    )
    assert [r.attempts for r in handed] == [0] * 6


@pytest.mark.timeout(60)
def test_prefetching_worker_runs_each_job_once(committed: Engine) -> None:
    registry = sqlaq.Registry()
    recorder = Recorder()
    registry.add("noop", recorder.saw)
    ids = enqueue_many(committed, "noop", 500)
    worker = fast_worker(committed, registry, recorder, concurrency=4, prefetch=50, burst=True)
    worker.run()
    assert sorted(job_id for _, job_id, *_ in recorder.seen) == sorted(ids)
    assert count_status(committed, "done") == 500


def test_prefetch_must_be_a_non_negative_int() -> None:
    with pytest.raises(sqlaq.ConfigError, match="prefetch must be between 0"):
        WorkerConfig(prefetch=-1)


def test_claiming_pauses_while_the_writer_lags(committed: Engine) -> None:
    """Outcomes waiting for the writer count against claiming once they reach twice the
    capacity, so a slow database cannot make a worker hold ever more leases."""
    worker = sqlaq.Worker(committed, sqlaq.Registry(), concurrency=4, prefetch=2)
    assert worker._room() == 6
    worker._outbox._unwritten = [object()] * 11  # type: ignore[list-item]
    assert worker._room() == 6
    worker._outbox._unwritten.append(object())  # type: ignore[arg-type]
    assert worker._room() == 0
