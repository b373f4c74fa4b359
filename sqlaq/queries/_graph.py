"""Walks over a workflow's graph, shared by the stages that need one (retention keeps
an unfinished workflow's jobs, an operator reads or cancels a workflow whole).

The graph is the jobs' ``parent_ids`` (every parent a job was enqueued to wait for,
kept for good), not ``sqlaq_job_deps`` (whose rows go as parents finish). A step up
is a primary-key lookup; a step down (a parent's children) reads the jobs enqueued
after the parent (``id > parent``: a child is always enqueued after its parents, in
the same INSERT, whose ids follow its rows, or later), only from a parent flagged
``has_dependents``. Private to :mod:`sqlaq.queries`.
"""

from __future__ import annotations

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    and_,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import array

from sqlaq.queries._common import _IDS, _status, c
from sqlaq.schema import JobStatus, jobs


def _unfinished_lineage() -> CTE:
    """``kept``: the workflow jobs not finished (queued or running, with parents) and
    every ancestor of theirs (their parents, the parents' parents, ...).

    Renders::

        WITH RECURSIVE kept(id) AS (
            SELECT id FROM (SELECT id FROM sqlaq_jobs
                            WHERE status = 'queued' AND parent_ids IS NOT NULL
                            UNION ALL
                            SELECT id FROM sqlaq_jobs
                            WHERE status = 'running' AND parent_ids IS NOT NULL) AS unfinished
            UNION
            SELECT unnest(kept_job.parent_ids) FROM sqlaq_jobs AS kept_job, kept
            WHERE kept_job.id = kept.id)

    The seeds come from the waiting index (queued jobs with parents) and the running
    index (a handful of rows); each step up is a primary-key lookup. ``UNION`` keeps
    each ancestor once (a diamond is walked once).
    """
    unfinished = union_all(
        select(c.id).where(c.status == _status(JobStatus.QUEUED), c.parent_ids.is_not(None)),
        select(c.id).where(c.status == _status(JobStatus.RUNNING), c.parent_ids.is_not(None)),
    ).subquery("unfinished")
    kept = select(unfinished.c.id).cte("kept", recursive=True)
    step = jobs.alias("kept_job")
    return kept.union(
        select(func.unnest(step.c.parent_ids).label("id")).where(step.c.id == kept.c.id)
    )


def in_unfinished_workflow() -> ColumnElement[bool]:
    """True for a finished job (a row of ``sqlaq_jobs`` in the enclosing statement)
    that its workflow still needs: what retention keeps.

    ``kept`` (above) holds every ancestor of a workflow job not finished yet: a parent
    whose child still waits (a chord's member whose callback has not run: its result
    is what :func:`parent_results` reads), and the parents' parents up to the roots.
    A job is kept when it is in ``kept``, or when one of its parents is (a finished
    member of a group whose sibling still runs). Renders ``(has_dependents OR
    parent_ids IS NOT NULL) AND array_cat(ARRAY[id], parent_ids) && coalesce((SELECT
    array_agg(id) FROM kept), '{}')``: a job outside any workflow pays a test of two
    columns of its row; ``kept`` is an uncorrelated subquery, computed once per
    statement (and only if a workflow job is met), so the planner's cost of the
    statement stays low (a correlated walk or join is costed per row, and its estimate
    made PostgreSQL JIT-compile each prune batch: 0.3 s). A workflow job costs a scan
    of the ``kept`` array.

    Not kept: a finished job whose parents are finished and in no unfinished job's
    ancestry (the end of a branch that has finished while another branch of the same
    workflow runs): nothing that is still to run reads it.
    """
    lineage = _unfinished_lineage()
    kept = func.coalesce(
        select(func.array_agg(lineage.c.id)).scalar_subquery(),
        literal_column("'{}'", _IDS),
    )
    own = func.array_cat(array([c.id]), c.parent_ids)
    return and_(or_(c.has_dependents, c.parent_ids.is_not(None)), own.op("&&")(kept))


def workflow_cte(*, job_id: int) -> CTE:
    """``workflow``: the ids of every job of *job_id*'s workflow, *job_id* first, then
    outwards (its parents and children, theirs, ...).

    Renders::

        WITH RECURSIVE workflow(id) AS (
            SELECT id FROM sqlaq_jobs WHERE id = :b_id
            UNION
            SELECT near.id FROM workflow, LATERAL (
                SELECT unnest(up.parent_ids) AS id FROM sqlaq_jobs AS up
                WHERE up.id = workflow.id
                UNION ALL
                SELECT child.id FROM sqlaq_jobs AS parent
                JOIN sqlaq_jobs AS child ON child.id > parent.id
                    AND child.parent_ids @> ARRAY[parent.id]
                WHERE parent.id = workflow.id AND parent.has_dependents) AS near)

    A workflow is what its parent links connect, in either direction: a chain, a
    group with an ``after``, a chord or a batch (its members meet at the callback). A
    group enqueued without ``after`` is not one workflow: nothing links its jobs. An
    id of a pruned parent may appear (no row has it). Read it lazily (``LIMIT``) to
    bound the walk.
    """
    start = select(c.id).where(c.id == bindparam("b_id", job_id, BigInteger))
    walk = start.cte("workflow", recursive=True)
    up = jobs.alias("up")
    parent = jobs.alias("parent")
    child = jobs.alias("child")
    ups = select(func.unnest(up.c.parent_ids).label("id")).where(up.c.id == walk.c.id)
    downs = (
        select(child.c.id.label("id"))
        .select_from(
            parent.join(
                child,
                and_(
                    child.c.id > parent.c.id,
                    child.c.parent_ids.contains(array([parent.c.id])),
                ),
            )
        )
        .where(parent.c.id == walk.c.id, parent.c.has_dependents)
    )
    near = union_all(ups, downs).subquery("near").lateral("near")
    return walk.union(select(near.c.id).select_from(walk.join(near, true())))
