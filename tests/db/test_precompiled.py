"""The worker's claim run on the driver's cursor (``sqlaq.worker.precompiled``) reads
payloads exactly as SQLAlchemy's path does: psycopg's ``json.loads``, or the engine's own
``json_deserializer``."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any
from uuid import uuid4

import pytest
from sqlalchemy import Engine, create_engine, func, select, text, update
from sqlalchemy.pool import NullPool

import sqlaq
from sqlaq import ops, schema
from sqlaq.drive import Plan, plan_of
from sqlaq.worker.precompiled import Precompiled

PAYLOADS: list[Any] = [
    {},
    {"seq": 12345},
    {"text": 'é 漢字 🙂 \\ " \n', "nested": {"list": [1, 2.5, -0.0, None, True]}},
    {"big": 123456789012345678901234567890, "small": 1e-300, "exp": 1.5e300},
    {"list": ["a", 1, {"b": []}], "none": None, "empty": ""},
]


def claim_all(engine: Engine) -> list[ops.ClaimedJob]:
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        plan = plan_of(ops.claim)(
            worker_id=uuid4(), queue="precompiled", limit=100, lease=timedelta(seconds=30)
        )
        return Precompiled().run(conn, plan)


@pytest.fixture
def enqueued(committed: Engine) -> list[int]:
    with committed.begin() as conn:
        return [sqlaq.enqueue(conn, "k", p, queue="precompiled").job_id for p in PAYLOADS]


def test_the_claim_s_payloads_are_what_json_loads_reads(
    committed: Engine, enqueued: list[int]
) -> None:
    claimed = {job.id: job.payload for job in claim_all(committed)}
    expected = [json.loads(json.dumps(p)) for p in PAYLOADS]  # jsonb's own round trip
    assert [claimed[i] for i in enqueued] == expected


def test_an_engine_s_json_deserializer_is_kept(committed: Engine, enqueued: list[int]) -> None:
    custom = create_engine(
        committed.url, json_deserializer=lambda text: {"decoded by": "the app", "text": text}
    )
    try:
        claimed = {job.id: job.payload for job in claim_all(custom)}
    finally:
        custom.dispose()
    decoded = claimed[enqueued[1]]
    assert decoded["decoded by"] == "the app"  # psycopg hands the loader bytes
    assert json.loads(decoded["text"]) == {"seq": 12345}


def test_every_column_reads_as_sqlalchemy_reads_it(committed: Engine) -> None:
    # The cursor reads rows in binary: each column type of the jobs table must come back
    # as the same Python value (and type) as SQLAlchemy's own path reads it in text.
    with committed.begin() as conn:
        parent = sqlaq.enqueue(conn, "k", {"n": 1}, queue="precompiled").job_id
        child = sqlaq.enqueue(
            conn,
            "k",
            PAYLOADS[2],
            queue="precompiled",
            priority=-3,
            timeout=timedelta(days=1, seconds=3, microseconds=500),
            key="tenant é",
            run_at=datetime(2001, 2, 3, 4, 5, 6, 789, tzinfo=timezone(timedelta(hours=5))),
            after=[parent],
        ).job_id
        conn.execute(
            update(schema.jobs)
            .where(schema.jobs.c.id == child)
            .values(
                headers={"trace": "t"},
                result=[1, "two"],
                lease_token=uuid4(),
                locked_by=uuid4(),
                dedupe_key="d",
                debounce_key="b",
                last_error="e",
                attempted_at=func.now(),
                finished_at=func.now(),
            )
        )
    # Every column but parent_ids, whose array SQLAlchemy converts itself (a statement
    # returning it is run by SQLAlchemy, as every statement a converter needs).
    columns = [c for c in schema.jobs.c if c.name != "parent_ids"]
    jobs = schema.jobs.c
    statement = select(*columns).where(jobs.id.between(parent, child)).order_by(jobs.id)

    def rows() -> Plan[list[Any]]:
        return list((yield statement, None).all())

    precompiled = Precompiled()
    with committed.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        read = precompiled.run(conn, rows())
        assert precompiled._cursor is not None  # run on the driver's cursor, not by SQLAlchemy
        expected = [tuple(row) for row in conn.execute(statement)]
    assert [tuple(row) for row in read] == expected
    assert [[type(v) for v in row] for row in read] == [[type(v) for v in r] for r in expected]
    assert None not in read[1]  # every column of the child has a value: every type is read


def test_claims_narrowed_by_ever_new_clauses_keep_its_cache_bounded(committed: Engine) -> None:
    # Each new clause object makes a new claim statement (the narrowed claims' cache is
    # by identity, and evicts): the compiled SQL kept stays bounded, and each claim
    # still takes the clause's own value.
    with committed.begin() as conn:
        ids = [sqlaq.enqueue(conn, "k", {"n": n}, queue="precompiled").job_id for n in range(3)]
    precompiled = Precompiled()
    claimed: list[int] = []
    with committed.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        for n in range(400):
            where = sqlaq.jobs.c.id == ids[n % 3] if n >= 397 else sqlaq.jobs.c.id == -n
            plan = plan_of(ops.claim)(
                worker_id=uuid4(), queue="precompiled", lease=timedelta(seconds=30), where=where
            )
            claimed += [job.id for job in precompiled.run(conn, plan)]
    assert claimed == [ids[1], ids[2], ids[0]]
    assert len(precompiled._sql) <= 256


#: True only inside a transaction whose commit does not wait for its WAL flush.
RELAXED = text("current_setting('synchronous_commit') = 'off'")


@pytest.mark.parametrize("relaxed", [True, False], ids=["relaxed", "synchronous"])
def test_a_relaxed_claim_commits_without_its_flush_and_leaves_the_session_as_it_was(
    committed: Engine, relaxed: bool
) -> None:
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "k", queue="precompiled").job_id
    with committed.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        plan = plan_of(ops.claim)(
            worker_id=uuid4(), queue="precompiled", lease=timedelta(seconds=30), where=RELAXED
        )
        claimed = Precompiled().run(conn, plan, relaxed=relaxed)
        assert [job.id for job in claimed] == ([job_id] if relaxed else [])
        # The setting was the claim's transaction's: the session (and the pool's next
        # user of this connection) commits as before.
        assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
    if relaxed:  # the claim committed
        with committed.connect() as conn:
            status = conn.execute(
                select(sqlaq.jobs.c.status).where(sqlaq.jobs.c.id == job_id)
            ).scalar()
        assert status == "running"


def test_the_worker_s_claims_commit_relaxed(committed: Engine) -> None:
    # A worker whose condition holds only in a relaxed transaction finds its job.
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "k", queue="precompiled").job_id
    ran: list[int] = []
    registry = sqlaq.Registry()
    registry.handler("k")(lambda payload: ran.append(sqlaq.current_job().id))
    sqlaq.Worker(committed, registry, queues=["precompiled"], where=RELAXED, burst=True).run()
    assert ran == [job_id]


def test_a_relaxed_claim_that_sqlalchemy_runs_is_relaxed_too(committed: Engine) -> None:
    # A JSON-path clause has a bind processor: SQLAlchemy runs the claim, in a
    # transaction of its own with the setting.
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "k", {"region": "eu"}, queue="precompiled").job_id
    where = [RELAXED, sqlaq.jobs.c.payload["region"].astext == "eu"]
    with committed.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        plan = plan_of(ops.claim)(
            worker_id=uuid4(), queue="precompiled", lease=timedelta(seconds=30), where=where
        )
        assert [job.id for job in Precompiled().run(conn, plan, relaxed=True)] == [job_id]
        assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
    with committed.connect() as conn:  # committed
        assert (
            conn.execute(select(sqlaq.jobs.c.status).where(sqlaq.jobs.c.id == job_id)).scalar()
            == "running"
        )


def test_one_cursor_per_connection_follows_the_connection_it_runs_on(committed: Engine) -> None:
    # The cursor is kept for the connection it was made on: a run on another connection,
    # or on a new one after the first was lost, gets a cursor of that connection.
    with committed.begin() as conn:
        ids = [sqlaq.enqueue(conn, "k", {"n": n}, queue="precompiled").job_id for n in range(3)]
    precompiled = Precompiled()

    def claim_one(conn: Any) -> list[int]:
        plan = plan_of(ops.claim)(
            worker_id=uuid4(), queue="precompiled", lease=timedelta(seconds=30)
        )
        return [job.id for job in precompiled.run(conn, plan, relaxed=True)]

    with committed.connect() as first, committed.connect() as second:
        first = first.execution_options(isolation_level="AUTOCOMMIT")
        second = second.execution_options(isolation_level="AUTOCOMMIT")
        assert claim_one(first) == [ids[0]]
        assert claim_one(second) == [ids[1]]
        first.connection.driver_connection.close()  # type: ignore[union-attr]
        with pytest.raises(Exception, match="closed"):
            claim_one(first)  # the lost connection is invalidated, as before
        assert first.invalidated
    with committed.connect() as third:
        third = third.execution_options(isolation_level="AUTOCOMMIT")
        assert claim_one(third) == [ids[2]]
        assert claim_one(third) == []


def test_a_statement_is_prepared_at_its_first_run_unless_preparing_is_off(
    committed: Engine,
) -> None:
    # psycopg prepares a statement at its sixth run by default: until then the server
    # parses and plans the claim at every run (0.5-1 ms), the wake-ups of a new worker's
    # first jobs. A connection with preparing off (PgBouncer) must keep it unprepared.
    def prepared_after_one_claim(connect_args: dict[str, Any]) -> list[str]:
        # A connection of its own (NullPool): nothing else was prepared on it.
        engine = create_engine(committed.url, poolclass=NullPool, connect_args=connect_args)
        try:
            with engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                plan = plan_of(ops.claim)(
                    worker_id=uuid4(), queue="prepared", lease=timedelta(seconds=30)
                )
                assert Precompiled().run(conn, plan, relaxed=True) == []
                names = conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements")
                return list(names.scalars())
        finally:
            engine.dispose()

    (statement,) = prepared_after_one_claim({})
    assert "UPDATE sqlaq_jobs" in statement
    assert prepared_after_one_claim({"prepare_threshold": None}) == []
