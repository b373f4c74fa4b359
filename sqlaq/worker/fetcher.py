"""The fetcher: which queues may have due jobs, and claiming them. Run thread only.

This module owns a worker's claims: the queues that may have due jobs (notified,
polled, or a slot of a limited kind freed), the round robin between them, the poll
schedule, and the claims themselves: each limited kind in a short transaction of its
own under the kind's lock (:func:`sqlaq.claim_limited`, for free slots only), then the
other kinds in one statement on a connection held in autocommit (a claim is one
statement: no BEGIN or COMMIT round trip). It hands claimed jobs back; starting them is
the worker's.

The plain claim is bounded (:func:`sqlaq.ops.claiming.claim_bounded`): it starts at the
claim index's position of the last job claimed from the queue, so a snapshot held
elsewhere, which keeps the dead entries of every job claimed since, cannot slow it; the
insert trigger's NOTIFY moves the bound back to where new jobs sit, and a poll, a
reconnect or a notification without a position makes the next claim a full one
(``docs/explanation/held-snapshots.md``). It is run by
:class:`~sqlaq.worker.precompiled.Precompiled`: its statement compiled once to the
driver's SQL and executed on the psycopg cursor itself (prepared on the server at its
first run, unless the URL says ``prepare_threshold=none``), its rows read as tuples.
It skips SQLAlchemy's execution path, about a fifth of a millisecond of the GIL per
claim: a claim runs thousands of times a second in a drain, and once per wake-up.

A claim commits without waiting for its WAL flush (``relaxed``: the setting inside the
claim's statement, :func:`sqlaq.queries.relaxed_stmt`). The flush after an idle moment is most of a
wake-up on many disks (0.3 to several milliseconds, against 0.05 for the round trip),
and a claim lost to a crash of the server is a job run again, which the lease already
allows for: ``docs/explanation/delivery-guarantees.md``. What a job's handler makes of
it (a completion, a retry, its own writes in a transactional handler) commits as usual,
and flushes the claim before it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from time import monotonic
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, StatementError

from sqlaq import ops, queries
from sqlaq.bounds import BIGINT_MIN
from sqlaq.config import WorkerConfig
from sqlaq.drive import plan_of, run
from sqlaq.errors import ConfigError
from sqlaq.lease import Lease
from sqlaq.ops.claiming import claim_bounded, first_due
from sqlaq.queries import ClaimPosition
from sqlaq.registry import Registry
from sqlaq.transient import describe, is_transient
from sqlaq.worker.gates import KindGates
from sqlaq.worker.precompiled import Precompiled

__all__ = ["FULL_CLAIM_SPACING", "LOOK_BEHIND_STOP", "Fetcher", "parse_wake"]

_log = logging.getLogger(__name__)

#: A listening worker's poll looks behind its bounds only this many times the last
#: look's (or full claim's) duration after it: each walks the dead index entries a held
#: snapshot keeps (100 to 400 ms after 300,000 jobs), so they take at most 2 % of a
#: connection's time (and of a server core's). The worker's claims do not wait for a
#: look. Without such a snapshot a look takes a millisecond or two: each poll looks. (A
#: worker no NOTIFY reaches makes every poll's claim a full one instead: it has no other
#: way to find a job that became due behind its bound.)
FULL_CLAIM_SPACING = 50

#: How long a stopping worker waits for a look behind its bound to end, once it has
#: asked the server to cancel it (seconds).
LOOK_BEHIND_STOP = 5.0

#: A walk of the claim index from its start (a full claim, a look behind the bounds)
#: that took longer than this (seconds) says a held snapshot keeps dead entries there: a
#: listening worker then answers a notification without a position, or a reconnection
#: of its listener, with a look behind its bounds too (unspaced), not with a full claim
#: on its claiming thread. Below it, a full claim is quicker than a look (no hand-off);
#: without a held snapshot a full claim takes a millisecond or two.
SLOW_WALK = 0.005

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_wake(payload: str, queues: Collection[str]) -> tuple[str, ClaimPosition | None] | None:
    """What a notification on ``sqlaq_jobs`` says: which of *queues* has new due jobs,
    and the earliest place they may sit in the claim index (None: unknown, anywhere).

    The insert trigger (revision ``sqlaq_0008``) sends ``<queue> <priority> <run_at in
    microseconds since 1970>``: the highest priority and the earliest ``run_at`` of the
    due jobs one statement inserted into the queue, so no new job sits before
    ``(priority, run_at)``. Anything else naming a queue (the queue alone: sqlaq's other
    senders, an older trigger, ``NOTIFY sqlaq_jobs, 'q'`` by hand) gives no position.
    A payload that is exactly one of *queues* is that queue, whatever it holds. None:
    none of *queues*.
    """
    if payload in queues:
        return payload, None
    parts = payload.rsplit(" ", 2)
    if len(parts) != 3 or parts[0] not in queues:
        return None
    queue, priority, micros = parts
    try:
        return queue, ClaimPosition(
            int(priority),
            _EPOCH + timedelta(microseconds=int(micros)),
            BIGINT_MIN,  # below any id: before every job of its (priority, run_at)
        )
    except (ValueError, OverflowError):
        return queue, None


_CLAIM_FAIR = plan_of(ops.claim_fair)


class Fetcher:
    """Claims due jobs for one worker.

    Args:
        engine: The queue's database.
        registry: The handlers (their limits).
        config: The worker's options.
        worker_id: Written to ``locked_by`` of every claimed job.
        back_off: Called with a transient database error: waits before the next try.
        recovered: Called after a claim succeeded.
        found: Called, from another thread, with a queue and a position behind its
            bound where a look behind the bound found a due job (the worker hands it
            to :meth:`notified` on its run thread). None: a listening worker's poll
            drops the bounds instead (a full claim on the run thread).
    """

    def __init__(
        self,
        engine: Engine,
        registry: Registry,
        config: WorkerConfig,
        worker_id: UUID,
        back_off: Callable[[BaseException], None],
        recovered: Callable[[], None],
        found: Callable[[str, ClaimPosition], None] | None = None,
    ) -> None:
        self._engine = engine
        self._found = found
        self._behind: threading.Thread | None = None  # the look behind the bounds
        self._behind_cancel: Callable[[], None] | None = None  # cancels its query
        # The queues to look behind, taken by the look's thread until none are left; the
        # lock makes "add, and start a thread if none runs" and "none left, so end" one
        # step each, so no request is left without a thread to take it.
        self._to_look: set[str] = set()
        self._look_lock = threading.Lock()
        self._halt = False  # stop(): the look's thread ends after its current query
        self._walk = 0.0  # how long the last full claim or look took (seconds)
        self._config = config
        self._worker_id = worker_id
        self._back_off = back_off
        self._recovered = recovered
        self._conn: Connection | None = None
        self._precompiled = Precompiled()
        self._due: set[str] = set()  # queues that may have due jobs
        # Queues set aside while their limited kinds were claimed only for the free slots
        # (never ahead): due again as soon as a job ends here and frees a slot.
        self._capped: set[str] = set()
        self._turn = 0
        self._next_poll = 0.0
        self._short_ends_due = config.listen and not config.burst
        # Per queue, the claim index's position of the last job claimed there: the next
        # claim starts after it (a bounded claim), not at the queue's first entry, so it
        # never walks the dead entries of the jobs claimed before, which a snapshot held
        # elsewhere keeps from being cleaned up. No entry: the next claim is a full one.
        # A job that becomes due before the bound (a late commit, an expired lease, a
        # row that was locked) is found when its NOTIFY lowers the bound, or at a poll:
        # a listening worker looks behind its bounds on another connection, off the
        # claiming thread (found), one that is not drops them (a full claim).
        self._bounds: dict[str, ClaimPosition] = {}
        self._next_full = 0.0  # a poll looks behind from then on (FULL_CLAIM_SPACING)
        # Limited kinds (a concurrency limit or a rate) are claimed one kind at a time
        # under the kind's lock (ops.claim_limited); the plain claim skips them.
        self.gates = KindGates(registry)
        self._limited = bool(self.gates)  # asked once per finished job
        # Worker affinity: the clauses every claim carries, made once (the claims built
        # around them are cached by their identity, so each is compiled once); () for
        # none, which leaves the claims as they are without it.
        where = config.where
        if isinstance(where, str):
            where = (queries.where_text(where),)
        self._where: tuple[Any, ...] = tuple(where or ())
        self._where_checked = not self._where
        self._weights = dict(config.key_weights)  # of the fair queues' keys
        if self._where:
            queries.where_check_stmt(where=list(self._where))  # ConfigError: another table

    def check_where(self) -> None:
        """Run the worker's ``where`` against the jobs table once (``LIMIT 0``: no row is
        read), so an expression that does not compile or type-check stops the worker
        at its start with one line. A transient error leaves the check to the first
        claim.

        Raises:
            ConfigError: the database refused the expression.
        """
        if self._where_checked:
            return
        try:
            with self._engine.connect() as conn:
                conn.execute(queries.where_check_stmt(where=list(self._where))).all()
        except DBAPIError as exc:
            if is_transient(exc):
                return
            raise ConfigError(
                f"{self._where_shown()} does not run against the jobs table: {_primary(exc)}"
            ) from None
        except StatementError as exc:  # e.g. a clause with a bind parameter without value
            raise ConfigError(
                f"{self._where_shown()} does not run against the jobs table: {exc.orig}"
            ) from None
        self._where_checked = True

    def _where_failed(self, error: BaseException) -> None:
        """A claim failed on a data error (SQLSTATE class 22: a cast of a job's value,
        a division by zero...): with a ``where``, the expression met a row it cannot
        evaluate. Raise that as one line; any other error is left to the caller.

        Raises:
            ConfigError: it was the condition's.
        """
        orig = getattr(error, "orig", None) or error
        if self._where and str(getattr(orig, "sqlstate", "") or "").startswith("22"):
            raise ConfigError(
                f"{self._where_shown()} failed on a job: {_primary(error)}; make it hold "
                "(true or false) for every row, e.g. test the value's form before a cast"
            ) from None

    def _where_shown(self) -> str:
        where = self._config.where
        if not isinstance(where, str):
            return "where"
        shown = repr(where)
        return f"where {shown if len(shown) <= 80 else shown[:76] + '...' + shown[0]}"

    @property
    def due(self) -> bool:
        """True while some queue may have due jobs."""
        return bool(self._due)

    @property
    def blocked(self) -> bool:
        """True while a limited kind is held back (full, or its rate)."""
        return bool(self.gates.blocked)

    def woken(self, queues: Iterable[str], *, full: bool = True) -> None:
        """*queues* may have due jobs anywhere (a poll, a NOTIFY without a position, a
        reconnect): their next claims are full ones (unless not *full*: they may have
        due jobs after their bounds). A listening worker whose last walk of the claim
        index was slow (:data:`SLOW_WALK`: a held snapshot keeps dead entries) looks
        behind its bounds instead, on another connection, and keeps claiming from them."""
        queues = tuple(queues)
        self._due.update(queues)
        if full:
            if self._found is not None and self._short_ends_due and self._walk > SLOW_WALK:
                self._look([queue for queue in queues if queue in self._bounds])
            else:
                for queue in queues:
                    self._bounds.pop(queue, None)
        if self.gates:
            self.gates.woken(queues)

    def notified(self, queue: str, position: ClaimPosition | None) -> None:
        """*queue* has new due jobs, none before *position* in the claim index (None:
        anywhere, as :meth:`woken`): the queue's bound moves back to it, if it is past."""
        if position is None:
            self.woken((queue,))
            return
        bound = self._bounds.get(queue)
        if bound is not None and position.key() < bound.key():
            self._bounds[queue] = position
        self._due.add(queue)
        if self.gates:
            self.gates.woken((queue,))

    def finished(self, kind: str, queue: str) -> None:
        """A job of *kind* ended here: if a limited kind's slot freed, or *queue*'s limited
        kinds wait for a free slot of this worker, claim now."""
        if self._limited and (self.gates.finished(kind) or queue in self._capped):
            self._capped.discard(queue)
            self._due.add(queue)

    def next_wake(self) -> float:
        """When to look again without being woken (``time.monotonic`` clock)."""
        next_try = self.gates.next_try()
        return self._next_poll if next_try is None else min(self._next_poll, next_try)

    def fetch(self, room: int, free: int, stopping: Callable[[], bool]) -> list[ops.ClaimedJob]:
        """Claim up to *room* jobs from the due queues, in turn; of limited kinds, only
        for the *free* slots (a job of a limited kind never waits in memory, so its
        claim is its start, what its limits count)."""
        if not self._where_checked:
            self.check_where()  # not at the start: the database was away then
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
            self._poll(queues, now)
            self._next_poll = now + self._config.poll_interval.total_seconds()
        if self.gates.blocked and self.gates.expire(now):
            self._due.update(queues)  # a rate window moved on, or a poll came
        # Round robin: each turn starts one queue further, so a queue that fills every
        # free slot cannot starve the others.
        start = self._turn % len(queues)
        self._turn += 1
        return [q for q in queues[start:] + queues[:start] if q in self._due]

    def _poll(self, queues: tuple[str, ...], now: float) -> None:
        """The poll: every queue may have due jobs. Behind the bounds, where a job may
        have become due without a NOTIFY that says where (an expired lease, a row that
        was locked, a NOTIFY turned off), a listening worker looks on a connection of
        its own while its claims go on from the bounds: the look walks the dead entries
        a held snapshot keeps, and a claim that walked them would delay every job due
        meanwhile. Other workers drop the bounds (a full claim)."""
        if self._found is None or not self._short_ends_due:
            self.woken(queues, full=now >= self._next_full)
            return
        self.woken(queues, full=False)
        if now >= self._next_full:
            self._look([queue for queue in queues if queue in self._bounds])

    def _look(self, queues: list[str]) -> None:
        """Look behind the bounds of *queues* on a connection of its own: in the look's
        thread, started unless one runs (it takes these too before it ends)."""
        found = self._found
        if not queues or found is None:
            return
        with self._look_lock:
            self._to_look.update(queues)
            self._halt = False
            if self._behind is not None:
                return
            self._behind = threading.Thread(
                target=self._look_behind, args=(found,), name="sqlaq-look-behind", daemon=True
            )
            self._behind.start()

    def _look_behind(self, found: Callable[[str, ClaimPosition], None]) -> None:
        """In its own thread: find the first due job of each queue asked for, until none
        is left, and report its position to *found* (:meth:`notified` moves a bound back
        to it, if it is behind)."""
        try:
            with self._engine.connect() as conn:
                self._behind_cancel = conn.connection.driver_connection.cancel  # type: ignore[union-attr]
                while True:
                    with self._look_lock:
                        queues, self._to_look = self._to_look, set()
                        if not queues:
                            self._behind = None
                            return
                    for queue in sorted(queues):
                        if self._halt:
                            break
                        started = monotonic()
                        position = run(
                            conn,
                            first_due(
                                queue=queue, exclude_kinds=self.gates.kinds, where=self._where
                            ),
                        )
                        conn.rollback()
                        ended = monotonic()
                        self._walk = ended - started
                        self._next_full = ended + FULL_CLAIM_SPACING * self._walk
                        if position is not None:  # a bounded claim starts after its position
                            found(queue, position._replace(id=position.id - 1))
        except Exception as exc:  # the next poll looks again
            _log.debug("could not look behind the claim bounds: %s", describe(exc))
            with self._look_lock:
                self._to_look.clear()
                self._behind = None
        finally:
            self._behind_cancel = None

    def _fetch(self, queue: str, room: int, free: int) -> list[ops.ClaimedJob]:
        limited = min(room, free)  # a limited kind is claimed for free slots only
        claimed = self._fetch_limited(queue, limited) if self.gates and free > 0 else []
        if len(claimed) >= room:
            return claimed
        try:
            conn = self._connection()
            if queue in self._config.fair:  # shared fairly across the queue's keys
                plan = _CLAIM_FAIR(
                    worker_id=self._worker_id,
                    queue=queue,
                    limit=room - len(claimed),
                    lease=self._config.lease,
                    weights=self._weights,
                    exclude_kinds=self.gates.kinds,
                    where=self._where,
                )
                jobs = self._precompiled.run(conn, plan, relaxed=True)
            else:
                jobs = self._claim(conn, queue, room - len(claimed))
            conn.commit()  # ends SQLAlchemy's own transaction, if any; nothing is sent
        except Exception as exc:
            self.close()
            if not is_transient(exc):
                self._where_failed(exc)
                raise
            self._back_off(exc)
            return claimed
        self._recovered()
        if not jobs or (self._short_ends_due and len(jobs) < room - len(claimed)):
            # Nothing more is due there now. With LISTEN on, a claim that came back
            # short says so as well as an empty one would: the worker waits for a
            # NOTIFY (or the poll) instead of asking again at once, which would cost a
            # round trip and a commit and delay the jobs just claimed (this thread
            # holds the GIL until it blocks on that claim). A burst worker asks until a
            # claim comes back empty (its stop), so jobs enqueued meanwhile are not left.
            self._due.discard(queue)
            if limited < room and self.gates and self.gates.open(queue, monotonic()):
                # Its limited kinds may have more, held back only by this worker's free
                # slots (a prefetching worker's room is larger): look again when a slot
                # frees, not only at the next poll (a burst worker would have stopped).
                self._capped.add(queue)
        return claimed + jobs

    def _claim(self, conn: Connection, queue: str, limit: int) -> list[ops.ClaimedJob]:
        """The plain claim of *queue*, from its bound (see ``_bounds``). A bounded claim
        that comes back empty is followed at once by a full one where no NOTIFY would
        tell of a job before the bound (a burst worker, one that only polls): their
        "nothing is due" stays the whole queue's."""
        after = self._bounds.get(queue)
        while True:
            started = monotonic()
            plan = claim_bounded(
                worker_id=self._worker_id,
                queue=queue,
                limit=limit,
                lease=self._config.lease,
                after=after,
                exclude_kinds=self.gates.kinds,
                where=self._where,
            )
            jobs, position = self._precompiled.run(conn, plan, relaxed=True)
            if after is None and self._short_ends_due:  # listening: NOTIFYs tell the rest
                ended = monotonic()
                self._walk = ended - started
                self._next_full = ended + FULL_CLAIM_SPACING * self._walk
            if position is not None:
                self._bounds[queue] = position
                return jobs
            if after is None or self._short_ends_due:
                return jobs
            after = None
            self._bounds.pop(queue, None)

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
                        where=self._where,
                        key_concurrency=handler.key_concurrency,
                        ordered=handler.ordered,
                    )
            except Exception as exc:
                if not is_transient(exc):
                    self._where_failed(exc)
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

    def hand_back(self, leases: list[Lease]) -> list[int]:
        """Hand *leases*' jobs back (:func:`sqlaq.handback`) on the claim connection if
        one is held (the writer may have none: a server at ``max_connections``), else
        on a connection of the pool; return the ids handed back."""
        if self._conn is None:
            with self._engine.begin() as conn:
                return ops.handback(conn, leases, raise_on_lost=False)
        try:
            handed = ops.handback(self._conn, leases, raise_on_lost=False)
            self._conn.commit()  # ends SQLAlchemy's own transaction; nothing is sent
        except Exception:
            self.close()
            raise
        return handed

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def stop(self) -> None:
        """Cancel a look behind the bounds still running and wait for its thread (at
        most :data:`LOOK_BEHIND_STOP`), then :meth:`close`: the worker is stopping."""
        with self._look_lock:
            self._to_look.clear()
            self._halt = True
            behind, cancel = self._behind, self._behind_cancel
        if behind is not None:
            if cancel is not None:
                with suppress(Exception):  # ended meanwhile, or a connection gone
                    cancel()
            behind.join(LOOK_BEHIND_STOP)
        self.close()

    def close(self) -> None:
        """Return the claim connection to the pool (which discards it if invalidated)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(Exception):  # a broken connection: nothing to do
                conn.close()


def _primary(error: BaseException) -> str:
    """The server's primary message of *error* (without its ``LINE 1: ...`` context)."""
    orig = getattr(error, "orig", None) or error
    diag = getattr(orig, "diag", None)
    return getattr(diag, "message_primary", None) or describe(error)
