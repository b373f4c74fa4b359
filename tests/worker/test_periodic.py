"""Periodic jobs: one job per schedule slot across workers, no backfill unless asked.

``enqueue_periodic`` takes the time to look at, so most tests walk a simulated clock
through many slots in moments; the slots and the dedupe are the database's either way.
The worker tests run two real workers against the same schedule.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from workerkit import rows, scalar, wait_until

import sqlaq
from sqlaq.periodic import MAX_BACKFILL, Periodic, enqueue_periodic

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def every_minute(**options: Any) -> Periodic:
    return Periodic.build("* * * * *", kind="tick", **options)


def tick(engine: Engine, periodic: Periodic, at: datetime) -> list[datetime]:
    with engine.begin() as conn:
        return [job.slot for job in enqueue_periodic(conn, [periodic], now=at)]


def periodic_jobs(engine: Engine) -> list[Any]:
    return rows(engine, "SELECT id, kind, dedupe_key, queue, payload FROM sqlaq_jobs ORDER BY id")


def test_first_sight_records_the_slot_then_each_new_slot_enqueues_once(
    committed: Engine,
) -> None:
    periodic = every_minute(payload={"n": 1}, queue="cron")
    assert tick(committed, periodic, T0 + timedelta(seconds=30)) == []  # first sight
    assert tick(committed, periodic, T0 + timedelta(seconds=59)) == []  # same slot
    assert tick(committed, periodic, T0 + MINUTE) == [T0 + MINUTE]  # the slot's instant
    assert tick(committed, periodic, T0 + MINUTE + timedelta(seconds=1)) == []
    assert tick(committed, periodic, T0 + 2 * MINUTE + timedelta(seconds=5)) == [T0 + 2 * MINUTE]
    (first, second) = periodic_jobs(committed)
    assert (first.kind, first.queue, first.payload) == ("tick", "cron", {"n": 1})
    assert first.dedupe_key == f"periodic:tick:{(T0 + MINUTE).isoformat()}"
    assert second.dedupe_key == f"periodic:tick:{(T0 + 2 * MINUTE).isoformat()}"
    last = scalar(committed, "SELECT last_slot FROM sqlaq_periodic WHERE name = 'tick'")
    assert last == T0 + 2 * MINUTE


def test_missed_slots_are_skipped_unless_backfill_is_asked(committed: Engine) -> None:
    plain = every_minute(name="plain")
    backfilled = every_minute(name="backfilled", backfill=True)
    for periodic in (plain, backfilled):
        tick(committed, periodic, T0)
    later = T0 + 5 * MINUTE + timedelta(seconds=10)
    assert tick(committed, plain, later) == [T0 + 5 * MINUTE]
    assert tick(committed, backfilled, later) == [T0 + k * MINUTE for k in range(1, 6)]


def test_backfill_is_bounded(committed: Engine) -> None:
    periodic = every_minute(backfill=True)
    tick(committed, periodic, T0)
    slots = tick(committed, periodic, T0 + (MAX_BACKFILL + 500) * MINUTE)
    assert len(slots) == MAX_BACKFILL
    assert slots[-1] == T0 + (MAX_BACKFILL + 500) * MINUTE  # the latest ones


@pytest.mark.timeout(60)
def test_two_schedulers_racing_over_a_simulated_clock_enqueue_each_slot_once(
    committed: Engine,
) -> None:
    """Two connections tick the same schedule at the same simulated instants (a barrier
    releases them together), 40 slots long: exactly one job per slot."""
    periodic = every_minute()
    instants = [T0 + k * timedelta(seconds=20) for k in range(121)]  # 40 minutes
    barrier = threading.Barrier(2)
    enqueued: list[list[datetime]] = [[], []]
    errors: list[BaseException] = []

    def scheduler(me: int) -> None:
        try:
            for at in instants:
                barrier.wait(10)
                enqueued[me] += tick(committed, periodic, at)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=scheduler, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not errors, errors
    slots = sorted(enqueued[0] + enqueued[1])
    assert slots == [T0 + k * MINUTE for k in range(1, 41)]
    keys = [job.dedupe_key for job in periodic_jobs(committed)]
    assert len(keys) == len(set(keys)) == 40


def test_registry_periodic_registers_the_handler_and_the_schedule() -> None:
    registry = sqlaq.Registry()

    @registry.periodic("0 * * * *", kind="hourly_report", payload={"scope": "all"})
    def hourly_report(payload: dict[str, Any]) -> None: ...

    @registry.periodic("@daily", name="nightly_report", payload={"scope": "day"})
    @registry.handler("daily", max_attempts=2)
    def daily(payload: dict[str, Any]) -> None: ...

    assert registry.get("hourly_report") is not None
    hourly, nightly = registry.periodics
    assert (hourly.name, hourly.kind, dict(hourly.payload)) == (
        "hourly_report",
        "hourly_report",
        {"scope": "all"},
    )
    assert (nightly.name, nightly.kind, nightly.max_attempts) == ("nightly_report", "daily", 2)
    assert nightly.schedule.expression == "@daily"


def test_registry_periodic_rejects_bad_schedules_and_names() -> None:
    registry = sqlaq.Registry()
    registry.add("report", print)
    with pytest.raises(sqlaq.ConfigError, match="would never call"):
        registry.periodic("* * * * *", kind="report")(repr)
    with pytest.raises(sqlaq.ConfigError, match="cron"):
        registry.add_periodic("every hour", kind="report")
    with pytest.raises(sqlaq.ConfigError, match="no handler for kind 'nothing'"):
        registry.add_periodic("* * * * *", kind="nothing")
    with pytest.raises(sqlaq.ConfigError, match="periodic job 'report'"):
        registry.add_periodic("* * * * *", kind="report", queue="")
    registry.add_periodic("* * * * *", kind="report")
    with pytest.raises(sqlaq.ConfigError, match="already scheduled; pass name="):
        registry.add_periodic("0 * * * *", kind="report")
    registry.add_periodic("0 * * * *", kind="report", name="hourly")
    assert [p.name for p in registry.periodics] == ["hourly", "report"]


# -- two real workers ------------------------------------------------------------------------


@contextmanager
def workers(engine: Engine, registry: sqlaq.Registry, count: int) -> Iterator[list[sqlaq.Worker]]:
    started = [
        sqlaq.Worker(
            engine,
            registry,
            maintenance_interval=timedelta(milliseconds=100),
            poll_interval=timedelta(milliseconds=100),
        )
        for _ in range(count)
    ]
    threads = [threading.Thread(target=w.run) for w in started]
    for thread in threads:
        thread.start()
    try:
        yield started
    finally:
        for worker in started:
            worker.stop()
        for thread in threads:
            thread.join(15)


def rounds(worker: sqlaq.Worker) -> int:
    assert worker._maintenance is not None
    return worker._maintenance.rounds


@pytest.mark.timeout(60)
def test_two_workers_enqueue_one_job_per_slot(committed: Engine) -> None:
    """Two workers run the same schedule. Each time its recorded slot is set back a
    slot (as if the last slot had been missed), exactly one job is enqueued for the
    current slot, and it runs once. (A yearly schedule, so that no real slot comes by
    during the test; the every-minute walk above covers many slots.)"""
    registry = sqlaq.Registry()
    ran: list[int] = []

    @registry.periodic("0 0 1 1 *", kind="tick")
    def tick_handler(payload: dict[str, Any]) -> None:
        ran.append(sqlaq.current_job().id)

    with workers(committed, registry, 2) as both:
        wait_until(
            lambda: scalar(committed, "SELECT count(*) FROM sqlaq_periodic") == 1,
            10,
            "first sight to be recorded",
        )
        for round_ in range(1, 4):
            with committed.begin() as conn:
                conn.execute(
                    text("UPDATE sqlaq_periodic SET last_slot = last_slot - interval '1 year'")
                )
            # Done, not only started: the next round enqueues the same slot again, and
            # its dedupe key would (rightly) refuse a twin of a job still pending.
            wait_until(
                lambda r=round_: (
                    scalar(committed, "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'") == r
                ),
                10,
                f"slot job {round_} done",
            )
        # Both workers go on ticking: after five more rounds each, still three jobs.
        seen = [rounds(w) for w in both]
        wait_until(
            lambda: all(rounds(w) >= n + 5 for w, n in zip(both, seen, strict=True)),
            10,
            "five more rounds of each worker",
        )
    assert scalar(committed, "SELECT count(*) FROM sqlaq_jobs") == 3
    assert scalar(committed, "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'") == 3
    assert len(ran) == len(set(ran)) == 3
