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

It also replaces the settle trigger's function (sqlaq_0006): a finishing parent that
sees another parent's edge that no transaction is deleting (its ``xmax`` is 0) leaves
the child to that parent, which finishes later, and notifies nothing; it notifies
``sqlaq_release`` only when every parent left is finishing in a transaction in flight
(the check after commit waits for those, see ``sqlaq.queries.wait_finishing_stmt``).
Before, every parent but the last notified, and a NOTIFY serializes the commits that
send one: a fan-in's members no longer do.
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
        """
        CREATE OR REPLACE FUNCTION sqlaq_jobs_settle_children() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            children bigint[];
            child bigint;
            other bigint;
            free boolean;
            finishing boolean;
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
                -- A parent left that is not finishing now (its edge's xmax is 0: no
                -- transaction deletes it)? It settles this child when it finishes:
                -- nothing to do here. Walk up, then down, from this parent's own edge,
                -- one ordered probe per edge: the nearest live edge comes first, not
                -- the dead ones of earlier parents, and edges being deleted (a few:
                -- those of the parents finishing in flight) are stepped over.
                free := false;
                finishing := false;
                other := NEW.id;
                LOOP
                    SELECT d.parent_id, d.xmax = '0'::xid INTO other, free
                    FROM sqlaq_job_deps d WHERE d.child_id = child AND d.parent_id > other
                    ORDER BY d.parent_id LIMIT 1;
                    EXIT WHEN other IS NULL OR free;
                    finishing := true;
                END LOOP;
                CONTINUE WHEN free;
                other := NEW.id;
                LOOP
                    SELECT d.parent_id, d.xmax = '0'::xid INTO other, free
                    FROM sqlaq_job_deps d WHERE d.child_id = child AND d.parent_id < other
                    ORDER BY d.parent_id DESC LIMIT 1;
                    EXIT WHEN other IS NULL OR free;
                    finishing := true;
                END LOOP;
                CONTINUE WHEN free;
                IF finishing THEN
                    -- Each parent left is finishing in a transaction in flight: check
                    -- again after commit (whoever listens on sqlaq_release waits for
                    -- those transactions, then looks).
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
    # sqlaq_0006's function: a parent that sees another parent left always notifies.
    op.execute(
        """
        CREATE OR REPLACE FUNCTION sqlaq_jobs_settle_children() RETURNS trigger
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
    op.execute("DROP INDEX IF EXISTS sqlaq_jobs_parents_idx")
