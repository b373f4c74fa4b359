"""Retention beside a host's foreign key to jobs declared without ``ON DELETE``.

One referencing row used to make PostgreSQL refuse each whole batch: ``sqlaq prune``
exited 2 and the leader logged a traceback every round and stepped down, so nothing was
pruned again. Now the referenced jobs stay, the rest goes, and one warning names the
table and the fix.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import BigInteger, Column, Engine, ForeignKey, Integer, MetaData, Table, text
from sqlalchemy.exc import IntegrityError
from workerkit import wait_until

import sqlaq
from sqlaq import NewJob, queries
from sqlaq.config import WorkerConfig
from sqlaq.maintenance import Maintenance

pytestmark = pytest.mark.timeout(120)

host = MetaData()
# What the README used to recommend: a foreign key with no ondelete.
invoices = Table(
    "test_fk_invoices",
    host,
    Column("id", Integer, primary_key=True),
    Column("job_id", BigInteger, ForeignKey(sqlaq.jobs.c.id)),
)
# Keys that never stop a delete.
receipts = Table(
    "test_fk_receipts",
    host,
    Column("id", Integer, primary_key=True),
    Column("job_id", BigInteger, ForeignKey(sqlaq.jobs.c.id, ondelete="SET NULL")),
)


@pytest.fixture
def host_tables(committed: Engine) -> Iterator[Engine]:
    host.create_all(committed)
    try:
        yield committed
    finally:
        host.drop_all(committed)


def old_done_jobs(engine: Engine, count: int, referenced: int = 1) -> tuple[list[int], list[int]]:
    """*count* jobs done 8 days ago; the first *referenced* of them held by an invoice, and
    every one by a receipt (SET NULL: no hold). Returns (referenced ids, the others)."""
    with engine.begin() as conn:
        ids = [r.job_id for r in sqlaq.enqueue_many(conn, [NewJob("k")] * count)]
        conn.execute(
            text("UPDATE sqlaq_jobs SET status = 'done', finished_at = now() - interval '8 days'")
        )
        if referenced:
            held = [{"id": i, "job_id": j} for i, j in enumerate(ids[:referenced])]
            conn.execute(invoices.insert(), held)
        conn.execute(receipts.insert(), [{"id": i, "job_id": j} for i, j in enumerate(ids)])
    return ids[:referenced], ids[referenced:]


def remaining(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id FROM sqlaq_jobs ORDER BY id")).scalars())


def prune_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_blocking_keys_are_found_in_the_catalog(host_tables: Engine) -> None:
    with host_tables.connect() as conn:
        found = [queries.Reference(*r) for r in conn.execute(queries.blocking_references_stmt())]
    assert found == [queries.Reference("public", "test_fk_invoices", "job_id")]
    assert found[0].qualified == "public.test_fk_invoices"


def test_prune_deletes_around_a_referenced_job_and_reports_it(
    host_tables: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    held, _ = old_done_jobs(host_tables, 50)
    caplog.set_level(logging.WARNING, logger="sqlaq")
    with host_tables.connect() as conn:
        result = sqlaq.prune(conn, older_than=timedelta(days=7))
        assert conn.execute(text("SELECT 1")).scalar_one() == 1  # still usable
        conn.commit()
    assert result == 49
    assert (result.skipped, result.referenced_by) == (1, ("public.test_fk_invoices",))
    assert remaining(host_tables) == held
    (warning,) = prune_warnings(caplog)
    message = warning.getMessage()
    assert "1 finished job(s)" in message
    assert "public.test_fk_invoices" in message
    assert 'ondelete="SET NULL"' in message
    assert "CASCADE" in message
    assert "\n" not in message


def test_a_loop_of_batches_prunes_everything_else_and_warns_once(
    host_tables: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    held, _ = old_done_jobs(host_tables, 95, referenced=3)
    caplog.set_level(logging.WARNING, logger="sqlaq")
    results = []
    with host_tables.connect() as conn:
        while True:
            results.append(sqlaq.prune(conn, older_than=timedelta(days=7), limit=10))
            conn.commit()
            if results[-1] < 10:
                break
    assert [int(r) for r in results] == [10] * 9 + [2]
    assert [r.skipped for r in results] == [0] * 9 + [3]
    assert len(prune_warnings(caplog)) == 1
    assert remaining(host_tables) == held


def test_without_blocking_keys_nothing_is_skipped(host_tables: Engine) -> None:
    old_done_jobs(host_tables, 5, referenced=0)
    with host_tables.connect() as conn:
        result = sqlaq.prune(conn, older_than=timedelta(days=7))
        conn.commit()
    assert (int(result), result.skipped, result.referenced_by) == (5, 0, ())
    assert repr(result) == "PruneResult(5, skipped=0, referenced_by=())"
    assert remaining(host_tables) == []
    with host_tables.connect() as conn:  # SET NULL did its part
        assert conn.execute(text("SELECT count(job_id) FROM test_fk_receipts")).scalar_one() == 0


def test_a_violation_nobody_foresaw_fails_only_its_savepoint(host_tables: Engine) -> None:
    """A key whose ON DELETE action itself fails (SET DEFAULT to a job that does not
    exist) is not a blocking key, so it reaches the delete: the error comes out after the
    retries, and the caller's transaction is still usable."""
    old_done_jobs(host_tables, 3)
    with host_tables.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE test_fk_default (job_id bigint DEFAULT -1"
                " REFERENCES sqlaq_jobs (id) ON DELETE SET DEFAULT)"
            )
        )
        conn.execute(text("INSERT INTO test_fk_default SELECT id FROM sqlaq_jobs"))
    try:
        with host_tables.connect() as conn:
            with pytest.raises(IntegrityError, match="test_fk_default"):
                sqlaq.prune(conn, older_than=timedelta(days=7))
            assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 3
            conn.rollback()
    finally:
        with host_tables.begin() as conn:
            conn.execute(text("DROP TABLE test_fk_default"))


def test_sqlaq_prune_command_exits_0_with_one_warning_line(
    host_tables: Engine, database_url: str
) -> None:
    held, _ = old_done_jobs(host_tables, 2500)  # three batches of the command's 1000
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from sqlaq.cli import admin_main; admin_main()",
            "prune",
            "--database-url",
            database_url,
            "--done-older-than",
            "7d",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "pruned 2499 job(s)"
    (line,) = done.stderr.splitlines()
    assert "public.test_fk_invoices" in line
    assert 'ondelete="SET NULL"' in line
    assert remaining(host_tables) == held


def test_the_leader_prunes_the_rest_and_keeps_leading(
    host_tables: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    held, _ = old_done_jobs(host_tables, 30)
    caplog.set_level(logging.INFO, logger="sqlaq")
    config = WorkerConfig(maintenance_interval=timedelta(milliseconds=50))
    maintainer = Maintenance(host_tables, [], config, "m-fk")
    maintainer.start()
    try:
        wait_until(lambda: remaining(host_tables) == held, 10, "the unreferenced jobs pruned")
        rounds = maintainer.rounds
        wait_until(lambda: maintainer.rounds >= rounds + 3, 10, "three more rounds")
        assert maintainer.leading.is_set()
    finally:
        maintainer.stop()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    leadership = [r.getMessage() for r in caplog.records if "leader" in r.getMessage()]
    assert leadership == ["maintenance leader elected", "maintenance leader stepped down"]
    warnings = prune_warnings(caplog)
    assert warnings
    assert all("public.test_fk_invoices" in r.getMessage() for r in warnings)
