"""Claim: taking due jobs under a lease (the plain and the bounded claim), the first job
a claim would take, the ``where=`` clauses that narrow a claim, and the relaxed commit
of a claim's transaction.

The lock, limit state, rate log and keyed candidates of limited kinds are
:mod:`sqlaq.queries.limited`'s; the fair claim across a queue's keys is
:mod:`sqlaq.queries.fair`'s. Both build on this module (the claim's UPDATE, the
``where=`` check); it imports neither."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, TypeVar
from uuid import UUID

from sqlalchemy import (
    BigInteger,
    Boolean,
    ClauseElement,
    ColumnElement,
    FromClause,
    Integer,
    Interval,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    case,
    exists,
    func,
    literal_column,
    null,
    select,
    text,
    tuple_,
    type_coerce,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, TIMESTAMP
from sqlalchemy.dialects.postgresql import UUID as PG_UUID

from sqlaq.bounds import SMALLINT_MAX
from sqlaq.errors import ConfigError
from sqlaq.queries._common import (
    _IDS,
    _NOW,
    _PENDING,
    _RUNNING,
    _expired_error,
    _status,
    c,
)
from sqlaq.queries.columns import CLAIM_COLUMNS
from sqlaq.schema import (
    JobStatus,
    jobs,
    paused_queues,
)


class ClaimPosition(NamedTuple):
    """A place in the claim index's order (``priority DESC, run_at, id``): where a
    bounded claim (:func:`claim_stmt` with ``bounded=True``) starts.

    The worker keeps, per queue, the position of the last job it claimed (its
    ``run_at`` as it was before the claim) and claims from there on; see
    :mod:`sqlaq.worker.fetcher`.

    Attributes:
        priority: The job's priority.
        run_at: Its ``run_at`` when it was claimed (the claim writes the lease's end
            there).
        id: Its id.
    """

    priority: int
    run_at: datetime
    id: int

    def key(self) -> tuple[int, datetime, int]:
        """A key that sorts positions in the index's order (the earliest first)."""
        return (-self.priority, self.run_at, self.id)


#: The bound of a full claim: a priority above any ``smallint``, so the claim's first
#: range (``priority = :b_priority``) is empty and its second (``priority <
#: :b_priority``) is the whole queue, in the index's order.
FULL_CLAIM = ClaimPosition(SMALLINT_MAX + 1, datetime(1, 1, 1, tzinfo=UTC), 0)


def claim_params(
    *,
    queue: str,
    worker_id: UUID,
    limit: int,
    lease: timedelta,
    kind: str | None = None,
    exclude_kinds: Collection[str] = (),
    ids: Sequence[int] | None = None,
    after: ClaimPosition | None = None,
) -> dict[str, Any]:
    """The bind values of :func:`claim_stmt` (built with the same *kind*,
    *exclude_kinds* or *ids* choice: each variant is a statement of its own). *after* is
    the position a bounded claim starts after (:data:`FULL_CLAIM` when None); a claim
    built without ``bounded`` ignores it."""
    params = {"b_queue": queue, "b_worker": worker_id, "b_limit": limit, "b_lease": lease}
    if kind is not None:
        params["b_kind"] = kind
    if exclude_kinds:
        params["b_excluded"] = sorted(exclude_kinds)
    if ids is not None:
        params["b_ids"] = list(ids)
    if after is not None:
        params["b_priority"], params["b_run_at"], params["b_id"] = after
    return params


