"""sqlaq on Citus: ``sqlaq citus-distribute``, the runtime detection, the router-shaped
statements of the core path, and a drain by worker processes on a real 3-node cluster.

``nox -s citus`` builds Citus (../shared/citus/build.sh, cached), starts a throwaway
cluster (cluster.sh: a coordinator and two worker nodes) and sets ``SQLAQ_CITUS_URL`` to
the coordinator's database; without it the cluster tests are skipped. The first test
(no Citus: a clear refusal) runs in the default suite, on the plain server.

Every cluster test starts from a database without sqlaq's tables (the cluster has one
database, with the extension on every node) and leaves it so.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

import alembic.command
import psycopg
import pytest
from conftest import alembic_config
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from worker_app import EFFECTS
from workerkit import (
    LEDGER,
    Recorder,
    fast_worker,
    ledger_table,
    rows,
    running,
    scalar,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq import admin, citus, migrations, results
from sqlaq.queries import citus as citus_queries

CITUS = os.environ.get("SQLAQ_CITUS_URL", "")
needs_citus = pytest.mark.skipif(not CITUS, reason="SQLAQ_CITUS_URL is not set: run nox -s citus")
pytestmark = pytest.mark.timeout(300)


def _sqlaq(url: str, *args: str) -> tuple[int, str, str]:
    """``sqlaq <args> --database-url <url>``: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stderr(err):
        code = admin.run([*args, "--database-url", url], {}, out)
    return code, out.getvalue(), err.getvalue()


def test_citus_distribute_refuses_a_server_without_citus(database_url: str) -> None:
    """On plain PostgreSQL: one line naming what is missing, exit 1, nothing changed."""
    code, out, err = _sqlaq(database_url, "citus-distribute", "--dry-run")
    assert code == 1, (out, err)
    assert err.count("\n") == 1, err
    assert "no Citus extension" in err
    assert "Traceback" not in err
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            assert citus.is_distributed(conn) is False
    finally:
        engine.dispose()


# -- on the cluster ----------------------------------------------------------------------


def _reset(engine: Engine) -> None:
    """Drop every sqlaq table and function (and the test ledger) of the public schema."""
    with engine.begin() as conn:
        tables = conn.execute(
            text(
                "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') "
                "AND c.relname LIKE 'sqlaq\\_%'"
            )
        ).scalars()
        for table in list(tables):
            conn.execute(text(f'DROP TABLE IF EXISTS "{table}" CASCADE'))
        functions = conn.execute(
            text(
                "SELECT p.oid::regprocedure::text FROM pg_proc p "
                "JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = 'public' AND p.proname LIKE 'sqlaq\\_%'"
            )
        ).scalars()
        for function in list(functions):
            conn.execute(text(f"DROP FUNCTION IF EXISTS {function} CASCADE"))


@pytest.fixture
def installed() -> Iterator[Engine]:
    """The cluster's database with sqlaq's schema at head (``sqlaq migrate``), not yet
    distributed; emptied afterwards."""
    engine = create_engine(CITUS)
    _reset(engine)
    try:
        code, _, err = _sqlaq(CITUS, "migrate")
        assert code == 0, err
        yield engine
    finally:
        _reset(engine)
        engine.dispose()


@pytest.fixture
def distributed(installed: Engine) -> Iterator[Engine]:
    """*installed*, converted by ``sqlaq citus-distribute``; a new engine on it."""
    code, _, err = _sqlaq(CITUS, "citus-distribute")
    assert code == 0, err
    engine = create_engine(CITUS, pool_size=8)
    try:
        yield engine
    finally:
        engine.dispose()


@needs_citus
def test_distribute_dry_run_then_convert_then_again(installed: Engine) -> None:
    """--dry-run prints the DDL and changes nothing; the conversion distributes the job
    table by queue (and the paused queues as a reference table); a second run says so."""
    code, out, err = _sqlaq(CITUS, "citus-distribute", "--dry-run")
    assert code == 0, err
    assert out.splitlines() == [f"{s};" for s in citus_queries.distribute_ddl()]
    assert "create_distributed_table('sqlaq_jobs', 'queue')" in out
    with installed.connect() as conn:
        assert citus.is_distributed(conn) is False
    code, out, err = _sqlaq(CITUS, "citus-distribute")
    assert code == 0, err
    assert "distributed by queue" in out
    kinds = dict(rows(installed, "SELECT table_name::text, citus_table_type FROM citus_tables"))
    assert kinds == {"sqlaq_jobs": "distributed", "sqlaq_paused_queues": "reference"}
    column = scalar(
        installed,
        "SELECT distribution_column FROM citus_tables WHERE table_name = 'sqlaq_jobs'::regclass",
    )
    assert column == "queue"
    # The engine that asked before keeps its answer until told to forget it.
    with installed.connect() as conn:
        assert citus.is_distributed(conn) is False
    citus.forget(installed)
    with installed.connect() as conn:
        assert citus.is_distributed(conn) is True
    code, out, err = _sqlaq(CITUS, "citus-distribute")
    assert code == 0, err
    assert "already distributed" in out


