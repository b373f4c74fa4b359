"""Workflows on a real database: jobs that wait for others, the shapes, the failure
policies, and parents finishing at the same instant on two connections."""

from __future__ import annotations

import io
import json
import threading
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from workerkit import scalar, wait_until

import sqlaq
from sqlaq import InvalidJobError, NewJob, admin

pytestmark = pytest.mark.timeout(120)

WORKER = uuid.uuid4()


def _claim_all(conn: Connection, limit: int = 100) -> list[sqlaq.ClaimedJob]:
    return sqlaq.claim(conn, worker_id=WORKER, limit=limit)


def _run(conn: Connection, kind_results: dict[int, Any] | None = None) -> list[int]:
    """Claim what is due and complete it (storing *kind_results* per id); the ids."""
    jobs = _claim_all(conn)
    for job in jobs:
        if kind_results and job.id in kind_results:
            sqlaq.results.complete_with_result(conn, job.lease, json.dumps(kind_results[job.id]))
        else:
            sqlaq.complete(conn, job.lease)
    return sorted(j.id for j in jobs)


def _status(conn: Connection, job_id: int) -> tuple[str, str | None]:
    row = conn.execute(
        text("SELECT status, last_error FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
    ).one()
    return row[0], row[1]


def _fail_for_good(conn: Connection, job_id: int) -> None:
    (job,) = [j for j in _claim_all(conn) if j.id == job_id]
    assert sqlaq.fail(conn, job.lease, "boom") == sqlaq.JobStatus.FAILED


def test_a_child_waits_until_its_parent_is_done(conn: Connection) -> None:
    parent = sqlaq.enqueue(conn, "p").job_id
    child = sqlaq.enqueue(conn, "c", after=[parent]).job_id
    assert _run(conn) == [parent]  # the child is not claimable yet
    assert _run(conn) == [child]
    assert _run(conn) == []


def test_a_chain_runs_in_order_each_once(conn: Connection) -> None:
    flow = sqlaq.chain(conn, [NewJob("a"), NewJob("b"), NewJob("c")])
    a, b, c = flow.job_ids
    assert flow.callback_id is None
    assert [_run(conn) for _ in range(4)] == [[a], [b], [c], []]


def test_a_group_after_a_parent_fans_out(conn: Connection) -> None:
    root = sqlaq.enqueue(conn, "root").job_id
    flow = sqlaq.group(conn, [NewJob("m") for _ in range(3)], after=[root])
    assert _run(conn) == [root]
    assert _run(conn) == sorted(flow.job_ids)


def test_a_chord_callback_runs_last_and_reads_its_parents_results(conn: Connection) -> None:
    flow = sqlaq.chord(conn, [NewJob("m", {"n": n}) for n in range(3)], then=NewJob("sum"))
    members = list(flow.job_ids)
    assert flow.callback_id is not None
    assert _run(conn, {m: n * 10 for n, m in enumerate(members)}) == members
    assert _run(conn) == [flow.callback_id]
    parents = sqlaq.parent_results(conn, flow.callback_id)
    assert [(p.job_id, p.status, p.result) for p in parents] == [
        (members[0], "done", 0),
        (members[1], "done", 10),
        (members[2], "done", 20),
    ]


def test_a_chord_is_not_released_while_one_member_is_left(conn: Connection) -> None:
    flow = sqlaq.chord(conn, [NewJob("m"), NewJob("m")], then=NewJob("sum"))
    first, second = flow.job_ids
    jobs = {j.id: j for j in _claim_all(conn)}
    sqlaq.complete(conn, jobs[first].lease)
    assert _claim_all(conn) == []
    sqlaq.complete(conn, jobs[second].lease)
    assert _run(conn) == [flow.callback_id]


def test_a_batch_callback_runs_whatever_the_outcomes(conn: Connection) -> None:
    flow = sqlaq.batch(conn, [NewJob("m", max_attempts=1), NewJob("m")], on_complete=NewJob("cb"))
    bad, good = flow.job_ids
    jobs = {j.id: j for j in _claim_all(conn)}
    sqlaq.fail(conn, jobs[bad].lease, "boom")
    sqlaq.complete(conn, jobs[good].lease)
    assert _run(conn) == [flow.callback_id]
    assert [(p.job_id, p.status) for p in sqlaq.parent_results(conn, flow.callback_id)] == [
        (bad, "failed"),
        (good, "done"),
    ]


def test_a_retried_parent_releases_nothing(conn: Connection) -> None:
    parent = sqlaq.enqueue(conn, "p", max_attempts=3).job_id
    child = sqlaq.enqueue(conn, "c", after=[parent]).job_id
    (job,) = _claim_all(conn)
    assert sqlaq.fail(conn, job.lease, "again", retry_in=timedelta(0)) == sqlaq.JobStatus.QUEUED
    assert [j.id for j in _claim_all(conn)] == [parent]  # the retry, not the child
    assert _status(conn, child) == ("queued", None)
    waiting = conn.execute(
        text("SELECT count(*) FROM sqlaq_job_deps WHERE child_id = :c"), {"c": child}
    )
    assert waiting.scalar_one() == 1


def test_a_failed_parent_cancels_its_children_down_the_chain(conn: Connection) -> None:
    a, b, c = sqlaq.chain(conn, [NewJob("a", max_attempts=1), NewJob("b"), NewJob("c")]).job_ids
    _fail_for_good(conn, a)
    assert _status(conn, b) == ("cancelled", f"parent job {a} failed")
    assert _status(conn, c) == ("cancelled", f"parent job {b} cancelled")
    assert _claim_all(conn) == []
    assert conn.execute(text("SELECT count(*) FROM sqlaq_job_deps")).scalar_one() == 0


def test_on_parent_failure_fail_fails_the_child_naming_the_parent(conn: Connection) -> None:
    parent = sqlaq.enqueue(conn, "p", max_attempts=1).job_id
    child = sqlaq.enqueue(conn, "c", after=[parent], on_parent_failure="fail").job_id
    _fail_for_good(conn, parent)
    assert _status(conn, child) == ("failed", f"parent job {parent} failed")


def test_on_parent_failure_run_runs_the_child_anyway(conn: Connection) -> None:
    parent = sqlaq.enqueue(conn, "p", max_attempts=1).job_id
    child = sqlaq.enqueue(conn, "c", after=[parent], on_parent_failure="run").job_id
    _fail_for_good(conn, parent)
    assert _run(conn) == [child]


def test_cancelling_the_root_cancels_what_has_not_run(conn: Connection) -> None:
    flow = sqlaq.chain(conn, [NewJob("a"), NewJob("b"), NewJob("c")])
    sqlaq.cancel(conn, flow.job_ids[0])
    assert [_status(conn, j)[0] for j in flow.job_ids] == ["cancelled"] * 3


def test_a_parent_already_done_or_failed_when_the_child_is_enqueued(conn: Connection) -> None:
    done = sqlaq.enqueue(conn, "p").job_id
    failed = sqlaq.enqueue(conn, "p", max_attempts=1).job_id
    jobs = {j.id: j for j in _claim_all(conn)}
    sqlaq.complete(conn, jobs[done].lease)
    sqlaq.fail(conn, jobs[failed].lease, "boom")
    runs = sqlaq.enqueue(conn, "c", after=[done]).job_id
    cancelled = sqlaq.enqueue(conn, "c", after=[done, failed]).job_id
    anyway = sqlaq.enqueue(conn, "c", after=[failed], on_parent_failure="run").job_id
    assert _status(conn, cancelled) == ("cancelled", f"parent job {failed} failed")
    assert _run(conn) == [runs, anyway]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"after": [0]}, "after must hold job ids"),
        ({"after": "12"}, "after must be a list of job ids"),
        ({"after": [2**62]}, f"after names no job with id {2**62}"),
        ({"after": [], "on_parent_failure": "ignore"}, "on_parent_failure must be"),
        ({"after": [], "dedupe_key": "k"}, "after does not go with dedupe_key"),
    ],
)
def test_bad_after_is_refused_and_writes_nothing(
    conn: Connection, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message):
        sqlaq.enqueue(conn, "c", **options)
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