def claim_stmt(
    *,
    queue: str,
    worker_id: UUID,
    limit: int,
    lease: timedelta,
    kind: str | None = None,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
    ids: bool = False,
    bounded: bool = False,
) -> Update:
    """Claim up to *limit* due jobs of *queue*, in priority order; never more.

    With *kind*, only jobs of that kind (``AND kind = :b_kind``): the claim of a limited
    kind, run under :func:`lock_kind_stmt`. With *exclude_kinds*, jobs of any other kind
    (``AND kind <> ALL(:b_excluded)``): the claim that must not bypass those limits.
    With *ids*, only the jobs whose ids are bound as ``b_ids`` (``AND id = ANY(:b_ids)``):
    the claim of a keyed kind, whose jobs were picked by :func:`keyed_candidates_stmt`
    under the kind's lock (a picked job no longer due is not claimed).

    *where* narrows the claim (worker affinity): one boolean clause, or a sequence of
    them, over :data:`sqlaq.jobs` columns, e.g. ``jobs.c.payload["region"].astext ==
    "eu"``. The clauses land inside the locking CTE, beside the due-job predicate, so
    only matching rows are locked and claimed. (``claim_stmt(...).where(...)`` would
    filter the UPDATE after the CTE had locked and counted other rows: fewer jobs
    claimed, and rows of other workers locked until commit.) A clause may use another
    table only inside a subquery (``EXISTS``/``IN``); the CTE's FROM stays
    ``sqlaq_jobs``.

    Raises:
        ConfigError: *where* is not a SQLAlchemy clause, or brings another table into
            the claim's FROM.

    Renders::

        WITH candidates AS MATERIALIZED (
            SELECT id FROM sqlaq_jobs
            WHERE status IN ('queued', 'running') AND queue = :b_queue AND run_at <= now()
              AND NOT EXISTS (SELECT * FROM sqlaq_paused_queues
                              WHERE sqlaq_paused_queues.queue = :b_queue)
            ORDER BY priority DESC, run_at, id LIMIT :b_limit FOR UPDATE SKIP LOCKED)
        UPDATE sqlaq_jobs SET status = 'running', attempts = attempts + 1,
            locked_by = :b_worker, lease_token = gen_random_uuid(), run_at = now() + :b_lease
        FROM candidates WHERE sqlaq_jobs.id = candidates.id
            AND sqlaq_jobs.id = ANY (ARRAY(SELECT candidates.id FROM candidates))
        RETURNING ...

    A paused queue (a row in ``sqlaq_paused_queues``, see :mod:`sqlaq.control`) gives
    nothing: its jobs stay as they are until it is resumed.

    A due ``running`` row is a job whose lease expired. If it has attempts left it is
    claimed again (``last_error`` records the expiry). If it was on its last attempt it
    is marked ``failed`` in the same statement with a ``last_error`` saying the lease
    expired, and returned with status ``failed`` so the caller can skip it: a job that
    kills its worker every time ends failed and never loops.

    **Bounded** (``bounded=True``, the worker's claim): the claim starts after a
    position of the claim index, ``(:b_priority, :b_run_at, :b_id)`` (a
    :class:`ClaimPosition`, from :func:`claim_params`'s *after*), instead of at the
    queue's first entry, in two ranges of the index taken in order::

        WITH at_bound AS MATERIALIZED (SELECT id, priority, run_at FROM sqlaq_jobs
            WHERE <as above> AND priority = :b_priority
              AND (run_at, id) > (:b_run_at, :b_id)
            ORDER BY priority DESC, run_at, id LIMIT :b_limit FOR UPDATE SKIP LOCKED),
        below AS MATERIALIZED (SELECT id, priority, run_at FROM sqlaq_jobs
            WHERE <as above> AND priority < :b_priority
            ORDER BY priority DESC, run_at, id
            LIMIT :b_limit - (SELECT count(*) FROM at_bound) FOR UPDATE SKIP LOCKED),
        candidates AS (SELECT * FROM at_bound UNION ALL SELECT * FROM below)
        UPDATE sqlaq_jobs SET <as above>
        WHERE sqlaq_jobs.id = ANY (ARRAY(SELECT candidates.id FROM candidates))
        RETURNING ..., <the last candidate's priority, run_at, id>

    Both bounds are index conditions: the scan starts at the position and never
    visits the entries before it, the dead entries of the jobs claimed before, which a
    snapshot held elsewhere keeps from being cleaned up (each would cost a heap fetch).
    ``below`` runs only when ``at_bound`` gave fewer than *limit* (a ``LIMIT 0`` reads
    nothing). The last three columns returned, the same on every row, are the
    position of the last candidate in the index's order (its ``run_at`` as it was
    before the claim overwrote it): where the next claim starts.
    :data:`FULL_CLAIM` as the position claims from the queue's first entry.
    """
    v = claim_params(queue=queue, worker_id=worker_id, limit=limit, lease=lease)
    due = _due(queue, kind=kind, exclude_kinds=exclude_kinds, where=where, ids=ids)
    limit_ = bindparam("b_limit", v["b_limit"], Integer)
    if bounded:
        candidates = _bounded_candidates(due, limit_)
    else:
        candidates = (
            select(c.id)
            .where(*due)
            .order_by(c.priority.desc(), c.run_at, c.id)
            .limit(limit_)
            .with_for_update(skip_locked=True)
            .cte("candidates")
            .prefix_with("MATERIALIZED")
        )
    return _claim_update(candidates, v, bounded=bounded)


