"""Workflows: jobs that wait for other jobs; chain, group, chord and batch.

Every shape is enqueued in the caller's transaction, in a few statements: the jobs, the
parents' flag, the edges and each child's hold. It exists whole once the caller commits,
or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlaq import queries
from sqlaq.drive import Plan, operation, plan_of
from sqlaq.encoding import NewJob
from sqlaq.errors import InvalidJobError
from sqlaq.ops._citus import DISTRIBUTED, refuse
from sqlaq.ops._common import _check_positive
from sqlaq.ops._links import RELEASE_BATCH, check_after, check_policy, link, mark_parents
from sqlaq.ops.enqueuing import enqueue_many
from sqlaq.records import ParentResult, Workflow, WorkflowJob, WorkflowJobs
from sqlaq.schema import JobStatus


def _check_jobs(jobs: Iterable[NewJob], what: str) -> list[NewJob]:
    if isinstance(jobs, NewJob) or not isinstance(jobs, Iterable):
        raise InvalidJobError(f"{what} must be a list of sqlaq.NewJob")
    batch = list(jobs)
    for index, job in enumerate(batch):
        _check_job(job, f"{what}[{index}]")
    return batch


def _check_job(job: object, what: str) -> NewJob:
    if not isinstance(job, NewJob):
        raise InvalidJobError(f"{what} must be a sqlaq.NewJob, got {type(job).__name__}")
    if job.dedupe_key is not None:
        raise InvalidJobError(
            f"{what} has a dedupe_key: a workflow's jobs cannot be deduplicated (a duplicate "
            "would join a workflow it is not part of)"
        )
    return job


# Why workflows refuse on Citus.
_NO_TRIGGER = (
    "a parent's dependency trigger releases its children, and Citus refuses triggers on a "
    "distributed table"
)


def _shape(
    jobs: Sequence[NewJob],
    edges: Sequence[tuple[int, int]],
    after: Iterable[int] | None,
    roots: Sequence[int],
    on_parent_failure: str,
) -> Plan[list[int]]:
    """Enqueue *jobs*, link them by *edges* (index pairs), and make the jobs at *roots*
    (indexes) wait for *after* too. Returns the jobs' ids, in order."""
    policy = check_policy(on_parent_failure)
    external = check_after(after) if after is not None else []
    yield from refuse("workflows", _NO_TRIGGER)
    statuses = yield from mark_parents(external)
    if not jobs:
        return []
    results = yield from plan_of(enqueue_many)(jobs)
    ids = [r.job_id for r in results]
    pairs = [(ids[p], ids[ch]) for p, ch in edges]
    pairs += [(parent, ids[root]) for root in roots for parent in external]
    internal = list(dict.fromkeys(ids[p] for p, _ in edges))
    statuses |= yield from mark_parents(internal)
    yield from link(pairs, statuses, policy)
    return ids


@operation
def chain(
    jobs: Iterable[NewJob],
    *,
    after: Iterable[int] | None = None,
    on_parent_failure: str = "cancel",
) -> Plan[Workflow]:
    """Enqueue *jobs* to run one after the other, each once the one before it is done.

    Atomic in the caller's transaction: the chain exists whole once the caller commits.
    By default a step that fails (for good) or is cancelled cancels every step after it.

    Args:
        conn: The caller's Connection or Session.
        jobs: The steps, in order (:class:`~sqlaq.NewJob`, no ``dedupe_key``).
        after: Job ids the first step waits for too.
        on_parent_failure: What a step does when the step before it (or a job of
            *after*) fails or is cancelled: ``"cancel"`` (itself, and so the rest),
            ``"run"`` (runs anyway) or ``"fail"`` (fails, naming the parent).

    Returns:
        The steps' ids, in order (:attr:`Workflow.job_ids`).

    Raises:
        InvalidJobError: bad input, or *after* names no job; nothing was written.
    """
    batch = _check_jobs(jobs, "jobs")
    edges = [(i, i + 1) for i in range(len(batch) - 1)]
    ids = yield from _shape(batch, edges, after, [0] if batch else [], on_parent_failure)
    return Workflow(tuple(ids))


