"""fair claiming: the fair index (a share's pending jobs in claim order)

Revision ID: sqlaq_0009
Revises: sqlaq_0008
Create Date: 2026-12-04

Frozen literal DDL, like the revisions before it. No table rewrite: one partial index
over the pending rows (queued or running) that have a key, built by one scan.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0009"
down_revision: str | None = "sqlaq_0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # A queue's pending keyed jobs by key in claim order: the fair claim walks the keys
    # (one probe each: a loose index scan) and reads each key's first due jobs from it.
    # Only rows with a key: a job without one (every job of an application that does
    # not use keys) costs this index nothing.
    op.execute(
        "CREATE INDEX sqlaq_jobs_fair_idx ON sqlaq_jobs "
        "(queue, key, priority DESC, run_at, id) "
        "WHERE status IN ('queued', 'running') AND key IS NOT NULL"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0009'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0008'::text $$"
    )
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_fair_idx")
