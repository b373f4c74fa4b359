"""What a finished attempt means: one pure function, one value. No SQL, no clock, no I/O.

:func:`decide` maps what a handler did (returned, or raised) to an :class:`Outcome`,
from the handler's policy and the job's attempts; the worker writes that value, the test
kit (:func:`sqlaq.testing.drain`) writes the same value with the same statements, and the
metrics count it. Nothing else decides what an attempt means, and no outcome is ever a
set of mutable fields on a shared object.

Two verdicts are not the handler's to give: ``lost`` (the lease is gone: the job was
claimed again elsewhere) and ``cancelled`` (``sqlaq.cancel`` while it ran). The worker's
lease bookkeeping (:mod:`sqlaq.worker.leases`) learns those and replaces the handler's
outcome with :data:`LOST` or :data:`CANCELLED`; nothing is written for either.

Decisions written down here:

* A :class:`~sqlaq.Snooze` is never refused and never fails the job: its delay is clamped
  to :data:`sqlaq.bounds.MAX_DURATION` (100 years), so "snooze for ever" is storable.
* A retry delay from the policy (a :class:`~sqlaq.Backoff` or a tenacity ``wait_*``) is
  clamped the same way; a policy that raises falls back to the default backoff, so a
  broken policy never loses a job.
* ``asyncio.CancelledError`` that escapes a handler (a sub-task it awaited was
  cancelled) is a failure like any other exception, retried per policy; only the worker
  cancelling the handler itself at shutdown is not an outcome (its job is handed back).
* ``last_error`` is bounded: the exception's message is cut to
  :data:`MAX_MESSAGE_LENGTH` characters before the traceback summary, so a handler that
  raises a 10 MB message costs a few kilobytes per attempt, in the row and in the log.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from sqlaq.backoff import DEFAULT_BACKOFF
from sqlaq.bounds import clamp_duration
from sqlaq.errors import PermanentError, Snooze, SqlaqError
from sqlaq.results import encode_result
from sqlaq.schema import JobStatus

if TYPE_CHECKING:
    from sqlaq.records import ClaimedJob
    from sqlaq.registry import Handler

__all__ = [
    "CANCELLED",
    "DONE",
    "LOST",
    "MAX_MESSAGE_LENGTH",
    "Outcome",
    "Verdict",
    "decide",
    "describe_error",
    "unwritable",
]

_log = logging.getLogger(__name__)

#: Frames of a handler's traceback kept in ``last_error`` (the innermost ones).
TRACEBACK_FRAMES = 8
#: Characters of an exception's ``Type: message`` line kept in ``last_error``.
MAX_MESSAGE_LENGTH = 2000


class Verdict(StrEnum):
    """What became of an attempt."""

    DONE = "done"  # the handler returned
    RETRY = "retry"  # it failed; queued again after a delay
    FAILED = "failed"  # it failed for good: no attempts left, or not retryable
    SNOOZED = "snoozed"  # it raised Snooze: queued again, attempt not counted
    LOST = "lost"  # the lease was gone: nothing written
    CANCELLED = "cancelled"  # cancelled while it ran: nothing written


#: The status each verdict leaves in the table (None: nothing is written).
_STATUS: dict[Verdict, JobStatus | None] = {
    Verdict.DONE: JobStatus.DONE,
    Verdict.RETRY: JobStatus.QUEUED,
    Verdict.FAILED: JobStatus.FAILED,
    Verdict.SNOOZED: JobStatus.QUEUED,
    Verdict.LOST: None,
    Verdict.CANCELLED: JobStatus.CANCELLED,
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One attempt's outcome: a value, decided once by :func:`decide`.

    Attributes:
        verdict: What became of the attempt.
        delay: For ``retry`` and ``snoozed``: how long until the job is due again
            (within ``[0, MAX_DURATION]``).
        error: For ``retry`` and ``failed``: the summary written to ``last_error``.
        exception: The exception the handler raised, if any (for tests and logs; never
            written).
        result: For ``done``: the handler's return value as JSON text, stored in the
            job's ``result`` column; None when it returned None.
    """

    verdict: Verdict
    delay: timedelta | None = None
    error: str | None = None
    exception: BaseException | None = None
    result: str | None = None

    @property
    def status(self) -> JobStatus | None:
        """The status this outcome leaves in the table; None for ``lost``."""
        return _STATUS[self.verdict]

    @property
    def writes(self) -> bool:
        """False for ``lost`` and ``cancelled``: nothing of the attempt is written."""
        return self.verdict not in (Verdict.LOST, Verdict.CANCELLED)


