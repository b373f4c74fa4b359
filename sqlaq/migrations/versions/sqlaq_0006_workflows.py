"""workflows: jobs that wait for other jobs

Revision ID: sqlaq_0006
Revises: sqlaq_0005
Create Date: 2026-12-04

Frozen literal DDL, like the revisions before it. Cheap on a large table: the new
``sqlaq_jobs`` columns are nullable, or carry a constant default (recorded in the catalog
by PostgreSQL 11+, no rewrite); the CHECK constraint is added NOT VALID and validated
after (a scan that blocks no writer); the waiting index is partial on rows no existing
job matches (``parent_ids IS NOT NULL``); the edges table is new and the trigger is metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sqlaq.migrations import _citus

revision: str = "sqlaq_0006"
down_revision: str | None = "sqlaq_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _citus.prepare()
    # Set on a job when another job is enqueued to wait for it: only flagged jobs run
    # the trigger below when they finish.
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN has_dependents boolean NOT NULL DEFAULT false")
    # A waiting job's choice when a parent fails or is cancelled (NULL: 'cancel').
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN on_parent_failure text")
    # Every parent the job was enqueued to wait for (its results' addresses).
    op.execute("ALTER TABLE sqlaq_jobs ADD COLUMN parent_ids bigint[]")
    op.execute(
        "ALTER TABLE sqlaq_jobs ADD CONSTRAINT sqlaq_jobs_on_parent_failure_check "
        "CHECK (on_parent_failure IN ('cancel', 'run', 'fail')) NOT VALID"
    )
    op.execute("ALTER TABLE sqlaq_jobs VALIDATE CONSTRAINT sqlaq_jobs_on_parent_failure_check")
    # A waiting job is queued with run_at = '9999-01-01' (past any run_at an enqueue
    # accepts, yet readable by Python): never due, so the claim does not change. This
    # index finds the queued jobs that have parents, for the release sweep.
    op.execute(
        "CREATE INDEX sqlaq_jobs_waiting_idx ON sqlaq_jobs (id) "
        "WHERE status = 'queued' AND parent_ids IS NOT NULL"
    )
    # One row per parent not yet finished of each waiting job. A parent deletes its own
    # rows when it finishes: no row is shared by two parents.
    op.execute(
        """
        CREATE TABLE sqlaq_job_deps (
            parent_id bigint NOT NULL,
            child_id bigint NOT NULL,
            CONSTRAINT sqlaq_job_deps_pkey PRIMARY KEY (parent_id, child_id)
        )
        """
    )
    # (child_id, parent_id): "is any parent left?" probes from the finishing parent's
    # own position, up and down, so it meets a live edge at once instead of walking the
    # dead edges of the parents that finished before it.
    op.execute("CREATE INDEX sqlaq_job_deps_child_id_idx ON sqlaq_job_deps (child_id, parent_id)")
    op.execute(
        """
        CREATE FUNCTION sqlaq_jobs_settle_children() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            children bigint[];
            child bigint;
            other bigint;
            released_queue text;
        BEGIN
            IF OLD.parent_ids IS NOT NULL THEN
                DELETE FROM sqlaq_job_deps WHERE child_id = NEW.id;
            END IF;
            IF NOT NEW.has_dependents THEN
                RETURN NULL;
            END IF;
            WITH gone AS (DELETE FROM sqlaq_job_deps WHERE parent_id = NEW.id RETURNING child_id)
            SELECT array_agg(child_id) INTO children FROM gone;
            IF children IS NULL THEN
                RETURN NULL;
            END IF;
            IF NEW.status <> 'done' THEN
                UPDATE sqlaq_jobs SET
                    status = CASE WHEN on_parent_failure = 'fail' THEN 'failed'
                        ELSE 'cancelled' END,
                    finished_at = now(),
                    last_error = format('parent job %s %s', NEW.id, NEW.status)
                WHERE id = ANY (children) AND status = 'queued'
                    AND run_at >= '9900-01-01 00:00:00+00'
                    AND coalesce(on_parent_failure, 'cancel') <> 'run';
            END IF;
            FOREACH child IN ARRAY children LOOP
                -- Any parent left? Probe up, then down, from this parent's own edge: the
                -- nearest live edge comes first, not the dead ones of earlier parents.
                SELECT d.parent_id INTO other FROM sqlaq_job_deps d
                WHERE d.child_id = child AND d.parent_id > NEW.id
                ORDER BY d.parent_id LIMIT 1;
                IF other IS NULL THEN
                    SELECT d.parent_id INTO other FROM sqlaq_job_deps d
                    WHERE d.child_id = child AND d.parent_id < NEW.id
                    ORDER BY d.parent_id DESC LIMIT 1;
                END IF;
                IF other IS NOT NULL THEN
                    -- Its parent may be finishing at this instant, unseen: check again
                    -- after commit (whoever listens on sqlaq_release).
                    PERFORM pg_notify('sqlaq_release', child::text);
                ELSE
                    released_queue := NULL;
                    UPDATE sqlaq_jobs SET run_at = now()
                    WHERE id = child AND status = 'queued'
                        AND run_at >= '9900-01-01 00:00:00+00'
                    RETURNING queue INTO released_queue;
                    IF released_queue IS NOT NULL THEN
                        PERFORM pg_notify('sqlaq_jobs', released_queue);
                    END IF;
                END IF;
            END LOOP;
            RETURN NULL;
        END
        $$
        """
    )
    _citus.jobs_trigger(
        "CREATE TRIGGER sqlaq_jobs_deps_trg AFTER UPDATE OF status ON sqlaq_jobs "
        "FOR EACH ROW WHEN ((NEW.has_dependents OR OLD.parent_ids IS NOT NULL) AND "
        "NEW.status IN ('done', 'failed', 'cancelled')) "
        "EXECUTE FUNCTION sqlaq_jobs_settle_children()"
    )
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0006'::text $$"
    )


def downgrade() -> None:
    _citus.prepare()
    op.execute(
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_schema_revision() RETURNS text "
        "LANGUAGE sql IMMUTABLE AS $$ SELECT 'sqlaq_0005'::text $$"
    )
    _citus.jobs_trigger("DROP TRIGGER IF EXISTS sqlaq_jobs_deps_trg ON sqlaq_jobs")
    op.execute("DROP FUNCTION IF EXISTS sqlaq_jobs_settle_children()")
    op.execute("DROP TABLE IF EXISTS sqlaq_job_deps")
    # Jobs still waiting become due: without the edges nothing would ever release them.
    op.execute(
        "UPDATE sqlaq_jobs SET run_at = now() WHERE status = 'queued' "
        "AND run_at >= '9900-01-01 00:00:00+00'"
    )
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_waiting_idx")
    op.execute(
        "ALTER TABLE sqlaq_jobs DROP CONSTRAINT IF EXISTS sqlaq_jobs_on_parent_failure_check"
    )
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS parent_ids")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS on_parent_failure")
    op.execute("ALTER TABLE sqlaq_jobs DROP COLUMN IF EXISTS has_dependents")
