"""The worker's configuration: one frozen dataclass and its defaults.

This module owns the names, defaults and validation of every worker option. The Python
API (``sqlaq.Worker(engine, registry, concurrency=8)``) and the ``sqlaq-worker`` command
both build a :class:`WorkerConfig`, so an option is spelled and checked in one place.
It must not read the environment (only ``cli.py`` does) nor touch a database.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from sqlaq.encoding import check_name
from sqlaq.errors import ConfigError, InvalidJobError
from sqlaq.ops import DEFAULT_LEASE
from sqlaq.schema import DEFAULT_QUEUE

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_LEASE",
    "DEFAULT_MAINTENANCE_INTERVAL",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_QUEUES",
    "DEFAULT_RETAIN_DONE",
    "DEFAULT_RETAIN_FAILED",
    "WorkerConfig",
]

DEFAULT_QUEUES: tuple[str, ...] = (DEFAULT_QUEUE,)
#: Jobs run at once: sync handlers each hold a thread, async ones a slot on the loop.
DEFAULT_CONCURRENCY = 10
#: How often the worker looks for due jobs without being notified: scheduled jobs,
#: retries, expired leases, and notifications lost while the listener was down.
DEFAULT_POLL_INTERVAL = timedelta(seconds=5)
#: How long a stopping worker lets running jobs finish before handing them back.
DEFAULT_GRACE_PERIOD = timedelta(seconds=30)
#: How often the maintenance thread runs: periodic jobs are also enqueued at each slot
#: boundary, whatever the interval; the leader prunes and sweeps once per interval.
DEFAULT_MAINTENANCE_INTERVAL = timedelta(seconds=60)
#: The leader deletes done and cancelled jobs this long after they finished...
DEFAULT_RETAIN_DONE = timedelta(days=7)
#: ... and failed jobs this long after (kept longer: someone may want to retry them).
DEFAULT_RETAIN_FAILED = timedelta(days=30)
#: Upper bound of concurrency: each sync slot is a thread.
MAX_CONCURRENCY = 10_000


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Every option of a :class:`~sqlaq.Worker`, validated on construction.

    Args:
        queues: The queues served, claimed one statement per queue in turn (round robin).
            A single name is accepted for one queue.
        concurrency: Jobs run at once; the claim size is the number of free slots.
        prefetch: Jobs claimed ahead of free slots, held in memory (their leases
            renewed like running ones), so a slot that frees starts its next job at
            once instead of after a claim's round trip: more throughput for short
            handlers, at the price of jobs waiting in one worker while another may be
            idle. Limited kinds are never prefetched: they are claimed only for a slot
            free now, which a worker kept busy by prefetched work seldom has, so serve
            them from workers without prefetch. 0 (the default) claims only for free
            slots.
        lease: How long a claim holds a job before another worker may take it. The
            worker renews it every ``lease / 3`` while the handler runs, so it bounds
            how long a crashed worker's jobs wait, not how long a job may run. A
            handler's own ``lease`` overrides it for that kind.
        poll_interval: Look for due jobs at least this often, notified or not.
        grace_period: On stop, how long running jobs may finish before they are handed
            back to the queue (status queued, due now, attempt refunded).
        burst: Run what is due, then stop (instead of waiting for more).
        listen: Wake on ``NOTIFY`` through a dedicated LISTEN connection. Without it the
            worker relies on polling alone.
        maintenance: Run the maintenance thread: enqueue the registry's periodic jobs,
            and take part in the leader election for retention and the expired-lease
            sweep. Off in burst mode whatever this says.
        maintenance_interval: How often the maintenance thread wakes (periodic jobs
            are also enqueued at each slot boundary), and so how soon another worker
            takes over from a leader that died.
        retain_done: The leader deletes done and cancelled jobs finished longer ago;
            None keeps them for ever.
        retain_failed: The leader deletes failed jobs finished longer ago; None keeps
            them for ever.

    Raises:
        ConfigError: an option has an unusable type or value; the message names it.
    """

    queues: tuple[str, ...] = DEFAULT_QUEUES
    concurrency: int = DEFAULT_CONCURRENCY
    prefetch: int = 0
    lease: timedelta = DEFAULT_LEASE
    poll_interval: timedelta = DEFAULT_POLL_INTERVAL
    grace_period: timedelta = DEFAULT_GRACE_PERIOD
    burst: bool = False
    listen: bool = True
    maintenance: bool = True
    maintenance_interval: timedelta = DEFAULT_MAINTENANCE_INTERVAL
    retain_done: timedelta | None = DEFAULT_RETAIN_DONE
    retain_failed: timedelta | None = DEFAULT_RETAIN_FAILED

    def __post_init__(self) -> None:
        object.__setattr__(self, "queues", _check_queues(self.queues))
        _check_int("concurrency", self.concurrency, 1, MAX_CONCURRENCY)
        _check_int("prefetch", self.prefetch, 0, MAX_CONCURRENCY)
        _check_duration("lease", self.lease, minimum=timedelta(milliseconds=100))
        _check_duration("poll_interval", self.poll_interval, minimum=timedelta(milliseconds=10))
        _check_duration("grace_period", self.grace_period, minimum=timedelta(0))
        _check_duration(
            "maintenance_interval", self.maintenance_interval, minimum=timedelta(milliseconds=10)
        )
        for name in ("retain_done", "retain_failed"):
            if getattr(self, name) is not None:
                _check_duration(name, getattr(self, name), minimum=timedelta(0))
        for name in ("burst", "listen", "maintenance"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_options(cls, base: WorkerConfig | None = None, **options: Any) -> WorkerConfig:
        """Return *base* (or the defaults) with *options* replaced, validated.

        Raises:
            ConfigError: an option is unknown or has an unusable value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown worker option(s): {', '.join(unknown)}; "
                f"known options are {', '.join(sorted(known))}"
            )
        current = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        return cls(**{**current, **options})

    @property
    def heartbeat_interval(self) -> timedelta:
        """How often leases are renewed: a third of the lease, so two renewals may fail
        (a database blip, a busy host) before the lease runs out."""
        return self.lease / 3


def _check_queues(value: object) -> tuple[str, ...]:
    names: Iterable[object]
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, Iterable):
        names = tuple(value)
    else:
        raise ConfigError(f"queues must be a queue name or names, got {value!r}")
    checked: list[str] = []
    for name in names:
        try:
            queue = check_name("queue", name)
        except InvalidJobError as exc:
            raise ConfigError(str(exc)) from exc
        if queue not in checked:
            checked.append(queue)
    if not checked:
        raise ConfigError("queues must name at least one queue")
    return tuple(checked)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low} and {high}, got {value}")


def _check_duration(name: str, value: object, *, minimum: timedelta) -> None:
    if not isinstance(value, timedelta):
        raise ConfigError(
            f"{name} must be a datetime.timedelta, got {value!r}; use timedelta(seconds=...)"
        )
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum.total_seconds():g}s, got {value}")