@needs_citus
def test_distribute_names_each_problem_in_one_line(installed: Engine) -> None:
    """A host foreign key to sqlaq_jobs and a host trigger on it: one line each, exit 1,
    nothing converted. A schema behind sqlaq's head: one line naming the fix."""
    with installed.begin() as conn:
        conn.execute(text("CREATE TABLE sqlaq_test_orders (id int, job_id bigint)"))
        conn.execute(
            text(
                "ALTER TABLE sqlaq_test_orders ADD CONSTRAINT orders_job_fkey "
                "FOREIGN KEY (job_id) REFERENCES sqlaq_jobs (id)"
            )
        )
        conn.execute(
            text(
                "CREATE FUNCTION sqlaq_test_touch() RETURNS trigger LANGUAGE plpgsql "
                "AS $$ BEGIN RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER host_touch BEFORE UPDATE ON sqlaq_jobs "
                "FOR EACH ROW EXECUTE FUNCTION sqlaq_test_touch()"
            )
        )
    code, _, err = _sqlaq(CITUS, "citus-distribute")
    assert code == 1
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert "foreign key orders_job_fkey of table sqlaq_test_orders" in lines[0]
    assert "trigger host_touch" in lines[1]
    with installed.connect() as conn:
        assert conn.execute(citus_queries.citus_distribution_stmt()).first() is None
    _reset(installed)
    with installed.begin() as conn:
        migrations.upgrade(conn, "sqlaq_0005")
    code, _, err = _sqlaq(CITUS, "citus-distribute", "--dry-run")
    assert code == 1
    assert len(err.splitlines()) == 1, err
    assert "alembic upgrade heads" in err


def _tasks(conn: Any, stmt: Any, params: dict[str, Any]) -> int:
    """How many tasks (shards) Citus runs *stmt* with *params* on: EXPLAIN's Task Count."""
    compiled = stmt.compile(dialect=postgresql.dialect())
    values = {**compiled.params, **params}
    sql = str(compiled)
    plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {sql}", values).scalar_one()
    plan = json.loads(plan) if isinstance(plan, str) else plan
    node = plan[0]["Plan"]
    assert node["Custom Plan Provider"] == "Citus Adaptive", node
    return int(node["Distributed Query"]["Job"]["Task Count"])


@needs_citus
def test_the_core_path_runs_as_router_statements(distributed: Engine) -> None:
    """Claim, extend, complete, fail, snooze, hand back, and the per-queue cancel, retry,
    sweep and prune: one task each (EXPLAIN)."""
    lease = sqlaq.Lease(1, uuid4(), uuid4(), 1, None, "q1")  # type: ignore[arg-type]
    fence = sqlaq.queries.fence_params([lease]) | {"b_queue": "q1"}
    claim = citus_queries.citus_claim_params(
        queue="q1", worker_id=uuid4(), limit=10, lease=timedelta(seconds=30), token=uuid4().hex
    )
    checks = [
        (citus_queries.citus_claim_stmt(), claim),
        (citus_queries.citus_extend_lease_stmt(), fence | {"b_lease": timedelta(seconds=30)}),
        (citus_queries.citus_complete_stmt(), fence),
        (citus_queries.citus_complete_result_stmt(), fence | {"b_result": "1"}),
        (
            citus_queries.citus_fail_stmt(),
            fence | {"b_retry": True, "b_retry_in": timedelta(seconds=1), "b_error": "x"},
        ),
        (citus_queries.citus_snooze_stmt(), fence | {"b_delay": timedelta(seconds=1)}),
        (citus_queries.citus_handback_stmt(), fence),
        (citus_queries.citus_cancel_stmt(), {"b_queue": "q1", "b_ids": [1, 2]}),
        (sqlaq.queries.retry_stmt(job_ids=[1, 2], queue="q1"), {}),
        (citus_queries.citus_sweep_stmt(), {"b_queue": "q1", "b_ids": [1, 2]}),
        (
            citus_queries.citus_prune_stmt(),
            {"b_queue": "q1", "b_ids": [1], "b_older_than": timedelta(0), "b_statuses": ["done"]},
        ),
    ]
    with distributed.begin() as conn:
        for stmt, params in checks:
            assert _tasks(conn, stmt, params) == 1, str(stmt)


