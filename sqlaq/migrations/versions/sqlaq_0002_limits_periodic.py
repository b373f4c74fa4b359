"""limits and periodic jobs: attempted_at, the running index, sqlaq_rates, sqlaq_periodic

Revision ID: sqlaq_0002
Revises: sqlaq_0001
Create Date: 2026-12-02

Frozen literal DDL, like sqlaq_0001. Every statement is cheap on a large table:
``ADD COLUMN`` of a nullable column without a default rewrites nothing, and the new
partial index covers running rows only (a handful), so it builds in moments. It is
built without CONCURRENTLY so that the revision stays one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0002"
down_revision: str | None = "sqlaq_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # When the current attempt started (the claim's now()): what rate limits and
    # operators read, on the database's clock.
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN attempted_at timestamptz")
    # Counts the live leases of one kind under its claim lock (global concurrency).
    op.execute(
        "CREATE INDEX sqlaq_jobs_running_idx ON sqlaq_jobs (kind, run_at) WHERE status = 'running'"
    )
    # The recent starts of each rate-limited kind: a sliding-window log, trimmed to the
    # rate's count on every claim, so a row never holds more than N timestamps.
    op.execute(
        """
        CREATE TABLE sqlaq_rates (
            kind text NOT NULL,
            starts timestamptz[] NOT NULL DEFAULT '{}',
            CONSTRAINT sqlaq_rates_pkey PRIMARY KEY (kind)
        )
        """
    )
    # The last schedule slot enqueued for each periodic job: the upsert that advances it
    # is what makes one job per slot across any number of workers.
    op.execute(
        """
        CREATE TABLE sqlaq_periodic (
            name text NOT NULL,
            last_slot timestamptz NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT sqlaq_periodic_pkey PRIMARY KEY (name)
        )
        """
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0002'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0001'::text $$"
    )
    op.execute("DROP TABLE IF EXISTS sqlaq_periodic")
    op.execute("DROP TABLE IF EXISTS sqlaq_rates")
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_running_idx")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS attempted_at")
