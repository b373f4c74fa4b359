"""The leases a worker holds: every run in flight, keyed by its claim, and every
decision that a run's lease is gone. No other part of the worker decides that.

This module owns:

* **what is held**: each run from claim to written outcome, keyed by the run itself
  (its identity: one :class:`~sqlaq.worker.run.Run` per claim, so per lease token;
  never by job id: a worker that stalled past its lease may claim its own job again,
  and the stale run must neither overwrite nor remove the new one);
* **lost and cancelled**: a run is *lost* when its job was claimed again (here, by a new
  claim of the same job, or elsewhere, found by a renewal that matched no row) and
  *cancelled* when ``sqlaq.cancel`` reached it (the cancel's NOTIFY, or a renewal that
  found the job cancelled). :meth:`Leases.verdict` gives the outcome that replaces the
  handler's for such a run: nothing of it is written;
* **the heartbeat**: its schedule (a third of the shortest lease in use, so two renewals
  may fail before a lease runs out) and its statements (one ``extend_lease`` per lease
  length, run by the writer in its transaction), and the renewals handlers ask for.

Every method but :meth:`extend` and :meth:`renew_now` runs in the worker's run thread;
:meth:`extend` runs in the writer's thread and only reads the runs it is handed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from time import monotonic
from uuid import UUID

from sqlalchemy import Connection, Engine

from sqlaq import ops
from sqlaq.context import JobContext
from sqlaq.lease import Lease
from sqlaq.outcome import CANCELLED, LOST, Outcome
from sqlaq.worker.run import Run

__all__ = ["Leases", "Renewed"]

_log = logging.getLogger(__name__)

#: What a renewal found, by token: the renewed lease, or None when the job was
#: cancelled; a lease found lost otherwise is absent.
Renewed = dict[UUID, Lease | None]


class Leases:
    """The runs a worker holds and the fate of their leases.

    Args:
        engine: The queue's database, for renewals asked by handlers.
        lengths: Every lease length in use (the worker's and the handlers' own).
        on_cancelled: Called with each run found cancelled (its handler is told).
    """

    def __init__(
        self,
        engine: Engine,
        lengths: Iterable[timedelta],
        on_cancelled: Callable[[Run], None] | None = None,
    ) -> None:
        self._engine = engine
        self._on_cancelled = on_cancelled
        self.interval = min(lengths).total_seconds() / 3
        self.next = monotonic() + self.interval
        # Held runs are keyed by identity (a Run hashes as an object: no UUID hashed or
        # compared per job). What is gone or late is rare and keyed by token: a run
        # handed back that never finishes leaves only its token behind.
        self._held: dict[Run, None] = {}
        self._latest: dict[int, Run] = {}  # job id -> its newest held run
        self._gone: dict[UUID, Outcome] = {}  # runs whose lease is gone: LOST/CANCELLED
        self._late: set[UUID] = set()  # timed out: their handler's own outcome is dropped

    def __len__(self) -> int:
        return len(self._held)

    def __bool__(self) -> bool:
        return bool(self._held)

    def __iter__(self) -> Iterator[Run]:
        return iter(self._held)

    # -- holding -----------------------------------------------------------------------

    def hold(self, run: Run) -> None:
        """Hold *run* from its claim on. A run of the same job still held here is lost:
        the new claim replaced its lease (it expired while this worker stalled)."""
        job_id = run.job.id
        previous = self._latest.get(job_id)
        if previous is not None and previous in self._held and previous.token not in self._gone:
            self._mark(previous, LOST, "lease expired and the job was claimed again here")
        self._held[run] = None
        self._latest[job_id] = run

    def release(self, run: Run) -> None:
        """Forget *run*: its outcome was written, or its job handed back."""
        self._held.pop(run, None)
        if self._gone:
            self._gone.pop(run.token, None)
        latest = self._latest
        job_id = run.job.id
        if latest.get(job_id) is run:
            del latest[job_id]

    def handed_back(self, run: Run) -> None:
        """*run*'s job was handed back (a stopping worker): it is no longer held, and
        whatever its handler returns now is not written."""
        self._held.pop(run, None)
        self._gone[run.token] = LOST
        if self._latest.get(run.job.id) is run:
            del self._latest[run.job.id]

    def timed_out(self, run: Run) -> None:
        """*run* ran past its timeout: its timed-out outcome is being written, its lease
        is no longer renewed, and what its handler returns later is dropped."""
        self._late.add(run.token)

    def late(self, run: Run) -> bool:
        """True (once) for the handler's own outcome of a run that timed out."""
        if self._late and run.token in self._late:
            self._late.discard(run.token)
            return True
        return False

    def verdict(self, run: Run) -> Outcome | None:
        """LOST or CANCELLED if *run*'s lease is known gone, else None."""
        return self._gone.get(run.token) if self._gone else None

    def renewable(self, excluding: set[UUID]) -> list[Run]:
        """Held runs whose lease the heartbeat keeps: not gone, not in *excluding*
        (finished, their outcomes being written)."""
        gone, late = self._gone, self._late
        return [
            r
            for r in self._held
            if r.token not in gone and r.token not in excluding and r.token not in late
        ]

    # -- learning that a lease is gone -------------------------------------------------

    def cancelled(self, job_id: int) -> None:
        """``sqlaq.cancel`` reached job *job_id* (its NOTIFY): its held run is cancelled
        (an older run of it here, if any, is already lost)."""
        run = self._latest.get(job_id)
        if run is not None and run.token not in self._gone:
            self._mark(run, CANCELLED, "job cancelled while running")

    def _mark(self, run: Run, outcome: Outcome, reason: str) -> None:
        self._gone[run.token] = outcome
        if outcome is CANCELLED:
            run.context._set_cancelled()
            _log.info(reason, extra=run.log_extra())
            if self._on_cancelled is not None:
                self._on_cancelled(run)
        elif run.handler is not None and run.handler.transaction:
            # Its own transaction may have completed the job as the renewal ran: its
            # outcome (done, or not written: lease lost) is logged when it reports.
            _log.debug("%s; its transaction decides", reason, extra=run.log_extra())
        else:
            _log.warning("%s; the result will not be written", reason, extra=run.log_extra())

    # -- the heartbeat -----------------------------------------------------------------

    def due(self) -> bool:
        """True once the next renewal is due."""
        return monotonic() >= self.next

    @staticmethod
    def extend(conn: Connection, runs: Sequence[Run]) -> Renewed:
        """Renew the lease of each of *runs*: one statement per lease length (in the
        writer's thread, inside its transaction).

        Returns:
            The renewed leases by token; None for a job found cancelled (so the worker
            knows even when it missed the cancel's NOTIFY); a lease lost otherwise is
            absent.
        """
        groups: dict[timedelta, list[Lease]] = {}
        for run in runs:
            groups.setdefault(run.context.lease_length, []).append(run.context.lease)
        renewed: Renewed = {}
        for length, leases in groups.items():
            for lease in ops.extend_lease(conn, leases, length=length, raise_on_lost=False):
                renewed[lease.token] = lease
        lost = [run for run in runs if run.token not in renewed]
        if lost:  # rare: find which were cancelled
            cancelled = set(ops.cancelled_among(conn, [run.job.id for run in lost]))
            renewed.update((run.token, None) for run in lost if run.job.id in cancelled)
        return renewed

    def apply(self, runs: Sequence[Run], renewed: Renewed) -> None:
        """After commit: hand each run its renewed lease, or mark it gone; schedule the
        next renewal."""
        self.next = monotonic() + self.interval
        for run in runs:
            token = run.token
            lease = renewed.get(token)
            if lease is not None:
                run.context._set_lease(lease)
            elif run not in self._held or token in self._gone:
                continue  # written or handed back meanwhile, or already known gone
            elif token in renewed:
                self._mark(run, CANCELLED, "job cancelled while running")
            else:
                self._mark(run, LOST, "lease lost (expired and claimed again, or deleted)")

    def renew_soon(self) -> None:
        """Renew the held leases at once, not at the next heartbeat: the listener (re)
        connected, and a cancel sent while it was not listening is found by a renewal
        (it matches no row of a cancelled job)."""
        if self._held:
            self.next = min(self.next, monotonic())

    def next_renewal(self) -> float:
        """When the next renewal is due (``time.monotonic`` clock)."""
        return self.next

    def renew_now(self, context: JobContext, length: timedelta) -> Lease:
        """Renew one job's lease at once, in a transaction of its own: what
        ``current_job().extend_lease()`` runs, in the handler's thread.

        Raises:
            LeaseLostError: the lease is gone.
        """
        with self._engine.begin() as conn:
            lease = ops.extend_lease(conn, context.lease, length=length)[0]
        # A lease shorter than any so far needs renewing more often; from another
        # thread, but a race here only makes one renewal early.
        if length.total_seconds() / 3 < self.interval:
            self.interval = length.total_seconds() / 3
            self.next = min(self.next, monotonic() + self.interval)
        return lease
