"""The outbox: the run thread's side of writing outcomes. No SQL.

Finished runs wait here, each with the outcome to write, until the writer
(:mod:`sqlaq.worker.writer`, its own thread) is free; then they go to it as one
:class:`~sqlaq.worker.writer.Batch`, with the leases due for renewal. Once the writer
is through with a batch, the outbox settles it on the run thread: written runs are
released from the lease bookkeeping, each change of state is logged, the worker's
``on_job_finished`` callback is told, renewed leases are applied.

At most one batch is in flight; outcomes that finish meanwhile wait for the next. A
batch the database did not take (a connection fault) puts its unwritten outcomes back
at the front, in order, to be written once the database is back (the worker backs off
meanwhile); a fault that is not the database being away is raised (the worker stops).

It is used by the run thread only (:mod:`sqlaq.worker.core`), so it holds no lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from uuid import UUID

from sqlaq.outcome import Outcome, Verdict
from sqlaq.transient import is_transient
from sqlaq.worker.leases import Leases
from sqlaq.worker.run import Finished, JobResult, Run
from sqlaq.worker.writer import Batch, Writer, Written

__all__ = ["Outbox"]

_log = logging.getLogger("sqlaq.worker")


class Outbox:
    """Outcomes on their way to the writer, and the batch it is writing.

    Args:
        writer: The writer batches go to.
        leases: The worker's lease bookkeeping: written runs are released from it, and
            renewals applied to it.
        on_job_finished: The worker's callback, told of each outcome once written (or
            found lost); None for none.
        back_off: Called with a connection fault that stopped a batch (it waits).
        recovered: Called once a batch was written after a fault.
    """

    def __init__(
        self,
        writer: Writer,
        leases: Leases,
        on_job_finished: Callable[[JobResult], None] | None,
        back_off: Callable[[BaseException], None],
        recovered: Callable[[], None],
    ) -> None:
        self._writer = writer
        self._leases = leases
        self._on_job_finished = on_job_finished
        self._back_off = back_off
        self._recovered = recovered
        self._unwritten: list[tuple[Finished, Outcome]] = []  # not yet handed to the writer
        self._writing: Batch | None = None  # handed to the writer, not yet settled
        #: Outcomes were written since this was last lowered (a burst worker's sign that
        #: a parent's completion may have released its children in the same commit).
        self.wrote = False

    def __len__(self) -> int:
        """The outcomes not settled yet: waiting, and in the batch in flight."""
        writing = self._writing
        return len(self._unwritten) + (len(writing.items) if writing is not None else 0)

    @property
    def writing(self) -> bool:
        """A batch is in flight (handed to the writer, not settled)."""
        return self._writing is not None

    @property
    def waiting(self) -> bool:
        """Outcomes wait for the next batch."""
        return bool(self._unwritten)

    @property
    def ready(self) -> bool:
        """There is something to do at once: the writer is through with its batch, or
        is free while outcomes wait."""
        writing = self._writing
        if writing is None:
            return bool(self._unwritten)
        return writing.done.is_set()

    def add(self, finished: Finished, outcome: Outcome) -> None:
        """*finished*'s *outcome* is to be written (with the next batch)."""
        self._unwritten.append((finished, outcome))

    def turn(self) -> None:
        """Settle the batch in flight if the writer is through with it; then, with the
        writer free, hand it the next one."""
        writing = self._writing
        if writing is not None and writing.done.is_set():
            self.settle_batch()
        if self._writing is None:
            self.hand_to_writer()

    def hand_to_writer(self) -> None:
        """Give the writer the waiting outcomes and, if due, the leases to renew."""
        renewing = self.renewable() if self._leases.due() else None
        if not self._unwritten and renewing is None:
            return
        batch = Batch(self._unwritten, renewing)
        self._unwritten = []
        self._writing = batch
        self._writer.submit(batch)

    def settle_batch(self, timeout: float | None = 0.0) -> bool:
        """Apply what the writer did with the batch in flight (waiting up to *timeout*);
        False if it is still writing it."""
        batch = self._writing
        if batch is None:
            return True
        if not batch.done.wait(timeout):
            return False
        self._writing = None
        self.settle(batch.written)
        if batch.error is not None:
            self._unwritten[:0] = batch.unwritten()  # written again, in order
            if not is_transient(batch.error):
                # Not the database being away, and not one row (the writer wrote those
                # one by one): a fault of the worker itself, or a changed schema.
                raise batch.error
            self._back_off(batch.error)  # then written again, once the database is back
            return True
        self._recovered()
        if batch.renewing is not None:
            self._leases.apply(batch.renewing, batch.renewed)
        return True

    def settle(self, written: list[Written]) -> None:
        """After commit: forget written runs, log each state change, tell the callback."""
        debug = _log.isEnabledFor(logging.DEBUG)
        info = debug or _log.isEnabledFor(logging.INFO)
        leases = self._leases
        callback = self._on_job_finished
        if written:
            self.wrote = True
        for finished, outcome, status in written:
            leases.release(finished.run)
            # "job done" is a DEBUG line, every other change INFO (a lost lease WARNING):
            # with logging at its level off, a job costs no log call at all.
            if debug or status is None or (info and outcome.verdict is not Verdict.DONE):
                finished.log(_log, outcome, status)
            if callback is not None:
                try:
                    callback(finished.result(outcome, status))
                except Exception:
                    _log.exception("on_job_finished callback raised")

    def renewable(self) -> list[Run]:
        """Held runs whose lease the heartbeat keeps: not gone, not finished."""
        finishing: set[UUID] = {f.run.token for f, _ in self._unwritten}
        if self._writing is not None:
            finishing.update(f.run.token for f, _ in self._writing.items)
        return self._leases.renewable(finishing)
