"""The ORM-mapped Job beside a host's own models, and transactional enqueue."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, ForeignKey, String, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from workerkit import libpq_url

import sqlaq
from sqlaq import InvalidJobError, Job


class HostBase(DeclarativeBase):
    """A host application's own declarative base, with its own MetaData."""


class Order(HostBase):
    __tablename__ = "test_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(50))
    # Host foreign keys to jobs use the Column object: a string would be resolved in the
    # host's MetaData, which does not hold sqlaq_jobs.
    job_id: Mapped[int | None] = mapped_column(ForeignKey(sqlaq.jobs.c.id, ondelete="SET NULL"))


@pytest.fixture
def host_tables(committed: Engine) -> Iterator[Engine]:
    HostBase.metadata.create_all(committed)
    try:
        yield committed
    finally:
        HostBase.metadata.drop_all(committed)


@pytest.fixture
def listener(database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("LISTEN sqlaq_jobs")
        yield conn


def _notifications(
    conn: psycopg.Connection[tuple[object, ...]], timeout: float, stop_after: int | None = None
) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout, stop_after=stop_after)]


def test_job_and_host_row_commit_together_and_wake_workers(
    host_tables: Engine, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    with Session(host_tables) as session:
        job = Job(kind="ship_order", payload={"order": 1}, queue="shipping")
        session.add(job)
        session.flush()  # eager_defaults: id and server defaults are loaded
        session.add(Order(id=1, item="book", job_id=job.id))
        session.commit()
        assert job.status == "queued"
        assert job.attempts == 0
        assert job.max_attempts == 5
        assert job.created_at is not None

    [payload] = _notifications(listener, timeout=5, stop_after=1)
    assert payload.rsplit(" ", 2)[0] == "shipping"  # then the job's position (sqlaq_0008)
    assert _notifications(listener, timeout=0.2) == []
    with Session(host_tables) as session:
        order = session.get(Order, 1)
        assert order is not None
        stored = session.get(Job, order.job_id)
        assert stored is not None
        assert (stored.kind, stored.payload, stored.queue) == (
            "ship_order",
            {"order": 1},
            "shipping",
        )


def test_rolled_back_enqueue_leaves_no_job_and_no_notification(
    host_tables: Engine, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    with Session(host_tables) as session:
        session.add(Order(id=2, item="pen"))
        session.add(Job(kind="ship_order", payload={"order": 2}))
        sqlaq.enqueue(session, "audit", {"order": 2})
        session.flush()
        session.rollback()
    assert _notifications(listener, timeout=0.5) == []
    with host_tables.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM test_orders")).scalar_one() == 0


def test_operations_run_on_a_session_in_its_transaction(host_tables: Engine) -> None:
    import uuid

    with Session(host_tables) as session:
        session.add(Order(id=3, item="cup"))
        result = sqlaq.enqueue(session, "ship_order", {"order": 3}, dedupe_key="order-3")
        assert sqlaq.enqueue(session, "ship_order", dedupe_key="order-3").duplicate
        (claimed,) = sqlaq.claim(session, worker_id=uuid.uuid4())
        assert claimed.id == result.job_id
        sqlaq.complete(session, claimed.lease)
        session.commit()
    with Session(host_tables) as session:
        assert session.scalars(select(Job.status)).all() == ["done"]


def test_a_job_that_waits_for_others_is_enqueued_with_after_not_through_the_orm(
    host_tables: Engine,
) -> None:
    for attempt in (
        lambda: Job(kind="ship_order", after=[1]),
        lambda: Job(kind="ship_order", parent_ids=[1]),
        lambda: Job(kind="ship_order", has_dependents=True),
        lambda: Job(kind="ship_order", on_parent_failure="run"),
    ):
        with pytest.raises(InvalidJobError, match=r"sqlaq\.enqueue\(session, .*after=\[ids\]"):
            attempt()
    job = Job(kind="ship_order")
    with pytest.raises(InvalidJobError, match="parent_ids"):
        job.parent_ids = [1]
    # The supported path, in the session's flush and transaction beside the host's rows.
    with Session(host_tables) as session:
        parent = Job(kind="pack_order")
        session.add_all([Order(id=4, item="mug"), parent])
        session.flush()
        parent_id = parent.id
        child = sqlaq.enqueue(session, "ship_order", {"order": 4}, after=[parent_id]).job_id
        session.commit()
    with Session(host_tables) as session:
        loaded = session.get(Job, child)
        assert loaded is not None
        assert (loaded.parent_ids, loaded.status) == ([parent_id], "queued")
        assert session.get(Job, parent_id).has_dependents  # type: ignore[union-attr]
        edges = session.execute(text("SELECT parent_id, child_id FROM sqlaq_job_deps")).all()
        assert [tuple(e) for e in edges] == [(parent_id, child)]