@needs_citus
def test_enqueue_claim_extend_complete_fail_on_the_cluster(distributed: Engine) -> None:
    """The operations choose the Citus statements on their own; fencing holds."""
    worker = uuid4()
    with distributed.begin() as conn:
        assert citus.is_distributed(conn) is True
        ids = [sqlaq.enqueue(conn, "k", {"i": i}, queue=f"q{i % 2}").job_id for i in range(6)]
    with distributed.begin() as conn:
        claimed = sqlaq.claim(conn, worker_id=worker, queue="q0", limit=10)
    assert sorted(j.id for j in claimed) == ids[0::2]
    assert {j.lease.queue for j in claimed} == {"q0"}
    assert len({j.lease.token for j in claimed}) == 3
    first, second, third = claimed
    with distributed.begin() as conn:
        renewed = sqlaq.extend_lease(conn, [first.lease, second.lease], length=timedelta(minutes=5))
        assert [r.job_id for r in renewed] == [first.id, second.id]
        assert all(r.queue == "q0" for r in renewed)
        assert sqlaq.complete(conn, renewed[0]) == [first.id]
        assert sqlaq.fail(conn, second.lease, "boom", retry_in=timedelta(0)) == "queued"
        assert sqlaq.ops.handback(conn, third.lease) == [third.id]
    # The lease of the first claim is stale: the job went back to its queue.
    with distributed.begin() as conn, pytest.raises(sqlaq.LeaseLostError):
        sqlaq.complete(conn, second.lease)
    with distributed.begin() as conn:
        again = sqlaq.claim(conn, worker_id=worker, queue="q0", limit=10)
    assert sorted(j.id for j in again) == sorted([second.id, third.id])
    assert {j.lease.token for j in again}.isdisjoint({second.lease.token, third.lease.token})
    with distributed.begin() as conn:
        assert sorted(sqlaq.complete(conn, [j.lease for j in again])) == sorted(
            [second.id, third.id]
        )
    # Narrowed by a clause (worker affinity), plain and excluding kinds.
    affinity = sqlaq.jobs.c.payload["i"].astext == "3"
    with distributed.begin() as conn:
        (picked,) = sqlaq.claim(conn, worker_id=worker, queue="q1", where=affinity, limit=9)
        assert picked.id == ids[3]
        assert not sqlaq.claim(
            conn, worker_id=worker, queue="q1", where=[affinity], exclude_kinds=["x"]
        )
    statuses = dict(rows(distributed, "SELECT id, status FROM sqlaq_jobs WHERE queue = 'q0'"))
    assert set(statuses.values()) == {"done"}
    assert scalar(distributed, "SELECT count(*) FROM sqlaq_jobs WHERE queue = 'q1'") == 3


@needs_citus
@pytest.mark.asyncio
async def test_the_async_operations_detect_citus_too(distributed: Engine) -> None:
    """sqlaq.asyncio's driver answers the detection step per engine, as the sync one."""
    from sqlalchemy.ext.asyncio import create_async_engine

    import sqlaq.asyncio as aq

    engine = create_async_engine(CITUS)
    try:
        async with engine.begin() as conn:
            job_id = (await aq.enqueue(conn, "k", queue="aq")).job_id
        async with engine.begin() as conn:
            (job,) = await aq.claim(conn, worker_id=uuid4(), queue="aq")
            assert job.lease.queue == "aq"
        async with engine.begin() as conn:
            assert await aq.complete(conn, job.lease) == [job_id]
    finally:
        await engine.dispose()


@needs_citus
def test_what_does_not_run_on_citus_yet_refuses_in_one_line(distributed: Engine) -> None:
    """Each refusal is a ConfigError naming Citus and why; the transaction stays usable."""
    with distributed.begin() as conn:
        job = sqlaq.enqueue(conn, "k", queue="q").job_id
        for call in (
            lambda: sqlaq.enqueue(
                conn,
                "k",
                queue="q",
                debounce=timedelta(seconds=1),
                debounce_key="a",
                max_wait=timedelta(seconds=5),
            ),
            lambda: sqlaq.enqueue(
                conn, "k", queue="q", dedupe_key="a", unique_for=timedelta(seconds=1)
            ),
            lambda: sqlaq.enqueue(conn, "k", queue="q", after=[job]),
            lambda: sqlaq.complete(conn, sqlaq.Lease(job, uuid4(), uuid4(), 1, None)),  # type: ignore[arg-type]
            lambda: sqlaq.chain(conn, [sqlaq.NewJob("k"), sqlaq.NewJob("k")]),
            lambda: sqlaq.read_workflow(conn, job),
            lambda: sqlaq.cancel_workflow(conn, job),
            lambda: sqlaq.claim_fair(conn, worker_id=uuid4(), queue="q"),
        ):
            with pytest.raises(sqlaq.ConfigError, match="Citus") as caught:
                call()
            assert "\n" not in str(caught.value)
        assert scalar(distributed, "SELECT 1") == 1


