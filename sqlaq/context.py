"""``sqlaq.current_job()``: what a running handler may know about its job.

This module owns the :class:`JobContext` a handler sees and the context variable that
carries it. The worker sets the variable around each call, in the handler's thread for a
sync handler and inside the task for an ``async`` one, so ``current_job()`` works in
both and never sees another job. It must not import the worker: the worker hands each
context the function that renews a lease.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextvars import ContextVar, Token
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlaq.lease import Lease

if TYPE_CHECKING:
    from sqlaq.records import ClaimedJob

__all__ = ["JobContext", "current_job"]

#: Renews one job's lease to ``now() + length`` and returns the new lease; raises
#: LeaseLostError when the lease is gone. Supplied by the worker.
LeaseRenewer = Callable[["JobContext", timedelta], Lease]

#: Held while a context's lease is replaced (the heartbeat's thread and the handler's).
_LEASE_LOCK = threading.Lock()

_CURRENT: ContextVar[JobContext | None] = ContextVar("sqlaq_current_job", default=None)


class JobContext:
    """The job a handler is running, as :func:`current_job` returns it.

    Attributes:
        id: The job's id.
        kind: Its kind.
        queue: The queue it was claimed from.
        attempt: This attempt's number (1 for the first run).
        max_attempts: How many attempts it may have in all.
        attempted_at: When this attempt started (the claim's ``now()``, database clock).
        key: The job's key (a tenant, an account: ``enqueue(..., key=...)``), or None.
        lease_length: The length the worker renews the lease by: the kind's ``lease=``
            or the worker's, until :meth:`extend_lease` is given another.
    """

    __slots__ = (
        "_cancelled",
        "_lease",
        "_renew",
        "_session",
        "attempt",
        "attempted_at",
        "id",
        "key",
        "kind",
        "lease_length",
        "max_attempts",
        "queue",
    )

    def __init__(
        self,
        id: int,  # the column's name, shadowing the builtin inside __init__ only
        kind: str,
        queue: str,
        attempt: int,
        max_attempts: int,
        lease: Lease,
        lease_length: timedelta,
        renew: LeaseRenewer,
        attempted_at: datetime | None = None,
        key: str | None = None,
    ) -> None:
        self.id = id
        self.kind = kind
        self.queue = queue
        self.attempt = attempt
        self.max_attempts = max_attempts
        self._lease = lease
        #: The lease length the worker's heartbeat keeps renewing for this job.
        self.lease_length = lease_length
        self._renew = renew
        self.attempted_at = attempted_at
        self.key = key
        self._cancelled = False
        self._session: Any = None

    @classmethod
    def for_job(cls, job: ClaimedJob, lease_length: timedelta, renew: LeaseRenewer) -> JobContext:
        """The context of the claimed *job*, renewing its lease with *renew*."""
        # Positional: built once per job, and keywords cost a worker twice as much.
        return cls(
            job.id,
            job.kind,
            job.queue,
            job.attempt,
            job.max_attempts,
            job.lease,
            lease_length,
            renew,
            job.attempted_at,
            job.key,
        )

    @property
    def lease(self) -> Lease:
        """The job's current lease, with the end last written by a renewal."""
        return self._lease

    @property
    def cancelled(self) -> bool:
        """True once the job was cancelled (``sqlaq.cancel``) while it runs.

        The worker learns it from the cancel's NOTIFY at once, or from its next lease
        renewal when the notification was missed. The result will not be written
        whatever the handler does now, so a long handler should check this between
        steps and return early. Nothing interrupts the handler for it.
        """
        return self._cancelled

    @property
    def session(self) -> Any:
        """The job's transaction, for a transactional handler (``transaction=True``, or
        a ``session`` parameter): a SQLAlchemy ``Session`` (``AsyncSession`` for an
        ``async`` handler) whose transaction also completes the job. None otherwise."""
        return self._session

    def _set_session(self, session: Any) -> None:
        self._session = session

    def _set_cancelled(self) -> None:
        # Called by the worker (another thread): one attribute store, atomic.
        self._cancelled = True

    def _set_lease(self, lease: Lease) -> None:
        # Called by the worker's heartbeat (another thread) and by extend_lease: the two
        # may renew at once, in either order, so the later end is kept (the database
        # keeps the later one too: a renewal never shortens a lease).
        with _LEASE_LOCK:
            if lease.expires_at >= self._lease.expires_at:
                self._lease = lease

    def extend_lease(self, length: timedelta | None = None) -> Lease:
        """Renew the lease now, to ``now() + length``, and keep that length from here on.

        A renewal never moves a lease's end earlier: asking for a shorter length than
        the one in use takes effect as the lease runs down (the heartbeat renews to
        ``now() + length`` once that is later than the current end).

        The worker renews every running job's lease on its own, so a handler needs this
        only before something that may stall longer than the lease (a long external
        call in a worker whose heartbeat may not get through), or to ask for a longer
        lease than its kind's. Runs one UPDATE on the worker's engine; in an ``async``
        handler use :meth:`extend_lease_async` so the event loop is not blocked.

        Args:
            length: The new lease length; default the current one.

        Returns:
            The renewed lease.

        Raises:
            LeaseLostError: the lease expired and the job was claimed again, or it was
                cancelled: stop working on it, its result will not be written.
        """
        if length is not None:
            self.lease_length = length
        lease = self._renew(self, self.lease_length)
        self._set_lease(lease)
        return lease

    async def extend_lease_async(self, length: timedelta | None = None) -> Lease:
        """:meth:`extend_lease` for ``async`` handlers: the UPDATE runs in a thread."""
        return await asyncio.to_thread(self.extend_lease, length)

    def __repr__(self) -> str:
        return (
            f"JobContext(id={self.id}, kind={self.kind!r}, queue={self.queue!r}, "
            f"attempt={self.attempt}/{self.max_attempts})"
        )


def current_job() -> JobContext:
    """The job the calling handler is running.

    Works in sync and ``async`` handlers, and in code they call (it is a context
    variable, so threads and tasks a handler starts itself see it only if they copy the
    context, as ``asyncio.create_task`` and ``asyncio.to_thread`` do).

    Raises:
        RuntimeError: called outside a handler run by a sqlaq worker.
    """
    job = _CURRENT.get()
    if job is None:
        raise RuntimeError("sqlaq.current_job() was called outside a job handler")
    return job


def bind(job: JobContext | None) -> Token[JobContext | None]:
    """Make *job* the current job in this context; returns a token for :func:`unbind`.

    For the worker (and :mod:`sqlaq.testing`), not for handlers.
    """
    return _CURRENT.set(job)


def unbind(token: Token[JobContext | None]) -> None:
    """Undo a :func:`bind`."""
    _CURRENT.reset(token)
