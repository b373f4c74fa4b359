"""The fair claim: a queue's due jobs shared between its keys by weight, through the
fair index (:data:`sqlaq.schema.FAIR_INDEX`), the rest in plain claim order.

It picks the candidates only: the UPDATE that takes them under a lease, and the
``where=`` check, are :mod:`sqlaq.queries.claim`'s. The limits of limited kinds (which a
fair claim leaves out) are :mod:`sqlaq.queries.limited`'s."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Integer,
    Numeric,
    Text,
    Update,
    bindparam,
    exists,
    func,
    literal_column,
    select,
    type_coerce,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import Grouping

from sqlaq.queries._common import _NOW, _PENDING, c
from sqlaq.queries.claim import _claim_update, _where_clauses, claim_params
from sqlaq.schema import paused_queues


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
