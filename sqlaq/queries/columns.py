"""The job's columns, in one table: which columns each INSERT writes, and the column
lists statements return."""

from __future__ import annotations

from sqlaq.queries._common import c

#: Columns a claim returns, in this order.
CLAIM_COLUMNS = (
    c.id,
    c.queue,
    c.kind,
    c.payload,
    c.priority,
    c.status,
    c.attempts,
    c.max_attempts,
    c.lease_token,
    c.run_at,
    c.created_at,
    c.headers,
    c.timeout,
)

#: Columns :func:`enqueue_copy_stmt` loads, in this order; ``run_at`` and ``created_at``
#: keep their default, ``now()``.
COPY_COLUMNS = ("queue", "kind", "payload", "priority", "max_attempts")

#: Columns :func:`job_outcome_stmt` and :func:`watch_job_stmt` return, in this order.
OUTCOME_COLUMNS = (c.id, c.status, c.result, c.last_error, c.finished_at)
