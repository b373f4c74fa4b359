"""One attempt in a worker: :class:`Run` (claimed, running) and :class:`Finished` (its
outcome, a value), and :class:`JobResult`, what callbacks receive. No SQL, no threads.

A run is identified by its claim, never by its job: ``run.token`` is the lease token the
claim wrote, unique to that attempt. A worker that stalled past its lease may claim its
own job again; the two runs then have the same job id and different tokens, and
everything the worker keeps in flight is keyed by the token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from sqlaq.context import JobContext, LeaseRenewer
from sqlaq.encoding import slot_setters
from sqlaq.errors import JobTimeoutError
from sqlaq.ops import ClaimedJob
from sqlaq.outcome import Outcome, Verdict
from sqlaq.registry import Handler
from sqlaq.schema import JobStatus

__all__ = ["Finished", "JobResult", "Run", "bounded", "in_a_process", "timed_out"]


def in_a_process(handler: Handler, executor: str) -> bool:
    """Whether *handler* runs in a child process in a worker whose ``executor`` is
    *executor*: its own ``executor`` if it has one, else the worker's; never an
    ``async`` or a transactional handler (the registry refuses them the option)."""
    if handler.is_async or handler.transaction:
        return False
    return (handler.executor or executor) == "process"


#: Characters of an error's first line put in a log line.
LOG_ERROR_LENGTH = 200


@dataclass(frozen=True, slots=True)
class JobResult:
    """What became of one run, as a worker's ``on_job_finished`` callback receives it.

    Attributes:
        job_id: The job.
        kind: Its kind.
        queue: Its queue.
        attempt: The attempt that ran.
        status: The status written: done, queued (to be retried, or snoozed), failed or
            cancelled; None when the lease was lost and nothing was written.
        error: The failure summary written to ``last_error``, if the attempt failed.
        duration: Seconds the handler ran.
        outcome: The attempt's :class:`~sqlaq.outcome.Outcome` as written.
    """

    job_id: int
    kind: str
    queue: str
    attempt: int
    status: JobStatus | None
    error: str | None
    duration: float
    outcome: Outcome | None = None


@dataclass(frozen=True, eq=False, slots=True)
class Run:
    """One attempt of one job in this process, from claim to written outcome.

    Attributes:
        job: The claimed job.
        handler: Its handler; None when the kind has no handler here.
        context: What ``current_job()`` returns while it runs; holds the current lease.
    """

    job: ClaimedJob
    handler: Handler | None
    context: JobContext

    @classmethod
    def of(
        cls, job: ClaimedJob, handler: Handler | None, lease_length: timedelta, renew: LeaseRenewer
    ) -> Run:
        """A run of the claimed *job*, with the context its handler will see.

        Built by slot setters (:func:`~sqlaq.encoding.slot_setters`), as the claim
        builds its jobs: a worker makes one per job.
        """
        run = object.__new__(cls)
        set_job, set_handler, set_context = _RUN_SETTERS
        set_job(run, job)
        set_handler(run, handler)
        set_context(run, JobContext.for_job(job, lease_length, renew))
        return run

    @property
    def timeout(self) -> timedelta | None:
        """How long this attempt may run: the job's own timeout (``enqueue(...,
        timeout=...)``) over its handler's; None for no limit. The one place the
        effective timeout is decided."""
        if self.job.timeout is not None:
            return self.job.timeout
        return self.handler.timeout if self.handler is not None else None

    @property
    def token(self) -> UUID:
        """The claim's lease token: this run's identity."""
        return self.job.lease.token

    def log_extra(self) -> dict[str, Any]:
        """The ``extra`` keys of this run's log lines."""
        job = self.job
        return {"job_id": job.id, "kind": job.kind, "attempt": job.attempt, "queue": job.queue}


@dataclass(frozen=True, eq=False, slots=True)
class Finished:
    """A run whose handler is done, with what the attempt means.

    Attributes:
        run: The run.
        outcome: What the handler's return or exception means (:func:`sqlaq.outcome.decide`).
        duration: Seconds the handler ran.
        committed: The outcome is already written: a transactional handler's
            transaction completed the job (or found its lease gone and rolled back).
        status: With *committed*: the status written (None: lease gone, nothing).
    """

    run: Run
    outcome: Outcome
    duration: float
    committed: bool = False
    status: JobStatus | None = None

    @classmethod
    def of(cls, run: Run, outcome: Outcome, duration: float) -> Finished:
        """``Finished(run, outcome, duration)``, built by slot setters: a worker makes
        one per job (a frozen dataclass's ``__init__`` costs twice as much)."""
        finished = object.__new__(cls)
        set_run, set_outcome, set_duration, set_committed, set_status = _FINISHED_SETTERS
        set_run(finished, run)
        set_outcome(finished, outcome)
        set_duration(finished, duration)
        set_committed(finished, False)
        set_status(finished, None)
        return finished

    def result(self, outcome: Outcome, status: JobStatus | None) -> JobResult:
        """This run as a :class:`JobResult`: *outcome* was written as *status*."""
        job = self.run.job
        return JobResult(
            job.id, job.kind, job.queue, job.attempt, status, outcome.error, self.duration, outcome
        )

    def log(self, log: logging.Logger, outcome: Outcome, status: JobStatus | None) -> None:
        """Log the written outcome: done at DEBUG (like ``job started``: two lines per
        job at INFO would cost more than a no-op job itself), every other state change at
        INFO, a lost lease at WARNING; errors cut to their first line."""
        extra = self.run.log_extra()
        extra["duration"] = round(self.duration, 6)
        verdict = outcome.verdict
        if status is None:
            log.warning("job result not written: lease lost", extra=extra)
        elif verdict is Verdict.DONE:
            log.debug("job done", extra=extra)
        elif verdict is Verdict.CANCELLED:
            log.info("job cancelled; its result was not written", extra=extra)
        elif verdict is Verdict.SNOOZED:
            extra["snooze"] = outcome.delay.total_seconds() if outcome.delay else 0.0
            log.info("job snoozed", extra=extra)
        else:
            extra["error"] = (outcome.error or "").partition("\n")[0][:LOG_ERROR_LENGTH]
            if status is JobStatus.QUEUED:
                extra["retry_in"] = outcome.delay.total_seconds() if outcome.delay else 0.0
                log.info("job failed, will retry", extra=extra)
            else:
                log.info("job failed", extra=extra)


_RUN_SETTERS = slot_setters(Run)
_FINISHED_SETTERS = slot_setters(Finished)


def timed_out(timeout: timedelta) -> JobTimeoutError:
    """The error an attempt that ran past *timeout* is failed with."""
    return JobTimeoutError(f"timed out after {timeout.total_seconds():g}s")


async def bounded(awaitable: Awaitable[object], timeout: timedelta | None) -> object:
    """Await *awaitable*, cancelled at *timeout* (an ``async`` handler's deadline).

    Raises:
        JobTimeoutError: the deadline passed (a TimeoutError the handler raised itself
            passes through as it is).
    """
    if timeout is None:
        return await awaitable
    deadline = asyncio.timeout(timeout.total_seconds())
    try:
        async with deadline:
            return await awaitable
    except TimeoutError:
        if deadline.expired():
            raise timed_out(timeout) from None
        raise
