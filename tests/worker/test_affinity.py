"""Worker affinity: ``Worker(where=...)`` serves only the jobs matching its condition, in
every claim it makes (plain, prefetching, a limited kind's), and leaves the rest to other
workers; a condition the table refuses stops the worker at its start with one line."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine
from workerkit import rows

import sqlaq
from sqlaq import ConfigError

pytestmark = pytest.mark.timeout(60)

EU = sqlaq.jobs.c.payload["region"].astext == "eu"


def _registry(ran: list[tuple[str, str]], *, limited: bool = True) -> sqlaq.Registry:
    registry = sqlaq.Registry()

    def record(payload: dict[str, Any]) -> None:
        ran.append((sqlaq.current_job().kind, payload["region"]))

    registry.handler("a_plain")(record)
    registry.handler("b_plain")(record)
    if limited:
        # A limit far above what one worker reaches: what is tested is the limited
        # claim's path.
        registry.handler("a_limited", concurrency=100_000, rate="10000/s")(record)
    return registry


def _enqueue(engine: Engine, kind: str, regions: list[str], **fields: Any) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob(kind, {"region": r}, **fields) for r in regions])


def _statuses(engine: Engine) -> dict[tuple[str, str, str], int]:
    found = rows(
        engine,
        "SELECT kind, payload->>'region' AS region, status, count(*) AS n FROM sqlaq_jobs "
        "GROUP BY 1, 2, 3",
    )
    return {(r.kind, r.region, r.status): r.n for r in found}


@pytest.mark.parametrize("prefetch", [0, 50], ids=["free-slots", "prefetch"])
def test_a_where_worker_serves_its_jobs_and_another_the_rest(
    committed: Engine, prefetch: int
) -> None:
    # The other region's jobs come first by priority: a claim without the condition
    # takes them first.
    _enqueue(committed, "a_plain", ["us"] * 30, priority=5)
    _enqueue(committed, "a_plain", ["eu"] * 40)
    ran: list[tuple[str, str]] = []
    affine = sqlaq.Worker(
        committed, _registry(ran), where=EU, concurrency=4, prefetch=prefetch, burst=True
    )
    affine.run()
    assert sorted(ran) == [("a_plain", "eu")] * 40
    assert _statuses(committed) == {("a_plain", "eu", "done"): 40, ("a_plain", "us", "queued"): 30}
    ran.clear()
    sqlaq.Worker(committed, _registry(ran), concurrency=4, burst=True).run()
    assert sorted(ran) == [("a_plain", "us")] * 30


def test_a_sequence_of_clauses_is_and_ed(committed: Engine) -> None:
    _enqueue(committed, "a_plain", ["eu", "us"] * 5)
    _enqueue(committed, "b_plain", ["eu", "us"] * 5)
    ran: list[tuple[str, str]] = []
    where = [sqlaq.jobs.c.kind.like("a%"), EU]
    sqlaq.Worker(committed, _registry(ran), where=where, concurrency=2, burst=True).run()
    assert sorted(ran) == [("a_plain", "eu")] * 5


@pytest.mark.parametrize(
    "where",
    [sqlaq.jobs.c.kind == "b_plain", sqlaq.jobs.c.kind.in_(["b_plain", "x"])],
    ids=["equals", "in"],
)
def test_a_clause_with_values_of_its_own(committed: Engine, where: Any) -> None:
    # Without limited kinds the claim runs compiled once, on the driver's cursor: the
    # clause's own values ("b_plain") go with the claim's.
    _enqueue(committed, "a_plain", ["eu"] * 5, priority=5)
    _enqueue(committed, "b_plain", ["eu"] * 5)
    ran: list[tuple[str, str]] = []
    registry = _registry(ran, limited=False)
    sqlaq.Worker(committed, registry, where=where, concurrency=2, burst=True).run()
    assert sorted(ran) == [("b_plain", "eu")] * 5


def test_the_limited_claim_honours_where(committed: Engine) -> None:
    _enqueue(committed, "a_limited", ["us"] * 20, priority=5)
    _enqueue(committed, "a_limited", ["eu"] * 20)
    ran: list[tuple[str, str]] = []
    sqlaq.Worker(committed, _registry(ran), where=EU, concurrency=4, burst=True).run()
    assert sorted(ran) == [("a_limited", "eu")] * 20
    assert _statuses(committed)[("a_limited", "us", "queued")] == 20


def test_sql_text_is_a_condition_too(committed: Engine) -> None:
    _enqueue(committed, "a_plain", ["us"] * 5, priority=5, queue="other")
    _enqueue(committed, "b_plain", ["e%:u", "us"] * 5)
    ran: list[tuple[str, str]] = []
    # The text is taken as written: a percent sign is a percent sign, a colon never a
    # bind parameter. Its OR stays inside it: the other queue's jobs match its second
    # half, not the claim's queue.
    where = "payload->>'region' = 'e%:u' OR kind = 'a_plain'"
    sqlaq.Worker(committed, _registry(ran), where=where, concurrency=2, burst=True).run()
    assert sorted(ran) == [("b_plain", "e%:u")] * 5
    assert _statuses(committed)[("a_plain", "us", "queued")] == 5


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("payload->>'region' = 'eu' AND nope = 1", 'column "nope" does not exist'),
        ("payload = 5", "operator does not exist: jsonb = integer"),
        ("kind LIKE", "syntax error"),
        (sqlaq.jobs.c.kind.op("~~~")("x"), "operator does not exist"),
    ],
    ids=["column", "type", "syntax", "clause"],
)
def test_a_condition_the_table_refuses_stops_the_worker_at_its_start(
    committed: Engine, where: Any, message: str
) -> None:
    _enqueue(committed, "a_plain", ["eu"])
    ran: list[tuple[str, str]] = []
    worker = sqlaq.Worker(committed, _registry(ran), where=where, burst=True)
    with pytest.raises(ConfigError, match="does not run against the jobs table") as info:
        worker.run()
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert worker.stopped.is_set()
    assert not worker.started.is_set()
    assert ran == []
    assert _statuses(committed) == {("a_plain", "eu", "queued"): 1}


def test_a_clause_over_another_table_or_not_a_clause_is_refused_at_construction(
    committed: Engine,
) -> None:
    other = sqlaq.schema.paused_queues.c.queue == "x"
    with pytest.raises(ConfigError, match="sqlaq_paused_queues beside sqlaq_jobs"):
        sqlaq.Worker(committed, _registry([]), where=other)
    with pytest.raises(ConfigError, match="where must be a SQLAlchemy boolean clause"):
        sqlaq.Worker(committed, _registry([]), where=[EU, 3])


@pytest.mark.parametrize("kind", ["a_plain", "a_limited"])
def test_a_condition_that_fails_on_a_job_stops_the_worker_with_one_line(
    committed: Engine, kind: str
) -> None:
    # It compiles and types (the start check passes); the cast fails on one row only.
    with committed.begin() as conn:
        sqlaq.enqueue(conn, kind, {"region": "eu", "n": "abc"})
    ran: list[tuple[str, str]] = []
    where = "(payload->>'n')::int > 3"
    worker = sqlaq.Worker(committed, _registry(ran), where=where, burst=True)
    with pytest.raises(ConfigError, match=r"where .* failed on a job: invalid input syntax"):
        worker.run()
    assert worker.stopped.is_set()
    assert ran == []
    assert _statuses(committed) == {(kind, "eu", "queued"): 1}
