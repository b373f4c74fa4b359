"""Limited kinds: the per-kind claim lock, the limit state (live leases, the starts the
rate log counts), the rate log's writes, and the candidates of keyed kinds (a limit per
key, strict order per key).

The claim that takes a limited kind's jobs is :mod:`sqlaq.queries.claim`'s
(:func:`~sqlaq.queries.claim_stmt` with ``kind`` or ``ids``), run under the kind's lock;
the fair claim is :mod:`sqlaq.queries.fair`'s. How they run together is
:mod:`sqlaq.ops.claiming`'s."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Insert,
    Integer,
    Interval,
    Select,
    Text,
    bindparam,
    exists,
    func,
    literal_column,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert

from sqlaq.limits import Rate
from sqlaq.queries._common import (
    _IDS,
    _NOW,
    _PENDING,
    _RUNNING,
    _key_rows,
    c,
)
from sqlaq.queries.claim import _where_clauses
from sqlaq.schema import (
    KIND_LOCK_CLASS,
    jobs,
    paused_queues,
    rates,
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
