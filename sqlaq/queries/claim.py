"""Claim: taking due jobs under a lease, and the per-kind lock, limit state and rate
log of limited kinds."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple
from uuid import UUID

from sqlalchemy import (
    BigInteger,
    Boolean,
    ClauseElement,
    ColumnElement,
    FromClause,
    Insert,
    Integer,
    Interval,
    Numeric,
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
    or_,
    select,
    text,
    tuple_,
    type_coerce,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, TIMESTAMP, insert
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.sql.elements import Grouping

from sqlaq.errors import ConfigError
from sqlaq.limits import Rate
from sqlaq.queries._common import (
    _IDS,
    _NOW,
    _PENDING,
    _RUNNING,
    _expired_error,
    _key_rows,
    _status,
    c,
)
from sqlaq.queries.columns import CLAIM_COLUMNS
from sqlaq.schema import (
    KIND_LOCK_CLASS,
    JobStatus,
    jobs,
    paused_queues,
    rates,
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
FULL_CLAIM = ClaimPosition(32768, datetime(1, 1, 1, tzinfo=UTC), 0)


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
    until the transaction ends, so run it first in the transaction it is meant for (the
    worker sends it in one pipeline with its claim: one implicit transaction, one round
    trip). A commit then returns before its flush; PostgreSQL's WAL writer flushes it
    within ``3 x wal_writer_delay`` (600 ms by default), and any later synchronous commit
    of any session flushes it first. Only a crash of the server in between undoes the
    transaction, never anything after it. The worker's claims use it: a claim undone
    that way leaves its job queued as before, to run again, exactly as the job of a
    worker that crashed (``docs/explanation/delivery-guarantees.md``).
    """
    return select(
        func.set_config(
            literal_column("'synchronous_commit'", Text),
            literal_column("'off'", Text),
            literal_column("true", Boolean),
        )
    )


def lock_kind_stmt(*, kind: str) -> Select[Any]:
    """Take the claim lock of a limited *kind* until the transaction ends.

    Renders ``SELECT pg_advisory_xact_lock(<KIND_LOCK_CLASS>, hashtext(:b_kind))``. Run
    it first, in its own statement: the statements after it then see every claim
    committed by the lock's previous holder (each statement of a READ COMMITTED
    transaction takes a fresh snapshot; a lock taken inside a statement would not).
    Two kinds whose names hash alike share a lock, which only makes them take turns.
    """
    key = func.hashtext(bindparam("b_kind", kind, Text))
    return select(func.pg_advisory_xact_lock(literal_column(str(KIND_LOCK_CLASS), Integer), key))


def kind_limit_state_params(*, kind: str, rate: Rate | None) -> dict[str, Any]:
    """The bind values of :func:`kind_limit_state_stmt`."""
    return {
        "b_kind": kind,
        "b_period": rate.period if rate else timedelta(0),
        "b_count": rate.count if rate else 1,
    }


def kind_limit_state_stmt(*, kind: str, rate: Rate | None) -> Select[Any]:
    """Select what a limited claim of *kind* needs: ``running, recent, pivot, now``.

    * ``running``: the kind's live leases (running rows whose lease has not expired; an
      expired one is claimable again, so it no longer holds a slot), counted through
      the running index.
    * ``recent``: how many starts of the kind's log (``sqlaq_rates``) count against
      *rate* now: those less than a period old, and any later than ``now()`` (written
      by a transaction that started after this one but took the lock first).
    * ``pivot``: the start that must leave the window before one more may start once
      the log is full: the ``count``-th newest counted start, else the oldest one (NULL
      when none counts).
    * ``now``: the transaction's clock, to which new starts are written.

    The log stays in the database: only two numbers and a timestamp come back.
    """
    v = kind_limit_state_params(kind=kind, rate=rate)
    kind_ = bindparam("b_kind", v["b_kind"], Text)
    running = (
        select(func.count())
        .select_from(jobs)
        .where(_RUNNING, c.kind == kind_, c.run_at > _NOW)
        .scalar_subquery()
    )
    start = _counted_starts(bindparam("b_period", v["b_period"], Interval), kind_)
    recent = select(func.count()).select_from(start).scalar_subquery()
    kth_newest = (
        select(start.c.s)
        .order_by(start.c.s.desc())
        .offset(bindparam("b_count", v["b_count"], Integer) - literal_column("1", Integer))
        .limit(1)
        .scalar_subquery()
    )
    oldest = select(func.min(start.c.s)).scalar_subquery()
    return select(
        running.label("running"),
        recent.label("recent"),
        func.coalesce(kth_newest, oldest).label("pivot"),
        _NOW.label("now"),
    )


