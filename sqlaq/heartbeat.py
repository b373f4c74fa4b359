"""Lease renewal: when the worker renews the leases of its running jobs, and how.

This module owns the heartbeat's schedule (a third of the shortest lease in use, so two
renewals may fail, say in a database blip, before a lease runs out) and its statement
plan: one ``extend_lease`` for all running jobs, or one per lease length when handlers
set their own. It finds lost leases (the job was cancelled, or expired and was claimed
again) and marks their runs so their results are never written. It must not decide
anything else about a job; the worker calls it inside its turn's transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import timedelta
from time import monotonic

from sqlalchemy import Connection, Engine

from sqlaq import ops
from sqlaq.context import JobContext
from sqlaq.lease import Lease
from sqlaq.runner import Run

__all__ = ["Heartbeat"]

_log = logging.getLogger(__name__)


class Heartbeat:
    """The renewal schedule of a worker's leases.

    Args:
        engine: The queue's database, for renewals asked by handlers.
        leases: Every lease length in use (the worker's and the handlers' own).
    """

    def __init__(self, engine: Engine, leases: Iterable[timedelta]) -> None:
        self._engine = engine
        self.interval = min(leases).total_seconds() / 3
        self.next = monotonic() + self.interval

    def due(self) -> bool:
        """True once the next renewal is due."""
        return monotonic() >= self.next

    def extend(self, conn: Connection, runs: Sequence[Run]) -> dict[int, Lease | None]:
        """Renew the lease of each of *runs*: one statement per lease length.

        Returns:
            The renewed leases by job id; None for a job found cancelled (so the worker
            knows even when it missed the cancel's NOTIFY); a lease lost otherwise is
            absent.
        """
        groups: dict[timedelta, list[Lease]] = {}
        for run in runs:
            groups.setdefault(run.context.lease_length, []).append(run.context.lease)
        renewed: dict[int, Lease | None] = {}
        for length, leases in groups.items():
            for lease in ops.extend_lease(conn, leases, lease=length, raise_on_lost=False):
                renewed[lease.job_id] = lease
        lost = [run.job.id for run in runs if run.job.id not in renewed]
        if lost:  # rare: find which were cancelled
            renewed.update(dict.fromkeys(ops.cancelled_among(conn, lost)))
        return renewed

    def apply(self, runs: Sequence[Run], renewed: dict[int, Lease | None]) -> None:
        """After commit: hand each run its renewed lease, or mark it lost; schedule the
        next renewal."""
        self.next = monotonic() + self.interval
        for run in runs:
            lease = renewed.get(run.job.id)
            if lease is not None:
                run.context._set_lease(lease)
                continue
            if run.lost:
                continue  # already known (a cancel's NOTIFY)
            if run.job.id in renewed:
                run.lost = True
                run.context._set_cancelled()
                _log.info("job cancelled while running", extra=run.log_extra())
                continue
            # Cancelled, or expired and claimed again: whatever the handler returns now
            # must not be written (the fence would refuse it anyway).
            run.lost = True
            _log.warning("lease lost; the result will not be written", extra=run.log_extra())

    def renew_now(self, context: JobContext, length: timedelta) -> Lease:
        """Renew one job's lease at once, in a transaction of its own: what
        ``current_job().extend_lease()`` runs, in the handler's thread.

        Raises:
            LeaseLostError: the lease is gone.
        """
        with self._engine.begin() as conn:
            lease = ops.extend_lease(conn, context.lease, lease=length)[0]
        # A lease shorter than any so far needs renewing more often; from another
        # thread, but a race here only makes one renewal early.
        if length.total_seconds() / 3 < self.interval:
            self.interval = length.total_seconds() / 3
            self.next = min(self.next, monotonic() + self.interval)
        return lease