def _due(
    queue: str,
    *,
    kind: str | None = None,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
    ids: bool = False,
) -> tuple[ColumnElement[bool], ...]:
    """What makes a job a claim's candidate (see :func:`claim_stmt`): due in the queue
    bound as ``b_queue``, the queue not paused, the kind filters, *where*."""
    which: list[ColumnElement[bool]] = []
    if kind is not None:
        which.append(c.kind == bindparam("b_kind", kind, Text))
    if exclude_kinds:
        excluded = bindparam("b_excluded", sorted(exclude_kinds), ARRAY(Text))
        which.append(c.kind != func.all(excluded))
    if ids:
        which.append(c.id == func.any(bindparam("b_ids", [], _IDS)))
    narrowed = _where_clauses(where)
    queue_ = bindparam("b_queue", queue, Text)
    return (
        _PENDING,
        c.queue == queue_,
        c.run_at <= _NOW,
        # Uncorrelated, so PostgreSQL runs it once per claim (an InitPlan: one probe
        # of the paused table's primary key) and skips the claim index's walk
        # altogether while the queue is paused (a one-time filter).
        ~exists().where(paused_queues.c.queue == queue_),
        *which,
        *narrowed,
    )


def first_due_params(*, queue: str, exclude_kinds: Collection[str] = ()) -> dict[str, Any]:
    """The bind values of :func:`first_due_stmt`."""
    params: dict[str, Any] = {"b_queue": queue}
    if exclude_kinds:
        params["b_excluded"] = sorted(exclude_kinds)
    return params