def test_a_workflow_job_with_a_dedupe_key_is_refused(conn: Connection) -> None:
    with pytest.raises(InvalidJobError, match="cannot be deduplicated"):
        sqlaq.chain(conn, [NewJob("a"), NewJob("b", dedupe_key="k")])
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


def test_a_rolled_back_workflow_leaves_nothing(committed: Engine) -> None:
    with committed.connect() as conn:
        with conn.begin() as trans:
            sqlaq.chord(conn, [NewJob("m"), NewJob("m")], then=NewJob("sum"))
            sqlaq.chain(conn, [NewJob("a"), NewJob("b")])
            trans.rollback()
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM sqlaq_job_deps")).scalar_one() == 0


def test_two_parents_finishing_at_the_same_instant_release_the_child_once(
    committed: Engine,
) -> None:
    """Each round: two parents complete on two connections behind a barrier, commit
    together, then each runs the post-commit check (what a worker does on the release
    notification). The child is released, by exactly one of the three chances."""
    rounds = 30
    for _ in range(rounds):
        with committed.begin() as conn:
            flow = sqlaq.chord(conn, [NewJob("m"), NewJob("m")], then=NewJob("sum"))
            leases = {j.id: j.lease for j in _claim_all(conn)}
        child = flow.callback_id
        assert child is not None
        barrier = threading.Barrier(2)
        released: list[list[int]] = [[], []]

        def finish(
            index: int,
            parent: int,
            child: int = child,
            leases: dict[int, Any] = leases,
            barrier: threading.Barrier = barrier,
            released: list[list[int]] = released,
        ) -> None:
            with committed.connect() as conn:
                with conn.begin():
                    sqlaq.complete(conn, leases[parent])
                    barrier.wait(10)
                with conn.begin():
                    released[index] = sqlaq.release_waiting(conn, job_ids=[child])

        threads = [threading.Thread(target=finish, args=(i, p)) for i, p in enumerate(flow.job_ids)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        with committed.begin() as conn:
            due = conn.execute(
                text("SELECT run_at <= now() FROM sqlaq_jobs WHERE id = :id"), {"id": child}
            ).scalar_one()
            assert due, "the child was never released"
            assert len(released[0]) + len(released[1]) == 1
            assert [j.id for j in _claim_all(conn)] == [child]
            assert conn.execute(text("SELECT count(*) FROM sqlaq_job_deps")).scalar_one() == 0


def test_the_check_after_commit_waits_for_a_parent_still_finishing(committed: Engine) -> None:
    """The first parent finishes (its transaction stays open): it sees the second
    parent's edge not being deleted, so it leaves the child to it and notifies nothing.
    The second one, seeing only an edge being deleted, notifies sqlaq_release and
    commits first. Its check waits for the first parent's commit, then releases the
    child: the child is never left waiting."""
    with committed.begin() as conn:
        flow = sqlaq.chord(conn, [NewJob("m"), NewJob("m")], then=NewJob("sum"))
        leases = {j.id: j.lease for j in _claim_all(conn)}
    first, second = flow.job_ids
    child = flow.callback_id
    assert child is not None
    url = committed.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with (
        psycopg.connect(url, autocommit=True) as listener,
        committed.connect() as early,
        committed.connect() as late,
    ):
        listener.execute("LISTEN sqlaq_release")
        early.begin()
        sqlaq.complete(early, leases[first])
        with late.begin():
            sqlaq.complete(late, leases[second])
        (heard,) = listener.notifies(timeout=10, stop_after=1)
        assert heard.payload == str(child)

        released: list[int] = []
        pid: list[int] = []

        def check() -> None:
            with committed.begin() as conn:
                pid.append(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
                released.extend(sqlaq.release_waiting(conn, job_ids=[child]))

        checker = threading.Thread(target=check)
        checker.start()
        wait_until(lambda: pid, 10, "the check to start")
        wait_until(
            lambda: scalar(
                committed,
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid",
                pid=pid[0],
            ),
            10,
            "the check to wait for the first parent's transaction",
        )
        early.commit()
        checker.join(30)
        assert not checker.is_alive()
        assert released == [child]
        assert [n.payload for n in listener.notifies(timeout=0.2)] == []


def test_parents_finishing_on_four_connections_release_every_child_without_the_sweep(
    committed: Engine,
) -> None:
    """Forty chords of two to nine members, their members completed on four connections
    at once in batches of three (the batches interleave and race); a listener checks
    each job named on sqlaq_release after commit, as a worker does, and no sweep runs.
    Every callback is released, each once."""
    with committed.begin() as conn:
        flows = [
            sqlaq.chord(conn, [NewJob("m", queue="fan") for _ in range(2 + n % 8)], NewJob("cb"))
            for n in range(40)
        ]
    url = committed.url.set(drivername="postgresql").render_as_string(hide_password=False)
    released: list[int] = []
    done = threading.Event()
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_release")

        def listen() -> None:
            while not done.is_set():
                for heard in listener.notifies(timeout=0.1):
                    with committed.begin() as conn:
                        released.extend(sqlaq.release_waiting(conn, job_ids=[int(heard.payload)]))

        def complete() -> None:
            worker = uuid.uuid4()
            while True:
                with committed.begin() as conn:
                    jobs = sqlaq.claim(conn, worker_id=worker, queue="fan", limit=3)
                    sqlaq.complete(conn, [job.lease for job in jobs])
                if not jobs:
                    return

        checker = threading.Thread(target=listen)
        checker.start()
        completers = [threading.Thread(target=complete) for _ in range(4)]
        for thread in completers:
            thread.start()
        for thread in completers:
            thread.join(60)
        callbacks = [flow.callback_id for flow in flows]
        try:
            wait_until(
                lambda: (
                    scalar(
                        committed,
                        "SELECT count(*) FROM sqlaq_jobs WHERE id = ANY(:ids) AND run_at <= now()",
                        ids=callbacks,
                    )
                    == len(callbacks)
                ),
                10,
                "every callback to be released",
            )
        finally:
            done.set()
            checker.join(10)
    assert len(released) == len(set(released))
    with committed.begin() as conn:
        assert sorted(j.id for j in _claim_all(conn)) == sorted(callbacks)
        assert conn.execute(text("SELECT count(*) FROM sqlaq_job_deps")).scalar_one() == 0


def test_the_sweep_releases_a_child_left_waiting(committed: Engine) -> None:
    """A crash between a parent's commit and its check leaves the child waiting with no
    edge: release_waiting finds it."""
    with committed.begin() as conn:
        parent = sqlaq.enqueue(conn, "p").job_id
        child = sqlaq.enqueue(conn, "c", after=[parent]).job_id
        conn.execute(text("DELETE FROM sqlaq_job_deps"))  # as if the check never ran
    with committed.begin() as conn:
        assert sqlaq.release_waiting(conn) == [child]
        assert sqlaq.release_waiting(conn) == []


def test_explain_names_the_parents_a_job_waits_for(conn: Connection) -> None:
    flow = sqlaq.chord(conn, [NewJob("m"), NewJob("m")], then=NewJob("sum"))
    first, second = flow.job_ids
    assert flow.callback_id is not None
    reasons = sqlaq.explain(conn, flow.callback_id)
    assert reasons[0].code == "parents"
    assert reasons[0].message == f"waiting for 2 parent(s): ids {first}, {second}"
    assert "not_due" not in [r.code for r in reasons]
    jobs = {j.id: j for j in _claim_all(conn)}
    sqlaq.complete(conn, jobs[first].lease)
    assert sqlaq.explain(conn, flow.callback_id)[0].message == (
        f"waiting for 1 parent(s): ids {second}"
    )


def test_sqlaq_show_prints_a_workflow_jobs_parents_only(
    committed: Engine, database_url: str
) -> None:
    with committed.begin() as conn:
        first, second = sqlaq.chain(conn, [NewJob("a"), NewJob("b")]).job_ids
        plain = sqlaq.enqueue(conn, "plain").job_id
    shown = {}
    for job_id in (first, second, plain):
        out = io.StringIO()
        assert admin.run(["show", str(job_id), "--database-url", database_url], {}, out) == 0
        shown[job_id] = out.getvalue()
    assert "has_dependents     True\n" in shown[first]
    assert f"parent_ids         [{first}]\n" in shown[second]
    assert "on_parent_failure  cancel\n" in shown[second]
    assert "parent_ids" not in shown[plain]
