"""The outbox (``sqlaq.worker.outbox``): outcomes on their way to the writer, one batch
in flight, and what a batch the database did not take leaves behind. The writer here is
a stand-in that only records the batches handed to it; the test plays its part."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import psycopg
import pytest

from sqlaq.outcome import Outcome, Verdict
from sqlaq.schema import JobStatus
from sqlaq.worker.outbox import Outbox
from sqlaq.worker.writer import Batch

DONE = Outcome(Verdict.DONE)


class Run:
    def __init__(self, name: str) -> None:
        self.name = name
        self.token = uuid4()


class Finished:
    def __init__(self, name: str) -> None:
        self.run = Run(name)
        self.logged: list[Any] = []

    def log(self, logger: Any, outcome: Outcome, status: JobStatus | None) -> None:
        self.logged.append(status)

    def result(self, outcome: Outcome, status: JobStatus | None) -> str:
        return self.run.name


class Writer:
    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def submit(self, batch: Batch) -> None:
        self.batches.append(batch)


class Leases:
    def __init__(self) -> None:
        self.released: list[str] = []
        self.renewal_due = False

    def due(self) -> bool:
        return self.renewal_due

    def release(self, run: Run) -> None:
        self.released.append(run.name)

    def renewable(self, finishing: set[Any]) -> list[Any]:
        return []


class World:
    """An outbox, its stand-ins, and what it told the worker."""

    def __init__(self) -> None:
        self.writer = Writer()
        self.leases = Leases()
        self.told: list[str] = []
        self.backed_off: list[BaseException] = []
        self.outbox = Outbox(
            self.writer,  # type: ignore[arg-type]
            self.leases,  # type: ignore[arg-type]
            self.told.append,  # type: ignore[arg-type]
            self.backed_off.append,
            lambda: None,
        )

    def add(self, *names: str) -> list[Finished]:
        added = [Finished(name) for name in names]
        for finished in added:
            self.outbox.add(finished, DONE)  # type: ignore[arg-type]
        return added


def names(batch: Batch) -> list[str]:
    return [f.run.name for f, _ in batch.items]  # type: ignore[attr-defined]


def test_one_batch_in_flight_and_what_finishes_meanwhile_waits_for_the_next() -> None:
    world = World()
    outbox = world.outbox
    world.add("a", "b")
    assert outbox.ready
    assert not outbox.writing
    outbox.turn()
    (first,) = world.writer.batches
    assert names(first) == ["a", "b"]
    assert outbox.writing
    assert not outbox.ready
    world.add("c")
    outbox.turn()
    assert len(world.writer.batches) == 1  # the writer is busy: "c" waits
    assert len(outbox) == 3  # back-pressure counts both
    first.written = [(f, o, JobStatus.DONE) for f, o in first.items]
    first.done.set()
    assert outbox.ready
    outbox.turn()  # settles the first batch, hands over the next
    assert world.leases.released == ["a", "b"]
    assert world.told == ["a", "b"]
    assert names(world.writer.batches[1]) == ["c"]
    assert outbox.wrote


def test_a_batch_the_database_did_not_take_is_written_again_first_in_order() -> None:
    world = World()
    outbox = world.outbox
    world.add("a", "b", "c")
    outbox.turn()
    (batch,) = world.writer.batches
    world.add("d")  # finished while the batch was in flight
    (a, _), *_ = batch.items
    batch.written = [(a, DONE, JobStatus.DONE)]
    batch.error = psycopg.OperationalError("server closed the connection unexpectedly")
    batch.done.set()
    outbox.turn()
    assert world.backed_off == [batch.error]
    assert world.told == ["a"]  # the one written is settled
    assert names(world.writer.batches[1]) == ["b", "c", "d"]


def test_a_fault_that_is_not_the_database_away_is_raised_with_the_outcomes_kept() -> None:
    world = World()
    outbox = world.outbox
    world.add("a", "b")
    outbox.turn()
    (batch,) = world.writer.batches
    batch.error = RuntimeError("a bug in the writer")
    batch.done.set()
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        outbox.turn()
    assert world.backed_off == []
    assert not outbox.writing
    assert outbox.waiting
    assert len(outbox) == 2


def test_a_stuck_writer_is_not_settled() -> None:
    world = World()
    outbox = world.outbox
    world.add("a")
    outbox.turn()
    assert outbox.settle_batch(timeout=0.01) is False
    assert outbox.writing