@needs_citus
def test_enqueue_variants_wake_the_coordinator_s_listeners(distributed: Engine) -> None:
    """Single, batch, mixed batch, COPY and dedupe (per queue) enqueues work, and each
    wakes the workers of its queues: a NOTIFY heard on the coordinator."""
    url = make_url(CITUS).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_jobs")
        with distributed.begin() as conn:
            sqlaq.enqueue(conn, "k", queue="one")
            sqlaq.enqueue(conn, "k", queue="later", delay=timedelta(hours=1))
            batch = sqlaq.enqueue_many(
                conn, sqlaq.NewJob("k", queue="batch").with_payloads([{}] * 3)
            )
            mixed = [sqlaq.NewJob("k", queue=f"m{i % 3}", priority=i) for i in range(9)]
            results = sqlaq.enqueue_many(conn, mixed)
            sqlaq.enqueue_copy(conn, [sqlaq.NewJob("k", queue="copy")] * 4)
            first = sqlaq.enqueue(conn, "k", queue="d1", dedupe_key="key")
            twin = sqlaq.enqueue(conn, "k", queue="d1", dedupe_key="key")
            other = sqlaq.enqueue(conn, "k", queue="d2", dedupe_key="key")
        heard = {n.payload for n in listener.notifies(timeout=2, stop_after=50)}
    assert heard == {"one", "batch", "m0", "m1", "m2", "copy", "d1", "d2"}
    assert len(batch) == 3
    # Results come back in input order: each job's row has its own priority.
    priorities = dict(rows(distributed, "SELECT id, priority FROM sqlaq_jobs"))
    assert [priorities[r.job_id] for r in results] == list(range(9))
    assert twin.duplicate
    assert twin.job_id == first.job_id
    assert not other.duplicate
    assert other.job_id != first.job_id
    assert scalar(distributed, "SELECT count(*) FROM sqlaq_jobs") == 1 + 1 + 3 + 9 + 4 + 2
    # Debounce (per queue, without max_wait): the second enqueue pushes the first back.
    with distributed.begin() as conn:
        debounce = {"debounce": timedelta(seconds=30), "debounce_key": "d"}
        one = sqlaq.enqueue(conn, "k", {"n": 1}, queue="db", **debounce)
        two = sqlaq.enqueue(conn, "k", {"n": 2}, queue="db", **debounce)
        elsewhere = sqlaq.enqueue(conn, "k", {"n": 3}, queue="db2", **debounce)
    assert two.job_id == one.job_id
    assert two.outcome == sqlaq.EnqueueOutcome.DEBOUNCED
    assert elsewhere.job_id != one.job_id
    payload = scalar(distributed, "SELECT payload FROM sqlaq_jobs WHERE id = :id", id=one.job_id)
    assert payload == {"n": 2}


@needs_citus
def test_limited_claim_pause_and_results_on_the_cluster(distributed: Engine) -> None:
    """claim_limited (lock and rate log on the coordinator), pause (a reference table),
    complete_with_result and result."""
    worker = uuid4()
    with distributed.begin() as conn:
        for _ in range(4):
            sqlaq.enqueue(conn, "limited", queue="lq")
        assert sqlaq.pause(conn, "lq")
    with distributed.begin() as conn:
        assert sqlaq.claim_limited(conn, worker_id=worker, kind="limited", queue="lq").jobs == []
        assert sqlaq.resume(conn, "lq")
    with distributed.begin() as conn:
        claimed = sqlaq.claim_limited(
            conn, worker_id=worker, kind="limited", queue="lq", limit=4, concurrency=2
        )
    assert len(claimed.jobs) == 2
    job = claimed.jobs[0]
    with distributed.begin() as conn:
        assert results.complete_with_result(conn, job.lease, results.encode_result({"n": 1}))
    with distributed.begin() as conn:
        outcome = sqlaq.result(conn, job.id)
    assert outcome.status == "done"
    assert outcome.result == {"n": 1}


@needs_citus
def test_cancel_sweep_retry_and_prune_run_queue_by_queue(distributed: Engine) -> None:
    """cancel finds each job's queue, cancels per queue, and tells the worker of a
    running one on the coordinator; sweep ends expired leases; retry queues a cancelled
    job again; prune deletes finished jobs; each over several queues."""
    url = make_url(CITUS).set(drivername="postgresql").render_as_string(hide_password=False)
    worker = uuid4()
    with distributed.begin() as conn:
        ids = [sqlaq.enqueue(conn, "k", queue=f"c{i % 3}", max_attempts=1).job_id for i in range(9)]
    with distributed.begin() as conn:
        running = [
            sqlaq.claim(conn, worker_id=worker, queue=q, limit=1, lease=timedelta(seconds=1))[0]
            for q in ("c0", "c1")
        ]
    with distributed.begin() as conn:  # as sqlaq.wait marks the jobs it waits for
        awaited = "UPDATE sqlaq_jobs SET awaited = true WHERE id = ANY(:ids)"
        conn.execute(text(awaited), {"ids": [ids[2], running[1].id]})
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_cancel")
        listener.execute("LISTEN sqlaq_finished")
        with distributed.begin() as conn:
            cancelled = sqlaq.cancel(conn, [running[0].id, ids[2], ids[5], 10**9])
        heard = {(n.channel, n.payload) for n in listener.notifies(timeout=2, stop_after=2)}
    assert cancelled == sorted([running[0].id, ids[2], ids[5]])
    # The running job's worker is told; so are the waiters of an awaited job.
    assert heard == {("sqlaq_cancel", str(running[0].id)), ("sqlaq_finished", str(ids[2]))}
    with distributed.begin() as conn, pytest.raises(sqlaq.LeaseLostError):
        sqlaq.complete(conn, running[0].lease)
    # The other claimed job's 1 s lease expires on its only attempt: the sweep fails it.
    wait_until(
        lambda: (
            scalar(
                distributed,
                "SELECT count(*) FROM sqlaq_jobs WHERE run_at <= now() AND status = 'running'",
            )
            == 1
        ),
        10,
        "the lease expired",
    )
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN sqlaq_finished")
        with distributed.begin() as conn:
            assert sqlaq.ops.sweep(conn) == 1
        heard = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert heard == [str(running[1].id)]  # failed for good, and awaited
    assert scalar(
        distributed, "SELECT status FROM sqlaq_jobs WHERE id = :id", id=running[1].id
    ) == ("failed")
    with distributed.begin() as conn:
        assert sqlaq.retry(conn, [ids[2], 10**9]) == [ids[2]]
    with distributed.begin() as conn:
        pruned = sqlaq.prune(conn, older_than=timedelta(0))
    assert pruned == 3  # two cancelled, one failed, in three queues
    assert scalar(distributed, "SELECT count(*) FROM sqlaq_jobs") == 6


