"""Workflows: jobs that wait for other jobs (their parents).

A waiting job is ``queued`` with ``run_at = '9999-01-01'`` (never due, so the claim
does not change) and one row of ``sqlaq_job_deps`` per parent not yet finished. When a parent
finishes, the revision's trigger deletes its own rows, applies each child's
``on_parent_failure`` and releases the children left with no row, in the parent's
transaction; :func:`release_stmt` checks again after commit what two parents finishing
at once could each have missed, and :func:`release_waiting_stmt` is the leader's sweep
for what a lost notification left.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Integer,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    case,
    exists,
    func,
    literal_column,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP, aggregate_order_by, insert

from sqlaq.queries._common import _IDS, _NOW, _status, c
from sqlaq.queries._graph import workflow_cte
from sqlaq.schema import CHANNEL, WAITING_FROM, WAITING_RUN_AT, JobStatus, job_deps, jobs

d = job_deps.c

#: A waiting job's run_at: later than any run_at an enqueue accepts, yet a datetime
#: Python reads back (``'infinity'`` is not).
_HELD = literal_column(f"'{WAITING_RUN_AT}'", TIMESTAMP(timezone=True))
_HELD_FROM = literal_column(f"'{WAITING_FROM}'", TIMESTAMP(timezone=True))

# Queued jobs with parents (the waiting index's predicate, schema.WAITING_SQL), held.
_WAITING = and_(
    c.status == _status(JobStatus.QUEUED), c.parent_ids.is_not(None), c.run_at >= _HELD_FROM
)


def _no_parent_left() -> ColumnElement[bool]:
    # The latest parent's edge first (a backward scan of the (child_id, parent_id)
    # index): parents mostly finish in id order, so the edges of those that finished
    # (dead until vacuum) lie below the live ones, not in the scan's way.
    last = (
        select(d.parent_id)
        .where(d.child_id == c.id)
        .order_by(d.parent_id.desc())
        .limit(literal_column("1", Integer))
        .scalar_subquery()
    )
    return last.is_(None)


def mark_parents_stmt(*, job_ids: Collection[int]) -> Update:
    """Flag *job_ids* as parents of a job being enqueued, and read their status.

    Renders ``UPDATE sqlaq_jobs SET has_dependents = true WHERE id = ANY(:b_ids)
    RETURNING id, status``. The row lock it takes holds each parent's completion until
    the enqueuing transaction ends, so a parent cannot finish between this read and the
    edges' insert (its trigger then sees them). A missing id returns no row.
    """
    return (
        update(jobs)
        .where(c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)))
        .values(has_dependents=literal_column("true", Boolean))
        .returning(c.id, c.status)
    )


def link_stmt(*, parent_ids: Collection[int], child_ids: Collection[int]) -> Any:
    """Insert the edges ``(parent_ids[i], child_ids[i])`` (parents not yet finished).

    Renders ``INSERT INTO sqlaq_job_deps (parent_id, child_id) SELECT * FROM
    unnest(:b_parents, :b_children) ON CONFLICT DO NOTHING``.
    """
    pairs = (
        func.unnest(
            bindparam("b_parents", list(parent_ids), _IDS),
            bindparam("b_children", list(child_ids), _IDS),
        )
        .table_valued("parent_id", "child_id")
        .render_derived(name="pairs")
    )
    stmt = insert(job_deps).from_select(
        ["parent_id", "child_id"], select(pairs.c.parent_id, pairs.c.child_id)
    )
    return stmt.on_conflict_do_nothing()


def hold_stmt(
    *, parent_ids: Collection[int], child_ids: Collection[int], on_parent_failure: str
) -> Update:
    """Record each child's parents and policy, and hold the children that have an edge.

    Renders::

        UPDATE sqlaq_jobs SET parent_ids = p.parents, on_parent_failure = :b_policy,
            run_at = CASE WHEN EXISTS (SELECT 1 FROM sqlaq_job_deps
                WHERE child_id = sqlaq_jobs.id) THEN '9999-01-01 00:00:00+00' ELSE run_at END
        FROM (SELECT child_id, array_agg(parent_id ORDER BY ordinality) AS parents
              FROM unnest(:b_parents, :b_children) WITH ORDINALITY
                AS pairs(parent_id, child_id, ordinality) GROUP BY child_id) AS p
        WHERE sqlaq_jobs.id = p.child_id AND sqlaq_jobs.status = 'queued'
        RETURNING id

    Run after :func:`link_stmt` in the same transaction: a child with an edge left waits.
    """
    pairs = (
        func.unnest(
            bindparam("b_parents", list(parent_ids), _IDS),
            bindparam("b_children", list(child_ids), _IDS),
        )
        .table_valued("parent_id", "child_id", with_ordinality="ordinality")
        .render_derived(name="pairs")
    )
    grouped = (
        select(
            pairs.c.child_id,
            func.array_agg(aggregate_order_by(pairs.c.parent_id, pairs.c.ordinality)).label(
                "parents"
            ),
        )
        .group_by(pairs.c.child_id)
        .subquery("p")
    )
    waits = exists().where(d.child_id == c.id)
    return (
        update(jobs)
        .where(c.id == grouped.c.child_id, c.status == _status(JobStatus.QUEUED))
        .values(
            parent_ids=grouped.c.parents,
            on_parent_failure=bindparam("b_policy", on_parent_failure, Text),
            run_at=case((waits, _HELD), else_=c.run_at),
        )
        .returning(c.id)
    )


def end_children_stmt(*, job_ids: Collection[int], status: JobStatus, error: str) -> Update:
    """End queued jobs whose parent had already failed when they were enqueued.

    Renders ``UPDATE sqlaq_jobs SET status = :status, finished_at = now(), last_error =
    :b_error WHERE id = ANY(:b_ids) AND status = 'queued' RETURNING id`` (the status
    inlined: ``cancelled`` or ``failed``).
    """
    return (
        update(jobs)
        .where(
            c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)),
            c.status == _status(JobStatus.QUEUED),
        )
        .values(
            status=_status(status), finished_at=_NOW, last_error=bindparam("b_error", error, Text)
        )
        .returning(c.id)
    )


def _released(where: ColumnElement[bool]) -> Select[Any]:
    released = (
        update(jobs)
        .where(where, _WAITING, _no_parent_left())
        .values(run_at=_NOW)
        .returning(c.id, c.queue)
        .cte("released")
    )
    channel = literal_column(f"'{CHANNEL}'", Text)
    return select(released.c.id, func.pg_notify(channel, released.c.queue))


def release_stmt(*, job_ids: Collection[int]) -> Select[Any]:
    """Make due the waiting jobs among *job_ids* that have no parent left to wait for.

    Renders::

        WITH released AS (
            UPDATE sqlaq_jobs SET run_at = now()
            WHERE id = ANY(:b_ids) AND status = 'queued' AND parent_ids IS NOT NULL
              AND run_at >= '9900-01-01 00:00:00+00'
              AND (SELECT parent_id FROM sqlaq_job_deps
                   WHERE sqlaq_job_deps.child_id = sqlaq_jobs.id
                   ORDER BY parent_id DESC LIMIT 1) IS NULL
            RETURNING id, queue)
        SELECT released.id, pg_notify('sqlaq_jobs', released.queue) FROM released

    Run after a parent's finishing transaction committed, and after
    :func:`wait_finishing_stmt` (which waits for the other parents finishing in flight):
    it then sees every other parent's committed delete.
    Idempotent: a released job is no longer waiting, so only one run releases it. Reads
    the child's edges only; writes the child only when it releases it.
    """
    return _released(c.id == func.any(bindparam("b_ids", list(job_ids), _IDS)))


def wait_finishing_stmt(*, job_ids: Collection[int]) -> Select[Any]:
    """Wait until no transaction in flight is deleting an edge of *job_ids*.

    Renders ``SELECT parent_id FROM sqlaq_job_deps WHERE child_id = ANY(:b_ids) AND xmax
    <> '0'::xid FOR KEY SHARE OF sqlaq_job_deps``: an edge whose parent is finishing in
    another transaction (its delete in flight sets the row's ``xmax``) is locked, which
    waits for that transaction to end (an edge it deleted is then skipped); an edge
    nobody deletes (``xmax`` 0) is not locked. Run before :func:`release_stmt`, as its
    own statement, so that the release's snapshot sees those transactions' ends.

    Why: a finishing parent that sees another parent's edge not being deleted
    (``xmax`` 0) relies on that parent, which finishes later, and does not notify. That
    later parent, seeing only edges being deleted, notifies ``sqlaq_release``, and may
    commit first: its check waits here for the earlier one.
    """
    return (
        select(d.parent_id)
        .where(
            d.child_id == func.any(bindparam("b_ids", list(job_ids), _IDS)),
            literal_column("sqlaq_job_deps.xmax") != literal_column("'0'::xid"),
        )
        .with_for_update(read=True, key_share=True, of=job_deps)
    )


def release_waiting_stmt(*, limit: int) -> Select[Any]:
    """Release up to *limit* waiting jobs with no parent left (the leader's sweep).

    :func:`release_stmt` over the first *limit* waiting jobs (queued, with parents, held:
    the waiting index) that have no edge left: what a crash or a
    lost notification between a parent's commit and its check left waiting.
    """
    candidates = (
        select(c.id)
        .where(_WAITING, _no_parent_left())
        .order_by(c.id)
        .limit(bindparam("b_limit", limit, Integer))
        .scalar_subquery()
    )
    return _released(c.id.in_(candidates))


def waiting_for_stmt(*, job_id: int) -> Select[tuple[int]]:
    """The parents *job_id* still waits for: ``SELECT parent_id FROM sqlaq_job_deps
    WHERE child_id = :b_id ORDER BY parent_id``."""
    return (
        select(d.parent_id)
        .where(d.child_id == bindparam("b_id", job_id, BigInteger))
        .order_by(d.parent_id)
    )


def parent_results_stmt(*, job_id: int) -> Select[Any]:
    """Every parent of *job_id*, in the order they were given: id, status and result.

    Renders ``SELECT sqlaq_jobs.id, status, result FROM unnest((SELECT parent_ids FROM
    sqlaq_jobs WHERE id = :b_id)) WITH ORDINALITY AS parents JOIN sqlaq_jobs ON id =
    parents.parent_id ORDER BY parents.ordinality``. A pruned parent has no row.
    """
    child = jobs.alias("child")
    ids = (
        select(child.c.parent_ids)
        .where(child.c.id == bindparam("b_id", job_id, BigInteger))
        .scalar_subquery()
    )
    parents = (
        func.unnest(ids)
        .table_valued("parent_id", with_ordinality="ordinality")
        .render_derived(name="parents")
    )
    return (
        select(c.id, c.status, c.result)
        .select_from(parents.join(jobs, c.id == parents.c.parent_id))
        .order_by(parents.c.ordinality)
    )


def workflow_stmt(*, job_id: int, limit: int, count_limit: int) -> Select[Any]:
    """The jobs of *job_id*'s workflow: up to *limit* of them, in dependency order
    (by id: a parent is always enqueued before its children), and how many the walk
    met, up to *count_limit*.

    Renders::

        WITH RECURSIVE workflow(id) AS (...),  -- workflow_cte
        found AS MATERIALIZED (SELECT id FROM workflow LIMIT :b_count_limit)
        SELECT id, kind, queue, status,
            status = 'queued' AND run_at >= '9900-01-01 00:00:00+00' AS waiting,
            finished_at, parent_ids, (SELECT count(*) FROM found) AS total
        FROM sqlaq_jobs
        WHERE id IN (SELECT id FROM found LIMIT :b_limit)
        ORDER BY id

    The walk stops once it met *count_limit* jobs (``total`` then says "at least"),
    and the jobs listed are the *limit* it met first: *job_id*, then the nearest.
    """
    walk = workflow_cte(job_id=job_id)
    found = (
        select(walk.c.id)
        .limit(bindparam("b_count_limit", count_limit, Integer))
        .cte("found")
        .prefix_with("MATERIALIZED")
    )
    shown = select(found.c.id).limit(bindparam("b_limit", limit, Integer))
    total = select(func.count()).select_from(found).scalar_subquery()
    return (
        select(
            c.id,
            c.kind,
            c.queue,
            c.status,
            and_(c.status == _status(JobStatus.QUEUED), c.run_at >= _HELD_FROM).label("waiting"),
            c.finished_at,
            c.parent_ids,
            total.label("total"),
        )
        .where(c.id.in_(shown))
        .order_by(c.id)
    )


def set_setting_stmt(*, name: str, value: str) -> Select[Any]:
    """Set the setting *name* for the rest of the transaction; select what it was.

    Renders ``SELECT current_setting(:b_name) AS was, set_config(:b_name, :b_value,
    true)``. A workflow's walk (:func:`workflow_stmt`,
    :func:`~sqlaq.queries.cancel_workflow_stmt`) is a recursive statement whose
    estimated cost is far above its real one: PostgreSQL would JIT-compile it (0.5 s,
    for a walk of a few milliseconds). The operations turn ``jit`` off around the walk
    and set it back to what it was; the dashboard bounds its walk with
    ``statement_timeout``.
    """
    setting = bindparam("b_name", name, Text)
    return select(
        func.current_setting(setting).label("was"),
        func.set_config(
            setting, bindparam("b_value", value, Text), literal_column("true", Boolean)
        ),
    )
