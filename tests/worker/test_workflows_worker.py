"""Workflows run by real in-process workers: a chain in order, a chord's callback
reading its parents' results, and a fan-in whose parents finish on two workers at once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Engine, text
from workerkit import Recorder, fast_worker, running, scalar, wait_until

import sqlaq
from sqlaq import NewJob

pytestmark = pytest.mark.timeout(90)


def test_a_chain_runs_in_order_with_a_worker(committed: Engine) -> None:
    order: list[str] = []
    registry = sqlaq.Registry()

    @registry.handler("step")
    def step(payload: dict[str, Any]) -> None:
        order.append(payload["name"])

    recorder = Recorder()
    with committed.begin() as conn:
        flow = sqlaq.chain(conn, [NewJob("step", {"name": n}) for n in "abcd"])
    with running(fast_worker(committed, registry, recorder, concurrency=4)):
        results = recorder.wait_for(4)
    assert order == ["a", "b", "c", "d"]
    assert [r.job_id for r in results] == list(flow.job_ids)


def test_a_chord_callback_reads_its_parents_results(committed: Engine) -> None:
    registry = sqlaq.Registry()
    seen: list[list[Any]] = []

    @registry.handler("square")
    def square(payload: dict[str, Any]) -> int:
        return int(payload["n"]) ** 2

    @registry.handler("total")
    def total(payload: dict[str, Any]) -> int:
        with committed.connect() as conn:
            parents = sqlaq.parent_results(conn, sqlaq.current_job().id)
        seen.append([(p.status, p.result) for p in parents])
        return sum(p.result for p in parents)

    recorder = Recorder()
    with committed.begin() as conn:
        flow = sqlaq.chord(conn, [NewJob("square", {"n": n}) for n in range(5)], NewJob("total"))
    with running(fast_worker(committed, registry, recorder, concurrency=4)):
        results = recorder.wait_for(6)
    assert results[-1].job_id == flow.callback_id
    assert seen == [[("done", n * n) for n in range(5)]]
    with committed.connect() as conn:
        assert flow.callback_id is not None
        assert sqlaq.result(conn, flow.callback_id).result == 30


def test_a_fan_in_finishing_on_two_workers_runs_its_callback_once(committed: Engine) -> None:
    """Sixty parents on two workers (their completions interleave and race); the
    callback runs exactly once, after every parent."""
    registry = sqlaq.Registry()
    callback_runs: list[int] = []
    parents_done = threading.Event()

    @registry.handler("part")
    def part(payload: dict[str, Any]) -> None:
        pass

    @registry.handler("join")
    def join(payload: dict[str, Any]) -> None:
        callback_runs.append(sqlaq.current_job().id)
        parents_done.set()

    recorder = Recorder()
    with committed.begin() as conn:
        flow = sqlaq.chord(conn, [NewJob("part") for _ in range(60)], NewJob("join"))
    first = fast_worker(committed, registry, recorder, concurrency=4)
    second = fast_worker(committed, registry, recorder, concurrency=4)
    with running(first), running(second):
        results = recorder.wait_for(61)
        assert parents_done.wait(10)
    assert callback_runs == [flow.callback_id]
    assert sorted(r.job_id for r in results) == sorted([*flow.job_ids, flow.callback_id])
    # The callback started after every parent had finished.
    started_after = scalar(
        committed,
        "SELECT c.attempted_at >= max(p.finished_at) FROM sqlaq_jobs c, sqlaq_jobs p "
        "WHERE c.id = :c AND p.id = ANY(c.parent_ids) GROUP BY c.attempted_at",
        c=flow.callback_id,
    )
    assert started_after is True


def test_a_release_notification_makes_the_worker_check_the_job_again(committed: Engine) -> None:
    """What two parents committing at once leave: a child still held with no parent
    left. The sqlaq_release notification the parents' trigger sends makes a listening
    worker (here without the leader's sweep) release it, and it runs."""
    registry = sqlaq.Registry()

    @registry.handler("p")
    def p(payload: dict[str, Any]) -> None:
        raise AssertionError("the parent is not run here")

    @registry.handler("child")
    def child(payload: dict[str, Any]) -> None:
        pass

    recorder = Recorder()
    worker = fast_worker(committed, registry, recorder, maintenance=False)
    with running(worker):
        wait_until(lambda: worker.listening, 10, "the worker never listened")
        with committed.begin() as conn:
            parent = sqlaq.enqueue(conn, "p", queue="elsewhere").job_id
            held = sqlaq.enqueue(conn, "child", after=[parent]).job_id
        with committed.begin() as conn:
            conn.execute(text("DELETE FROM sqlaq_job_deps"))  # as if the parent finished
            conn.execute(text("SELECT pg_notify('sqlaq_release', :id)"), {"id": str(held)})
        (result,) = recorder.wait_for(1)
    assert result.job_id == held


def test_a_burst_worker_runs_a_chord_to_its_callback(committed: Engine) -> None:
    """The members' completions release the callback in their own commit (the trigger),
    after the claim that found nothing due: a burst worker looks again before it exits."""
    registry = sqlaq.Registry()

    @registry.handler("square")
    def square(payload: dict[str, Any]) -> int:
        return int(payload["n"]) ** 2

    @registry.handler("total")
    def total(payload: dict[str, Any]) -> None:
        pass

    with committed.begin() as conn:
        flow = sqlaq.chord(conn, [NewJob("square", {"n": n}) for n in range(3)], NewJob("total"))
    recorder = Recorder()
    fast_worker(committed, registry, recorder, burst=True, concurrency=2).run()
    assert sorted(r.job_id for r in recorder.results) == [*flow.job_ids, flow.callback_id]
    assert recorder.results[-1].job_id == flow.callback_id


def test_a_burst_worker_releases_what_a_race_left_before_it_exits(committed: Engine) -> None:
    """A burst worker has no listener and no leader's sweep: before it exits it
    releases the waiting jobs whose parents have all finished, and runs them."""
    registry = sqlaq.Registry()

    @registry.handler("child")
    def child(payload: dict[str, Any]) -> None:
        pass

    with committed.begin() as conn:
        parent = sqlaq.enqueue(conn, "p", queue="elsewhere").job_id
        held = sqlaq.enqueue(conn, "child", after=[parent]).job_id
        conn.execute(text("DELETE FROM sqlaq_job_deps"))  # as if the parent finished
    recorder = Recorder()
    worker = fast_worker(committed, registry, recorder, burst=True)
    worker.run()
    assert [r.job_id for r in recorder.results] == [held]
