"""What a claim tells the fetcher (sqlaq.worker.fetcher): with LISTEN on, a claim that
comes back short ends the queue's turn as an empty one does (the worker waits for a
NOTIFY or the poll instead of claiming again at once); a burst worker, and one that
only polls, claim until a claim comes back empty."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import Engine

import sqlaq
from sqlaq import NewJob, WorkerConfig
from sqlaq.worker.fetcher import Fetcher

pytestmark = pytest.mark.timeout(60)


def _fetcher(engine: Engine, **options: object) -> Fetcher:
    registry = sqlaq.Registry()
    registry.handler("due")(lambda payload: None)

    def back_off(exc: BaseException) -> None:
        raise exc

    # No poll within the test: only claims and the NOTIFY below change what is due.
    config = WorkerConfig(poll_interval=timedelta(minutes=10), **options)  # type: ignore[arg-type]
    return Fetcher(engine, registry, config, uuid.uuid4(), back_off, lambda: None)


def _enqueue(engine: Engine, count: int) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_many(conn, NewJob("due").with_payloads([{"i": i} for i in range(count)]))


@pytest.mark.parametrize(
    ("options", "due_after_short"),
    [
        ({}, False),  # LISTEN on: a short claim ends the turn
        ({"burst": True}, True),  # a burst worker asks until a claim is empty
        ({"listen": False}, True),  # polling only: asks until a claim is empty
    ],
)
def test_a_short_claim_ends_the_queues_turn_only_where_a_notify_will_come(
    committed: Engine, options: dict[str, object], due_after_short: bool
) -> None:
    fetcher = _fetcher(committed, **options)
    try:
        _enqueue(committed, 5)
        full = fetcher.fetch(3, 3, lambda: False)  # asks 3 of 5: a full claim
        assert len(full) == 3
        assert fetcher.due
        short = fetcher.fetch(10, 10, lambda: False)  # asks 10, 2 are left
        assert len(short) == 2
        assert fetcher.due is due_after_short
        fetcher.woken(["default"])  # a NOTIFY
        _enqueue(committed, 1)
        assert len(fetcher.fetch(10, 10, lambda: False)) == 1
        if due_after_short:
            assert fetcher.due
            assert fetcher.fetch(10, 10, lambda: False) == []
        assert not fetcher.due  # an empty claim ends the turn everywhere
    finally:
        fetcher.close()
