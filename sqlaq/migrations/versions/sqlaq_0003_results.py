"""job results: the result column, and a NOTIFY when a job someone waits for finishes

Revision ID: sqlaq_0003
Revises: sqlaq_0002
Create Date: 2026-12-09

Frozen literal DDL, like the revisions before it. Cheap on a large table: ``result`` is
nullable without a default, and ``awaited``'s default is a constant, which
PostgreSQL 11+ records in the catalog instead of rewriting the table; the trigger is
metadata only.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0003"
down_revision: str | None = "sqlaq_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # A handler's return value, written by the completion that marks the job done.
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN result jsonb")
    # Set by sqlaq.wait on a pending job: only flagged jobs notify when they finish.
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN awaited boolean NOT NULL DEFAULT false")
    op.execute(
        """
        CREATE FUNCTION sqlaq_jobs_notify_finish() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('sqlaq_finished', NEW.id::text);
            RETURN NULL;
        END
        $$
        """
    )
    # The WHEN clause is evaluated without calling the function, so an unflagged job (the
    # common case: nobody waits for it) costs one boolean test per updated row.
    _citus.jobs_trigger(
        "CREATE TRIGGER sqlaq_jobs_finish_trg AFTER UPDATE OF status ON sqlaq_jobs "
        "FOR EACH ROW WHEN (NEW.awaited AND "
        "NEW.status IN ('done', 'failed', 'cancelled')) "
        "EXECUTE FUNCTION sqlaq_jobs_notify_finish()"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0003'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0002'::text $$"
    )
    _citus.jobs_trigger("DROP TRIGGER IF EXISTS sqlaq_jobs_finish_trg ON sqlaq_jobs")
    op.execute("DROP FUNCTION IF EXISTS sqlaq_jobs_notify_finish()")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS awaited")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS result")
