"""Periodic jobs: a cron schedule that enqueues a job per slot, once across all workers.

This module owns :class:`Periodic` (what to enqueue, on which schedule) and
:func:`enqueue_periodic`, which every worker runs about once a minute. Its SQL comes from
:mod:`sqlaq.queries`; its calendar from :mod:`sqlaq.cron`.

How one job per slot is guaranteed, whatever the number of workers: the table
``sqlaq_periodic`` holds, per periodic job, the last slot enqueued. In one transaction a
worker locks that row (``SELECT ... FOR UPDATE``, which waits for any other worker doing
the same and then reads what it committed), enqueues a job for each slot after it that
is due, and moves the row forward. A second worker arriving for the same slot finds the
row already there and enqueues nothing. The job and the row commit together, so a crash
between the two cannot lose a slot or double it.

Decisions written down here:

* **Time** is the database's ``now()``: a slot is due once ``now()`` has reached it.
* **First sight**: the first time a periodic job is seen (no row yet), its current slot
  is recorded and *not* enqueued: deploying a daily job at 15:00 does not run
  "today's midnight" at once. The next slot runs.
* **No backfill** (the default): when workers were down across several slots, only the
  latest slot is enqueued when they return; the missed ones are skipped. With
  ``backfill=True`` every missed slot is enqueued (the latest :data:`MAX_BACKFILL` of
  them), in slot order.
* Each job's ``dedupe_key`` is ``periodic:<name>:<slot>`` (slot in ISO 8601 UTC), so
  ``sqlaq list``/``show`` tell which slot a job is for.
* **Time zones**: a schedule may be read on an IANA zone's wall clock (``tz=``); its
  slots are still UTC instants, distinct and increasing, so the above holds unchanged.
  Across daylight saving changes a slot in a skipped hour runs once, at the first
  instant after the gap, and a slot in a repeated hour once, at its first occurrence
  (see :mod:`sqlaq.cron`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from sqlaq import ops, queries
from sqlaq.cron import CronSchedule, time_zone
from sqlaq.drive import Plan, operation, plan_of
from sqlaq.encoding import NewJob, check_name
from sqlaq.errors import ConfigError, InvalidJobError
from sqlaq.schema import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE

__all__ = ["MAX_BACKFILL", "Periodic", "PeriodicJob", "enqueue_periodic"]

#: With ``backfill=True``, at most this many missed slots are enqueued at once (the
#: latest ones).
MAX_BACKFILL = 1000


@dataclass(frozen=True, slots=True)
class Periodic:
    """A job enqueued on a cron schedule. Build it with ``registry.periodic(...)``.

    Attributes:
        name: Unique among periodic jobs; the key of its ``sqlaq_periodic`` row.
            Renaming it starts afresh (first sight).
        schedule: When (5-field cron, in ``schedule.tz``, UTC by default).
        kind: The job's kind.
        payload: The job's payload.
        queue: The job's queue.
        priority: The job's priority.
        max_attempts: The job's attempts.
        backfill: Enqueue every slot missed while no worker ran, not just the latest.
    """

    name: str
    schedule: CronSchedule
    kind: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backfill: bool = False

    @classmethod
    def build(
        cls,
        schedule: str | CronSchedule,
        *,
        kind: str,
        name: str | None = None,
        payload: Mapping[str, Any] | None = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backfill: bool = False,
        tz: ZoneInfo | str | None = None,
    ) -> Periodic:
        """A checked Periodic: the schedule parsed (read in time zone *tz*, UTC by
        default), the job's fields validated.

        Raises:
            ConfigError: the schedule, the time zone, a name or a job field is unusable.
        """
        if isinstance(schedule, CronSchedule):
            cron = schedule
            if tz is not None and time_zone(tz) != schedule.tz:
                raise ConfigError(
                    f"schedule {schedule.expression!r} is already in time zone "
                    f"{schedule.zone!r}: pass tz=None or parse it with tz={tz!r}"
                )
        else:
            cron = CronSchedule.parse(schedule, tz=tz)
        periodic = cls(
            name=kind if name is None else name,
            schedule=cron,
            kind=kind,
            payload={} if payload is None else payload,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            backfill=bool(backfill),
        )
        try:
            check_name("periodic name", periodic.name)
            periodic.new_job(datetime(2000, 1, 1).astimezone())  # validates every field
        except InvalidJobError as exc:
            raise ConfigError(f"periodic job {periodic.name!r}: {exc}") from exc
        return periodic

    def new_job(self, slot: datetime) -> NewJob:
        """The job of *slot*."""
        return NewJob(
            kind=self.kind,
            payload=self.payload,
            queue=self.queue,
            priority=self.priority,
            max_attempts=self.max_attempts,
            dedupe_key=f"periodic:{self.name}:{slot.isoformat()}",
        )

    def due_slots(self, last: datetime, now: datetime) -> list[datetime]:
        """The slots after *last* that are due at *now*, oldest first (only the latest
        one without backfill)."""
        if not self.backfill:
            latest = self.schedule.latest_at_or_before(now)
            return [latest] if latest is not None and latest > last else []
        slots: list[datetime] = []
        moment = self.schedule.next_after(last)
        while moment is not None and moment <= now:
            slots.append(moment)
            if len(slots) > MAX_BACKFILL:
                del slots[0]
            moment = self.schedule.next_after(moment)
        return slots


@dataclass(frozen=True, slots=True)
class PeriodicJob:
    """A job :func:`enqueue_periodic` enqueued.

    Attributes:
        name: The periodic job's name.
        slot: The schedule slot it is for.
        job_id: The job.
    """

    name: str
    slot: datetime
    job_id: int


@operation
def enqueue_periodic(
    periodics: Iterable[Periodic], *, now: datetime | None = None
) -> Plan[list[PeriodicJob]]:
    """Enqueue the due slots of *periodics* that no one has enqueued yet.

    Runs in the caller's transaction; commit at once, since each periodic job's row stays
    locked until then (another worker doing the same waits for it, then finds its slots
    taken). Safe to run from every worker as often as you like. From async code:
    ``await sqlaq.asyncio.enqueue_periodic(async_conn, periodics)``.

    Args:
        now: The time to look at; default the database's ``now()``. (Tests pass a
            simulated clock; the slots recorded are the ones this time makes due.)

    Returns:
        The jobs enqueued, in slot order per periodic job.
    """
    if now is None:
        now = (yield queries.clock_stmt(), None).scalar_one()
    enqueued: list[PeriodicJob] = []
    for periodic in periodics:
        current = periodic.schedule.latest_at_or_before(now)
        if current is None:
            continue
        first = yield queries.periodic_insert_stmt(name=periodic.name, slot=current), None
        if first.first() is not None:
            continue  # first sight: recorded, not enqueued
        last = (yield queries.periodic_lock_stmt(name=periodic.name), None).scalar_one()
        slots = periodic.due_slots(last, now)
        if not slots:
            continue
        yield queries.periodic_advance_stmt(name=periodic.name, slot=slots[-1]), None
        new_jobs = [periodic.new_job(slot) for slot in slots]
        results = yield from plan_of(ops.enqueue_many)(new_jobs)
        enqueued += [
            PeriodicJob(periodic.name, slot, result.job_id)
            for slot, result in zip(slots, results, strict=True)
        ]
    return enqueued