@needs_citus
def test_a_later_revision_upgrades_a_distributed_table(installed: Engine) -> None:
    """Distributed at sqlaq_0006, then ``sqlaq migrate`` to the head (sqlaq_0007: a
    column, an index, the revision function; and the later ones) on the distributed
    table: sqlaq runs each revision's multi-shard DDL one connection per node itself
    (Citus would refuse the function command after a parallel DDL); the operations then
    use the new key column."""
    _reset(installed)
    with installed.begin() as conn:
        migrations.upgrade(conn, "sqlaq_0006")
        for statement in citus_queries.distribute_ddl():
            conn.execute(text(statement))
    code, out, err = _sqlaq(CITUS, "migrate")
    assert code == 0, err
    assert f"sqlaq_0006 -> {migrations.HEAD}" in out
    with installed.connect() as conn:
        assert migrations.check(conn) == migrations.HEAD
    engine = create_engine(CITUS)
    try:
        with engine.begin() as conn:
            assert citus.is_distributed(conn)
            sqlaq.enqueue(conn, "k", queue="kq", key="tenant-1")
        with engine.begin() as conn:
            (job,) = sqlaq.claim(conn, worker_id=uuid4(), queue="kq")
            assert sqlaq.complete(conn, job.lease) == [job.id]
    finally:
        engine.dispose()


@needs_citus
def test_alembic_downgrades_and_upgrades_a_distributed_table() -> None:
    """The host's Alembic (the repository's alembic.ini): ``alembic upgrade heads``,
    ``sqlaq citus-distribute``, then downgrades to sqlaq_0005 run on the distributed
    table (sqlaq keeps no trigger there: its trigger DDL is skipped), the one below
    refuses in one line naming why, and ``alembic upgrade heads`` comes back to a head
    that ``sqlaq check --deep`` finds as converted; the jobs stay and run."""
    cfg = alembic_config(CITUS)
    engine = create_engine(CITUS)
    _reset(engine)
    try:
        alembic.command.upgrade(cfg, "heads")
        code, _, err = _sqlaq(CITUS, "citus-distribute")
        assert code == 0, err
        with engine.begin() as conn:
            job_id = sqlaq.enqueue(conn, "k", queue="aq").job_id
        alembic.command.downgrade(cfg, "sqlaq_0005")
        with engine.connect() as conn:
            assert migrations.current_revision(conn) == "sqlaq_0005"
            assert citus.is_distributed(conn)
        with pytest.raises(sqlaq.SchemaOutOfDateError) as refused:
            alembic.command.downgrade(cfg, "sqlaq_0004")
        message = str(refused.value)
        assert "\n" not in message
        assert "sqlaq_0005 downgrade is refused on Citus" in message
        assert "undistribute_table('sqlaq_jobs')" in message
        alembic.command.upgrade(cfg, "heads")
        code, _, err = _sqlaq(CITUS, "check", "--deep")
        assert code == 0, err
        assert (
            scalar(
                engine,
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'sqlaq_jobs'"
                "::regclass AND NOT tgisinternal",
            )
            == 0
        )
        citus.forget(engine)
        with engine.begin() as conn:
            (job,) = sqlaq.claim(conn, worker_id=uuid4(), queue="aq")
            assert job.id == job_id
            assert sqlaq.complete(conn, job.lease) == [job_id]
    finally:
        _reset(engine)
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS alembic_version"))
        engine.dispose()


