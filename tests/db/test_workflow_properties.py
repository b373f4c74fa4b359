"""Workflows over random DAGs (hypothesis), drained in the test's transaction.

Each example enqueues a random DAG (every job after a random subset of the jobs before
it, each with a random failure policy; some jobs fail), drains it with
``sqlaq.testing.drain``, and checks against a model: no job runs before its parents,
each job that should run runs exactly once, and every job ends as its policy says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text

import sqlaq
from sqlaq.testing import drain

pytestmark = pytest.mark.timeout(300)

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def dags(draw: st.DrawFn) -> list[tuple[list[int], str, bool]]:
    """Nodes in topological order: (parents, on_parent_failure, fails)."""
    size = draw(st.integers(min_value=1, max_value=12))
    nodes = []
    for index in range(size):
        parents = draw(st.lists(st.integers(0, index - 1), unique=True)) if index else []
        policy = draw(st.sampled_from(["cancel", "run", "fail"]))
        fails = draw(st.integers(0, 4)) == 0
        nodes.append((sorted(parents), policy, fails))
    return nodes


def model(nodes: list[tuple[list[int], str, bool]]) -> tuple[list[str], set[int]]:
    """Each node's final status, and the nodes whose handler runs."""
    status: list[str] = []
    ran: set[int] = set()
    for index, (parents, policy, fails) in enumerate(nodes):
        parent_failed = any(status[p] in ("failed", "cancelled") for p in parents)
        if parent_failed and policy == "cancel":
            status.append("cancelled")
        elif parent_failed and policy == "fail":
            status.append("failed")
        else:
            ran.add(index)
            status.append("failed" if fails else "done")
    return status, ran


@pytest.fixture
def db(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn:
        yield conn


REGISTRY = sqlaq.Registry()


@REGISTRY.handler("node")
def node(payload: dict[str, Any]) -> None:
    if payload["fails"]:
        raise RuntimeError(f"node {payload['i']} fails")


@SETTINGS
@given(nodes=dags())
def test_a_random_dag_runs_each_job_once_never_before_its_parents(
    db: Connection, nodes: list[tuple[list[int], str, bool]]
) -> None:
    with db.begin() as outer:
        try:
            ids: list[int] = []
            for index, (parents, policy, fails) in enumerate(nodes):
                ids.append(
                    sqlaq.enqueue(
                        db,
                        "node",
                        {"i": index, "fails": fails},
                        max_attempts=1,
                        after=[ids[p] for p in parents],
                        on_parent_failure=policy,
                    ).job_id
                )
            ran = drain(db, REGISTRY)
            order = [job.payload["i"] for job in ran]
            expected_status, expected_ran = model(nodes)
            assert sorted(order) == sorted(expected_ran)  # each once
            position = {i: n for n, i in enumerate(order)}
            for index in order:
                for parent in nodes[index][0]:
                    if parent in position:
                        assert position[parent] < position[index]
            rows = db.execute(
                text("SELECT id, status FROM sqlaq_jobs WHERE id = ANY(:ids)"), {"ids": ids}
            ).all()
            statuses = dict(rows)
            assert [statuses[i] for i in ids] == expected_status
            assert db.execute(text("SELECT count(*) FROM sqlaq_job_deps")).scalar_one() == 0
        finally:
            outer.rollback()