def first_due_stmt(
    *,
    queue: str,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Select[Any]:
    """The claim index's position of the first job a claim of *queue* would take (the
    same candidates as :func:`claim_stmt` with *exclude_kinds* and *where*), read
    without a lock: where a worker's look behind its bound finds a job that became due
    there (:mod:`sqlaq.worker.fetcher`).

    Renders ``SELECT priority, run_at, id FROM sqlaq_jobs WHERE <the claim's
    candidates> ORDER BY priority DESC, run_at, id LIMIT 1``: the walk of a full claim,
    dead entries a held snapshot keeps included, on a connection of its own instead of
    the claiming one.
    """
    return (
        select(c.priority, c.run_at, c.id)
        .where(*_due(queue, exclude_kinds=exclude_kinds, where=where))
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(literal_column("1", Integer))
    )


def _claim_update(candidates: Any, v: dict[str, Any], *, bounded: bool = False) -> Update:
    """The claim's UPDATE of the jobs whose ids the materialized CTE *candidates* holds
    (locked by it), returning :data:`CLAIM_COLUMNS` (see :func:`claim_stmt`); *bounded*:
    the bounded claim's, found by id alone and returning the last candidate's position
    too."""
    exhausted = and_(_RUNNING, c.attempts >= c.max_attempts)
    expired_error = _expired_error()
    reclaimed_error = _expired_error("claimed again")
    # The join alone lets the planner hash the whole table when the limit is large and
    # the table small (a 200-row claim beside 20,000 queued rows: a seq scan, 7.3 ms);
    # "id = ANY(ARRAY(<the candidates>))" hands it the ids as an index condition, read
    # once from the materialized CTE (an InitPlan, never re-run per row): 2.5 ms.
    picked = func.any(func.array(select(candidates.c.id).scalar_subquery()))
    # A bounded claim has no join to its candidates (nothing of theirs is returned per
    # row, see _last_position): the UPDATE finds its rows by id alone.
    joined = () if bounded else (c.id == candidates.c.id,)
    return (
        update(jobs)
        .where(*joined, c.id == picked)
        .values(
            status=case((exhausted, _status(JobStatus.FAILED)), else_=_status(JobStatus.RUNNING)),
            attempts=case((exhausted, c.attempts), else_=c.attempts + literal_column("1", Integer)),
            locked_by=case(
                (exhausted, null()),
                else_=bindparam("b_worker", v["b_worker"], PG_UUID(as_uuid=True)),
            ),
            lease_token=case((exhausted, null()), else_=func.gen_random_uuid()),
            run_at=case(
                (exhausted, c.run_at), else_=_NOW + bindparam("b_lease", v["b_lease"], Interval)
            ),
            finished_at=case((exhausted, _NOW), else_=null()),
            attempted_at=case((exhausted, c.attempted_at), else_=_NOW),
            last_error=case(
                (exhausted, expired_error),
                (_RUNNING, reclaimed_error),
                else_=c.last_error,
            ),
        )
        .returning(*CLAIM_COLUMNS, *(_last_position(candidates) if bounded else ()))
    )


def _last_position(candidates: Any) -> tuple[ColumnElement[Any], ...]:
    """The claim index's position of the last of a bounded claim's *candidates* (its
    priority, its run_at before the claim, its id): three uncorrelated subqueries over
    the CTE, each run once (an InitPlan), the same on every row returned.

    Not the candidates' run_at per row through a join: PostgreSQL joined the UPDATE to a
    UNION ALL of CTEs with a nested loop over a materialized list, n x n/2 comparisons
    (14 ms of a 16 ms claim of 300)."""
    last = candidates.c
    order = (last.priority.asc(), last.run_at.desc(), last.id.desc())
    return tuple(
        select(column)
        .order_by(*order)
        .limit(literal_column("1", Integer))
        .scalar_subquery()
        .label(f"last_{column.name}")
        for column in (last.priority, last.run_at, last.id)
    )


def _bounded_candidates(due: Sequence[ColumnElement[bool]], limit: Any) -> Any:
    """The candidates of a bounded claim (see :func:`claim_stmt`): the rest of the
    bound's priority after the bound, then the lower priorities, as one CTE."""
    first = FULL_CLAIM
    priority = bindparam("b_priority", first.priority, Integer)
    after = tuple_(
        bindparam("b_run_at", first.run_at, TIMESTAMP(timezone=True)),
        bindparam("b_id", first.id, BigInteger),
    )
    order = (c.priority.desc(), c.run_at, c.id)
    at_bound = (
        select(c.id, c.priority, c.run_at)
        .where(*due, c.priority == priority, tuple_(c.run_at, c.id) > after)
        .order_by(*order)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("at_bound")
        .prefix_with("MATERIALIZED")
    )
    # What the first range left of the limit: 0 when it gave all (LIMIT 0 reads nothing).
    left = limit - select(func.count()).select_from(at_bound).scalar_subquery()
    below = (
        select(c.id, c.priority, c.run_at)
        .where(*due, c.priority < priority)
        .order_by(*order)
        .limit(left)
        .with_for_update(skip_locked=True)
        .cte("below")
        .prefix_with("MATERIALIZED")
    )
    return select(at_bound).union_all(select(below)).cte("candidates").prefix_with("MATERIALIZED")


def _where_clauses(
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]],
) -> list[ColumnElement[bool]]:
    """*where* as a list of clauses over ``sqlaq_jobs`` alone (see :func:`claim_stmt`)."""
    clauses = list(where) if isinstance(where, Sequence) else [where]
    for clause in clauses:
        if not isinstance(clause, ClauseElement) or isinstance(clause, FromClause):
            raise ConfigError(
                f"where must be a SQLAlchemy boolean clause (or a sequence of them) over "
                f"sqlaq.jobs columns, got {type(clause).__name__}: e.g. "
                "sqlaq.jobs.c.payload['region'].astext == 'eu'"
            )
    if clauses:
        froms = select(c.id).where(*clauses).get_final_froms()
        others = [f for f in froms if f is not jobs]
        if others:
            names = ", ".join(sorted(str(getattr(f, "name", f)) for f in others))
            raise ConfigError(
                f"where uses {names} beside sqlaq_jobs: a claim reads sqlaq_jobs only; "
                "test other tables inside a subquery, e.g. exists().where(...)"
            )
    return clauses


