"""A worker's bookkeeping of its limited kinds: which to claim now, and when again.

This module owns one worker's memory of why a limited kind (a concurrency limit or a
rate, see :mod:`sqlaq.limits`) was not worth claiming, so the worker does not open a
transaction and take the kind's lock on every turn for nothing. It runs no SQL and keeps
no clock of its own: the worker passes ``monotonic()`` readings. A kind is skipped:

* for a queue where its last claim found nothing due, until that queue is notified or
  polled (:meth:`KindGates.woken`);
* when it is **full** (its concurrency limit reached), until a job of it ends here
  (:meth:`KindGates.finished`), any queue is notified (a worker that ends a job of a
  limited kind notifies its queue), or the next poll;
* when its **rate** holds jobs back, until the window has moved on (the claim says when).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sqlaq.ops import LimitedClaim
from sqlaq.registry import Handler

__all__ = ["KindGates"]


class KindGates:
    """The limited kinds of one worker's registry, and when each is worth claiming.

    Args:
        handlers: Every handler of the registry; the limited ones are kept, by kind.
    """

    def __init__(self, handlers: Iterable[Handler]) -> None:
        #: The limited handlers, sorted by kind (the order claims take their locks in).
        self.handlers = sorted((h for h in handlers if h.limited), key=lambda h: h.kind)
        #: Their kinds: what the plain claim must skip.
        self.kinds = [h.kind for h in self.handlers]
        self._blocked: dict[str, float] = {}  # kind -> monotonic time to try again
        self._full: set[str] = set()  # kinds blocked by their concurrency limit
        self._empty: set[tuple[str, str]] = set()  # (queue, kind): nothing due

    def __bool__(self) -> bool:
        return bool(self.handlers)

    @property
    def blocked(self) -> bool:
        """True while some kind waits for its limit (jobs of it may be due)."""
        return bool(self._blocked)

    def next_try(self) -> float | None:
        """The soonest time a blocked kind is worth claiming again, or None."""
        return min(self._blocked.values()) if self._blocked else None

    def open(self, queue: str, now: float) -> list[Handler]:
        """The limited handlers worth claiming in *queue* at *now*."""
        return [
            h
            for h in self.handlers
            if (queue, h.kind) not in self._empty and self._blocked.get(h.kind, 0.0) <= now
        ]

    def record(
        self, queue: str, kind: str, claimed: LimitedClaim, wanted: int, now: float, poll: float
    ) -> None:
        """Remember why a claim of *kind* in *queue* took fewer than *wanted* jobs.

        Args:
            now: The time of the claim.
            poll: The worker's next poll: when a full kind is tried again at the latest.
        """
        if claimed.rate_wait is not None:
            self._blocked[kind] = now + claimed.rate_wait.total_seconds()
        elif claimed.full:
            self._full.add(kind)
            self._blocked[kind] = poll
        elif len(claimed.jobs) < wanted:
            self._empty.add((queue, kind))

    def finished(self, kind: str) -> bool:
        """A job of *kind* ended here; True if that reopens the kind (it was full)."""
        if kind not in self._full:
            return False
        self._full.discard(kind)
        self._blocked.pop(kind, None)
        return True

    def woken(self, queues: Collection[str]) -> None:
        """*queues* were notified or polled: look at them again, and at full kinds (a
        slot may have freed in another worker)."""
        for kind in self._full:
            self._blocked.pop(kind, None)
        self._full.clear()
        if self._empty:
            self._empty = {pair for pair in self._empty if pair[0] not in queues}

    def expire(self, now: float) -> bool:
        """Reopen the kinds whose wait is over; True if any was."""
        over = [kind for kind, until in self._blocked.items() if now >= until]
        for kind in over:
            del self._blocked[kind]
            self._full.discard(kind)
        return bool(over)
