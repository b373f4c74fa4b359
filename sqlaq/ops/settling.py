"""Settle: what the holder of a lease does with it (extend, complete, fail, snooze, hand
back), each fenced: a lost lease changes nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlaq import queries
from sqlaq.bounds import clamp_duration
from sqlaq.drive import Plan, operation
from sqlaq.encoding import (
    check_duration,
)
from sqlaq.errors import ConfigError
from sqlaq.lease import Lease
from sqlaq.ops._citus import DISTRIBUTED, by_queue, tell_waiters
from sqlaq.ops._common import _NIL_LEASE, DEFAULT_LEASE, _as_leases, _check_lost, on_first_use
from sqlaq.queries import citus as citus_queries
from sqlaq.schema import (
    JobStatus,
)

#: ``last_error`` is cut to this many characters (a traceback summary, not a log).
MAX_ERROR_LENGTH = 8000

_EXTEND = queries.extend_lease_stmt(leases=[], lease=DEFAULT_LEASE)

_COMPLETE = queries.complete_stmt(leases=[])

_FAIL = queries.fail_stmt(lease=_NIL_LEASE, error="", retry_in=None)

_HANDBACK = queries.handback_stmt(leases=[])

_SNOOZE = queries.snooze_stmt(leases=[], delay=timedelta(0))

# On Citus (sqlaq_jobs distributed by queue): the same, for the leases of one queue;
# built on first use.
_citus_extend_stmt = on_first_use(citus_queries.citus_extend_lease_stmt)

_citus_complete_stmt = on_first_use(citus_queries.citus_complete_stmt)

_citus_fail_stmt = on_first_use(citus_queries.citus_fail_stmt)

_citus_handback_stmt = on_first_use(citus_queries.citus_handback_stmt)

_citus_snooze_stmt = on_first_use(citus_queries.citus_snooze_stmt)


@operation
def extend_lease(
    leases: Lease | Iterable[Lease],
    *,
    length: timedelta = DEFAULT_LEASE,
    raise_on_lost: bool = True,
    lease: timedelta | None = None,
) -> Plan[list[Lease]]:
    """Move the end of each still-held lease to ``now() + length``, in one statement;
    never earlier than it is (a renewal does not shorten a lease).

    Args:
        leases: The leases to renew.
        length: How long each renewed lease lasts from now (as
            :meth:`JobContext.extend_lease`'s ``length``).
        raise_on_lost: Raise when a lease was lost, rather than leave it out.
        lease: Deprecated name of *length* (a :class:`DeprecationWarning`).

    Returns:
        The renewed leases (with their new ``expires_at``); a lost one is absent.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true.
        InvalidJobError: *length* is not a positive timedelta of at most 100 years.
        ConfigError: both *length* and its old name *lease* were given.
    """
    if lease is not None:
        # Checked now, when the operation is called (a plan's body runs later), so that
        # the warning points at the caller's line, sync or awaited.
        if length is not DEFAULT_LEASE:
            raise ConfigError("extend_lease takes length= (lease= is its old name), not both")
        warnings.warn(
            "extend_lease(lease=) is deprecated: pass length= (the same duration)",
            DeprecationWarning,
            stacklevel=3,
        )
        length = lease
    check_duration("length", length, allow_zero=False)
    return _extend(_as_leases(leases), length, raise_on_lost)


def _extend(held: list[Lease], length: timedelta, raise_on_lost: bool) -> Plan[list[Lease]]:
    if not held:
        return []
    ends: dict[int, datetime] = {}
    if (yield DISTRIBUTED):
        for queue, group in by_queue(held, "extend_lease").items():
            params = queries.fence_params(group) | {"b_lease": length, "b_queue": queue}
            ends.update((yield _citus_extend_stmt(), params).all())
    else:
        params = queries.fence_params(held) | {"b_lease": length}
        extended = yield _EXTEND, params
        ends.update(extended.all())
    _check_lost(held, ends, raise_on_lost)
    return [
        Lease(h.job_id, h.worker_id, h.token, h.attempt, ends[h.job_id], h.queue)
        for h in held
        if h.job_id in ends
    ]


@operation
def complete(leases: Lease | Iterable[Lease], *, raise_on_lost: bool = True) -> Plan[list[int]]:
    """Mark done every job whose lease is still held, in one statement.

    Returns:
        The ids of the jobs marked done.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true; the other jobs of
            the call were marked done all the same.
    """
    return (
        yield from _fenced(
            _COMPLETE, leases, raise_on_lost, citus=_citus_complete_stmt, finishes=True
        )
    )


def _fenced(
    stmt: Any,
    leases: Lease | Iterable[Lease],
    raise_on_lost: bool,
    params: Mapping[str, Any] | None = None,
    *,
    citus: Callable[[], Any],
    notify: bool = False,
    finishes: bool = False,
) -> Plan[list[int]]:
    """Run a fenced statement that returns the ids it changed, over *leases*; on Citus,
    the statement *citus* gives (its router shape, built on first use) once per queue,
    with *notify* a wake-up of the queues whose jobs it changed (a statement of its own,
    on the coordinator), and with *finishes* (its statement returns ``id, awaited``) the
    waiters of the awaited ones told."""
    held = _as_leases(leases)
    if not held:
        return []
    if (yield DISTRIBUTED):
        changed: set[int] = set()
        woken = []
        awaited: list[int] = []
        for queue, group in by_queue(held, "a fenced update").items():
            values = queries.fence_params(group) | dict(params or {}) | {"b_queue": queue}
            rows = (yield citus(), values).all()
            ids = {row[0] for row in rows}
            changed |= ids
            if finishes:
                awaited += [row[0] for row in rows if row[1]]
            if ids:
                woken.append(queue)
        if notify and woken:
            (yield queries.notify_queues_stmt(queues=woken), None).all()
        yield from tell_waiters(awaited)
        _check_lost(held, changed, raise_on_lost)
        return [h.job_id for h in held if h.job_id in changed]
    values = queries.fence_params(held) | dict(params or {})
    # Rows, not .scalars(): a ScalarResult rebuilds the result's metadata on each call.
    changed = {row[0] for row in (yield stmt, values)}
    _check_lost(held, changed, raise_on_lost)
    return [h.job_id for h in held if h.job_id in changed]


@operation
def fail(
    lease: Lease,
    error: str,
    *,
    retry_in: timedelta | None = None,
    raise_on_lost: bool = True,
) -> Plan[JobStatus | None]:
    """Record a failed attempt of the job held by *lease*.

    With *retry_in* and attempts left, the job is queued again to run at
    ``now() + retry_in`` (compute it with a :class:`~sqlaq.Backoff`); otherwise it
    ends ``failed``. *error* becomes ``last_error`` (cut to 8000 characters).

    Returns:
        ``JobStatus.QUEUED`` or ``JobStatus.FAILED``; None when the lease was lost and
        *raise_on_lost* is false.

    Raises:
        LeaseLostError: the lease was lost and *raise_on_lost* is true.
        InvalidJobError: *retry_in* is not a timedelta from zero to 100 years.
    """
    if retry_in is not None:
        check_duration("retry_in", retry_in)
    error = _clean_error(error)
    params = queries.fail_params(lease=lease, error=error, retry_in=retry_in)
    if (yield DISTRIBUTED):
        (queue,) = by_queue([lease], "fail")
        row = (yield _citus_fail_stmt(), params | {"b_queue": queue}).first()
        if row is not None and row.awaited and row.status == JobStatus.FAILED:
            yield from tell_waiters([row.id])
    else:
        row = (yield _FAIL, params).first()
    if row is None:
        _check_lost([lease], (), raise_on_lost)
        return None
    return JobStatus(row.status)


def _clean_error(error: object) -> str:
    # What text cannot hold is spelt out instead: NUL, and lone surrogates (an error
    # message quoting undecodable bytes).
    text = str(error).replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode()
    if len(text) > MAX_ERROR_LENGTH:
        text = text[: MAX_ERROR_LENGTH - 20] + "\n... (truncated)"
    return text


@operation
def snooze(
    leases: Lease | Iterable[Lease],
    delay: timedelta,
    *,
    raise_on_lost: bool = True,
) -> Plan[list[int]]:
    """Queue still-held jobs again at ``now() + delay``, refunding the claim's attempt.

    What a handler's ``raise sqlaq.Snooze(delay)`` becomes.

    A *delay* longer than :data:`~sqlaq.bounds.MAX_DURATION` (100 years) is brought
    down to it, never refused: a job may snooze "for ever" (``Snooze(timedelta.max)``)
    and still be stored and read back.

    Returns:
        The ids of the jobs snoozed.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true.
        InvalidJobError: *delay* is negative or not a timedelta.
    """
    if not isinstance(delay, timedelta) or delay < timedelta(0):
        check_duration("delay", delay)  # raises, naming what was wrong
    delay = clamp_duration(delay)
    return (
        yield from _fenced(
            _SNOOZE, leases, raise_on_lost, {"b_delay": delay}, citus=_citus_snooze_stmt
        )
    )


@operation
def handback(leases: Lease | Iterable[Lease], *, raise_on_lost: bool = True) -> Plan[list[int]]:
    """Give still-held jobs back to their queue unfinished, in one statement.

    For a worker that stops before its jobs finish (a deploy, a scale-down): each job
    whose lease is still held goes back to ``queued``, due now, with its lease cleared
    and the attempt its claim counted refunded, since stopping a worker is not a failure
    of the job. Idle workers are notified on commit. Whatever the handler still does
    afterwards changes nothing: its lease is gone.

    Returns:
        The ids of the jobs handed back.

    Raises:
        LeaseLostError: a lease was lost and *raise_on_lost* is true; the other jobs of
            the call were handed back all the same.
    """
    return (
        yield from _fenced(
            _HANDBACK, leases, raise_on_lost, citus=_citus_handback_stmt, notify=True
        )
    )