#: The handler returned (nothing to store).
DONE = Outcome(Verdict.DONE)
#: The lease was lost: nothing of the attempt is written.
LOST = Outcome(Verdict.LOST)
#: The job was cancelled while it ran: nothing of the attempt is written.
CANCELLED = Outcome(Verdict.CANCELLED)


def decide(
    handler: Handler | None,
    job: ClaimedJob,
    error: BaseException | None,
    returned: object = None,
) -> Outcome:
    """What an attempt of *job* that ended with *error* (None: returned *returned*) means.

    Pure but for the handler's own retry policy, which is called here (and guarded: a
    policy that raises is logged and the default backoff used).

    Args:
        handler: The job's handler; None when its kind has none (the job fails).
        job: The claimed job (its ``attempt`` and ``max_attempts``).
        error: What the handler raised, or None if it returned.
        returned: What it returned: None, or a JSON value stored as the job's result.
            A value that is not JSON fails the job (no retry: the same code would
            return the same value) rather than losing the result silently.
    """
    if handler is None:
        return Outcome(Verdict.FAILED, error=f"no handler for kind {job.kind!r}")
    if error is None:
        if returned is None:
            return DONE
        try:
            return Outcome(Verdict.DONE, result=encode_result(returned))
        except SqlaqError as exc:
            return Outcome(
                Verdict.FAILED, error=f"the handler's return value cannot be stored: {exc}"
            )
    if isinstance(error, Snooze):
        return Outcome(Verdict.SNOOZED, delay=clamp_duration(error.delay), exception=error)
    summary = describe_error(error)
    if job.attempt >= job.max_attempts or isinstance(error, PermanentError):
        return Outcome(Verdict.FAILED, error=summary, exception=error)
    try:
        delay = handler.retry_in(job.attempt, error)
    except Exception:
        # A broken policy must not lose the job: retry on the default backoff.
        _log.exception("retry policy of kind %r raised; using the default", job.kind)
        delay = DEFAULT_BACKOFF(job.attempt)
    if delay is None:
        return Outcome(Verdict.FAILED, error=summary, exception=error)
    return Outcome(Verdict.RETRY, delay=clamp_duration(delay), error=summary, exception=error)


def unwritable(outcome: Outcome, cause: str) -> Outcome:
    """The outcome written instead of *outcome* when the server refused to store it:
    the job fails for good, with *cause* in ``last_error`` (what was refused, and why)."""
    intended = outcome.verdict.value
    return Outcome(
        Verdict.FAILED,
        error=f"the {intended} outcome of this attempt could not be written: {cause}",
        exception=outcome.exception,
    )


def describe_error(error: BaseException) -> str:
    """``last_error`` for *error*: its ``Type: message`` line first (cut to
    :data:`MAX_MESSAGE_LENGTH` characters), then the innermost frames of its traceback
    (a summary for operators, not a full log)."""
    try:
        head = "".join(traceback.format_exception_only(error)).strip()
    except Exception:  # a __str__ that raises must not lose the outcome
        head = f"{type(error).__name__}: <str() of the exception raised>"
    if len(head) > MAX_MESSAGE_LENGTH:
        head = f"{head[:MAX_MESSAGE_LENGTH]}... ({len(head) - MAX_MESSAGE_LENGTH} more characters)"
    frames = traceback.format_tb(error.__traceback__, limit=-TRACEBACK_FRAMES)
    if not frames:
        return head
    return f"{head}\n\nTraceback (most recent call last):\n{''.join(frames)}".rstrip()