def _counted_starts(period: ColumnElement[Any], kind: ColumnElement[str]) -> Any:
    """``SELECT s FROM sqlaq_rates, unnest(starts) AS s WHERE kind = :kind AND s > now() -
    :period``, as a subquery with column ``s``."""
    s = func.unnest(rates.c.starts).table_valued("s").render_derived(name="start")
    return (
        select(s.c.s)
        .select_from(rates)
        .join(s, literal_column("true", Boolean))
        .where(rates.c.kind == kind, s.c.s > _NOW - period)
        .subquery("counted")
    )


def record_starts_params(*, kind: str, rate: Rate, started: int) -> dict[str, Any]:
    """The bind values of :func:`record_starts_stmt`."""
    return {"b_kind": kind, "b_period": rate.period, "b_count": rate.count, "b_started": started}


def record_starts_stmt(*, kind: str, rate: Rate, started: int) -> Insert:
    """Log *started* new starts of *kind* at ``now()``, keeping only the starts that
    still count and at most the rate's count of them (the newest).

    Renders ``INSERT INTO sqlaq_rates (kind, starts) VALUES (:b_kind, <new starts>) ON
    CONFLICT (kind) DO UPDATE SET starts = ARRAY(SELECT s FROM (<counted old starts>
    UNION ALL <new starts>) ORDER BY s DESC LIMIT :b_count)``. The caller holds the
    kind's claim lock, so no one else writes the row meanwhile; the array never leaves
    the database.
    """
    v = record_starts_params(kind=kind, rate=rate, started=started)
    new = select(_NOW.label("s")).select_from(
        func.generate_series(
            literal_column("1", Integer), bindparam("b_started", v["b_started"], Integer)
        )
    )
    count = bindparam("b_count", v["b_count"], Integer)
    stmt = insert(rates).values(
        kind=bindparam("b_kind", v["b_kind"], Text),
        starts=func.array(new.limit(count).scalar_subquery()),
    )
    old = func.unnest(rates.c.starts).table_valued("s").render_derived(name="old")
    period = bindparam("b_period", v["b_period"], Interval)
    kept = select(old.c.s).where(old.c.s > _NOW - period).union_all(new).subquery("kept")
    merged = select(kept.c.s).order_by(kept.c.s.desc()).limit(count).scalar_subquery()
    return stmt.on_conflict_do_update(
        index_elements=[rates.c.kind], set_={"starts": func.array(merged)}
    )


def key_running_stmt(*, kind: str) -> Select[Any]:
    """Select the live leases of a keyed *kind*, per key: ``key, running``.

    Renders ``SELECT key, count(*) AS running FROM sqlaq_jobs WHERE status = 'running'
    AND kind = :b_kind AND run_at > now() AND key IS NOT NULL GROUP BY key``, through the
    running index (running rows only: a handful, whatever the backlog). A running job
    whose lease expired holds no slot of its key: it is due again, like any other.
    """
    return (
        select(c.key, func.count().label("running"))
        .where(_RUNNING, c.kind == bindparam("b_kind", kind, Text), c.run_at > _NOW)
        .where(c.key.is_not(None))
        .group_by(c.key)
    )


def keyed_candidates_params(
    *, queue: str, kind: str, limit: int, full_keys: Sequence[str], picked: Sequence[int]
) -> dict[str, Any]:
    """The bind values of :func:`keyed_candidates_stmt`."""
    return {
        "b_queue": queue,
        "b_kind": kind,
        "b_limit": limit,
        "b_full_keys": list(full_keys),
        "b_picked": list(picked),
    }