@needs_citus
def test_check_deep_knows_the_citus_shape(distributed: Engine) -> None:
    """``sqlaq check --deep`` on a converted schema: no drift (the primary key, the unique
    indexes leading with queue, no trigger); a real drift is still named, with fixes
    that run on Citus: a dropped dedupe index, the paused queues no longer a reference
    table."""
    code, out, err = _sqlaq(CITUS, "check", "--deep")
    assert code == 0, err
    assert f"as {migrations.HEAD} creates them" in out
    with distributed.begin() as conn:
        conn.execute(text("DROP INDEX sqlaq_jobs_dedupe_idx"))
        conn.execute(text("SELECT undistribute_table('sqlaq_paused_queues')"))
    code, _, err = _sqlaq(CITUS, "check", "--deep")
    assert code == 1
    assert "(2 difference(s))" in err, err
    (index,) = [line for line in err.splitlines() if "sqlaq_jobs_dedupe_idx" in line]
    assert "missing" in index
    assert "(queue, kind, dedupe_key)" in index
    (paused,) = [line for line in err.splitlines() if line.startswith("- citus ")]
    assert "sqlaq_paused_queues: not a reference table" in paused
    with distributed.connect() as conn:
        found = migrations.differences(conn)
    with distributed.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for difference in found:
            for statement in difference.statements:
                conn.execute(text(statement))
    code, _, err = _sqlaq(CITUS, "check", "--deep")
    assert code == 0, err


@needs_citus
def test_per_key_limits_and_order_within_a_queue(distributed: Engine) -> None:
    """claim_limited with key_concurrency, and ordered (one job of a key at a time, in
    enqueue order, within the queue on Citus)."""
    worker = uuid4()
    with distributed.begin() as conn:
        first = [sqlaq.enqueue(conn, "o", queue="oq", key="a").job_id for _ in range(3)]
        sqlaq.enqueue(conn, "o", queue="oq", key="b")
    with distributed.begin() as conn:
        taken = sqlaq.claim_limited(
            conn, worker_id=worker, kind="o", queue="oq", limit=10, ordered=True
        )
    assert sorted(j.payload == {} for j in taken.jobs) == [True, True]
    ids = {j.id for j in taken.jobs}
    assert first[0] in ids
    assert not ids & set(first[1:])
    with distributed.begin() as conn:
        again = sqlaq.claim_limited(
            conn, worker_id=worker, kind="o", queue="oq", limit=10, key_concurrency=2
        )
    assert {j.id for j in again.jobs} == {first[1]}  # key a holds one slot already


@needs_citus
def test_periodic_jobs_and_batch_dedupe_per_queue(distributed: Engine) -> None:
    """enqueue_periodic on the cluster (its slot row locked on the coordinator, its jobs
    a batch with dedupe keys): one job per slot, however many times it runs. A batch's
    duplicates resolve per queue: the same key in two queues makes two jobs."""
    registry = sqlaq.Registry()

    @registry.periodic("* * * * *", kind="tick", queue="pq")
    def tick(payload: dict[str, Any]) -> None:
        """A periodic job."""

    start = datetime(2026, 1, 1, tzinfo=UTC)
    with distributed.begin() as conn:
        assert sqlaq.enqueue_periodic(conn, registry.periodics, now=start) == []  # first sight
    for _ in range(2):
        with distributed.begin() as conn:
            done = sqlaq.enqueue_periodic(
                conn, registry.periodics, now=start + timedelta(minutes=3)
            )
    assert scalar(distributed, "SELECT count(*) FROM sqlaq_jobs WHERE queue = 'pq'") == 1
    assert done == []
    with distributed.begin() as conn:
        held = sqlaq.enqueue(conn, "k", queue="x1", dedupe_key="a").job_id
    with distributed.begin() as conn:
        batch = sqlaq.enqueue_many(
            conn,
            [
                sqlaq.NewJob("k", queue="x1", dedupe_key="a"),
                sqlaq.NewJob("k", queue="x2", dedupe_key="a"),
                sqlaq.NewJob("k", queue="x2", dedupe_key="a"),
                sqlaq.NewJob("k", queue="x1", dedupe_key="b"),
            ],
        )
    assert [r.duplicate for r in batch] == [True, False, True, False]
    assert batch[0].job_id == held
    assert batch[2].job_id == batch[1].job_id
    queues = dict(rows(distributed, "SELECT id, queue FROM sqlaq_jobs"))
    assert [queues[r.job_id] for r in batch] == ["x1", "x2", "x2", "x1"]


