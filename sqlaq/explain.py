"""Why a job is not running: :func:`explain` (and ``sqlaq explain ID``).

This module owns the answer to an operator's most common question. It reads the job
and what can hold it back, on the caller's connection, and returns every reason that
applies, each a :class:`Reason`: a stable code (:class:`ReasonCode`, for scripts and
alerts) and one line for people. What it reads, all through :mod:`sqlaq.queries`:

* the job's row: finished (status, when, last error), waiting for its parents (the
  ids of those not finished, from ``sqlaq_job_deps``), not due yet (a delay, a retry's
  backoff, a snooze), running under a lease (held by which worker, until when) or with
  a lease that ended;
* ``sqlaq_paused_queues``: its queue is paused;
* with the application's registry (limits live there, not in the database): its kind
  has no handler, is at its concurrency limit (counting live leases as the limited
  claim does), or its rate window is full (from the kind's start log, ``sqlaq_rates``);
  for a job with a key: its key is at the kind's ``key_concurrency``, or (an ``ordered``
  kind) an earlier job of its key is queued, running or failed;
* ``sqlaq_workers``: no worker serving its queue has been seen lately;
* a failed or cancelled job whose dedupe key another pending job holds (a retry leaves
  it alone);
* otherwise, due and waiting: how many due jobs a claim of its queue takes first.

It changes nothing and takes no lock: each answer is a snapshot (the job may start the
moment after).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from sqlaq import queries
from sqlaq.bounds import BIGINT_MAX
from sqlaq.drive import Plan, operation
from sqlaq.errors import ConfigError
from sqlaq.ops._links import waiting_for
from sqlaq.results import JobNotFoundError
from sqlaq.schema import JobStatus

if TYPE_CHECKING:
    from sqlaq.registry import Registry

__all__ = ["DEFAULT_STALE_AFTER", "Reason", "ReasonCode", "explain"]

#: A worker whose heartbeat is older than this is not counted as serving its queues
#: (workers write theirs once per maintenance interval, 60 s by default).
DEFAULT_STALE_AFTER = timedelta(minutes=5)
#: :func:`explain` counts the due jobs ahead of a waiting one up to this many.
AHEAD_LIMIT = 10_000
#: Every run_at from this one on is a job held for its parents (schema.WAITING_FROM).
_HELD_FROM = datetime(9900, 1, 1, tzinfo=UTC)


class ReasonCode(enum.StrEnum):
    """Why a job is not running (or what it is doing instead)."""

    FINISHED = "finished"  # done, failed or cancelled
    DEDUPE_TWIN = "dedupe_twin"  # finished; a pending job holds its dedupe key
    RUNNING = "running"  # a worker holds its lease
    LEASE_EXPIRED = "lease_expired"  # running, but its lease ended: to be claimed again
    NOT_DUE = "not_due"  # queued, due later (delay, backoff, snooze)
    PARENTS = "parents"  # waiting for the jobs it was enqueued after
    PAUSED = "paused"  # its queue is paused
    NO_HANDLER = "no_handler"  # the registry has no handler for its kind
    CONCURRENCY = "concurrency"  # its kind is at its concurrency limit
    RATE = "rate"  # its kind's rate window is full
    KEY_LIMIT = "key_limit"  # its key is at its kind's key_concurrency
    KEY_ORDER = "key_order"  # an earlier job of its key goes first (ordered kinds)
    NO_WORKER = "no_worker"  # no worker serving its queue was seen lately
    WAITING = "waiting"  # due, nothing holds it back: waiting for a claim


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason a job is not running.

    Attributes:
        code: What kind of reason (stable, for scripts).
        message: One line for people, with the times and names that matter.
    """

    code: ReasonCode
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@operation
def explain(
    job_id: int,
    *,
    registry: Registry | None = None,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> Plan[list[Reason]]:
    """Every reason job *job_id* is not running now, most decisive first.

    Args:
        job_id: The job.
        registry: The application's registry: its limits (concurrency, rate) and
            handlers are checked too. Without it, limits are not (they live in the
            registry, not in the database).
        stale_after: A worker not seen for this long does not count as serving its
            queues.

    Returns:
        At least one reason. A finished job gets ``finished`` (and maybe
        ``dedupe_twin``); a running one ``running`` or ``lease_expired``; a queued one
        every reason that holds it back, or ``waiting``.

    Raises:
        JobNotFoundError: no such job (never enqueued, pruned, or not committed).
        ConfigError: *job_id* is not an id, or *stale_after* not a positive timedelta.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 0 < job_id <= BIGINT_MAX:
        raise ConfigError(f"job_id must be a positive int, got {job_id!r}")
    if not isinstance(stale_after, timedelta) or stale_after <= timedelta(0):
        raise ConfigError(f"stale_after must be a positive timedelta, got {stale_after!r}")
    job = (yield queries.get_job_stmt(job_id=job_id), None).first()
    if job is None:
        raise JobNotFoundError(job_id)
    now: datetime = (yield queries.clock_stmt(), None).scalar_one()
    status = JobStatus(job.status)
    if status not in (JobStatus.QUEUED, JobStatus.RUNNING):
        return (yield from _finished(job, status, now))
    if status is JobStatus.RUNNING:
        return [(yield from _running(job, now))]
    reasons = yield from _held(job, now, registry)
    worker = yield from _no_worker(job.queue, stale_after)
    if worker is not None:
        reasons.append(worker)
    if not reasons or all(r.code is ReasonCode.NO_WORKER for r in reasons):
        reasons.insert(0, (yield from _waiting(job, now)))
    return reasons


def _finished(job: Any, status: JobStatus, now: datetime) -> Plan[list[Reason]]:
    when = _when(job.finished_at, now)
    if status is JobStatus.DONE:
        message = f"done {when}"
    elif status is JobStatus.FAILED:
        message = f"failed {when} on attempt {job.attempts} of {job.max_attempts}"
    else:
        message = f"cancelled {when}"
    if job.last_error and status is not JobStatus.DONE:
        message += f"; last error: {_first_line(job.last_error)}"
    reasons = [Reason(ReasonCode.FINISHED, message)]
    if job.dedupe_key is not None and status is not JobStatus.DONE:
        stmt = queries.dedupe_twin_stmt(job_id=job.id, kind=job.kind, dedupe_key=job.dedupe_key)
        twin = (yield stmt, None).first()
        if twin is not None:
            reasons.append(
                Reason(
                    ReasonCode.DEDUPE_TWIN,
                    f"job {twin.id} ({twin.status}) holds its dedupe key "
                    f"{job.dedupe_key!r}: a retry leaves this job alone while that one is "
                    "pending",
                )
            )
    return reasons


def _running(job: Any, now: datetime) -> Plan[Reason]:
    holder = yield from _worker_name(job.locked_by)
    if job.run_at > now:
        return Reason(
            ReasonCode.RUNNING,
            f"running: attempt {job.attempts} of {job.max_attempts}, leased by worker "
            f"{holder} until {_when(job.run_at, now)}",
        )
    return Reason(
        ReasonCode.LEASE_EXPIRED,
        f"its lease, held by worker {holder} for attempt {job.attempts} of "
        f"{job.max_attempts}, ended {_when(job.run_at, now)}: the worker stopped or stalled; "
        "the next claim of its queue (or the maintenance leader's sweep) takes it back",
    )


def _held(job: Any, now: datetime, registry: Registry | None) -> Plan[list[Reason]]:
    """What holds a queued job back: not due, paused queue, limits, no handler."""
    reasons: list[Reason] = []
    if job.parent_ids is not None and job.run_at >= _HELD_FROM:
        reasons.append((yield from _parents(job)))
    elif job.run_at > now:
        after = ""
        if job.attempts and job.last_error:
            after = f" (attempt {job.attempts} failed: {_first_line(job.last_error)})"
        reasons.append(Reason(ReasonCode.NOT_DUE, f"not due until {_when(job.run_at, now)}{after}"))
    paused = (yield queries.paused_queues_stmt(queue=job.queue), None).first()
    if paused is not None:
        by = f" by {paused.paused_by}" if paused.paused_by else ""
        reasons.append(
            Reason(
                ReasonCode.PAUSED,
                f"its queue {job.queue!r} is paused (since {_time(paused.paused_at)}{by}): "
                f"'sqlaq resume {job.queue}' resumes it",
            )
        )
    if registry is not None:
        reasons += yield from _limits(job, now, registry)
    return reasons


def _parents(job: Any) -> Plan[Reason]:
    parents = yield from waiting_for(job.id)
    if not parents:
        return Reason(
            ReasonCode.PARENTS,
            "its parents have all finished: the next release check (a worker's, or the "
            "maintenance leader's sweep) makes it due",
        )
    shown = ", ".join(map(str, parents[:10])) + (", ..." if len(parents) > 10 else "")
    return Reason(ReasonCode.PARENTS, f"waiting for {len(parents)} parent(s): ids {shown}")


def _limits(job: Any, now: datetime, registry: Registry) -> Plan[list[Reason]]:
    handler = registry.get(job.kind)
    if handler is None:
        known = ", ".join(map(repr, registry.kinds)) or "none"
        return [
            Reason(
                ReasonCode.NO_HANDLER,
                f"the registry has no handler for kind {job.kind!r} (it has: {known}): a "
                "worker with this registry fails the job at once",
            )
        ]
    reasons: list[Reason] = []
    if handler.keyed and job.key is not None:
        reasons += yield from _key_limits(job, handler.key_concurrency or 1, handler.ordered)
    if handler.concurrency is None and handler.rate is None:
        return reasons
    stmt = queries.kind_limit_state_stmt(kind=job.kind, rate=handler.rate)
    state = (yield stmt, None).one()
    if handler.concurrency is not None and state.running >= handler.concurrency:
        reasons.append(
            Reason(
                ReasonCode.CONCURRENCY,
                f"its kind {job.kind!r} is at its concurrency limit ({state.running} running, "
                f"limit {handler.concurrency})",
            )
        )
    rate = handler.rate
    if rate is not None and state.recent >= rate.count and state.pivot is not None:
        until = state.pivot + rate.period
        reasons.append(
            Reason(
                ReasonCode.RATE,
                f"its kind {job.kind!r} used its rate ({rate.count} per "
                f"{rate.period.total_seconds():g}s): the window is full until "
                f"{_when(until, now)}",
            )
        )
    return reasons


def _key_limits(job: Any, cap: int, ordered: bool) -> Plan[list[Reason]]:
    stmt = queries.key_state_stmt(kind=job.kind, key=job.key, job_id=job.id)
    state = (yield stmt, None).one()
    reasons: list[Reason] = []
    if ordered and state.earlier_id is not None:
        fix = ""
        if state.earlier_status == JobStatus.FAILED:
            fix = (
                f": it failed for good and holds the key until it is retried ('sqlaq retry "
                f"{state.earlier_id}') or deleted"
            )
        reasons.append(
            Reason(
                ReasonCode.KEY_ORDER,
                f"behind an earlier job of its key {job.key!r} (id {state.earlier_id}, "
                f"{state.earlier_status}){fix}",
            )
        )
    if state.running >= cap:
        reasons.append(
            Reason(
                ReasonCode.KEY_LIMIT,
                f"waiting: key {job.key!r} at its limit ({state.running} running, "
                f"key_concurrency {cap})",
            )
        )
    return reasons


def _no_worker(queue: str, stale_after: timedelta) -> Plan[Reason | None]:
    stmt = queries.serving_workers_stmt(queue=queue, within=stale_after)
    serving = (yield stmt, None).one()
    if serving.recent:
        return None
    minutes = stale_after.total_seconds() / 60
    seen = (
        f"one was last seen at {_time(serving.last_seen)}"
        if serving.last_seen is not None
        else "none has a heartbeat row serving it"
    )
    return Reason(
        ReasonCode.NO_WORKER,
        f"no worker has served queue {queue!r} in the last {minutes:g} minutes ({seen}): "
        f"start one with --queue {queue}",
    )


def _waiting(job: Any, now: datetime) -> Plan[Reason]:
    stmt = queries.jobs_ahead_stmt(
        queue=job.queue,
        priority=job.priority,
        run_at=job.run_at,
        job_id=job.id,
        limit=AHEAD_LIMIT,
    )
    ahead = (yield stmt, None).scalar_one()
    count = f"{ahead:,}" if ahead < AHEAD_LIMIT else f"{AHEAD_LIMIT:,} or more"
    return Reason(
        ReasonCode.WAITING,
        f"due since {_when(job.run_at, now)}, waiting to be claimed: {count} due job(s) of "
        f"queue {job.queue!r} come first",
    )


def _worker_name(worker_id: UUID | None) -> Plan[str]:
    if worker_id is None:
        return "(unknown)"
    row = (yield queries.workers_stmt(worker_id=worker_id), None).first()
    if row is None:
        return str(worker_id)
    return f"{worker_id} ({row.hostname}, pid {row.pid})"


def _when(moment: datetime | None, now: datetime) -> str:
    """``at 2026-12-16 10:00:00+00:00 (in 4m 59s)`` / ``(12s ago)``."""
    if moment is None:
        return "at an unknown time"
    delta = moment - now
    relative = f"in {_span(delta)}" if delta > timedelta(0) else f"{_span(-delta)} ago"
    return f"at {_time(moment)} ({relative})"


def _time(moment: datetime) -> str:
    return moment.isoformat(sep=" ", timespec="seconds")


def _span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    if seconds or not parts:
        parts.append(f"{seconds}s")
    return " ".join(parts[:2])


def _first_line(text: str, width: int = 200) -> str:
    line = text.partition("\n")[0]
    return line if len(line) <= width else line[: width - 3] + "..."
