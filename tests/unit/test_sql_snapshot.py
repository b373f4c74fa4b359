"""The compiled SQL of every statement builder, pinned to tests/unit/snapshots/sql.txt.

Every public function of :mod:`sqlaq.queries` (the ``*_stmt`` builders, the ``*_params``
helpers and the rest) is called with the arguments of :data:`CALLS` and compiled for
PostgreSQL (psycopg): the SQL as sent with its bind values, and the literal rendering
where the types allow one. Any change to that text fails here; a builder with no row in
:data:`CALLS` fails too, so a new builder comes with its snapshot.

An intended change: ``SQLAQ_UPDATE_SNAPSHOT=1 pytest tests/unit/test_sql_snapshot.py``
rewrites the file; review its diff like code.

The ``sql`` and ``binds`` lines (what reaches the server) are compared under every
SQLAlchemy the project supports. The ``literal`` lines are SQLAlchemy's own rendering for
reading, and its series render them differently (2.0 leaves some binds in an ON CONFLICT
clause as placeholders, 2.1 refuses an untyped interval): they are compared only under the
series named in the file's first line, the one that wrote it (``nox -s minimums`` runs
the floor's series).
"""

from __future__ import annotations

import inspect
import os
import uuid
import warnings
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg.sql
import pytest
import sqlalchemy
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.exc import CompileError, SAWarning

from sqlaq import queries
from sqlaq.encoding import NewJob
from sqlaq.lease import Lease
from sqlaq.limits import Rate
from sqlaq.schema import JobStatus, jobs

SNAPSHOT = Path(__file__).parent / "snapshots" / "sql.txt"
DIALECT = pg_psycopg.dialect()

WORKER = uuid.UUID("11111111-1111-1111-1111-111111111111")
TOKEN = uuid.UUID("22222222-2222-2222-2222-222222222222")
WHEN = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
LEASE = Lease(7, WORKER, TOKEN, 2, WHEN)
LEASE2 = Lease(8, WORKER, uuid.UUID("33333333-3333-3333-3333-333333333333"), 1, WHEN)
SECONDS = timedelta(seconds=30)
JOB = NewJob("send", {"to": "a@b.c"}, queue="mail", priority=3, delay=timedelta(seconds=5))
JOB_KEYED = NewJob("send", {"to": "x"}, dedupe_key="k1", max_attempts=4, timeout=SECONDS)
JOB_AT = NewJob("send", run_at=WHEN)
HEADERS = '{"traceparent": "00-abc"}'
REFERENCE = queries.Reference("public", "orders", "job_id")
RATE = Rate(5, timedelta(seconds=1))
#: An operator's condition: an OR to keep inside, a colon that is no bind, a percent sign.
WHERE_TEXT = "payload->>'region' = 'eu' OR payload::text LIKE '%12:30%'"

