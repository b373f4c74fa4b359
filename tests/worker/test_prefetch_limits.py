"""A prefetching worker and limited kinds: limited jobs are claimed for free slots only
(never ahead), and a queue whose limited kinds wait for a free slot is looked at again
as soon as one frees, so a burst worker runs every due job, whatever its prefetch."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine
from workerkit import count_status

import sqlaq


def _limited_registry(ran: list[int]) -> sqlaq.Registry:
    registry = sqlaq.Registry()

    # Limits far above what one worker reaches: what is tested is the claim's path.
    @registry.handler("limited", concurrency=100_000, rate="10000/s")
    def limited(_payload: dict[str, Any]) -> None:
        ran.append(sqlaq.current_job().id)

    @registry.handler("plain")
    def plain(_payload: dict[str, Any]) -> None:
        ran.append(sqlaq.current_job().id)

    return registry


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [None, 0, 50], ids=["auto", "none", "fixed"])
def test_a_burst_worker_runs_every_limited_job_whatever_its_prefetch(
    committed: Engine, prefetch: int | None
) -> None:
    with committed.begin() as conn:
        ids = [
            r.job_id
            for r in sqlaq.enqueue_many(
                conn,
                [sqlaq.NewJob("limited") for _ in range(300)]
                + [sqlaq.NewJob("plain") for _ in range(20)],
            )
        ]
    ran: list[int] = []
    worker = sqlaq.Worker(
        committed, _limited_registry(ran), concurrency=4, prefetch=prefetch, burst=True
    )
    worker.run()
    assert sorted(ran) == sorted(ids)
    assert count_status(committed, "done") == 320