@needs_citus
def test_transactional_handlers_and_wait_on_the_cluster(distributed: Engine) -> None:
    """An in-process worker runs a transactional handler: its write (a host table on the
    coordinator) and the job's completion with its result commit together; a handler
    that raises leaves no write. sqlaq.wait is woken by the outcome itself: with no
    finish trigger on Citus, complete_with_result and fail send ``sqlaq_finished`` for
    an awaited job from the coordinator (its poll here is slower than the timeout)."""
    registry = sqlaq.Registry()

    @registry.handler("txn", max_attempts=1)
    def txn(payload: dict[str, Any], session: Any) -> dict[str, int]:
        """Write one effect row in the job's transaction; raise when told to."""
        job = sqlaq.current_job()
        session.execute(text(f"INSERT INTO {EFFECTS} (job_id) VALUES (:j)"), {"j": job.id})
        if payload.get("boom"):
            raise RuntimeError("boom")
        return {"n": job.id}

    with distributed.begin() as conn:
        conn.execute(text(f"CREATE TABLE {EFFECTS} (job_id bigint NOT NULL)"))
    try:
        with distributed.begin() as conn:
            # Due in a moment: each wait below starts before its job finishes.
            later = {"queue": "tx", "max_attempts": 1}
            good = sqlaq.enqueue(conn, "txn", delay=timedelta(seconds=1), **later).job_id
            bad = sqlaq.enqueue(conn, "txn", {"boom": 1}, delay=timedelta(seconds=3), **later)
        recorder = Recorder()
        worker = fast_worker(distributed, registry, recorder, queues=["tx"])
        with running(worker):
            began = time.monotonic()
            outcome = sqlaq.wait(distributed, good, timeout=30, poll_interval=600)
            failed = sqlaq.wait(distributed, bad.job_id, timeout=30, poll_interval=600)
            # At its timeout, wait reads the job once more: woken well before it.
            assert time.monotonic() - began < 20
        assert outcome.status == "done"
        assert outcome.result == {"n": good}
        assert failed.status == "failed"
        assert "boom" in (failed.error or "")
        assert [r[0] for r in rows(distributed, f"SELECT job_id FROM {EFFECTS}")] == [good]
        assert bad.job_id != good
    finally:
        with distributed.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {EFFECTS}"))


@needs_citus
def test_explain_and_the_operators_commands(distributed: Engine) -> None:
    """sqlaq.explain, and stats, list, show, explain, pause, resume, workers, retry,
    cancel and prune from the command line: each answers on the cluster."""
    with distributed.begin() as conn:
        later = sqlaq.enqueue(conn, "k", queue="eq", delay=timedelta(hours=1)).job_id
        now = sqlaq.enqueue(conn, "k", queue="eq").job_id
    with distributed.begin() as conn:
        (reason, *_) = sqlaq.explain(conn, later)
    assert reason.code == sqlaq.ReasonCode.NOT_DUE
    for args, expected in (
        (["stats"], "eq"),
        (["list", "--queue", "eq"], str(later)),
        (["show", str(now)], "queued"),
        (["explain", str(later)], "not due"),
        (["pause", "eq"], "paused"),
        (["explain", str(now)], "paused"),
        (["resume", "eq"], "resumed"),
        (["workers"], "(none)"),
        (["cancel", str(now)], "cancelled"),
        (["retry", str(now)], "retried 1"),
        (["cancel", str(now), str(later)], "cancelled"),
        (["prune", "--cancelled-older-than", "0s"], "2"),
    ):
        code, out, err = _sqlaq(CITUS, *args)
        assert code == 0, (args, err)
        assert expected in out, (args, out)
    assert scalar(distributed, "SELECT count(*) FROM sqlaq_jobs") == 0


@needs_citus
def test_the_dashboard_s_read_only_pages_answer(distributed: Engine) -> None:
    """Every read-only page of the dashboard answers 200 on a converted schema, with
    jobs in several states over several queues."""
    from starlette.testclient import TestClient

    from sqlaq.dashboard import app

    with distributed.begin() as conn:
        ids = [sqlaq.enqueue(conn, "k", queue=f"d{i % 3}", max_attempts=1).job_id for i in range(6)]
    with distributed.begin() as conn:
        (job,) = sqlaq.claim(conn, worker_id=uuid4(), queue="d0", limit=1)
        sqlaq.fail(conn, job.lease, "boom")
        sqlaq.cancel(conn, [ids[1]])
    with TestClient(app(distributed), base_url="http://localhost") as client:
        for path in (
            "/", "/api/overview", "/jobs", "/jobs?queue=d1", f"/jobs/{job.id}",
            f"/jobs/{ids[2]}", "/failures", "/prune", "/workers", "/schedules",
        ):  # fmt: skip
            response = client.get(path)
            assert response.status_code == 200, (path, response.text[-2000:])
        assert "boom" in client.get("/failures").text