#: Builder name -> the keyword (or positional, as a tuple) arguments of each call pinned.
CALLS: dict[str, list[Any]] = {
    "enqueue_params": [((JOB,), {"headers": HEADERS})],
    "enqueue_stmt": [{"job": JOB}, {"job": JOB_KEYED, "headers": HEADERS}, {"job": JOB_AT}],
    "debounce_enqueue_stmt": [
        {"job": JOB, "debounce_key": "d", "debounce": SECONDS},
        {"job": JOB, "debounce_key": "d", "debounce": SECONDS, "max_wait": timedelta(minutes=5)},
    ],
    "unique_enqueue_stmt": [{"job": JOB_KEYED, "unique_for": timedelta(hours=1)}],
    "unique_holder_stmt": [{"kind": "send", "key": "k1"}],
    "retarget_hold_stmt": [
        {"kind": "send", "key": "k1", "job_id": 9, "unique_for": timedelta(hours=1)}
    ],
    "prune_unique_holds_stmt": [{"limit": 100}],
    "find_pending_duplicate_stmt": [{"kind": "send", "dedupe_key": "k1"}],
    "enqueue_many_stmt": [
        {"jobs_": [JOB, JOB_KEYED, JOB_AT]},
        {"jobs_": [JOB], "headers": HEADERS},
    ],
    "enqueue_uniform_stmt": [{}],
    "enqueue_uniform_params": [((JOB, '[{"a": 1}, {"a": 2}]'), {"headers": HEADERS})],
    "enqueue_copy_stmt": [{}],
    "find_pending_duplicates_stmt": [{"kinds": ["a", "b"], "dedupe_keys": ["k1", "k2"]}],
    "claim_params": [
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS},
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS, "kind": "k"},
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "exclude_kinds": {"b", "a"},
        },
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "after": queries.ClaimPosition(3, WHEN, 7),
        },
    ],
    "claim_stmt": [
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS},
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS, "kind": "k"},
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS, "kind": "k", "ids": True},
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "exclude_kinds": {"b", "a"},
        },
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "where": [jobs.c.payload["region"].astext == "eu", jobs.c.priority > 1],
        },
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "kind": "k",
            "where": queries.where_text(WHERE_TEXT),
        },
        # The worker's bounded claim: from a position of the claim index.
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS, "bounded": True},
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "exclude_kinds": {"b", "a"},
            "bounded": True,
        },
    ],
    "where_text": [((WHERE_TEXT,), {})],
    "where_check_stmt": [
        {"where": queries.where_text(WHERE_TEXT)},
        {"where": [jobs.c.payload["region"].astext == "eu", jobs.c.priority > 1]},
    ],
    "lock_kind_stmt": [{"kind": "k"}],
    "relaxed_commit_stmt": [{}],
    "relaxed_stmt": [
        ((queries.claim_stmt(queue="q", worker_id=WORKER, limit=5, lease=SECONDS),), {}),
        (
            (
                queries.claim_stmt(
                    queue="q", worker_id=WORKER, limit=5, lease=SECONDS, bounded=True
                ),
            ),
            {},
        ),
    ],
    "key_running_stmt": [{"kind": "k"}],
    "busiest_keys_stmt": [{}, {"limit": 5}],
    "fair_claim_params": [
        {"queue": "q", "worker_id": WORKER, "limit": 5, "lease": SECONDS},
        {
            "queue": "q",
            "worker_id": WORKER,
            "limit": 5,
            "lease": SECONDS,
            "exclude_kinds": {"b"},
            "weights": {"vip": 3, "a": 1},
        },
    ],
    "fair_claim_stmt": [{}, {"exclude_kinds": True}],
    "first_due_params": [{"queue": "q"}, {"queue": "q", "exclude_kinds": {"b", "a"}}],
    "first_due_stmt": [{"queue": "q"}, {"queue": "q", "exclude_kinds": ["a"]}],
    "keyed_candidates_params": [
        {"queue": "q", "kind": "k", "limit": 5, "full_keys": ["a"], "picked": [1, 2]}
    ],
    "keyed_candidates_stmt": [{"ordered": False}, {"ordered": True}],
    "kind_limit_state_params": [{"kind": "k", "rate": None}, {"kind": "k", "rate": RATE}],
    "kind_limit_state_stmt": [{"kind": "k", "rate": None}, {"kind": "k", "rate": RATE}],
    "record_starts_params": [{"kind": "k", "rate": RATE, "started": 3}],
    "record_starts_stmt": [{"kind": "k", "rate": RATE, "started": 3}],
    "fence_params": [(([LEASE, LEASE2],), {}), (([],), {})],
    "extend_lease_stmt": [{"leases": [LEASE, LEASE2], "lease": SECONDS}],
    "complete_stmt": [{"leases": [LEASE, LEASE2]}],
    "complete_result_params": [{"lease": LEASE, "result_json": '{"ok": true}'}],
    "complete_result_stmt": [{"lease": LEASE, "result_json": '{"ok": true}'}],
    "fail_params": [
        {"lease": LEASE, "error": "boom", "retry_in": SECONDS},
        {"lease": LEASE, "error": "boom", "retry_in": None},
    ],
    "fail_stmt": [{"lease": LEASE, "error": "boom", "retry_in": SECONDS}],
    "retry_stmt": [{"job_ids": [1, 2]}],
    "cancel_stmt": [{"job_ids": [1, 2]}],
    "cancel_workflow_stmt": [{"job_id": 9}],
    "cancelled_among_stmt": [{"job_ids": [1, 2]}],
    "blocking_references_stmt": [{}],
    "prune_stmt": [
        {"older_than": timedelta(days=7), "statuses": {JobStatus.DONE}, "limit": 1000},
        {
            "older_than": timedelta(days=7),
            "statuses": {JobStatus.DONE, JobStatus.FAILED},
            "limit": 1000,
            "spare": [REFERENCE],
        },
    ],
    "count_referenced_stmt": [
        {
            "older_than": timedelta(days=7),
            "statuses": {JobStatus.DONE},
            "references": [REFERENCE],
            "limit": 10,
        }
    ],
    "count_prunable_stmt": [{"older_than": timedelta(days=7), "statuses": {JobStatus.DONE}}],
    "sweep_stmt": [{"limit": 100}],
    "clock_stmt": [{}],
    "periodic_insert_stmt": [{"name": "nightly", "slot": WHEN}],
    "periodic_lock_stmt": [{"name": "nightly"}],
    "periodic_advance_stmt": [{"name": "nightly", "slot": WHEN}],
    "try_lead_stmt": [{}],
    "resign_stmt": [{}],
    "vacuum_need_stmt": [{}],
    "vacuum_stmt": [{}],
    "pause_stmt": [{"queue": "q"}, {"queue": "q", "paused_by": "ops"}],
    "resume_stmt": [{"queue": "q"}],
    "paused_queues_stmt": [{}, {"queue": "q"}],
    "heartbeat_stmt": [
        {"worker_id": WORKER, "hostname": "h", "pid": 42, "queues": ["a", "b"], "concurrency": 4}
    ],
    "forget_worker_stmt": [{"worker_id": WORKER}],
    "prune_workers_stmt": [{"older_than": timedelta(minutes=10)}],
    "workers_stmt": [{}, {"worker_id": WORKER}],
    "serving_workers_stmt": [{"queue": "q", "within": timedelta(minutes=1)}],
    "dedupe_twin_stmt": [{"job_id": 1, "kind": "k", "dedupe_key": "d"}],
    "jobs_ahead_stmt": [{"queue": "q", "priority": 1, "run_at": WHEN, "job_id": 5, "limit": 100}],
    "catalog_tables_stmt": [{"tables": ["sqlaq_jobs", "sqlaq_rates"]}],
    "catalog_indexes_stmt": [{"tables": ["sqlaq_jobs"]}],
    "catalog_constraints_stmt": [{"tables": ["sqlaq_jobs"]}],
    "catalog_triggers_stmt": [{"tables": ["sqlaq_jobs"]}],
    "catalog_functions_stmt": [{"functions": ["sqlaq_revision"]}],
    "due_queues_stmt": [{}],
    "enqueued_jobs_stmt": [{}, {"kind": "k", "payload": {"a": 1}, "queue": "q"}],
    "stats_counts_stmt": [{}],
    "stats_health_stmt": [{}],
    "get_job_stmt": [{"job_id": 1}],
    "key_state_stmt": [{"kind": "k", "key": "acme", "job_id": 7}],
    "job_outcome_stmt": [{"job_id": 1}],
    "watch_job_stmt": [{"job_id": 1}],
    "count_jobs_stmt": [{}, {"statuses": {JobStatus.FAILED}, "kind": "k", "queue": "q"}],
    "find_jobs_stmt": [
        {},
        {
            "statuses": {JobStatus.FAILED, JobStatus.DONE},
            "kind": "k",
            "queue": "q",
            "since": timedelta(hours=1),
            "after_id": 10,
            "limit": 50,
        },
        {"after_id": 10, "newest_first": True},
    ],
    "has_schema_revision_stmt": [{}],
    "schema_revision_stmt": [{}],
    "ping_stmt": [{}],
    "create_database_stmt": [{"name": "sqlaq_pytest_1a2b"}, {"name": 'odd "name": x'}],
    "drop_database_stmt": [{"name": "sqlaq_pytest_1a2b"}],
    "snooze_stmt": [{"leases": [LEASE], "delay": SECONDS}],
    "handback_stmt": [{"leases": [LEASE, LEASE2]}],
    "notify_queues_stmt": [{"queues": ["a", "b"]}],
    "listen_stmt": [{}, {"channel": ["sqlaq_jobs", "sqlaq_cancel"]}],
    "privileges_stmt": [
        {"needed": {"sqlaq_jobs": ["SELECT", "UPDATE"], "sqlaq_rates": ["INSERT"]}}
    ],
    "error_line": [{}],
    "overview_counts_stmt": [{"window": timedelta(hours=1)}],
    "overview_health_stmt": [{}],
    "throughput_stmt": [{"window": timedelta(hours=1), "bucket": timedelta(minutes=5)}],
    "wait_percentiles_stmt": [{"window": timedelta(hours=1), "bucket": timedelta(minutes=5)}],
    "failure_groups_stmt": [
        {"since": None},
        {"since": timedelta(days=1), "kind": "k", "error": "ValueError: x", "limit": 10},
    ],
    "failure_group_ids_stmt": [
        {"kind": "k", "error": "ValueError: x", "since": None, "after_id": 0, "limit": 100},
        {"kind": "k", "error": "E", "since": timedelta(days=1), "after_id": 5, "limit": 100},
    ],
    "running_by_kind_stmt": [{}],
    "running_workers_stmt": [{}],
    "rate_logs_stmt": [{}, {"periods": {"k": timedelta(seconds=1)}}],
    "periodic_slots_stmt": [{}],
    "jobs_list_stmt": [
        {"newest_first": True, "limit": 51},
        {
            "statuses": [JobStatus.FAILED],
            "kind": "k",
            "queue": "q",
            "since": timedelta(hours=2),
            "after_id": 7,
            "limit": 51,
            "error_head": 120,
        },
    ],
    "job_page_stmt": [{"job_id": 7, "head": 65537}],
    "job_value_stmt": [
        {"job_id": 7, "name": "payload"},
        {"job_id": 7, "name": "result"},
        {"job_id": 7, "name": "last_error"},
    ],
    "travel_stmts": [{"by": timedelta(hours=1)}],
    # workflows
    "mark_parents_stmt": [{"job_ids": [7, 8]}],
    "link_stmt": [{"parent_ids": [7, 8], "child_ids": [9, 9]}],
    "hold_stmt": [{"parent_ids": [7, 8], "child_ids": [9, 9], "on_parent_failure": "cancel"}],
    "end_children_stmt": [
        {"job_ids": [9], "status": JobStatus.CANCELLED, "error": "parent job 7 failed"}
    ],
    "release_stmt": [{"job_ids": [9, 10]}],
    "wait_finishing_stmt": [{"job_ids": [9, 10]}],
    "release_waiting_stmt": [{"limit": 1000}],
    "waiting_for_stmt": [{"job_id": 9}],
    "parent_results_stmt": [{"job_id": 9}],
    "workflow_cte": [{"job_id": 9}],
    "set_setting_stmt": [{"name": "jit", "value": "off"}],
    "workflow_stmt": [{"job_id": 9, "limit": 200, "count_limit": 10000}],
}

