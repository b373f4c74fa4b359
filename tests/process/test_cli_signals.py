"""``sqlaq-worker``'s signals, on real processes: however fast they come, it ends.

The first SIGTERM/SIGINT stops gracefully, the second hands running jobs back at once,
the third exits at once. A signal handler only writes to a pipe: one that called
``Worker.stop()`` itself deadlocked when a second signal arrived while the first
handler held an event's lock, and then nothing but SIGKILL ended the process.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from workerkit import count_status, ledger_runs, ledger_table, rows, wait_until, worker_processes

import sqlaq
from sqlaq.cli import EXIT_FORCED
from sqlaq.worker import WORKER_APPLICATION_NAME

WORKERS = 10
#: Long enough that nothing but a signal ends the worker within the test.
SLOW = {"seconds": 60}


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    """The ledger table (on a truncated queue), dropped after the test."""
    yield from ledger_table(committed)


@pytest.mark.timeout(120)
def test_two_or_three_signals_in_quick_succession_always_end_the_worker(
    ledger: Engine, database_url: str
) -> None:
    queues = [f"signals_{i}" for i in range(WORKERS)]
    with ledger.begin() as conn:
        ids = [sqlaq.enqueue(conn, "sleep", SLOW, queue=q).job_id for q in queues]
    with worker_processes(database_url) as start:
        workers = [
            start("--queue", q, "--concurrency", "1", "--grace-period", "60s", "--no-maintenance")
            for q in queues
        ]
        for i, (worker, job_id) in enumerate(zip(workers, ids, strict=True)):
            wait_until(lambda job_id=job_id: ledger_runs(ledger, job_id), 30, "the job to start")
            # Two different signals never merge into one pending signal; a third may
            # merge with the first, which then makes two: exit 1 either way.
            burst = [signal.SIGTERM, signal.SIGINT, signal.SIGTERM][: 2 + i % 2]
            for sig in burst:
                worker.signal(sig)
            assert worker.wait(timeout=10) == EXIT_FORCED, worker.output()
            assert "Traceback" not in worker.output()
    # Handed back (or, after an exit at once, still leased): never done nor lost.
    assert count_status(ledger, "done") == 0
    assert count_status(ledger, "queued") + count_status(ledger, "running") == WORKERS


@pytest.mark.timeout(60)
def test_third_signal_ends_a_worker_wedged_in_its_hand_back(
    ledger: Engine, database_url: str
) -> None:
    with ledger.begin() as conn:
        job_id = sqlaq.enqueue(conn, "sleep", SLOW, queue="wedged").job_id
    with worker_processes(database_url) as start, ledger.connect() as blocker:
        worker = start("--queue", "wedged", "--lease", "60s", "--grace-period", "60s")
        wait_until(lambda: ledger_runs(ledger, job_id), 30, "the job to start")
        # Hold the job's row: the hand-back's UPDATE waits for it, for ever.
        blocker.execute(text("SELECT id FROM sqlaq_jobs WHERE id = :id FOR UPDATE"), {"id": job_id})
        worker.signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in worker.output(), 10, "the first signal")
        worker.signal(signal.SIGINT)
        wait_until(lambda: _waiting_for_a_lock(ledger), 10, "the hand-back to wait on the row")
        assert worker.alive()
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=5) == EXIT_FORCED, worker.output()
        assert "a third time: exiting now" in worker.output()
        blocker.rollback()


def _waiting_for_a_lock(engine: Engine) -> bool:
    return bool(
        rows(
            engine,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = :name AND wait_event_type = 'Lock'",
            name=WORKER_APPLICATION_NAME,
        )
    )