def keyed_candidates_stmt(
    *,
    ordered: bool,
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
    per_queue: bool = False,
) -> Select[Any]:
    """Select ``id, key`` of up to ``b_limit`` due jobs of a keyed kind, in claim order,
    leaving out the keys at their limit and the jobs already picked.

    Renders::

        SELECT id, key FROM sqlaq_jobs
        WHERE status IN ('queued', 'running') AND queue = :b_queue AND run_at <= now()
          AND NOT EXISTS (<the queue is paused>) AND kind = :b_kind
          AND (key IS NULL OR key <> ALL(:b_full_keys)) AND id <> ALL(:b_picked)
          [AND (key IS NULL OR NOT EXISTS (SELECT FROM sqlaq_jobs AS earlier
                WHERE earlier.kind = sqlaq_jobs.kind AND earlier.key = sqlaq_jobs.key
                  AND earlier.id < sqlaq_jobs.id AND <KEY_SQL>))]
        ORDER BY priority DESC, run_at, id LIMIT :b_limit

    With *ordered* (strict order per key), only the first job of its key is a
    candidate: no earlier job of the kind and key may be queued (due or not: a job
    waiting for its retry holds the line), running, or failed (see
    :mod:`sqlaq.ops.claiming`); the key index answers in one probe. It locks nothing:
    it runs under the kind's claim lock (:func:`lock_kind_stmt`), and the claim by ids
    (:func:`claim_stmt` with *ids*) locks what it takes. *where* narrows it as
    :func:`claim_stmt`'s does.

    *per_queue* (a job table distributed on Citus by queue): the earlier jobs looked for
    are those of the same queue (``AND earlier.queue = :b_queue``), so the statement reads
    one shard; the order per key holds within a queue.
    """
    queue_ = bindparam("b_queue", "_", Text)
    kind_ = bindparam("b_kind", "_", Text)
    clauses: list[ColumnElement[bool]] = [
        _PENDING,
        c.queue == queue_,
        c.run_at <= _NOW,
        ~exists().where(paused_queues.c.queue == queue_),
        c.kind == kind_,
        or_(c.key.is_(None), c.key != func.all(bindparam("b_full_keys", [], ARRAY(Text)))),
        c.id != func.all(bindparam("b_picked", [], _IDS)),
    ]
    if ordered:
        earlier = jobs.alias("earlier")
        clauses.append(
            or_(
                c.key.is_(None),
                ~exists().where(
                    *([earlier.c.queue == queue_] if per_queue else []),
                    earlier.c.kind == c.kind,
                    earlier.c.key == c.key,
                    earlier.c.id < c.id,
                    _key_rows(earlier),
                ),
            )
        )
    return (
        select(c.id, c.key)
        .where(*clauses, *_where_clauses(where))
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(bindparam("b_limit", 1, Integer))
    )


