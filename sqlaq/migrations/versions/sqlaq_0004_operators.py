"""operators: paused queues, the workers' heartbeat rows, and the jobs' headers

Revision ID: sqlaq_0004
Revises: sqlaq_0003
Create Date: 2026-12-16

Frozen literal DDL, like the revisions before it. Cheap on a large table: two new
small tables, and ``headers`` is nullable without a default, so ``sqlaq_jobs`` is not
rewritten.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0004"
down_revision: str | None = "sqlaq_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # A row per paused queue: every claim of a queue looks its name up here (one primary
    # key probe, evaluated once per claim), so a pause holds across every worker at once.
    op.execute(
        """
        CREATE TABLE sqlaq_paused_queues (
            queue text NOT NULL,
            paused_at timestamptz NOT NULL DEFAULT now(),
            paused_by text,
            CONSTRAINT sqlaq_paused_queues_pkey PRIMARY KEY (queue)
        )
        """
    )
    # A row per running worker, written by its maintenance thread once per interval
    # (and at start), deleted when it stops cleanly; the leader prunes rows not seen for
    # a while (a worker that was killed).
    op.execute(
        """
        CREATE TABLE sqlaq_workers (
            worker_id uuid NOT NULL,
            hostname text NOT NULL,
            pid integer NOT NULL,
            queues text[] NOT NULL,
            concurrency integer NOT NULL,
            started_at timestamptz NOT NULL DEFAULT now(),
            last_seen_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT sqlaq_workers_pkey PRIMARY KEY (worker_id)
        )
        """
    )
    # What the enqueuer sends along with the job, outside its payload: the trace
    # context of the enqueue (W3C traceparent/tracestate) with sqlaq[otel].
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN headers jsonb")
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0004'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0003'::text $$"
    )
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS headers")
    op.execute("DROP TABLE IF EXISTS sqlaq_workers")
    op.execute("DROP TABLE IF EXISTS sqlaq_paused_queues")
