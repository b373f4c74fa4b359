"""Bad input raises InvalidJobError before any SQL runs, and nothing is written.

One test per item of DESIGN.md A3's list, for enqueue, enqueue_many and the ORM Job.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection
from sqlalchemy.orm import Session

import sqlaq
from sqlaq import InvalidJobError, NewJob
from tests.helpers import count_jobs

BAD_INPUT: list[tuple[str, dict[str, Any], str]] = [
    (
        "set-in-payload",
        {"payload": {"tags": {"a", "b"}}},
        r"payload\['tags'\] is a set.*use a list",
    ),
    ("object-in-payload", {"payload": {"when": object()}}, r"payload\['when'\] is a object"),
    ("payload-not-object", {"payload": [1, 2]}, r"payload must be a dict"),
    ("non-str-key", {"payload": {1: "x"}}, r"key 1 of type int"),
    ("nan", {"payload": {"x": float("nan")}}, r"payload\['x'\] is nan.*NaN"),
    ("infinity", {"payload": {"x": [1.0, float("inf")]}}, r"payload\['x'\]\[1\] is inf"),
    ("nul-in-payload", {"payload": {"x": "a\x00b"}}, r"payload\['x'\] contains a NUL"),
    ("nul-in-payload-key", {"payload": {"a\x00": 1}}, r"key containing a NUL"),
    ("nul-in-kind", {"kind": "se\x00nd"}, r"kind contains a NUL"),
    ("empty-kind", {"kind": ""}, r"kind must be a non-empty name"),
    ("blank-kind", {"kind": "   "}, r"kind must be a non-empty name"),
    ("long-kind", {"kind": "k" * 256}, r"kind is 256 characters long; the limit is 255"),
    ("kind-not-str", {"kind": 5}, r"kind must be a str, got int"),
    ("empty-queue", {"queue": ""}, r"queue must be a non-empty name"),
    ("long-queue", {"queue": "q" * 300}, r"queue is 300 characters long"),
    ("nul-in-queue", {"queue": "q\x00"}, r"queue contains a NUL"),
    ("max-attempts-zero", {"max_attempts": 0}, r"max_attempts must be between 1 and"),
    ("max-attempts-negative", {"max_attempts": -3}, r"max_attempts must be between 1 and"),
    ("max-attempts-bool", {"max_attempts": True}, r"max_attempts must be an int, got bool"),
    ("negative-delay", {"delay": timedelta(seconds=-1)}, r"delay must be zero or more"),
    ("delay-not-timedelta", {"delay": 5}, r"delay must be a datetime.timedelta"),
    ("priority-out-of-range", {"priority": 40_000}, r"priority must be between -32768 and"),
    ("empty-dedupe-key", {"dedupe_key": ""}, r"dedupe_key must not be empty"),
    ("long-dedupe-key", {"dedupe_key": "é" * 600}, r"dedupe_key is 1200 bytes"),
    ("nul-in-dedupe-key", {"dedupe_key": "a\x00"}, r"dedupe_key contains a NUL"),
]


def _call(fields: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "ok", "payload": {}} | fields


@pytest.mark.parametrize(
    ("fields", "message"), [(f, m) for _, f, m in BAD_INPUT], ids=[i for i, _, _ in BAD_INPUT]
)
def test_enqueue_rejects_bad_input_and_writes_nothing(
    conn: Connection, fields: dict[str, Any], message: str
) -> None:
    args = _call(fields)
    with pytest.raises(InvalidJobError, match=message):
        sqlaq.enqueue(conn, args.pop("kind"), args.pop("payload"), **args)
    assert count_jobs(conn) == 0


@pytest.mark.parametrize(
    ("fields", "message"), [(f, m) for _, f, m in BAD_INPUT], ids=[i for i, _, _ in BAD_INPUT]
)
def test_enqueue_many_rejects_the_whole_batch(
    conn: Connection, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message):
        sqlaq.enqueue_many(conn, [NewJob("fine"), NewJob(**_call(fields))])
    assert count_jobs(conn) == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [(f, m) for i, f, m in BAD_INPUT if "delay" not in i],
    ids=[i for i, _, _ in BAD_INPUT if "delay" not in i],
)
def test_orm_job_rejects_bad_input_at_construction(
    engine: Any, fields: dict[str, Any], message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(InvalidJobError, match=message):
            session.add(sqlaq.Job(**_call(fields)))
        assert count_jobs(session.connection()) == 0
        session.rollback()


def test_enqueue_many_rejects_items_that_are_not_new_jobs(conn: Connection) -> None:
    with pytest.raises(InvalidJobError, match=r"jobs\[1\] must be a sqlaq.NewJob, got dict"):
        sqlaq.enqueue_many(conn, [NewJob("a"), {"kind": "b"}])  # type: ignore[list-item]
    assert count_jobs(conn) == 0


def test_orm_job_needs_a_kind_and_refuses_python_timestamps() -> None:
    from datetime import UTC, datetime

    with pytest.raises(InvalidJobError, match="Job needs a kind"):
        sqlaq.Job(payload={})
    with pytest.raises(InvalidJobError, match="run_at is set by the database clock"):
        sqlaq.Job(kind="k", run_at=datetime.now(UTC))


@pytest.mark.parametrize(
    "lease", [timedelta(seconds=-1), timedelta(0), 30], ids=["negative", "zero", "not-timedelta"]
)
def test_claim_and_extend_reject_a_bad_lease(conn: Connection, lease: Any) -> None:
    sqlaq.enqueue(conn, "k")
    with pytest.raises(InvalidJobError, match="lease must be"):
        sqlaq.claim(conn, worker_id=uuid.uuid4(), lease=lease)
    assert count_jobs(conn, "status = 'queued'") == 1
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    with pytest.raises(InvalidJobError, match="lease must be"):
        sqlaq.extend_lease(conn, job.lease, lease=lease)


def test_fail_rejects_a_negative_retry_delay(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    with pytest.raises(InvalidJobError, match="retry_in must be zero or more"):
        sqlaq.fail(conn, job.lease, "x", retry_in=timedelta(seconds=-5))
    assert count_jobs(conn, "status = 'running'") == 1


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
def test_claim_rejects_a_bad_limit(conn: Connection, limit: Any) -> None:
    with pytest.raises(sqlaq.ConfigError, match="limit must be a positive int"):
        sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=limit)
