"""Periodic jobs: one job per schedule slot across workers, no backfill unless asked.

``enqueue_periodic`` takes the time to look at, so most tests walk a simulated clock
through many slots in moments; the slots and the dedupe are the database's either way.
The worker tests run two real workers against the same schedule.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import Connection, Engine, text
from workerkit import rows, scalar, wait_until

import sqlaq
from sqlaq.cron import CronSchedule
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


def racing_ticks(engine: Engine, periodic: Periodic, instants: list[datetime]) -> list[datetime]:
    """Two connections tick *periodic* at the same simulated *instants* (a barrier
    releases them together); the slots either enqueued, in order."""
    barrier = threading.Barrier(2)
    enqueued: list[list[datetime]] = [[], []]
    errors: list[BaseException] = []

    def scheduler(me: int) -> None:
        try:
            for at in instants:
                barrier.wait(10)
                enqueued[me] += tick(engine, periodic, at)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=scheduler, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not errors, errors
    return sorted(enqueued[0] + enqueued[1])


@pytest.mark.timeout(60)
def test_two_schedulers_racing_over_a_simulated_clock_enqueue_each_slot_once(
    committed: Engine,
) -> None:
    """Two connections tick the same schedule at the same simulated instants (a barrier
    releases them together), 40 slots long: exactly one job per slot."""
    periodic = every_minute()
    instants = [T0 + k * timedelta(seconds=20) for k in range(121)]  # 40 minutes
    slots = racing_ticks(committed, periodic, instants)
    assert slots == [T0 + k * MINUTE for k in range(1, 41)]
    keys = [job.dedupe_key for job in periodic_jobs(committed)]
    assert len(keys) == len(set(keys)) == 40


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.timeout(60)
def test_a_time_zone_schedule_enqueues_each_slot_once_across_dst_changes(
    committed: Engine,
) -> None:
    """At half past every hour in New York, walked 3 minutes at a time by two racing
    schedulers through the spring and the autumn change of 2026."""
    periodic = Periodic.build("30 * * * *", kind="tick", name="ny", tz="America/New_York")
    step = timedelta(minutes=3)
    spring = [utc("2026-03-08 05:00") + k * step for k in range(81)]  # to 09:00Z
    autumn = [utc("2026-11-01 03:00") + k * step for k in range(121)]  # to 09:00Z
    slots = racing_ticks(committed, periodic, spring + autumn)
    assert slots == [
        # 2026-03-08: 02:00 EST is followed by 03:00 EDT (07:00Z).
        utc("2026-03-08 05:30"),  # 00:30 EST
        utc("2026-03-08 06:30"),  # 01:30 EST
        utc("2026-03-08 07:00"),  # 02:30 does not exist: 03:00 EDT, once
        utc("2026-03-08 07:30"),  # 03:30 EDT
        utc("2026-03-08 08:30"),  # 04:30 EDT
        # Eight months later, no backfill: the latest slot only (22:30 EDT).
        utc("2026-11-01 02:30"),
        # 2026-11-01: 02:00 EDT is followed by 01:00 EST (06:00Z).
        utc("2026-11-01 03:30"),  # 23:30 EDT
        utc("2026-11-01 04:30"),  # 00:30 EDT
        utc("2026-11-01 05:30"),  # 01:30 EDT; 01:30 EST (06:30Z) is not run again
        utc("2026-11-01 07:30"),  # 02:30 EST
        utc("2026-11-01 08:30"),  # 03:30 EST
    ]
    keys = [job.dedupe_key for job in periodic_jobs(committed)]
    assert keys == [f"periodic:ny:{slot.isoformat()}" for slot in slots]


def test_travel_across_a_year_of_dst_changes_enqueues_each_slot_once(conn: Connection) -> None:
    """Sundays of March and October at 02:30 in Paris, with backfill, from 1 March 2026
    to the database's ``now()``: the clock moved by ``sqlaq.testing.travel``. The last
    Sunday of March skips 02:00-03:00, the last one of October repeats it."""
    from sqlaq.testing import enqueued_jobs, travel

    registry = sqlaq.Registry()

    @registry.periodic("30 2 * mar,oct sun", kind="sunday", tz="Europe/Paris", backfill=True)
    def sunday(payload: dict[str, Any]) -> None: ...

    assert sqlaq.enqueue_periodic(conn, registry.periodics) == []  # first sight
    recorded = conn.execute(text("SELECT last_slot FROM sqlaq_periodic")).scalar_one()
    now = conn.execute(text("SELECT now()")).scalar_one()
    start = utc("2026-03-01 00:00")
    travel(conn, recorded - start)  # as if the last slot were 1 March's midnight
    slots = [job.slot for job in sqlaq.enqueue_periodic(conn, registry.periodics)]

    expected = []
    for day in (start.date() + timedelta(days=n) for n in range((now - start).days + 1)):
        if day.month not in (3, 10) or day.isoweekday() != 7:
            continue
        if day.month == 10:  # summer time, +02:00 (the repeated hour's first occurrence)
            expected.append(datetime.combine(day, time(0, 30), UTC))
        elif (day + timedelta(days=7)).month == 3:  # winter time, +01:00
            expected.append(datetime.combine(day, time(1, 30), UTC))
        else:  # the change: 02:30 does not exist, 03:00 summer time is 01:00 UTC
            expected.append(datetime.combine(day, time(1, 0), UTC))
    assert slots == [slot for slot in expected if slot <= now]
    assert utc("2026-03-29 01:00") in slots
    assert utc("2026-10-25 00:30") in slots
    assert utc("2026-10-25 01:30") not in slots
    keys = [row.dedupe_key for row in enqueued_jobs(conn, "sunday")]
    assert keys == [f"periodic:sunday:{slot.isoformat()}" for slot in slots]
    assert sqlaq.enqueue_periodic(conn, registry.periodics) == []  # each slot once


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
    with pytest.raises(sqlaq.ConfigError, match=r"^unknown time zone 'Europe/Pariss': give"):
        registry.add_periodic("0 9 * * *", kind="report", name="paris", tz="Europe/Pariss")
    with pytest.raises(sqlaq.ConfigError, match="already in time zone 'UTC'"):
        Periodic.build(CronSchedule.parse("0 9 * * *"), kind="report", tz="Europe/Paris")
    paris = registry.add_periodic("0 9 * * *", kind="report", name="paris", tz="Europe/Paris")
    assert paris.schedule.tz == ZoneInfo("Europe/Paris")
    assert [p.name for p in registry.periodics] == ["hourly", "paris", "report"]


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
