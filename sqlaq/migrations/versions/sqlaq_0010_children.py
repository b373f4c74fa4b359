"""workflow children: an index that finds a job's children by parent

Revision ID: sqlaq_0010
Revises: sqlaq_0009
Create Date: 2026-12-04

Frozen literal DDL, like the revisions before it. No table rewrite: one partial GIN
index over ``parent_ids``, built by one scan. Once a parent has finished its rows of
``sqlaq_job_deps`` are gone, and its children were found by reading every job enqueued
after it; ``parent_ids @> ARRAY[parent]`` now reads them from this index. Only jobs with
parents (``parent_ids IS NOT NULL``) are in it: a job outside any workflow costs it
nothing. ``fastupdate`` is off: a walk probes the index once per job it meets, and a
pending list (up to ``gin_pending_list_limit``, 4 MB) would be read whole at each
probe.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0010"
down_revision: str | None = "sqlaq_0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # A job's children by parent, whatever their status: what a workflow's walk
    # (read_workflow, cancel_workflow, retention) reads for each step down.
    op.execute(
        "CREATE INDEX sqlaq_jobs_parents_idx ON sqlaq_jobs USING gin (parent_ids) "
        "WITH (fastupdate = off) WHERE parent_ids IS NOT NULL"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0010'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0009'::text $$"
    )
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_parents_idx")
