"""The links of a workflow: flag the parents, insert the edges, hold the children.
Shared by :func:`sqlaq.enqueue` (``after=``) and the shapes of :mod:`sqlaq.ops.workflows`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlaq import queries
from sqlaq.drive import Plan
from sqlaq.errors import InvalidJobError
from sqlaq.schema import FINISHED_STATUSES, JobStatus

#: What a waiting job may do when a parent fails or is cancelled.
ON_PARENT_FAILURE = ("cancel", "run", "fail")

#: How many waiting jobs one sweep statement releases.
RELEASE_BATCH = 1000


def check_policy(on_parent_failure: object) -> str:
    """*on_parent_failure* if it is one of :data:`ON_PARENT_FAILURE`; else raise."""
    if on_parent_failure not in ON_PARENT_FAILURE:
        raise InvalidJobError(
            f"on_parent_failure must be 'cancel', 'run' or 'fail', got {on_parent_failure!r}"
        )
    return str(on_parent_failure)


def check_after(after: Iterable[int]) -> list[int]:
    """The parent ids of *after*, in order, without repeats; raise on a non-id."""
    if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
        raise InvalidJobError(f"after must be a list of job ids, got {type(after).__name__}")
    ids = list(after)
    for job_id in ids:
        if type(job_id) is not int or job_id <= 0:
            raise InvalidJobError(f"after must hold job ids (positive ints), got {job_id!r}")
    return list(dict.fromkeys(ids))


def mark_parents(parent_ids: Sequence[int]) -> Plan[dict[int, JobStatus]]:
    """Flag *parent_ids* as parents (locking them until commit) and read their status.

    Raises:
        InvalidJobError: an id names no job.
    """
    if not parent_ids:
        return {}
    rows = (yield queries.mark_parents_stmt(job_ids=parent_ids), None).all()
    statuses = {row[0]: JobStatus(row[1]) for row in rows}
    missing = [p for p in parent_ids if p not in statuses]
    if missing:
        raise InvalidJobError(f"after names no job with id {missing[0]}")
    return statuses


def link(
    edges: Sequence[tuple[int, int]], statuses: dict[int, JobStatus], on_parent_failure: str
) -> Plan[None]:
    """Make each child of *edges* (``(parent, child)`` pairs) wait for its parents.

    *statuses* holds every parent's status, read by :func:`mark_parents` (a new job is
    queued). A parent already done is no edge; one already failed or cancelled ends the
    child at once unless its policy is ``run``.
    """
    if not edges:
        return
    pending = [(p, ch) for p, ch in edges if statuses[p] not in FINISHED_STATUSES]
    if pending:
        yield (
            queries.link_stmt(
                parent_ids=[p for p, _ in pending], child_ids=[ch for _, ch in pending]
            ),
            None,
        )
    yield (
        queries.hold_stmt(
            parent_ids=[p for p, _ in edges],
            child_ids=[ch for _, ch in edges],
            on_parent_failure=on_parent_failure,
        ),
        None,
    )
    if on_parent_failure == "run":
        return
    failed: dict[int, int] = {}
    for parent, child in edges:
        if statuses[parent] in (JobStatus.FAILED, JobStatus.CANCELLED):
            failed.setdefault(child, parent)
    for child, parent in failed.items():
        status = JobStatus.FAILED if on_parent_failure == "fail" else JobStatus.CANCELLED
        error = f"parent job {parent} {statuses[parent].value}"
        yield queries.end_children_stmt(job_ids=[child], status=status, error=error), None


def waiting_for(job_id: int) -> Plan[list[int]]:
    """The parents *job_id* still waits for (for :func:`sqlaq.explain`)."""
    rows = yield queries.waiting_for_stmt(job_id=job_id), None
    return [row[0] for row in rows]
