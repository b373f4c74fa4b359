"""The enqueue paths kept fast: a single enqueue is one statement, compiled once;
``enqueue_many`` sends a batch of jobs that differ only in their payload as one JSON
array (``queries.enqueue_uniform_stmt``), any other batch through the general statement,
with the same results either way; NewJob's fast checks refuse what the full ones do."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, event, text
from sqlalchemy.engine import Engine

import sqlaq
from sqlaq import InvalidJobError, NewJob

pytestmark = pytest.mark.timeout(60)

PAYLOADS: list[dict[str, Any]] = [
    {},
    {"seq": 1},
    {"n": -(10**17), "big": 10**40, "f": 1.5, "huge": 1e16, "neg": -2.5e20, "t": True, "z": None},
    {"text": "é ü 漢字 😀", "quote": 'a "b" \\ c', "nl": "x\ny"},
    {"nested": {"list": [1, [2, {"deep": "x"}]], "tuple": (1, 2)}},
    {"é": 1},
]


@contextmanager
def statements(conn: Connection) -> Iterator[list[tuple[str, Any]]]:
    """The SQL each cursor execution on *conn* runs, with its compiled-cache status."""
    seen: list[tuple[str, Any]] = []

    def before(*args: Any) -> None:
        statement, context = args[2], args[4]
        seen.append((statement, getattr(context, "cache_hit", None)))

    event.listen(conn, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(conn, "before_cursor_execute", before)


def _rows(conn: Connection, ids: list[int]) -> list[Any]:
    return list(
        conn.execute(
            text(
                "SELECT id, queue, kind, payload, priority, max_attempts, dedupe_key, timeout,"
                " run_at - created_at AS wait, run_at, headers FROM sqlaq_jobs"
                " WHERE id = ANY(:ids) ORDER BY id"
            ),
            {"ids": ids},
        ).all()
    )


def _enqueue_in_one(
    conn: Connection, jobs: Sequence[NewJob], marker: str = "jsonb_array_elements"
) -> list[int]:
    """Enqueue *jobs*, checking that they went as one statement holding *marker* (the
    uniform one by default) and came back as new jobs, ids in input order; their ids."""
    with statements(conn) as seen:
        results = sqlaq.enqueue_many(conn, jobs)
    assert len(seen) == 1
    assert marker in seen[0][0]
    ids = [r.job_id for r in results]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(jobs)
    assert all(r.outcome is sqlaq.EnqueueOutcome.INSERTED and r.inserted for r in results)
    assert not any(r.duplicate for r in results)
    assert results[0] == sqlaq.EnqueueResult(ids[0])
    return ids


def test_a_single_enqueue_is_one_statement_compiled_once(conn: Connection) -> None:
    sqlaq.enqueue(conn, "warm", {"n": 0})  # the first compiles (or finds it compiled)
    with statements(conn) as seen:
        sqlaq.enqueue(conn, "one", {"n": 1})
        sqlaq.enqueue(conn, "two", {"n": 2}, queue="other", priority=3)
    assert len(seen) == 2
    assert all(sql.startswith("INSERT INTO sqlaq_jobs") for sql, _ in seen)
    assert [str(hit) for _, hit in seen] == ["CacheStats.CACHE_HIT"] * 2


def test_a_uniform_batch_is_one_statement_and_every_field_is_stored(conn: Connection) -> None:
    shared: dict[str, Any] = {
        "queue": "bulk",
        "priority": -7,
        "delay": timedelta(hours=1),
        "max_attempts": 2,
        "timeout": timedelta(seconds=30),
    }
    jobs = [NewJob("fast", payload, **shared) for payload in PAYLOADS * 3]
    ids = _enqueue_in_one(conn, jobs)
    rows = _rows(conn, ids)
    for job, row in zip(jobs, rows, strict=True):
        assert row.payload == json.loads(job.payload_json)  # tuples come back as lists
        assert (row.queue, row.kind, row.priority, row.max_attempts, row.dedupe_key) == (
            "bulk",
            "fast",
            -7,
            2,
            None,
        )
        assert (row.timeout, row.wait, row.headers) == (
            timedelta(seconds=30),
            timedelta(hours=1),
            None,
        )
    # Floats stay floats (1e16 is spelt out), and big ints stay ints.
    assert rows[2].payload["huge"] == 1e16
    assert isinstance(rows[2].payload["huge"], float)
    assert rows[2].payload["big"] == 10**40


def test_a_uniform_batch_takes_run_at(conn: Connection) -> None:
    when = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    results = sqlaq.enqueue_many(conn, [NewJob("at", {"i": i}, run_at=when) for i in range(3)])
    rows = _rows(conn, [r.job_id for r in results])
    assert [(row.run_at, row.payload) for row in rows] == [(when, {"i": i}) for i in range(3)]


@pytest.mark.parametrize(
    "odd",
    [
        {"queue": "elsewhere"},
        {"kind": "other"},
        {"priority": 1},
        {"delay": timedelta(minutes=5)},
        {"max_attempts": 9},
        {"dedupe_key": "k"},
        {"run_at": datetime(2031, 1, 1, tzinfo=UTC)},
        {"timeout": timedelta(seconds=5)},
    ],
)
def test_a_batch_whose_jobs_differ_in_more_than_the_payload_is_stored_the_same(
    conn: Connection, odd: dict[str, Any]
) -> None:
    args = [{"kind": "k", "payload": {"i": i}} for i in range(5)]
    args[3] = args[3] | odd
    jobs = [NewJob(**a) for a in args]
    ids = _enqueue_in_one(conn, jobs, "unnest")
    rows = _rows(conn, ids)
    for job, row in zip(jobs, rows, strict=True):
        assert (row.queue, row.kind, row.payload, row.priority, row.max_attempts) == (
            job.queue,
            job.kind,
            job.payload,
            job.priority,
            job.max_attempts,
        )
        assert (row.dedupe_key, row.timeout) == (job.dedupe_key, job.timeout)


def test_a_uniform_batch_under_a_savepoint_rolls_back_whole(engine: Engine) -> None:
    with engine.connect() as conn, conn.begin():
        before = conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one()
        with conn.begin_nested() as nested:
            sqlaq.enqueue_many(conn, [NewJob("sp", {"i": i}) for i in range(10)])
            nested.rollback()
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == before
        conn.rollback()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"a": float("nan")}, "payload['a'] is nan"),
        ({"a": float("inf")}, "payload['a'] is inf"),
        ({"a": "x\x00y"}, "NUL"),
        ({"a\x00": 1}, "NUL"),
        ({"a": "\ud800"}, "lone surrogate"),
        ({1: "a"}, "key 1 of type int"),
        ({"a": {1, 2}}, "payload['a'] is a set"),
        ({"a": 10**5000}, "more than 4300 digits"),
        ([1], "payload must be a dict"),
    ],
)
def test_the_fast_payload_check_refuses_what_the_walk_does(payload: Any, message: str) -> None:
    with pytest.raises(InvalidJobError, match=message.replace("[", r"\[").replace("]", r"\]")):
        NewJob("k", payload)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"kind": ""}, "kind must be a non-empty name"),
        ({"kind": "x" * 256}, "kind is 256 characters long"),
        ({"kind": 3}, "kind must be a str"),
        ({"kind": ["k"]}, "kind must be a str"),
        ({"queue": "q\x00"}, "queue contains a NUL"),
        ({"priority": 40000}, "priority must be between"),
        ({"priority": True}, "priority must be an int"),
        ({"max_attempts": 0}, "max_attempts must be between"),
        ({"max_attempts": 1.0}, "max_attempts must be an int"),
        ({"delay": timedelta(seconds=-1)}, "delay must be zero or more"),
        ({"delay": 5}, "delay must be a datetime.timedelta"),
    ],
)
def test_the_fast_field_checks_refuse_what_the_full_ones_do(
    args: dict[str, Any], message: str
) -> None:
    NewJob("k", queue="q")  # both names are now known good: the fast path is taken
    with pytest.raises(InvalidJobError, match=message):
        NewJob(**({"kind": "k"} | args))


class _Name(str):
    """A str subclass: never cached as a known-good name."""


def test_a_str_subclass_name_is_checked_each_time() -> None:
    assert NewJob(_Name("sub")).kind == "sub"
    with pytest.raises(InvalidJobError, match="kind must be a non-empty name"):
        NewJob(_Name(" "))


def test_the_bulk_statements_bind_parameters_are_named_apart_from_columns() -> None:
    from sqlalchemy.dialects.postgresql import psycopg

    from sqlaq import queries

    for stmt in (
        queries.enqueue_uniform_stmt(),
        queries.enqueue_many_stmt(jobs_=[NewJob("k", {"a": 1}), NewJob("j", dedupe_key="d")]),
    ):
        names = set(stmt.compile(dialect=psycopg.dialect()).params)
        assert names, stmt
        assert all(name.startswith("b_") for name in names), names
    assert queries.enqueue_uniform_stmt() is queries.enqueue_uniform_stmt()  # built once


def test_newjobs_written_out_init_takes_exactly_its_fields() -> None:
    # NewJob.__init__ is written out for speed: a field added to the dataclass must be
    # added to it (and to sqlaq.encoding._SETTERS) too.
    import dataclasses
    import inspect

    fields = [f for f in dataclasses.fields(NewJob) if f.init]
    parameters = list(inspect.signature(NewJob).parameters.values())
    assert [p.name for p in parameters] == [f.name for f in fields]
    for field, parameter in zip(fields, parameters, strict=True):
        if field.default is not dataclasses.MISSING:
            assert parameter.default == field.default, field.name
        elif field.default_factory is not dataclasses.MISSING:
            assert repr(parameter.default) == repr(field.default_factory()), field.name
        else:
            assert parameter.default is inspect.Parameter.empty, field.name
    job = NewJob("k")
    assert job.payload == {}
    assert job.payload is not NewJob("k").payload
    values = {f.name: f"v-{f.name}" for f in fields}
    with pytest.raises(InvalidJobError):  # every value reaches the checks
        NewJob(**values)
    assert dataclasses.replace(NewJob("k", {"a": 1}), queue="q") == NewJob("k", {"a": 1}, "q")


def test_a_job_batch_is_one_statement_with_every_field_and_payload_stored(
    conn: Connection,
) -> None:
    template = NewJob(
        "batch",
        {"unused": True},
        queue="bulk",
        priority=4,
        max_attempts=3,
        delay=timedelta(minutes=2),
        timeout=timedelta(seconds=9),
    )
    batch = template.with_payloads(PAYLOADS * 2)
    assert isinstance(batch, sqlaq.JobBatch)
    assert len(batch) == len(PAYLOADS) * 2
    # The batch is a sequence of NewJob: each is the template with its payload.
    assert list(batch) == [dataclasses.replace(template, payload=p) for p in PAYLOADS * 2]
    assert batch[1] == dataclasses.replace(template, payload=PAYLOADS[1])
    assert batch[:2] == [dataclasses.replace(template, payload=p) for p in PAYLOADS[:2]]
    ids = _enqueue_in_one(conn, batch)
    rows = _rows(conn, ids)
    # The same rows as the same jobs sent as NewJob objects.
    twins = _rows(conn, [r.job_id for r in sqlaq.enqueue_many(conn, list(batch))])
    for job, row, twin in zip(batch, rows, twins, strict=True):
        assert row.payload == json.loads(job.payload_json) == twin.payload
        assert (row.queue, row.kind, row.priority, row.max_attempts, row.timeout, row.wait) == (
            "bulk",
            "batch",
            4,
            3,
            timedelta(seconds=9),
            timedelta(minutes=2),
        )
        assert row[1:9] == twin[1:9]
    assert isinstance(rows[2].payload["huge"], float)  # 1e16 spelt out, as for a NewJob
    assert sqlaq.enqueue_many(conn, NewJob("batch").with_payloads([])) == []


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"a": float("nan")}, "payloads[1]: payload['a'] is nan"),
        ({"a": "x\x00y"}, "payloads[1]: .*NUL"),
        ({"a": {1, 2}}, "payloads[1]: payload['a'] is a set"),
        ([1], "payloads[1]: payload must be a dict"),
    ],
)
def test_a_job_batch_refuses_a_bad_payload_by_its_index_and_writes_nothing(
    conn: Connection, payload: Any, message: str
) -> None:
    before = conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one()
    with pytest.raises(InvalidJobError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sqlaq.enqueue_many(conn, NewJob("k").with_payloads([{"ok": 1}, payload, {"ok": 2}]))
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == before


def test_a_job_batch_refuses_a_shared_dedupe_key_and_a_lone_payload() -> None:
    with pytest.raises(InvalidJobError, match="dedupe_key would make every job but the first"):
        NewJob("k", dedupe_key="d").with_payloads([{"a": 1}])
    with pytest.raises(InvalidJobError, match="got one dict; wrap it in a list"):
        NewJob("k").with_payloads({"a": 1})  # type: ignore[arg-type]
    with pytest.raises(InvalidJobError, match=r"template must be a sqlaq\.NewJob"):
        sqlaq.JobBatch("k", [{}])  # type: ignore[arg-type]


def test_a_job_batch_goes_through_enqueue_copy_too(conn: Connection) -> None:
    before = conn.execute(text("SELECT count(*) FROM sqlaq_jobs WHERE kind = 'cb'")).scalar_one()
    assert sqlaq.enqueue_copy(conn, NewJob("cb").with_payloads([{"i": i} for i in range(5)])) == 5
    payloads = (
        conn.execute(text("SELECT payload FROM sqlaq_jobs WHERE kind = 'cb' ORDER BY id"))
        .scalars()
        .all()
    )
    assert before == 0
    assert payloads == [{"i": i} for i in range(5)]


def test_the_fast_builders_make_what_the_classes_own_init_makes() -> None:
    # sqlaq.ops builds results, claimed jobs and leases without their __init__; a
    # field added to a class must still be set, and the objects must be equal.
    import uuid

    from sqlaq.lease import Lease
    from sqlaq.ops import claiming, enqueuing

    now = datetime.now(UTC)
    token, worker = uuid.uuid4(), uuid.uuid4()
    lease = Lease(7, worker, token, 2, now)
    assert claiming._new_lease(7, worker, token, 2, now) == lease
    values = (7, "q", "k", {"a": 1}, 3, 2, 5, now, lease, now, {"h": 1}, timedelta(seconds=4), "t")
    built = claiming._new_claimed_job(*values)
    assert built == sqlaq.ClaimedJob(*values)
    assert [getattr(built, f.name) for f in dataclasses.fields(built)] == list(values)
    assert enqueuing._inserted([4, 5]) == [sqlaq.EnqueueResult(4), sqlaq.EnqueueResult(5)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.kind = "other"  # type: ignore[misc]
