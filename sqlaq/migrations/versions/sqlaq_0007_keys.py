"""job keys: per-key concurrency and strict order per key

Revision ID: sqlaq_0007
Revises: sqlaq_0006
Create Date: 2026-12-04

Frozen literal DDL, like the revisions before it. Cheap on a large table: ``key`` is
nullable without a default (no rewrite), and the key index is partial on a column every
existing row has NULL (built by one scan, holding no row).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "sqlaq_0007"
down_revision: str | None = "sqlaq_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The job's key (a tenant, an account, a resource): what per-key limits and strict
    # order per key are counted over (NULL: no key).
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN key text")
    # The jobs of a key that are queued, running, or failed for good, in enqueue order:
    # "is there an earlier job of this key?" (strict order) is one probe of it.
    op.execute(
        "CREATE INDEX sqlaq_jobs_key_idx ON sqlaq_jobs (kind, key, id) "
        "WHERE key IS NOT NULL AND status IN ('queued', 'running', 'failed')"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0007'::text $$"
    )


def downgrade() -> None:
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0006'::text $$"
    )
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_key_idx")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS key")