@operation
def group(
    jobs: Iterable[NewJob],
    *,
    after: Iterable[int] | None = None,
    on_parent_failure: str = "cancel",
) -> Plan[Workflow]:
    """Enqueue *jobs* to run in parallel (fan-out), each once every job of *after* is done.

    Atomic in the caller's transaction; without *after*, the jobs are due at once.

    Args:
        conn: The caller's Connection or Session.
        jobs: The jobs (:class:`~sqlaq.NewJob`, no ``dedupe_key``).
        after: Job ids every job of the group waits for.
        on_parent_failure: What each job does when a job of *after* fails or is
            cancelled (as :func:`chain`'s).

    Returns:
        The jobs' ids, in order.

    Raises:
        InvalidJobError: bad input, or *after* names no job; nothing was written.
    """
    batch = _check_jobs(jobs, "jobs")
    ids = yield from _shape(batch, [], after, range(len(batch)), on_parent_failure)
    return Workflow(tuple(ids))


@operation
def chord(
    jobs: Iterable[NewJob],
    then: NewJob,
    *,
    after: Iterable[int] | None = None,
    on_parent_failure: str = "cancel",
) -> Plan[Workflow]:
    """Enqueue *jobs* in parallel and *then*, which runs once they are all done (fan-in).

    *then* reads their results with :func:`sqlaq.parent_results`. By default a job of
    the group that fails (for good) or is cancelled cancels *then*. Atomic in the
    caller's transaction.

    Args:
        conn: The caller's Connection or Session.
        jobs: The group (:class:`~sqlaq.NewJob`, no ``dedupe_key``).
        then: The callback, waiting for every job of the group.
        after: Job ids every job of the group waits for.
        on_parent_failure: What *then* (and the group, for *after*) does when a parent
            fails or is cancelled (as :func:`chain`'s).

    Returns:
        The group's ids (:attr:`Workflow.job_ids`) and the callback's
        (:attr:`Workflow.callback_id`).

    Raises:
        InvalidJobError: bad input, or *after* names no job; nothing was written.
    """
    return (yield from _fan_in(jobs, then, "then", after, on_parent_failure))


@operation
def batch(
    jobs: Iterable[NewJob],
    on_complete: NewJob,
    *,
    after: Iterable[int] | None = None,
) -> Plan[Workflow]:
    """Enqueue *jobs* in parallel and *on_complete*, which runs once every one of them
    has finished, whatever its outcome (done, failed or cancelled).

    The callback reads the outcomes with :func:`sqlaq.parent_results`. Atomic in the
    caller's transaction.

    Args:
        conn: The caller's Connection or Session.
        jobs: The batch (:class:`~sqlaq.NewJob`, no ``dedupe_key``).
        on_complete: The callback.
        after: Job ids every job of the batch waits for (a failed one cancels the batch).

    Returns:
        The batch's ids and the callback's.

    Raises:
        InvalidJobError: bad input, or *after* names no job; nothing was written.
    """
    return (yield from _fan_in(jobs, on_complete, "on_complete", after, "run"))


def _fan_in(
    jobs: Iterable[NewJob],
    then: NewJob,
    what: str,
    after: Iterable[int] | None,
    callback_policy: str,
) -> Plan[Workflow]:
    group_ = _check_jobs(jobs, "jobs")
    callback = _check_job(then, what)
    policy = check_policy(callback_policy)
    external = check_after(after) if after is not None else []
    statuses = yield from mark_parents(external)
    results = yield from plan_of(enqueue_many)([*group_, callback])
    ids = [r.job_id for r in results]
    members, callback_id = ids[:-1], ids[-1]
    statuses |= yield from mark_parents(members)
    # The group waits for *after* (cancelled if one fails), the callback for the group.
    yield from link([(p, m) for m in members for p in external], statuses, "cancel")
    yield from link([(m, callback_id) for m in members], statuses, policy)
    return Workflow(tuple(members), callback_id)


@operation
def release_waiting(
    *, job_ids: Iterable[int] | None = None, limit: int = RELEASE_BATCH
) -> Plan[list[int]]:
    """Release (make due) waiting jobs whose parents have all finished.

    Workers do this on their own: the parent's own transaction releases its children
    when it sees no other parent left, a worker checks again after commit when two
    parents may have finished at once, and the maintenance leader sweeps what a crash
    left. Call it to heal a database no worker serves, or in a test. Idempotent.

    With *job_ids* (the check a worker makes when told ``sqlaq_release``), it first
    waits for the transactions in flight that are finishing a parent of those jobs
    (their completion or cancel), so that it sees their outcome: run it in a
    transaction of its own, at READ COMMITTED (the default), holding no lock.

    Args:
        conn: The caller's Connection or Session.
        job_ids: Check these jobs only; None: up to *limit* waiting jobs.
        limit: How many jobs one sweep releases at most.

    Returns:
        The ids of the jobs released (now due).
    """
    if (yield DISTRIBUTED):
        return []  # no job waits there: workflows refuse (see _shape)
    if job_ids is not None:
        ids = list(job_ids)
        if not ids:
            return []
        # The other parents finishing in flight first (a statement of its own: the
        # release's snapshot then sees their commits).
        (yield queries.wait_finishing_stmt(job_ids=ids), None).all()
        stmt = queries.release_stmt(job_ids=ids)
    else:
        stmt = queries.release_waiting_stmt(limit=limit)
    rows = (yield stmt, None).all()
    return [row[0] for row in rows]


