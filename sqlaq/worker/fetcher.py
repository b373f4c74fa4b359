"""The fetcher: which queues may have due jobs, and claiming them. Run thread only.

This module owns a worker's claims: the queues that may have due jobs (notified,
polled, or a slot of a limited kind freed), the round robin between them, the poll
schedule, and the claims themselves: each limited kind in a short transaction of its
own under the kind's lock (:func:`sqlaq.claim_limited`, for free slots only), then the
other kinds in one statement on a connection held in autocommit (a claim is one
statement: no BEGIN or COMMIT round trip). It hands claimed jobs back; starting them is
the worker's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import suppress
from time import monotonic
from uuid import UUID

from sqlalchemy import Connection, Engine

from sqlaq import ops
from sqlaq.config import WorkerConfig
from sqlaq.registry import Registry
from sqlaq.transient import is_transient
from sqlaq.worker.gates import KindGates

__all__ = ["Fetcher"]


class Fetcher:
    """Claims due jobs for one worker.

    Args:
        engine: The queue's database.
        registry: The handlers (their limits).
        config: The worker's options.
        worker_id: Written to ``locked_by`` of every claimed job.
        back_off: Called with a transient database error: waits before the next try.
        recovered: Called after a claim succeeded.
    """

    def __init__(
        self,
        engine: Engine,
        registry: Registry,
        config: WorkerConfig,
        worker_id: UUID,
        back_off: Callable[[BaseException], None],
        recovered: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._config = config
        self._worker_id = worker_id
        self._back_off = back_off
        self._recovered = recovered
        self._conn: Connection | None = None
        self._due: set[str] = set()  # queues that may have due jobs
        self._turn = 0
        self._next_poll = 0.0
        # Limited kinds (a concurrency limit or a rate) are claimed one kind at a time
        # under the kind's lock (ops.claim_limited); the plain claim skips them.
        self.gates = KindGates(registry)

    @property
    def due(self) -> bool:
        """True while some queue may have due jobs."""
        return bool(self._due)

    @property
    def blocked(self) -> bool:
        """True while a limited kind is held back (full, or its rate)."""
        return bool(self.gates.blocked)

    def woken(self, queues: Iterable[str]) -> None:
        """*queues* may have due jobs (a NOTIFY, a reconnect)."""
        queues = tuple(queues)
        self._due.update(queues)
        if self.gates:
            self.gates.woken(queues)

    def finished(self, kind: str, queue: str) -> None:
        """A job of *kind* ended here: if a limited kind's slot freed, claim it now."""
        if self.gates and self.gates.finished(kind):
            self._due.add(queue)

    def next_wake(self) -> float:
        """When to look again without being woken (``time.monotonic`` clock)."""
        next_try = self.gates.next_try()
        return self._next_poll if next_try is None else min(self._next_poll, next_try)

    def fetch(self, room: int, free: int, stopping: Callable[[], bool]) -> list[ops.ClaimedJob]:
        """Claim up to *room* jobs from the due queues, in turn; of limited kinds, only
        for the *free* slots (a job of a limited kind never waits in memory, so its
        claim is its start, what its limits count)."""
        claimed: list[ops.ClaimedJob] = []
        for queue in self._due_queues():
            jobs = self._fetch(queue, room - len(claimed), free - len(claimed))
            claimed += jobs
            if len(claimed) >= room or stopping():
                break
        return claimed

    def _due_queues(self) -> list[str]:
        now = monotonic()
        queues = self._config.queues
        if now >= self._next_poll:
            self.woken(queues)
            self._next_poll = now + self._config.poll_interval.total_seconds()
        if self.gates.blocked and self.gates.expire(now):
            self._due.update(queues)  # a rate window moved on, or a poll came
        # Round robin: each turn starts one queue further, so a queue that fills every
        # free slot cannot starve the others.
        start = self._turn % len(queues)
        self._turn += 1
        return [q for q in queues[start:] + queues[:start] if q in self._due]

    def _fetch(self, queue: str, room: int, free: int) -> list[ops.ClaimedJob]:
        claimed = self._fetch_limited(queue, min(room, free)) if self.gates and free > 0 else []
        if len(claimed) >= room:
            return claimed
        try:
            conn = self._connection()
            jobs = ops.claim(
                conn,
                worker_id=self._worker_id,
                queue=queue,
                limit=room - len(claimed),
                lease=self._config.lease,
                exclude_kinds=self.gates.kinds,
            )
            conn.commit()  # ends SQLAlchemy's own transaction; nothing is sent
        except Exception as exc:
            self.close()
            if not is_transient(exc):
                raise
            self._back_off(exc)
            return claimed
        self._recovered()
        if not jobs:
            self._due.discard(queue)
        return claimed + jobs

    def _fetch_limited(self, queue: str, room: int) -> list[ops.ClaimedJob]:
        """Claim the limited kinds' due jobs of *queue* within their limits."""
        taken: list[ops.ClaimedJob] = []
        for handler in self.gates.open(queue, monotonic()):
            if len(taken) >= room:
                break
            try:
                with self._engine.begin() as conn:
                    claimed = ops.claim_limited(
                        conn,
                        worker_id=self._worker_id,
                        kind=handler.kind,
                        queue=queue,
                        limit=room - len(taken),
                        lease=handler.lease or self._config.lease,
                        concurrency=handler.concurrency,
                        rate=handler.rate,
                    )
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._back_off(exc)
                return taken
            self._recovered()
            self.gates.record(
                queue,
                handler.kind,
                claimed,
                room - len(taken),
                now=monotonic(),
                poll=self._next_poll,
            )
            taken += claimed.jobs
        return taken

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def close(self) -> None:
        """Return the claim connection to the pool (which discards it if invalidated)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(Exception):  # a broken connection: nothing to do
                conn.close()