def where_text(expression: str) -> ColumnElement[bool]:
    """An operator's SQL boolean *expression* over ``sqlaq_jobs`` columns as a clause for
    ``where=`` (the ``sqlaq-worker --where`` option), e.g. ``payload->>'region' = 'eu'``.

    The text is SQL, sent as written (``sqlalchemy.text()``): configuration of the
    operator's, trusted as a database URL is, never text from a job or a user. It is
    parenthesised, on a line of its own, so an ``OR`` in it (or a trailing ``--``
    comment) cannot reach beyond it once AND-ed into a claim; a colon in it is a colon,
    never a bind parameter (``payload->>'at' > '12:30'``, ``payload::text``).
    """
    escaped = expression.replace(":", "\\:")
    return type_coerce(text(f"({escaped}\n)"), Boolean)


def where_check_stmt(*, where: ColumnElement[bool] | Sequence[ColumnElement[bool]]) -> Select[Any]:
    """Check that *where* runs against ``sqlaq_jobs``: ``SELECT id FROM sqlaq_jobs WHERE
    <where> LIMIT 0``. PostgreSQL parses, resolves and types the clauses (an unknown
    column, a type mismatch, a syntax error fail here) without reading a row.

    Raises:
        ConfigError: *where* is not a SQLAlchemy clause, or uses another table beside
            ``sqlaq_jobs`` (see :func:`claim_stmt`).
    """
    return select(c.id).where(*_where_clauses(where)).limit(literal_column("0", Integer))


def relaxed_commit_stmt() -> Select[Any]:
    """Let the current transaction commit without waiting for its WAL to reach the disk.

    Renders ``SELECT set_config('synchronous_commit', 'off', true)``: the setting lasts
    until the transaction ends, so run it first in the transaction it is meant for. A
    commit then returns before its flush; PostgreSQL's WAL writer flushes it within ``3
    x wal_writer_delay`` (600 ms by default), and any later synchronous commit of any
    session flushes it first. Only a crash of the server in between undoes the
    transaction, never anything after it. The worker's claims commit so (inside the
    claim itself, see :func:`relaxed_stmt`): a claim undone that way leaves its job
    queued as before, to run again, exactly as the job of a worker that crashed
    (``docs/explanation/delivery-guarantees.md``).
    """
    return select(
        func.set_config(
            literal_column("'synchronous_commit'", Text),
            literal_column("'off'", Text),
            literal_column("true", Boolean),
        )
    )


_U = TypeVar("_U", bound=Update)


def relaxed_stmt(statement: _U) -> _U:
    """*statement* (an UPDATE, such as :func:`claim_stmt`'s), made to commit without
    waiting for its WAL flush when it runs in a transaction of its own (autocommit):
    the worker's claims.

    Adds ``AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`` to
    its ``WHERE`` (:func:`relaxed_commit_stmt` as a condition that always holds): an
    uncorrelated subquery, which PostgreSQL runs once per execution (an InitPlan, a
    one-time filter) before the rows are read, and whose setting lasts until the
    statement's implicit transaction commits. The same as sending
    :func:`relaxed_commit_stmt` before it, in one statement instead of two: the pipeline
    of two statements the worker used to send cost 0.4 ms more per claim than this
    (``bench/RESULTS.md``, "The relaxed commit in the claim"). In a transaction of the
    caller's, the setting holds until that transaction ends: use the plain statement
    there.
    """
    return statement.where(relaxed_commit_stmt().scalar_subquery().is_not(None))
