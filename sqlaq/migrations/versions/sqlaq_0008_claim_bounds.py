"""claim bounds: the insert trigger's NOTIFY says where the new jobs sit in the claim index

Revision ID: sqlaq_0008
Revises: sqlaq_0007
Create Date: 2026-12-04

Frozen literal DDL, like the revisions before it; only a function is replaced (no table
is touched). The worker claims from the position of the last job it claimed, not from
the queue's first entry (a bounded claim: the dead index entries behind it, which a
snapshot held elsewhere keeps, are never walked). A job that commits behind that
position must say where it is: each inserting statement now notifies, per queue, the
highest priority and the earliest ``run_at`` (in microseconds since 1970) of the due jobs
it inserted, ``'<queue> <priority> <microseconds>'``, and the worker moves its bound back
there. A ``run_at`` of ±infinity sends the queue alone (a position unknown: a full claim).

A worker of an earlier sqlaq matches the payload against its queue names and ignores
this one: between the upgrade and the new workers it finds new jobs at its poll
(``poll_interval``, 5 s by default), as it would with the trigger disabled. The
downgrade restores the queue-only payload, which this sqlaq reads as "somewhere in the
queue" (a full claim).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0008"
down_revision: str | None = "sqlaq_0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    op.execute(
        """
        CREATE OR REPLACE FUNCTION sqlaq_jobs_notify() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            IF coalesce(current_setting('sqlaq.notify', true), '') <> 'off' THEN
                PERFORM pg_notify('sqlaq_jobs', q.queue || coalesce(' ' || q.priority || ' '
                    || (extract(epoch FROM q.run_at) * 1000000)::bigint, ''))
                FROM (SELECT queue, max(priority) AS priority,
                        CASE WHEN isfinite(min(run_at)) THEN min(run_at) END AS run_at
                    FROM sqlaq_new_jobs WHERE run_at <= now() GROUP BY queue) AS q;
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0008'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0007'::text $$"
    )
    op.execute(
        """
        CREATE OR REPLACE FUNCTION sqlaq_jobs_notify() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            IF coalesce(current_setting('sqlaq.notify', true), '') <> 'off' THEN
                PERFORM pg_notify('sqlaq_jobs', q.queue)
                FROM (SELECT DISTINCT queue FROM sqlaq_new_jobs WHERE run_at <= now()) AS q;
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
