"""Walks over a workflow's graph, shared by the stages that need one (retention keeps
an unfinished workflow's jobs, an operator reads or cancels a workflow whole).

The graph is the jobs' ``parent_ids`` (every parent a job was enqueued to wait for,
kept for good), not ``sqlaq_job_deps`` (whose rows go as parents finish). A step up
is a primary-key lookup; a step down (a parent's children) probes the parents index
(sqlaq_0010: GIN over ``parent_ids``, partial on ``parent_ids IS NOT NULL``) with
``parent_ids @> ARRAY[parent]``, only from a parent flagged ``has_dependents``. The
index answers ``@>`` exactly (no recheck of the array), so a step down reads each child's
row but not its list of parents. Private to :mod:`sqlaq.queries`.
"""

from __future__ import annotations

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Select,
    and_,
    bindparam,
    func,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import array

from sqlaq.queries._common import _status, c
from sqlaq.schema import JobStatus, jobs


def _walk(name: str, seeds: Select[tuple[int]]) -> CTE:
    """``name``: *seeds* and every job their parent links reach, in either direction.

    Renders::

        WITH RECURSIVE name(id) AS (
            <seeds>
            UNION
            SELECT near.id FROM name, LATERAL (
                SELECT unnest(up.parent_ids) AS id FROM sqlaq_jobs AS up
                WHERE up.id = name.id
                UNION ALL
                SELECT child.id FROM sqlaq_jobs AS parent
                JOIN sqlaq_jobs AS child ON child.parent_ids @> ARRAY[parent.id]
                WHERE parent.id = name.id AND parent.has_dependents) AS near)

    ``UNION`` keeps each job once (a diamond, or a chord's callback met from each of
    its members, is walked once). An id of a pruned parent may appear (no row has it).
    The step down has no ``child.id > parent.id`` (true: a child is enqueued after its
    parents): it offered the planner a primary-key range scan from the parent on, which
    reads every job enqueued since, and PostgreSQL 14 took it on a small table.
    """
    walk = seeds.cte(name, recursive=True)
    up = jobs.alias("up")
    parent = jobs.alias("parent")
    child = jobs.alias("child")
    ups = select(func.unnest(up.c.parent_ids).label("id")).where(up.c.id == walk.c.id)
    downs = (
        select(child.c.id.label("id"))
        .select_from(
            parent.join(
                child,
                child.c.parent_ids.contains(array([parent.c.id])),
            )
        )
        .where(parent.c.id == walk.c.id, parent.c.has_dependents)
    )
    near = union_all(ups, downs).subquery("near").lateral("near")
    return walk.union(select(near.c.id).select_from(walk.join(near, true())))


def _unfinished_workflows() -> CTE:
    """``kept``: every job of every workflow that has a job not finished.

    Renders ``WITH RECURSIVE kept(id) AS (<seeds> UNION <a step up or down>)`` (the walk
    of :func:`_walk`), seeded by the pending workflow jobs::

        SELECT id FROM sqlaq_jobs WHERE status = 'queued' AND parent_ids IS NOT NULL
        UNION ALL
        SELECT id FROM sqlaq_jobs WHERE status = 'running'
            AND (parent_ids IS NOT NULL OR has_dependents)

    The queued seeds come from the waiting index, the running ones from the running
    index (a handful of rows). A queued job with children but no parents (a workflow's
    root not started yet) is no seed: its children wait for it, so they are seeds.
    """
    seeds = union_all(
        select(c.id).where(c.status == _status(JobStatus.QUEUED), c.parent_ids.is_not(None)),
        select(c.id).where(
            c.status == _status(JobStatus.RUNNING),
            or_(c.parent_ids.is_not(None), c.has_dependents),
        ),
    ).subquery("unfinished")
    return _walk("kept", select(seeds.c.id))


def in_unfinished_workflow() -> ColumnElement[bool]:
    """True for a finished job (a row of ``sqlaq_jobs`` in the enclosing statement)
    whose workflow has a job not finished yet: what retention keeps.

    A workflow is what its parent links connect, in either direction (see
    :func:`workflow_cte`): a chord's member done long ago whose callback still waits
    (its result is what :func:`parent_results` reads), a group's member done while its
    sibling runs, the end of a branch that finished while another branch runs. Once
    every job of the workflow has finished, its jobs go like any other.

    Renders ``(has_dependents OR parent_ids IS NOT NULL) AND id IN (SELECT id FROM
    kept)`` (``kept``: :func:`_unfinished_workflows`): a job outside any workflow pays a
    test of two columns of its row; the ``IN`` is an uncorrelated subquery, walked once
    per statement into a hash table (and only if a workflow job is met), so each
    workflow job costs one hash probe.
    """
    kept = _unfinished_workflows()
    return and_(or_(c.has_dependents, c.parent_ids.is_not(None)), c.id.in_(select(kept.c.id)))


def workflow_cte(*, job_id: int) -> CTE:
    """``workflow``: the ids of every job of *job_id*'s workflow, *job_id* first, then
    outwards (its parents and children, theirs, ...).

    Renders ``WITH RECURSIVE workflow(id) AS (SELECT id FROM sqlaq_jobs WHERE id = :b_id
    UNION <a step up or down>)`` (the walk of :func:`_walk`).

    A workflow is what its parent links connect, in either direction: a chain, a
    group with an ``after``, a chord or a batch (its members meet at the callback). A
    group enqueued without ``after`` is not one workflow: nothing links its jobs. An
    id of a pruned parent may appear (no row has it). Read it lazily (``LIMIT``) to
    bound the walk.
    """
    return _walk("workflow", select(c.id).where(c.id == bindparam("b_id", job_id, BigInteger)))
