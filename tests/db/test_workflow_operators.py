"""A workflow seen from the operator's side: retention keeps an unfinished workflow's
finished jobs, and a workflow is read and cancelled whole from any of its jobs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from helpers import finish_long_ago
from sqlalchemy import Connection, text
from sqlalchemy.dialects import postgresql

import sqlaq
from sqlaq import NewJob

pytestmark = pytest.mark.timeout(120)

WEEK = timedelta(days=7)


def _ids(conn: Connection, ids: list[int]) -> list[int]:
    """Which of *ids* still exist."""
    rows = conn.execute(
        text("SELECT id FROM sqlaq_jobs WHERE id = ANY(:ids) ORDER BY id"), {"ids": ids}
    )
    return list(rows.scalars())


def _prune_all(conn: Connection) -> int:
    deleted = 0
    while True:
        batch = sqlaq.prune(conn, older_than=WEEK, limit=2)
        deleted += batch
        if batch < 2:
            return deleted


# -- retention -----------------------------------------------------------------------


def test_prune_keeps_a_chords_members_while_its_callback_waits(conn: Connection) -> None:
    flow = sqlaq.chord(conn, [NewJob("member", {"n": n}) for n in range(3)], NewJob("total"))
    assert flow.callback_id is not None
    plain = sqlaq.enqueue(conn, "plain").job_id
    finish_long_ago(conn, plain, "done", "30 days")
    for member in flow.job_ids[:2]:
        finish_long_ago(conn, member, "done", "30 days")
    # The callback still waits for the third member: the first two are its results.
    assert _prune_all(conn) == 1
    assert _ids(conn, [plain, *flow.job_ids]) == list(flow.job_ids)
    count = sqlaq.queries.count_prunable_stmt(older_than=WEEK, statuses=["done"])
    assert conn.execute(count).scalar_one() == 0

    finish_long_ago(conn, flow.job_ids[2], "done", "30 days")
    # Released, not run yet: the members are still its parents' results.
    assert _prune_all(conn) == 0
    assert [p.job_id for p in sqlaq.parent_results(conn, flow.callback_id)] == list(flow.job_ids)

    finish_long_ago(conn, flow.callback_id, "done", "30 days")
    assert _prune_all(conn) == 4
    assert _ids(conn, [*flow.job_ids, flow.callback_id]) == []


def test_prune_keeps_a_chains_ancestors_and_a_groups_finished_siblings(
    conn: Connection,
) -> None:
    root = sqlaq.enqueue(conn, "root").job_id
    chain = sqlaq.chain(conn, [NewJob("step", {"n": n}) for n in range(3)], after=[root])
    group = sqlaq.group(conn, [NewJob("member", {"n": n}) for n in range(2)], after=[root])
    finish_long_ago(conn, root, "done", "30 days")
    finish_long_ago(conn, chain.job_ids[0], "done", "30 days")
    finish_long_ago(conn, chain.job_ids[1], "done", "30 days")
    finish_long_ago(conn, group.job_ids[0], "done", "30 days")
    # The chain's last step is due, not finished: its ancestors stay (the root, both
    # steps), and so does the group's finished member (its parent, the root, stays).
    assert _prune_all(conn) == 0
    finish_long_ago(conn, chain.job_ids[2], "done", "30 days")
    finish_long_ago(conn, group.job_ids[1], "failed", "30 days")
    assert _prune_all(conn) == 6


def test_prune_keeps_a_finished_branch_while_another_branch_of_its_workflow_runs(
    conn: Connection,
) -> None:
    # root -> left -> left_end, root -> right -> right_end: the left branch finished
    # long ago, the right one runs. The whole workflow stays until it has finished.
    root = sqlaq.enqueue(conn, "root").job_id
    left = sqlaq.enqueue(conn, "left", after=[root]).job_id
    left_end = sqlaq.enqueue(conn, "left_end", after=[left]).job_id
    right = sqlaq.enqueue(conn, "right", after=[root]).job_id
    right_end = sqlaq.enqueue(conn, "right_end", after=[right]).job_id
    plain = sqlaq.enqueue(conn, "plain").job_id
    for job_id in (root, left, left_end, plain):
        finish_long_ago(conn, job_id, "done", "30 days")
    conn.execute(text("UPDATE sqlaq_jobs SET status = 'running' WHERE id = :id"), {"id": right})
    flow = [root, left, left_end, right, right_end]
    count = sqlaq.queries.count_prunable_stmt(older_than=WEEK, statuses=["done"])
    assert conn.execute(count).scalar_one() == 1
    assert _prune_all(conn) == 1
    assert _ids(conn, [*flow, plain]) == flow
    assert [job.job_id for job in sqlaq.read_workflow(conn, left_end).jobs] == flow

    finish_long_ago(conn, right, "done", "30 days")
    assert _prune_all(conn) == 0  # right_end, released, has not run
    finish_long_ago(conn, right_end, "done", "30 days")
    assert _prune_all(conn) == 5
    assert _ids(conn, flow) == []


def test_prune_keeps_a_cancelled_child_while_its_root_runs(conn: Connection) -> None:
    root = sqlaq.enqueue(conn, "root").job_id
    child = sqlaq.enqueue(conn, "child", after=[root]).job_id
    grandchild = sqlaq.enqueue(conn, "grandchild", after=[child]).job_id
    conn.execute(text("UPDATE sqlaq_jobs SET status = 'running' WHERE id = :id"), {"id": root})
    assert sqlaq.cancel(conn, child) == [child]  # and its grandchild, in cascade
    conn.execute(
        text("UPDATE sqlaq_jobs SET finished_at = now() - interval '30 days' WHERE id = ANY(:i)"),
        {"i": [child, grandchild]},
    )
    assert _prune_all(conn) == 0
    finish_long_ago(conn, root, "done", "30 days")
    assert _prune_all(conn) == 3


def test_prune_deletes_a_finished_workflow_and_plain_jobs_as_before(conn: Connection) -> None:
    flow = sqlaq.chain(conn, [NewJob("step", {"n": n}) for n in range(3)])
    sqlaq.cancel(conn, flow.job_ids[0])  # cancels the rest, in cascade
    conn.execute(
        text("UPDATE sqlaq_jobs SET finished_at = now() - interval '30 days' WHERE id = ANY(:i)"),
        {"i": list(flow.job_ids)},
    )
    assert _prune_all(conn) == 3


# -- reading and cancelling a workflow from any of its jobs ---------------------------


def _shapes(conn: Connection) -> tuple[int, sqlaq.Workflow, sqlaq.Workflow]:
    """A root, a chain after it, and a batch whose first member comes after the chain."""
    root = sqlaq.enqueue(conn, "root").job_id
    chain = sqlaq.chain(conn, [NewJob("step", {"n": n}) for n in range(2)], after=[root])
    batch = sqlaq.batch(conn, [NewJob("member", {"n": n}) for n in range(2)], NewJob("report"))
    sqlaq.enqueue(conn, "unrelated")
    # The batch's first member waits for the chain's last step: one workflow, two roots.
    conn.execute(
        text("UPDATE sqlaq_jobs SET parent_ids = ARRAY[:p]::bigint[] WHERE id = :c"),
        {"p": chain.job_ids[1], "c": batch.job_ids[0]},
    )
    conn.execute(
        text("UPDATE sqlaq_jobs SET has_dependents = true WHERE id = :p"), {"p": chain.job_ids[1]}
    )
    return root, chain, batch


def test_read_workflow_lists_every_job_from_any_of_them_in_dependency_order(
    conn: Connection,
) -> None:
    root, chain, batch = _shapes(conn)
    assert batch.callback_id is not None
    everything = [root, *chain.job_ids, *batch.job_ids, batch.callback_id]
    finish_long_ago(conn, root, "done", "1 minute")
    for start in everything:
        flow = sqlaq.read_workflow(conn, start)
        assert [job.job_id for job in flow.jobs] == everything, start
        assert (flow.total, flow.more, flow.counted_all) == (6, 0, True)
    by_id = {job.job_id: job for job in sqlaq.read_workflow(conn, root).jobs}
    assert (by_id[root].status, by_id[root].kind, by_id[root].parent_ids) == ("done", "root", ())
    assert by_id[chain.job_ids[0]].waiting is False  # released by the root
    assert by_id[chain.job_ids[1]].waiting is True
    assert by_id[batch.callback_id].parent_ids == tuple(batch.job_ids)

    cut = sqlaq.read_workflow(conn, batch.callback_id, limit=2)
    assert [job.job_id for job in cut.jobs] == sorted([batch.callback_id, batch.job_ids[0]])
    assert (cut.total, cut.more) == (6, 4)
    assert sqlaq.read_workflow(conn, 2**62).jobs == ()


def test_cancel_workflow_cancels_every_pending_job_of_a_shape_without_one_root(
    conn: Connection,
) -> None:
    root, chain, batch = _shapes(conn)
    assert batch.callback_id is not None
    finish_long_ago(conn, root, "done", "1 minute")
    conn.execute(
        text("UPDATE sqlaq_jobs SET status = 'running' WHERE id = :i"), {"i": batch.job_ids[1]}
    )
    cancelled = sqlaq.cancel_workflow(conn, batch.job_ids[1])
    pending = [*chain.job_ids, *batch.job_ids, batch.callback_id]
    assert sorted(cancelled) == pending
    statuses = conn.execute(
        text("SELECT id, status FROM sqlaq_jobs WHERE id = ANY(:i) ORDER BY id"),
        {"i": [root, *pending]},
    ).all()
    assert [s for _, s in statuses] == ["done"] + ["cancelled"] * 5
    assert sqlaq.cancel_workflow(conn, root) == []
    assert sqlaq.cancel_workflow(conn, 2**62) == []


def test_a_group_without_after_is_not_one_workflow(conn: Connection) -> None:
    group = sqlaq.group(conn, [NewJob("member", {"n": n}) for n in range(2)])
    assert [j.job_id for j in sqlaq.read_workflow(conn, group.job_ids[0]).jobs] == [
        group.job_ids[0]
    ]
    assert sqlaq.cancel_workflow(conn, group.job_ids[0]) == [group.job_ids[0]]


def test_the_walk_runs_without_jit_and_sets_it_back(conn: Connection) -> None:
    flow = sqlaq.chain(conn, [NewJob("step"), NewJob("step")])
    for value in ("on", "off"):
        conn.execute(text("SELECT set_config('jit', :v, true)"), {"v": value})
        assert len(sqlaq.read_workflow(conn, flow.job_ids[0]).jobs) == 2
        assert conn.execute(text("SHOW jit")).scalar_one() == value
    assert len(sqlaq.cancel_workflow(conn, flow.job_ids[1])) == 2
    assert conn.execute(text("SHOW jit")).scalar_one() == "off"


def test_prune_runs_without_jit_and_sets_it_back(conn: Connection) -> None:
    plain = sqlaq.enqueue(conn, "plain").job_id
    finish_long_ago(conn, plain, "done", "30 days")
    conn.execute(text("SELECT set_config('jit', 'on', true)"))
    assert sqlaq.ops.count_prunable(conn, older_than=WEEK, statuses=["done"]) == 1
    assert conn.execute(text("SHOW jit")).scalar_one() == "on"
    assert sqlaq.prune(conn, older_than=WEEK) == 1
    assert conn.execute(text("SHOW jit")).scalar_one() == "on"


@pytest.mark.parametrize("walk", ["read", "cancel", "retention"])
def test_the_walks_find_children_through_the_parents_index(conn: Connection, walk: str) -> None:
    """Each workflow walk steps down from a parent through the parents index (sqlaq_0010)
    instead of reading every job enqueued after it."""
    flow = sqlaq.chord(conn, [NewJob("member") for _ in range(3)], NewJob("total"))
    for member in flow.job_ids:
        finish_long_ago(conn, member, "done", "30 days")
    stmt = {
        "read": sqlaq.queries.workflow_stmt(job_id=flow.job_ids[0], limit=200, count_limit=10),
        "cancel": sqlaq.queries.cancel_workflow_stmt(job_id=flow.job_ids[0]),
        "retention": sqlaq.queries.count_prunable_stmt(older_than=WEEK, statuses=["done"]),
    }[walk]
    sql = stmt.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
    conn.execute(text("SET LOCAL enable_seqscan = off"))
    plan = "\n".join(conn.execute(text(f"EXPLAIN (COSTS OFF) {sql}")).scalars())
    assert "sqlaq_jobs_parents_idx" in plan, plan