def fair_claim_params(
    *,
    queue: str,
    worker_id: UUID,
    limit: int,
    lease: timedelta,
    exclude_kinds: Collection[str] = (),
    weights: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The bind values of :func:`fair_claim_stmt` (built with the same *exclude_kinds*
    choice)."""
    params = claim_params(
        queue=queue, worker_id=worker_id, limit=limit, lease=lease, exclude_kinds=exclude_kinds
    )
    shares = sorted((weights or {}).items())
    params["b_weight_keys"] = [key for key, _ in shares]
    params["b_weights"] = [weight for _, weight in shares]
    return params


def fair_claim_stmt(
    *,
    exclude_kinds: bool = False,
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Update:
    """Claim up to ``b_limit`` due jobs of ``b_queue``, shared fairly between its keys.

    The keyed jobs of a queue are split into shares by their ``key``. The claim walks
    the keys that have claimable jobs through the fair index
    (:data:`sqlaq.schema.FAIR_INDEX`: a loose index scan, one probe per key, whatever
    its depth), allots the ``b_limit`` slots to the keys by weight (a key's j-th job
    scores ``j / weight``, the lowest scores win, ties at random, so equal keys take
    turns claim after claim), then takes from each key its allotted first due jobs in
    claim order (``FOR UPDATE SKIP LOCKED``). A key's weight is its own in
    ``b_weights`` (the weights of the keys of ``b_weight_keys``, in that order), else 1.
    When the keys give fewer than ``b_limit``, the claim takes the rest in plain claim
    order, jobs without a key included: those are no share of their own (the fair index
    holds keyed rows only, so a job without a key costs it nothing), they take the
    slots the keys leave. A claim comes back short only when fewer jobs are due.

    With *exclude_kinds*, jobs of the kinds bound as ``b_excluded`` are left out (the
    limited kinds, see :func:`claim_stmt`); *where* narrows the claim as
    :func:`claim_stmt`'s does. A paused queue gives nothing. The UPDATE is
    :func:`claim_stmt`'s: the same lease, attempts, expired-lease handling and
    ``RETURNING`` columns.

    Renders::

        WITH RECURSIVE walk(k) AS (
            (SELECT key FROM sqlaq_jobs
             WHERE <pending> AND queue = :b_queue AND key IS NOT NULL AND run_at <= now()
               AND NOT EXISTS (<the queue is paused>) ORDER BY key LIMIT 1)
            UNION ALL
            SELECT (SELECT key FROM sqlaq_jobs WHERE <pending> AND queue = :b_queue
                    AND key IS NOT NULL AND run_at <= now() AND key > walk.k
                    ORDER BY key LIMIT 1)
            FROM walk WHERE walk.k IS NOT NULL),
        shares AS MATERIALIZED (SELECT k, coalesce((:b_weights)[array_position(
            :b_weight_keys, k)], 1) AS w FROM walk WHERE k IS NOT NULL),
        allotted AS MATERIALIZED (SELECT k, count(*) AS n FROM (<the b_limit lowest
            scores j / w over generate_series(1, ceil(b_limit * w / sum(w)))>) GROUP BY k),
        fair AS MATERIALIZED (
            SELECT p.id FROM allotted JOIN LATERAL (
                SELECT id FROM sqlaq_jobs WHERE <pending> AND queue = :b_queue
                  AND key IS NOT NULL AND key = allotted.k AND run_at <= now()
                ORDER BY priority DESC, run_at, id LIMIT allotted.n
                FOR UPDATE SKIP LOCKED) AS p ON true),
        candidates AS MATERIALIZED (
            (SELECT id FROM fair UNION ALL SELECT id FROM (<claim_stmt's candidates,
             AND id <> ALL(ARRAY(SELECT id FROM fair))>) AS fallback) LIMIT :b_limit)
        UPDATE sqlaq_jobs SET ... (as claim_stmt)

    Raises:
        ConfigError: *where* is not a clause over ``sqlaq.jobs`` (see
            :func:`claim_stmt`).
    """
    v = claim_params(queue="_", worker_id=UUID(int=0), limit=1, lease=timedelta(seconds=1))
    queue_ = bindparam("b_queue", "_", Text)
    limit_ = bindparam("b_limit", 1, Integer)
    which: list[ColumnElement[bool]] = []
    if exclude_kinds:
        which.append(c.kind != func.all(bindparam("b_excluded", [], ARRAY(Text))))
    which += _where_clauses(where)
    not_paused = ~exists().where(paused_queues.c.queue == queue_)
    share = _share_of(c)
    # The shares with claimable jobs (due, of the kinds and rows this claim may take),
    # in key order, one index probe each: a share whose pending jobs all run or wait
    # for later is not one (its slots would go to the plain order).
    claimable = (_PENDING, c.queue == queue_, c.key.is_not(None), c.run_at <= _NOW, *which)
    first = (
        select(share.label("k"))
        .where(*claimable, not_paused)
        .order_by(share)
        .limit(literal_column("1", Integer))
        .cte("walk", recursive=True)
    )
    following = (
        select(share)
        .where(*claimable, share > first.c.k)
        .order_by(share)
        .limit(literal_column("1", Integer))
        .scalar_subquery()
    )
    walk = first.union_all(select(following).where(first.c.k.is_not(None)))
    weight = func.coalesce(
        # (:b_weights)[i]: a bind's cast must be parenthesised before a subscript.
        Grouping(bindparam("b_weights", [], ARRAY(Integer)))[
            func.array_position(bindparam("b_weight_keys", [], ARRAY(Text)), walk.c.k)
        ],
        literal_column("1", Integer),
    )
    shares = (
        select(walk.c.k, weight.label("w"))
        .where(walk.c.k.is_not(None))
        .cte("shares")
        .prefix_with("MATERIALIZED")
    )
    total = select(func.sum(shares.c.w)).scalar_subquery()
    taken = func.ceil(limit_ * type_coerce(shares.c.w, Numeric) / total)
    # The claim's slots: share s's j-th job scores j / weight; the b_limit lowest scores
    # (ties at random) say how many jobs each share gives, before a row is read.
    slot = (
        func.generate_series(literal_column("1", Integer), taken)
        .table_valued("j")
        .render_derived(name="slot")
    )
    slots = (
        select(shares.c.k)
        .select_from(shares.join(slot, literal_column("true", Boolean)))
        .order_by(slot.c.j / shares.c.w, func.random())
        .limit(limit_)
        .subquery("slots")
    )
    allotted = (
        select(slots.c.k, func.count().label("n"))
        .group_by(slots.c.k)
        .cte("allotted")
        .prefix_with("MATERIALIZED")
    )
    per_share = (
        select(c.id)
        .where(
            _PENDING,
            c.queue == queue_,
            c.key.is_not(None),
            share == allotted.c.k,
            c.run_at <= _NOW,
            *which,
        )
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(allotted.c.n)
        .with_for_update(skip_locked=True)
        .lateral("p")
    )
    fair = (
        select(per_share.c.id)
        .select_from(allotted.join(per_share, literal_column("true", Boolean)))
        .cte("fair")
        .prefix_with("MATERIALIZED")
    )
    fallback = (
        select(c.id)
        .where(
            _PENDING,
            c.queue == queue_,
            c.run_at <= _NOW,
            not_paused,
            c.id != func.all(func.array(select(fair.c.id).scalar_subquery())),
            *which,
        )
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(limit_)
        .with_for_update(skip_locked=True)
        .subquery("fallback")
    )
    candidates = (
        union_all(select(fair.c.id), select(fallback.c.id))
        .limit(limit_)
        .cte("candidates")
        .prefix_with("MATERIALIZED")
    )
    return _claim_update(candidates, v)


def _share_of(columns: Any) -> ColumnElement[str]:
    """The fair index's share: the job's key (the index holds keyed rows only)."""
    return columns.key  # type: ignore[no-any-return]