@needs_citus
@pytest.mark.timeout(600)
def test_two_worker_processes_drain_every_job_exactly_once(distributed: Engine) -> None:
    """N jobs over four queues, two worker processes serving all four: every job done,
    each run once (the ledger), none left queued or running; the maintenance leader
    (sweep, prune) fails nothing."""
    total, queues = 2000, ["a", "b", "c", "d"]
    with contextmanager(ledger_table)(distributed):
        with distributed.begin() as conn:
            for index, queue in enumerate(queues):
                share = range(index, total, len(queues))
                sqlaq.enqueue_many(conn, [sqlaq.NewJob("record", queue=queue) for _ in share])
        assert scalar(distributed, "SELECT count(*) FROM sqlaq_jobs") == total
        with worker_processes(CITUS) as start:
            began = time.monotonic()
            # Maintenance on: the leader sweeps and prunes queue by queue.
            args = ["--queue", ",".join(queues), "--concurrency", "20"]
            args += ["--maintenance-interval", "0.5s", "--log-level", "warning"]
            workers = [start(*args) for _ in range(2)]

            def drained() -> bool:
                done = "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'"
                return scalar(distributed, done) == total or not all(w.alive() for w in workers)

            wait_until(
                drained,
                timeout=480,
                message=f"{total} jobs done",
                interval=0.2,
            )
            elapsed = time.monotonic() - began
            assert all(w.alive() for w in workers), [w.output()[-3000:] for w in workers]
            for w in workers:
                w.signal(signal.SIGTERM)
            for w in workers:
                assert w.wait(60) == 0, w.output()[-3000:]
            logs = "".join(w.output() for w in workers)
            assert "Traceback" not in logs, logs[-3000:]
        counts = dict(rows(distributed, "SELECT status, count(*) FROM sqlaq_jobs GROUP BY 1"))
        assert counts == {"done": total}, counts
        runs = rows(distributed, f"SELECT job_id, count(*) FROM {LEDGER} GROUP BY 1")
        assert len(runs) == total
        assert {count for _, count in runs} == {1}
        pids = scalar(distributed, f"SELECT count(DISTINCT pid) FROM {LEDGER}")
        assert pids >= 2  # both workers ran jobs
        print(f"Citus drain: {total} jobs, 4 queues, 2 workers: {elapsed:.1f} s")


def _terminate_node_backends(port: int) -> int:
    """``pg_terminate_backend`` every client backend of the cluster's database on the
    node at *port* (a worker node: the coordinator's connections to its shards)."""
    node = make_url(CITUS).set(port=port)
    engine = create_engine(node)
    try:
        with engine.connect() as conn:
            killed = conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND backend_type = 'client backend'"
                )
            ).scalar_one()
    finally:
        engine.dispose()
    return int(killed)


@needs_citus
@pytest.mark.timeout(600)
def test_a_killed_worker_and_a_node_s_terminated_backends_lose_no_job(
    distributed: Engine,
) -> None:
    """Mid-drain, one worker process is SIGKILLed (its leases expire and are claimed
    again by the claim itself) and the backends of a worker node are terminated (the
    statements in flight fail and are retried): every job ends done, none is lost, and
    a job runs again only if its first run was cut off (a stale holder cannot complete
    it: the fence)."""
    total, queues = 1500, ["a", "b", "c"]
    done_sql = "SELECT count(*) FROM sqlaq_jobs WHERE status = 'done'"
    with contextmanager(ledger_table)(distributed):
        with distributed.begin() as conn:
            for queue in queues:
                jobs = sqlaq.NewJob("sleep", queue=queue).with_payloads(
                    [{"seconds": 0.01}] * (total // len(queues))
                )
                sqlaq.enqueue_many(conn, jobs)
        args = [
            "--queue", ",".join(queues), "--concurrency", "10", "--lease", "3s",
            "--poll-interval", "0.5", "--no-maintenance", "--log-level", "warning",
        ]  # fmt: skip
        with worker_processes(CITUS) as start:
            victim, survivor = start(*args), start(*args)
            wait_until(lambda: scalar(distributed, done_sql) >= total // 5, 120, "a fifth done")
            victim.signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
            late = start(*args)
            wait_until(lambda: scalar(distributed, done_sql) >= total // 2, 120, "half done")
            node_port = int(make_url(CITUS).port or 5432) + 1
            assert _terminate_node_backends(node_port) > 0

            def drained() -> bool:
                try:
                    done = scalar(distributed, done_sql)
                except OperationalError:  # this session's connection to the node was cut too
                    return False
                return done == total or not (survivor.alive() and late.alive())

            wait_until(
                drained,
                timeout=300,
                message=f"{total} jobs done",
                interval=0.2,
            )
            assert survivor.alive(), survivor.output()[-3000:]
            assert late.alive(), late.output()[-3000:]
            for worker in (survivor, late):
                worker.signal(signal.SIGTERM)
            for worker in (survivor, late):
                assert worker.wait(60) == 0, worker.output()[-3000:]
        counts = dict(rows(distributed, "SELECT status, count(*) FROM sqlaq_jobs GROUP BY 1"))
        assert counts == {"done": total}, counts
        finished = dict(
            rows(
                distributed,
                f"SELECT job_id, count(*) FROM {LEDGER} WHERE note = 'finished' GROUP BY 1",
            )
        )
        assert len(finished) == total  # every job's handler ran to its end at least once
        # A job that ran twice had a first run cut off: by the SIGKILL, or by a statement
        # on the terminated node (its outcome not written, its lease expired).
        again = [job for job, count in finished.items() if count > 1]
        victims = set(
            rows(distributed, f"SELECT job_id FROM {LEDGER} WHERE pid = :pid", pid=victim.pid)
        )
        print(
            f"Citus faults: {total} jobs done; {len(again)} finished twice; "
            f"{len(victims)} started by the killed worker"
        )
        assert len(again) <= 3 * 10 + len(victims), again
