"""Shared pieces of the statement builders: the job table's columns and the inlined
predicates of its partial indexes. Private to :mod:`sqlaq.queries`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Text,
    and_,
    cast,
    func,
    literal_column,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import UUID as PG_UUID

from sqlaq.schema import (
    JobStatus,
    jobs,
)

c = jobs.c


def _status(value: JobStatus) -> ColumnElement[str]:
    # Inlined, never bound: see the rules in sqlaq.queries' docstring.
    return literal_column(f"'{value.value}'", Text)


_RUNNING = c.status == _status(JobStatus.RUNNING)

# The predicates of the partial indexes (schema.py), as column expressions so they are
# qualified in joins; their literals are inlined, so the planner can match the indexes.
_PENDING = c.status.in_([_status(JobStatus.QUEUED), _status(JobStatus.RUNNING)])

_FINISHED = c.status.in_(
    [_status(s) for s in (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED)]
)

_DEDUPE = and_(_PENDING, c.dedupe_key.is_not(None))

# The debounce index's predicate (schema.DEBOUNCE_SQL), literals inlined.
_DEBOUNCE = and_(
    c.status == _status(JobStatus.QUEUED), c.attempted_at.is_(None), c.debounce_key.is_not(None)
)

_NOW = func.now()


def _key_rows(table: Any) -> ColumnElement[bool]:
    """The key index's predicate (schema.KEY_SQL) over *table* (``sqlaq_jobs`` or an
    alias of it), literals inlined: the keyed jobs queued, running or failed."""
    held = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.FAILED)
    return and_(table.c.key.is_not(None), table.c.status.in_([_status(s) for s in held]))


_IDS = ARRAY(BigInteger)

_UUIDS = ARRAY(PG_UUID(as_uuid=True))


def _expired_error(then: str | None = None) -> ColumnElement[str]:
    """``last_error`` of a job whose lease expired: ``'lease expired on attempt N of M:
    the worker stopped or crashed while running the job; not retried'`` on its last
    attempt, else ``'lease expired on attempt N; <then>'`` (claimed or queued again)."""
    head = literal_column("'lease expired on attempt '", Text) + cast(c.attempts, Text)
    if then is not None:
        return head + literal_column(f"'; {then}'", Text)
    return (
        head
        + literal_column("' of '", Text)
        + cast(c.max_attempts, Text)
        + literal_column(
            "': the worker stopped or crashed while running the job; not retried'", Text
        )
    )
