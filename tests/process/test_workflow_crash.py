"""A worker killed in the middle of a workflow loses nothing: the step it was running
comes back after its lease, and the steps after it run once, after it, elsewhere."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine
from workerkit import (
    FAST,
    START_TIMEOUT,
    job,
    ledger_runs,
    ledger_table,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq
from sqlaq import NewJob

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    yield from ledger_table(committed)


def test_a_worker_killed_mid_chain_loses_nothing(ledger: Engine, database_url: str) -> None:
    with ledger.begin() as conn:
        first, second, third = sqlaq.chain(
            conn,
            [NewJob("block_first", {"seconds": 60}), NewJob("record"), NewJob("record")],
        ).job_ids
    with worker_processes(database_url) as start:
        doomed = start("--lease", "2", *FAST)
        # Neither process's start-up (imports, connections) is what is tested.
        wait_until(lambda: ledger_runs(ledger, first), START_TIMEOUT, "the first step to start")
        doomed.signal(signal.SIGKILL)
        doomed.wait(10)
        assert job(ledger, second).status == "queued"  # still waiting for its parent
        wait_started(start("--lease", "2", *FAST))
        wait_until(lambda: job(ledger, third).status == "done", 30, "the chain's last step")
    assert [r.attempt for r in ledger_runs(ledger, first)] == [1, 2]
    assert [r.attempt for r in ledger_runs(ledger, second)] == [1]
    assert [r.attempt for r in ledger_runs(ledger, third)] == [1]
    assert job(ledger, first).finished_at <= job(ledger, second).attempted_at
    assert job(ledger, second).finished_at <= job(ledger, third).attempted_at