#: Constant column lists and values of the module, pinned beside the builders.
CONSTANTS = (
    "CLAIM_COLUMNS",
    "COPY_COLUMNS",
    "OUTCOME_COLUMNS",
    "WAIT_PERCENTILES",
    "LARGE_VALUES",
)


def _builders() -> dict[str, Callable[..., Any]]:
    """Every public function :mod:`sqlaq.queries` offers (wherever it is defined)."""
    return {
        name: value
        for name in dir(queries)
        if not name.startswith("_")
        and inspect.isfunction(inspect.unwrap(value := getattr(queries, name)))
        and value.__module__.startswith("sqlaq.queries")
    }


def _render(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(_render(v) for v in value)
    if isinstance(value, dict):
        return "params " + repr(sorted(value.items()))
    if isinstance(value, psycopg.sql.Composable):
        return "psycopg " + repr(value)
    compiled = value.compile(dialect=DIALECT)
    lines = ["sql " + str(compiled), "binds " + repr(sorted(compiled.params.items()))]
    try:
        # A warning (a type that renders no literal) is an error here whatever the
        # pytest configuration, so the file does not depend on how the test is run.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            literal = value.compile(dialect=DIALECT, compile_kwargs={"literal_binds": True})
        lines.append("literal " + str(literal))
    except (CompileError, SAWarning) as exc:  # no literal form: the binds above pin it
        lines.append(f"literal n/a ({type(exc).__name__})")
    return "\n".join(lines)


def _series() -> str:
    """The installed SQLAlchemy's series ("2.1"), which decides the literal lines."""
    return ".".join(sqlalchemy.__version__.split(".")[:2])


HEADER = "# literal lines rendered by SQLAlchemy "


def _comparable(text: str, *, literals: bool) -> str:
    """The text without its header, and without the literal renderings (a ``literal``
    line and its continuation lines, up to the next statement or entry) unless asked."""
    kept, in_literal = [], False
    for line in text.splitlines()[1:]:
        if line.startswith("literal "):
            in_literal = True
        elif not line or line.startswith(("sql ", "=== ", "params ", "psycopg ")):
            in_literal = False
        if literals or not in_literal:
            kept.append(line)
    return "\n".join(kept)


def _snapshot() -> str:
    builders = _builders()
    entries = [HEADER + _series()]
    for name in sorted(CALLS):
        for index, call in enumerate(CALLS[name]):
            args, kwargs = call if isinstance(call, tuple) else ((), call)
            entries.append(f"=== {name} #{index}\n{_render(builders[name](*args, **kwargs))}")
    for name in CONSTANTS:
        # Columns by name: a Column's repr holds object addresses.
        value = [getattr(item, "name", item) for item in getattr(queries, name)]
        entries.append(f"=== {name}\n{value!r}")
    return "\n\n".join(entries) + "\n"


def test_every_builder_has_a_snapshot_row() -> None:
    missing = sorted(set(_builders()) - set(CALLS))
    unknown = sorted(set(CALLS) - set(_builders()))
    assert not missing, f"builders without a row in CALLS (add one, then regenerate): {missing}"
    assert not unknown, f"rows in CALLS for no builder of sqlaq.queries: {unknown}"


def test_compiled_sql_matches_the_snapshot() -> None:
    text = _snapshot()
    if os.environ.get("SQLAQ_UPDATE_SNAPSHOT") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(text)
        pytest.skip(f"rewrote {SNAPSHOT}")
    assert SNAPSHOT.exists(), f"no {SNAPSHOT}: run with SQLAQ_UPDATE_SNAPSHOT=1"
    written = SNAPSHOT.read_text()
    assert written.startswith(HEADER), f"{SNAPSHOT}: no header: run with SQLAQ_UPDATE_SNAPSHOT=1"
    literals = written.splitlines()[0] == HEADER + _series()
    text, expected = _comparable(text, literals=literals), _comparable(written, literals=literals)
    if text != expected:
        # The first differing entry, so the failure says which builder changed.
        for got, want in zip(text.split("\n\n=== "), expected.split("\n\n=== "), strict=False):
            assert got == want
        assert text == expected