@operation
def parent_results(job_id: int) -> Plan[list[ParentResult]]:
    """The parents *job_id* was enqueued to wait for: id, status and result of each.

    What a chord's or a batch's callback reads. A parent pruned by retention is left out.

    Returns:
        One :class:`~sqlaq.ParentResult` per parent, in the order they were given.
    """
    rows = (yield queries.parent_results_stmt(job_id=job_id), None).all()
    return [ParentResult(row[0], JobStatus(row[1]), row[2]) for row in rows]


#: How many jobs :func:`read_workflow` counts at most (its walk stops there).
WORKFLOW_COUNT_LIMIT = 10_000


@operation
def read_workflow(job_id: int, *, limit: int = 200) -> Plan[WorkflowJobs]:
    """Every job of *job_id*'s workflow, whichever of its jobs *job_id* is.

    The workflow is what parent links connect, in either direction: a chain, a chord
    or a batch (its members meet at the callback), a group enqueued with ``after``,
    and whatever was enqueued ``after=`` one of their jobs. A group enqueued without
    ``after`` is no workflow (nothing links its jobs). A parent pruned by retention is
    left out (and what only it linked).

    Args:
        conn: The caller's Connection or Session.
        job_id: Any job of the workflow.
        limit: List at most this many jobs (the nearest to *job_id*); the rest are
            counted (:attr:`WorkflowJobs.more`), up to 10,000.

    Returns:
        The jobs in dependency order (:class:`~sqlaq.WorkflowJobs`); no job when no
        job has this id. A job outside any workflow is a workflow of one job.

    Raises:
        ConfigError: *limit* is not a positive int, or the job table is distributed on
            Citus (where workflows do not run).
    """
    _check_positive("limit", limit)
    yield from refuse("workflows", _NO_TRIGGER)
    stmt = queries.workflow_stmt(job_id=job_id, limit=limit, count_limit=WORKFLOW_COUNT_LIMIT)
    rows = yield from _without_jit(stmt)
    found = tuple(
        WorkflowJob(
            job_id=row.id,
            kind=row.kind,
            queue=row.queue,
            status=row.status,
            parent_ids=tuple(row.parent_ids or ()),
            waiting=row.waiting,
            finished_at=row.finished_at,
        )
        for row in rows
    )
    total = rows[0].total if rows else 0
    return WorkflowJobs(job_id, found, total, total < WORKFLOW_COUNT_LIMIT)


@operation
def cancel_workflow(job_id: int) -> Plan[list[int]]:
    """Cancel every queued or running job of *job_id*'s workflow, whichever of its
    jobs *job_id* is.

    The workflow is :func:`read_workflow`'s: a chain, a chord or a batch is cancelled
    whole from any of its jobs, parents and members too, whether or not it has a single
    root. Each job is cancelled as :func:`sqlaq.cancel` does (a running job's worker is
    told); finished jobs are left alone. One statement, in the caller's transaction.

    Returns:
        The ids of the jobs cancelled (none when no job has this id).

    Raises:
        ConfigError: the job table is distributed on Citus (where workflows do not run).
    """
    yield from refuse("workflows", _NO_TRIGGER)
    rows = yield from _without_jit(queries.cancel_workflow_stmt(job_id=job_id))
    return [row[0] for row in rows]


def _without_jit(stmt: Any) -> Plan[list[Any]]:
    """Run a workflow's walk with JIT off (see :func:`sqlaq.queries.set_setting_stmt`),
    then set ``jit`` back to what it was; its rows."""
    was = (yield queries.set_setting_stmt(name="jit", value="off"), None).scalar_one()
    rows = (yield stmt, None).all()
    yield queries.set_setting_stmt(name="jit", value=was), None
    return list(rows)
