"""Per-key concurrency and strict order per key under racing claims and real workers.

The claim-level tests race real connections against each other (a barrier releases
them together); the worker tests run three ``sqlaq-worker`` processes and read what
happened from the ledger (start and end of each run, on the database's clock).
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import Engine, text
from workerkit import (
    MANY_WORKERS,
    count_status,
    ledger_table,
    rows,
    wait_started,
    wait_until,
    worker_processes,
)

import sqlaq

FAST = ["--poll-interval", "0.2", "--log-level", "info"]


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    yield from ledger_table(committed)


def _enqueue(engine: Engine, kind: str, keys: list[str], **options: Any) -> list[int]:
    with engine.begin() as conn:
        results = sqlaq.enqueue_many(conn, [sqlaq.NewJob(kind, key=k, **options) for k in keys])
    return [r.job_id for r in results]


def _race(engine: Engine, claims: int, **limits: Any) -> list[int]:
    """*claims* connections claim the kind "race" at the same moment; what each got."""
    barrier = threading.Barrier(claims)
    got: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with engine.begin() as conn:
                conn.execute(text("SELECT 1"))  # connected before the barrier
                barrier.wait(10)
                claimed = sqlaq.claim_limited(
                    conn, worker_id=uuid.uuid4(), kind="race", limit=3, **limits
                )
            got.append(len(claimed.jobs))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(claims)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return got


def _running_per_key(engine: Engine) -> dict[str, list[int]]:
    found = rows(engine, "SELECT key, id FROM sqlaq_jobs WHERE status = 'running' ORDER BY key, id")
    per_key: dict[str, list[int]] = {}
    for key, job_id in found:
        per_key.setdefault(key, []).append(job_id)
    return per_key


@pytest.mark.timeout(60)
def test_racing_claims_never_exceed_a_keys_limit(committed: Engine) -> None:
    _enqueue(committed, "race", ["a", "b", "c"] * 10)
    got = _race(committed, 8, key_concurrency=2)
    assert sum(got) == 6
    assert {key: len(ids) for key, ids in _running_per_key(committed).items()} == {
        "a": 2,
        "b": 2,
        "c": 2,
    }


@pytest.mark.timeout(60)
def test_racing_ordered_claims_take_the_first_job_of_each_key(committed: Engine) -> None:
    ids = _enqueue(committed, "race", ["a", "b"] * 10)
    got = _race(committed, 8, ordered=True)
    assert sum(got) == 2
    assert _running_per_key(committed) == {"a": [ids[0]], "b": [ids[1]]}


def _runs(engine: Engine, ids: list[int]) -> dict[int, tuple[datetime, datetime, int]]:
    """Each job's (start, end, pid) from the ledger."""
    found = rows(
        engine,
        "SELECT job_id, note, at, pid FROM sqlaq_test_ledger WHERE job_id = ANY(:ids)",
        ids=ids,
    )
    starts = {r.job_id: (r.at, r.pid) for r in found if r.note == "start"}
    ends = {r.job_id: r.at for r in found if r.note == "end"}
    assert len(starts) == len(ends) == len(ids)
    return {i: (starts[i][0], ends[i], starts[i][1]) for i in ids}


def _overlaps(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant (an end before a start at equal times)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


@MANY_WORKERS
@pytest.mark.timeout(180)
def test_three_workers_never_run_more_than_two_of_a_key(ledger: Engine, database_url: str) -> None:
    """30 jobs over 3 keys of a kind with key_concurrency=2, three worker processes of 4
    slots each: never more than 2 of a key run at once, and the keys run side by side."""
    keys = ["a", "b", "c"] * 10
    with worker_processes(database_url) as start:
        # The jobs come once the three have started: a process slow to start (imports,
        # connections, on a loaded machine) could otherwise find every job done by the
        # first one, and the limit would not be tested across processes.
        wait_started(*[start("--concurrency", "4", *FAST) for _ in range(3)])
        ids = _enqueue(ledger, "tenant_job", keys, payload={"seconds": 0.1})
        wait_until(lambda: count_status(ledger, "done") == 30, 90, "all 30 jobs done")
    runs = _runs(ledger, ids)
    for key in "abc":
        of_key = [runs[i][:2] for i, k in zip(ids, keys, strict=True) if k == key]
        assert _overlaps(of_key) == 2, key
    assert _overlaps([run[:2] for run in runs.values()]) > 2  # other keys kept flowing
    assert len({run[2] for run in runs.values()}) >= 2  # the limit held across processes


@pytest.mark.timeout(120)
def test_three_workers_run_a_keys_jobs_one_at_a_time_in_enqueue_order(
    ledger: Engine, database_url: str
) -> None:
    """20 jobs over 2 keys of an ordered kind, three worker processes: each key's jobs
    run one after the other in enqueue order, the two keys side by side."""
    keys = ["a", "b"] * 10
    ids = _enqueue(ledger, "account_op", keys, payload={"seconds": 0.05})
    with worker_processes(database_url) as start:
        for _ in range(3):
            start("--concurrency", "4", *FAST)
        wait_until(lambda: count_status(ledger, "done") == 20, 90, "all 20 jobs done")
    runs = _runs(ledger, ids)
    for key in "ab":
        of_key = [runs[i] for i, k in zip(ids, keys, strict=True) if k == key]
        for before, after in itertools.pairwise(of_key):
            assert before[1] <= after[0], (key, before, after)  # ended before the next began
    assert _overlaps([run[:2] for run in runs.values()]) == 2  # one per key at once
