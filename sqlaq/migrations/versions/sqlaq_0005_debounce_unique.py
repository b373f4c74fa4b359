"""debounce, unique_for and per-job timeouts

Revision ID: sqlaq_0005
Revises: sqlaq_0004
Create Date: 2026-12-03

Frozen literal DDL, like the revisions before it. Cheap on a large table: the two new
``sqlaq_jobs`` columns are nullable without a default (no rewrite), the debounce index
is partial on a column every existing row has NULL (built by one scan, holding no row),
and the holds table is new.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0005"
down_revision: str | None = "sqlaq_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # A debounced job's key: at most one never-started queued job per (kind, key), the
    # arbiter of enqueue's ON CONFLICT ... DO UPDATE (a started job has left it: it has
    # read its payload).
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN debounce_key text")
    # The job's own attempt timeout, over its handler's (NULL: the handler's).
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN timeout interval")
    op.execute(
        "CREATE UNIQUE INDEX sqlaq_jobs_debounce_idx ON sqlaq_jobs (kind, debounce_key) "
        "WHERE status = 'queued' AND attempted_at IS NULL AND debounce_key IS NOT NULL"
    )
    # unique_for: a row per (kind, dedupe_key) holding the key until expires_at, whatever
    # becomes of its job; taken by an upsert whose WHERE lets only an expired hold be
    # taken over. The leader deletes expired rows.
    op.execute(
        """
        CREATE TABLE sqlaq_unique_holds (
            kind text NOT NULL,
            key text NOT NULL,
            job_id bigint NOT NULL,
            expires_at timestamptz NOT NULL,
            CONSTRAINT sqlaq_unique_holds_pkey PRIMARY KEY (kind, key)
        )
        """
    )
    op.execute("CREATE INDEX sqlaq_unique_holds_expires_at_idx ON sqlaq_unique_holds (expires_at)")
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0005'::text $$"
    )


def downgrade() -> None:
    # On Citus its upgrade could not run again: a unique index without queue.
    _citus.refuse(
        "sqlaq_0005",
        "downgrade",
        "its upgrade (a unique index on (kind, debounce_key), without the distribution "
        "column) could not run there again",
    )
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0004'::text $$"
    )
    op.execute("DROP TABLE IF EXISTS sqlaq_unique_holds")
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_debounce_idx")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS timeout")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS debounce_key")
