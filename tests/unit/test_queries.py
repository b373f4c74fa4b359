"""Compile-only pins of the SQL that matters in each builder."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy.dialects import postgresql

from sqlaq import JobStatus, Lease, NewJob, queries
from sqlaq.schema import jobs

DIALECT = postgresql.psycopg.dialect()  # type: ignore[attr-defined]
LEASE = Lease(1, uuid.uuid4(), uuid.uuid4(), 1, datetime.now(UTC))


def sql(stmt: object) -> str:
    return re.sub(r"\s+", " ", str(stmt.compile(dialect=DIALECT)))  # type: ignore[attr-defined]


def test_claim_locks_in_a_materialized_cte_joined_to_the_update() -> None:
    text = sql(
        queries.claim_stmt(queue="q", worker_id=uuid.uuid4(), limit=5, lease=timedelta(seconds=30))
    )
    assert text.startswith("WITH candidates AS MATERIALIZED (SELECT sqlaq_jobs.id")
    assert "sqlaq_jobs.status IN ('queued', 'running')" in text  # inlined, not bound
    assert "ORDER BY sqlaq_jobs.priority DESC, sqlaq_jobs.run_at, sqlaq_jobs.id" in text
    assert "LIMIT %(b_limit)s" in text
    assert "FOR UPDATE SKIP LOCKED" in text
    assert "FROM candidates WHERE sqlaq_jobs.id = candidates.id" in text
    assert "gen_random_uuid()" in text
    assert "now() + %(b_lease)s" in text
    assert " IN (SELECT" not in text


def test_enqueue_with_dedupe_names_the_partial_index_predicate_inline() -> None:
    text = sql(queries.enqueue_stmt(job=NewJob("k", dedupe_key="d")))
    assert (
        "ON CONFLICT (kind, dedupe_key) WHERE status IN ('queued', 'running')"
        " AND dedupe_key IS NOT NULL DO NOTHING" in text
    )
    assert "now() + %(b_delay)s" in text
    assert "RETURNING sqlaq_jobs.id" in text
    assert "ON CONFLICT" not in sql(queries.enqueue_stmt(job=NewJob("k")))


def test_enqueue_many_is_one_insert_from_unnest_in_input_order() -> None:
    text = sql(queries.enqueue_many_stmt(jobs_=[NewJob("a"), NewJob("b")]))
    assert "FROM unnest(%(b_queues)s::TEXT[]" in text
    assert "WITH ORDINALITY" in text
    assert "ORDER BY new_jobs.ordinality" in text
    assert "RETURNING sqlaq_jobs.id, sqlaq_jobs.kind, sqlaq_jobs.dedupe_key" in text


def test_fenced_updates_match_id_token_and_running_status() -> None:
    for stmt in (
        queries.complete_stmt(leases=[LEASE]),
        queries.extend_lease_stmt(leases=[LEASE], lease=timedelta(seconds=5)),
        queries.fail_stmt(lease=LEASE, error="e", retry_in=None),
    ):
        text = sql(stmt)
        # An array parameter, sent as one array literal (see fence_params).
        assert "sqlaq_jobs.id = any(%(b_ids)s::BIGINT[])" in text
        # The token counts on a running row only; the status test inside the token's
        # comparison, so the planner probes the primary key (never the running index).
        assert (
            "CASE WHEN (sqlaq_jobs.status = 'running') THEN sqlaq_jobs.lease_token END"
            " = any(%(b_tokens)s::UUID[])"
        ) in text


def test_prune_deletes_through_a_materialized_cte_of_finished_rows_only() -> None:
    text = sql(
        queries.prune_stmt(older_than=timedelta(days=7), statuses={JobStatus.DONE}, limit=500)
    )
    # (After the unfinished workflows' lineage, ``kept``, which it spares.)
    assert "doomed AS MATERIALIZED (SELECT sqlaq_jobs.id" in text
    assert "sqlaq_jobs.status IN ('done', 'failed', 'cancelled')" in text
    assert "FOR UPDATE SKIP LOCKED" in text
    assert "DELETE FROM sqlaq_jobs USING doomed WHERE sqlaq_jobs.id = doomed.id" in text


def test_bind_parameters_are_never_named_like_columns() -> None:
    columns = {"id", "queue", "kind", "payload", "status", "priority", "run_at", "attempts"}
    statements = [
        queries.enqueue_stmt(job=NewJob("k", dedupe_key="d")),
        queries.enqueue_many_stmt(jobs_=[NewJob("k")]),
        queries.claim_stmt(queue="q", worker_id=uuid.uuid4(), limit=1, lease=timedelta(1)),
        queries.extend_lease_stmt(leases=[LEASE], lease=timedelta(1)),
        queries.complete_stmt(leases=[LEASE]),
        queries.fail_stmt(lease=LEASE, error="e", retry_in=timedelta(1)),
        queries.retry_stmt(job_ids=[1]),
        queries.cancel_stmt(job_ids=[1]),
        queries.prune_stmt(older_than=timedelta(1), statuses={JobStatus.DONE}, limit=1),
    ]
    for stmt in statements:
        names = set(stmt.compile(dialect=DIALECT).params)
        assert all(name.startswith("b_") for name in names), names
        assert not names & columns


def test_the_job_fields_table_names_job_attributes_and_columns() -> None:
    from sqlaq.queries.columns import JOB_FIELDS, copy_row

    job = NewJob("k", {"a": 1}, queue="q", priority=2, max_attempts=3, key="t")
    columns = set(jobs.c.keys())
    for field in JOB_FIELDS:
        assert field.name == "delay" or field.name in columns, field
        if field.attr is not None:
            getattr(job, field.attr)  # a NewJob attribute
    assert queries.COPY_COLUMNS == ("queue", "kind", "payload", "priority", "max_attempts", "key")
    assert copy_row(job) == ("q", "k", job.payload_json, 2, 3, "t")
    # Each INSERT writes the fields' columns (delay folds into run_at).
    written = {f.name for f in JOB_FIELDS} - {"delay"}
    text = sql(queries.enqueue_stmt(job=job))
    listed = text[text.index("(") + 1 : text.index(")")].split(", ")
    assert set(listed) == written
    text = sql(queries.enqueue_many_stmt(jobs_=[job]))
    listed = text[text.index("(") + 1 : text.index(")")].split(", ")
    assert set(listed) == written
