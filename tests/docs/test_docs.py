"""Every code sample of the documentation runs here, one test case per fenced block.

The documentation is README.md, every page under docs/, and the Markdown files those
include (tests/docsamples.py finds the blocks: indented ones inside admonitions and
tabs too, ``--8<-- "path"`` snippets included). How each kind of block is checked:

* ```` ```python ````: executed for real against the test database, in the namespace a
  *prelude* gives it (see "Adding a prelude" below). A block that cannot run here is
  marked ``<!-- docs-test: skip reason="..." -->``, and the reason must name the test
  that runs it instead, as ``tests/test_x.py::test_name`` (the file and the test must
  exist); every dotted name it takes from a module it imports must exist too
  (``sqlaq.migrations.include_name``). Its case is then skipped with the reason.
* ```` ```sh ````: every command is checked by its program. ``sqlaq`` and
  ``sqlaq-worker`` lines go through the real argument parsers, so a renamed flag fails;
  the read-only ``sqlaq`` subcommands also run against the test database. ``alembic``
  lines go through Alembic's own parser. The set-up lines are not run (``pip install``
  and ``pip wheel`` install or build packages; the extras and the wheel file they name
  must be sqlaq's): a ``nox`` command must appear verbatim
  in ``.ci/run`` (``nox -s bench``, minutes long, must name a session of noxfile.py),
  and the quickstart script runs against a fresh database.
* ```` ```ini ````: parsed; the ``[alembic]`` section must hold the settings that make
  sqlaq's branch visible, and Alembic, given them, must find sqlaq's head revision.
* Blocks with no language or ``text`` (a diagram, sample output) are not run: their
  cases are skipped with the reason, so ``pytest -ra`` lists them.

A python, sh or ini block (or a command) that no rule covers fails its case, so a new
sample cannot go untested by accident. Other languages (``toml``, ``json``, ``yaml``...)
fail too until a rule is added in ``RUNNERS``.

Adding a prelude
----------------

A prelude is a generator registered with ``@prelude("name")`` (below, with the others):
its parameters are pytest fixtures (``committed``, ``clean_conn``, ``caplog``...); it sets
up real tables and small recording stubs, yields the dict the sample runs in, then checks
what the sample did (a handler ran, a row was written) and cleans up. A python block
picks its prelude in one of two ways:

1. A marker right before the block (blank lines allowed between; inside an admonition
   or tab, indent it like the block)::

       <!-- docs-test: prelude=name -->

2. For every block of a page, or of one section of a page, without markers: name them
   when registering, ``@prelude("name", pages=["docs/how-to/limits.md"])`` or
   ``pages=[("docs/how-to/limits.md", "Per-kind limits")]`` (the heading's text). A
   marker wins over this.

Blocks that build on each other (a tutorial) can share one namespace: a prelude may run
the page's earlier blocks itself with :func:`earlier_blocks`. A test that runs a
sample its own way finds it with ``docsamples.find_blocks(lang, contains)``, and the
sample's marker names that test in its skip reason.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import importlib
import inspect
import io
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from types import ModuleType, SimpleNamespace
from typing import Any

import docsamples
import pytest
from alembic.config import CommandLine, Config
from alembic.script import ScriptDirectory
from docsamples import Block
from sqlalchemy import Connection, Engine, String, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqlaq
from sqlaq import Job, admin, cli
from sqlaq.testing import drain

ROOT = docsamples.ROOT
BLOCKS = docsamples.all_blocks()
DOCUMENTS = [docsamples.load(path) for path in docsamples.documentation_files()]


# -- preludes for python blocks ------------------------------------------------------

Prelude = Callable[..., AbstractContextManager[dict[str, Any]]]
PRELUDES: dict[str, Prelude] = {}
#: The prelude of the python blocks without a marker, by (file, heading), or by
#: (file, None) for a whole page: what ``@prelude(name, pages=[...])`` registers.
PAGE_PRELUDES: dict[tuple[str, str | None], str] = {}


def prelude(
    name: str, pages: tuple[str | tuple[str, str], ...] | list[str | tuple[str, str]] = ()
) -> Callable[[Callable[..., Iterator[dict[str, Any]]]], Prelude]:
    """Register a prelude: a generator taking fixtures by name, yielding the namespace a
    sample runs in, then checking what the sample did. *pages* names the files (or
    ``(file, heading)`` sections) whose unmarked python blocks it serves."""

    def register(func: Callable[..., Iterator[dict[str, Any]]]) -> Prelude:
        assert name not in PRELUDES, f"two preludes named {name!r}"
        PRELUDES[name] = contextmanager(func)
        for where in pages:
            key = (where, None) if isinstance(where, str) else where
            assert key not in PAGE_PRELUDES, f"{key} has two preludes"
            PAGE_PRELUDES[key] = name
        return PRELUDES[name]

    return register


def prelude_of(block: Block) -> str | None:
    """The name of *block*'s prelude: its marker's, else its section's, else its page's."""
    return (
        block.options.get("prelude")
        or PAGE_PRELUDES.get((block.path, block.heading))
        or PAGE_PRELUDES.get((block.path, None))
    )


def earlier_blocks(block: Block) -> list[Block]:
    """The python blocks of *block*'s page before it: for a prelude that runs a
    tutorial's earlier steps (``exec`` each, in order, into the namespace)."""
    return [b for b in docsamples.load(block.path).blocks[: block.index] if b.lang == "python"]


@pytest.fixture
def clean_conn(committed: Engine) -> Iterator[Connection]:
    """A connection in a transaction rolled back after the test, on an empty queue, so a
    sample that drains the queue sees its own jobs only."""
    with committed.connect() as connection:
        transaction = connection.begin()
        try:
            yield connection
        finally:
            transaction.rollback()


class HostBase(DeclarativeBase):
    """A host application's declarative base, with a MetaData of its own."""


class Order(HostBase):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(50))


def _jobs(conn: Connection) -> list[Any]:
    columns = sqlaq.jobs.c
    stmt = select(columns.kind, columns.payload, columns.status).order_by(columns.id)
    return list(conn.execute(stmt).all())


@prelude("host")
def host_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database, and a host's ``orders`` table (Core) and its
    ``Order`` model (ORM), created for the sample and dropped after."""
    orders = Order.__table__
    HostBase.metadata.create_all(committed, checkfirst=False)
    try:
        yield {"engine": committed, "orders": orders, "Order": Order, "Session": Session}
        with committed.connect() as conn:
            stored = conn.execute(select(orders.c.id, orders.c.item).order_by(orders.c.id))
            assert [tuple(row) for row in stored] == [(7, "book"), (8, "pen")]
            assert [tuple(row) for row in _jobs(conn)] == [
                ("ship_order", {"order_id": 7}, "queued"),
                ("ship_order", {"order_id": 8}, "queued"),
            ]
    finally:
        HostBase.metadata.drop_all(committed)


@prelude("autocommit")
def autocommit_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database; after the sample, its job is committed (read on
    another connection)."""
    yield {"engine": committed}
    with committed.connect() as conn:
        assert [tuple(row) for row in _jobs(conn)] == [("send_report", {"report_id": 3}, "queued")]


@prelude("debounce")
def debounce_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database; then one queued job is left, with the last
    payload, due 30 s after the enqueues."""
    yield {"engine": committed}
    with committed.connect() as conn:
        assert [tuple(row) for row in _jobs(conn)] == [
            ("reindex", {"doc_id": 7, "revision": 3}, "queued")
        ]
        due = "SELECT run_at - created_at FROM sqlaq_jobs"
        assert conn.execute(text(due)).scalar_one() == timedelta(seconds=30)


@prelude("unique-for")
def unique_for_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database; then one job, holding its key for a day."""
    yield {"engine": committed}
    with committed.connect() as conn:
        assert [tuple(row) for row in _jobs(conn)] == [("daily_report", {}, "queued")]
        held = "SELECT expires_at - now() > interval '23 hours' FROM sqlaq_unique_holds"
        assert conn.execute(text(held)).scalar_one() is True


class Mailer:
    """Records what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def send(self, to: str, subject: str, *, idempotency_key: str) -> None:
        self.sent.append((to, subject, idempotency_key))


class Billing:
    """Records pushed invoices; raises the error set for an invoice instead."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        self.errors = errors
        self.pushed: list[str] = []

    async def push(self, invoice_id: str) -> None:
        if invoice_id in self.errors:
            raise self.errors[invoice_id]
        self.pushed.append(invoice_id)


def load_user(user_id: int) -> SimpleNamespace:
    return SimpleNamespace(id=user_id, email=f"user{user_id}@example.com")


@prelude("handlers")
def handlers_prelude(
    clean_conn: Connection, caplog: pytest.LogCaptureFixture
) -> Iterator[dict[str, Any]]:
    """``load_user``, a recording ``mailer`` and ``billing``, and ``log``; then the
    sample's registry runs one job of each kind, plus sync_invoice jobs whose push
    fails with a retryable and a non-retryable error."""
    mailer = Mailer()
    billing = Billing({"INV-2": OSError("billing is down"), "INV-3": ValueError("no such id")})
    caplog.set_level(logging.INFO, logger="myapp.jobs")
    namespace = {
        "__name__": "myapp.jobs",
        "load_user": load_user,
        "mailer": mailer,
        "billing": billing,
        "log": logging.getLogger("myapp.jobs"),
    }
    yield namespace

    registry: sqlaq.Registry = namespace["registry"]
    welcome = registry.enqueue(clean_conn, "send_welcome_email", {"user_id": 42}).job_id
    ok, down, bad = (
        registry.enqueue(clean_conn, "sync_invoice", {"invoice_id": invoice}).job_id
        for invoice in ("INV-1", "INV-2", "INV-3")
    )
    results = {result.id: result for result in drain(clean_conn, registry)}

    assert results[welcome].status == "done", results[welcome].error
    assert mailer.sent == [("user42@example.com", "Welcome!", "welcome-42")]
    assert results[ok].status == "done", results[ok].error
    assert billing.pushed == ["INV-1"]
    # max_attempts=10 of the handler is the default registry.enqueue gives the job.
    assert "syncing invoice INV-1 (attempt 1 of 10)" in caplog.messages
    # retry=IOError: an OSError retries, after wait_exponential(multiplier=5)'s 5 s ...
    assert results[down].status == "queued"
    retry_in = clean_conn.execute(
        text("SELECT run_at - now() FROM sqlaq_jobs WHERE id = :id"), {"id": down}
    ).scalar_one()
    assert retry_in == timedelta(seconds=5)
    # ... and anything else fails at once.
    assert results[bad].status == "failed"


@prelude("embedded-worker")
def embedded_worker_prelude(
    committed: Engine, capsys: pytest.CaptureFixture[str]
) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and a ``registry`` whose handler records its
    payloads; one job is committed before the sample starts its worker."""
    ran: list[dict[str, Any]] = []
    registry = sqlaq.Registry()
    registry.add("send_welcome_email", ran.append)
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "send_welcome_email", {"user_id": 42}).job_id
    namespace: dict[str, Any] = {"engine": committed, "registry": registry}
    try:
        yield namespace
    finally:  # a sample that failed half-way must not leave its worker running
        if "worker" in namespace:
            namespace["worker"].stop(now=True)
        if "thread" in namespace:
            namespace["thread"].join(10)
    assert not namespace["thread"].is_alive()
    assert ran == [{"user_id": 42}]
    assert f"{job_id} done" in capsys.readouterr().out.splitlines()
    with committed.connect() as conn:
        assert [tuple(row) for row in _jobs(conn)] == [
            ("send_welcome_email", {"user_id": 42}, "done")
        ]


@prelude("asyncio-worker")
def asyncio_worker_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and a ``registry`` whose ``async`` handler records
    its payloads and the loop it ran on; one job is committed before the sample runs."""
    ran: list[tuple[dict[str, Any], Any]] = []
    registry = sqlaq.Registry()

    async def send(payload: dict[str, Any]) -> None:
        import asyncio

        ran.append((payload, asyncio.get_running_loop()))

    registry.add("send_welcome_email", send)
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "send_welcome_email", {"user_id": 42})
    namespace: dict[str, Any] = {"engine": committed, "registry": registry}
    yield namespace
    assert [payload for payload, _ in ran] == [{"user_id": 42}]
    with committed.connect() as conn:
        assert [tuple(row) for row in _jobs(conn)] == [
            ("send_welcome_email", {"user_id": 42}, "done")
        ]


@prelude("pytest-session")
def pytest_session_prelude(clean_conn: Connection) -> Iterator[dict[str, Any]]:
    """``signup`` (the application code under test, which enqueues), a ``registry``
    handling its job, and ``sqlaq_session``, the test's Session (the plugin's fixture);
    then every ``test_*`` function the sample defines is called, with its arguments
    taken from the namespace as pytest would take fixtures."""
    welcomed: list[dict[str, Any]] = []
    registry = sqlaq.Registry()
    registry.add("send_welcome_email", welcomed.append)

    def signup(session: Session, *, email: str) -> None:
        sqlaq.enqueue(session, "send_welcome_email", {"email": email, "template": "welcome"})

    with Session(bind=clean_conn) as session:
        namespace = {"signup": signup, "registry": registry, "sqlaq_session": session}
        yield namespace
        _call_test_functions(namespace)
    assert welcomed == [{"email": "ada@example.com", "template": "welcome"}]


def _call_test_functions(namespace: dict[str, Any]) -> None:
    """Call every ``test_*`` function a sample defined, with its arguments taken from
    *namespace* as pytest would take fixtures."""
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests, "the sample defines no test function"
    for test in tests:
        test(**{name: namespace[name] for name in inspect.signature(test).parameters})


class Shipping:
    """The tutorial's ``myapp.shipping``: records the orders it shipped."""

    def __init__(self) -> None:
        self.shipped: list[int] = []

    def ship(self, order_id: int) -> None:
        self.shipped.append(order_id)


@contextmanager
def _myapp(**modules: dict[str, Any]) -> Iterator[ModuleType]:
    """The tutorial's ``myapp`` package, importable for as long as a sample runs: one
    module per keyword, holding the given names."""
    package = ModuleType("myapp")
    package.__path__ = []
    installed = {"myapp": package}
    for name, names in modules.items():
        module = ModuleType(f"myapp.{name}")
        module.__dict__.update(names)
        setattr(package, name, module)
        installed[f"myapp.{name}"] = module
    saved = {name: sys.modules.get(name) for name in installed}
    sys.modules.update(installed)
    try:
        yield package
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _tutorial_place_order(session: Session, item: str) -> int:
    """The tutorial's ``myapp.orders.place_order``, as its page writes it."""
    order = Order(item=item)
    session.add(order)
    session.flush()
    sqlaq.enqueue(session, "ship_order", {"order_id": order.id})
    return order.id


@prelude("tutorial-jobs")
def tutorial_jobs_prelude(clean_conn: Connection) -> Iterator[dict[str, Any]]:
    """``myapp.shipping`` importable; then the sample's registry runs a ``ship_order``
    job through its handler, which ships the order, with the handler's max_attempts."""
    shipping = Shipping()
    with _myapp(shipping={"ship": shipping.ship}):
        namespace: dict[str, Any] = {"__name__": "myapp.jobs"}
        yield namespace
    registry: sqlaq.Registry = namespace["registry"]
    job_id = registry.enqueue(clean_conn, "ship_order", {"order_id": 7}).job_id
    (result,) = drain(clean_conn, registry)
    assert (result.id, result.status) == (job_id, "done"), result.error
    assert shipping.shipped == [7]
    max_attempts = "SELECT max_attempts FROM sqlaq_jobs WHERE id = :id"
    assert clean_conn.execute(text(max_attempts), {"id": job_id}).scalar_one() == 10


@prelude("tutorial-orders")
def tutorial_orders_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and ``myapp.models.Order`` (its table created for
    the sample, dropped after); then the order and its job were committed together."""
    HostBase.metadata.create_all(committed, checkfirst=False)
    try:
        with _myapp(models={"Order": Order}):
            namespace: dict[str, Any] = {"engine": committed}
            yield namespace
        order_id = namespace["order_id"]
        with committed.connect() as conn:
            stored = conn.execute(select(Order.__table__.c.id, Order.__table__.c.item))
            assert [tuple(row) for row in stored] == [(order_id, "book")]
            assert [tuple(row) for row in _jobs(conn)] == [
                ("ship_order", {"order_id": order_id}, "queued")
            ]
    finally:
        HostBase.metadata.drop_all(committed)


@prelude("tutorial-test")
def tutorial_test_prelude(clean_conn: Connection) -> Iterator[dict[str, Any]]:
    """The tutorial's ``myapp`` (``shipping``, ``jobs.registry`` handling ``ship_order``,
    ``orders.place_order``) importable, its ``orders`` table created in the test's
    transaction, and ``sqlaq_session``; then every ``test_*`` function the sample defines
    is called as pytest would call it, and must have shipped one order."""
    shipping = Shipping()
    registry = sqlaq.Registry()
    registry.add("ship_order", lambda payload: shipping.ship(payload["order_id"]))
    HostBase.metadata.create_all(clean_conn, checkfirst=False)  # rolled back after
    modules = {
        "shipping": {"ship": shipping.ship, "shipped": shipping.shipped},
        "jobs": {"registry": registry},
        "orders": {"place_order": _tutorial_place_order},
    }
    with _myapp(**modules), Session(bind=clean_conn) as session:
        namespace: dict[str, Any] = {"sqlaq_session": session}
        yield namespace
        _call_test_functions(namespace)
    assert len(shipping.shipped) == 1


@prelude("readme")
def readme_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database, a host's ``orders`` table (Core) and an
    ``Invoice`` model (ORM) on a table of its own, created for the sample and dropped
    after; then the order, its invoice and the job's ``done`` (the invoice's id as its
    result) have all committed."""

    class Base(DeclarativeBase):
        pass

    class Invoice(Base):
        __tablename__ = "docs_invoices"
        id: Mapped[int] = mapped_column(primary_key=True)
        order_id: Mapped[int]
        total: Mapped[int]

    HostBase.metadata.create_all(committed, checkfirst=False)
    Base.metadata.create_all(committed)
    try:
        yield {"engine": committed, "orders": Order.__table__, "Invoice": Invoice}
        with committed.connect() as conn:
            assert conn.execute(text("SELECT id, item FROM orders")).all() == [(7, "book")]
            (invoice,) = conn.execute(text("SELECT id, order_id, total FROM docs_invoices"))
            job = conn.execute(text("SELECT kind, status, result FROM sqlaq_jobs")).one()
        assert tuple(invoice)[1:] == (7, 120)
        assert tuple(job) == ("issue_invoice", "done", invoice.id)
    finally:
        Base.metadata.drop_all(committed)
        HostBase.metadata.drop_all(committed)


def _jobs_module(**names: Any) -> dict[str, Any]:
    """The namespace of a sample that continues the README's ``myapp/jobs.py``: what its
    imports gave (``Any``, ``timedelta``, ``sqlaq``), a fresh ``registry``, and *names*."""
    return {
        "__name__": "myapp.jobs",
        "Any": Any,
        "timedelta": timedelta,
        "sqlaq": sqlaq,
        "registry": sqlaq.Registry(),
        **names,
    }


def _wait_for(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@prelude("snooze")
def snooze_prelude(clean_conn: Connection) -> Iterator[dict[str, Any]]:
    """``uploads`` (upload 1 still uploading, upload 2 complete) and a recording
    ``importer``; then the sample's handler runs a job for each upload."""
    uploads = {
        1: SimpleNamespace(id=1, complete=False),
        2: SimpleNamespace(id=2, complete=True),
    }
    loaded: list[SimpleNamespace] = []
    namespace = _jobs_module(uploads=uploads, importer=SimpleNamespace(load=loaded.append))
    yield namespace

    registry: sqlaq.Registry = namespace["registry"]
    waiting, ready = (
        registry.enqueue(clean_conn, "import_upload", {"upload_id": upload}).job_id
        for upload in (1, 2)
    )
    results = {result.id: result for result in drain(clean_conn, registry)}

    assert results[ready].status == "done", results[ready].error
    assert loaded == [uploads[2]]
    # Snoozed: queued again a minute later, the attempt refunded, no error recorded.
    assert results[waiting].status == "queued", results[waiting].error
    row = clean_conn.execute(
        text("SELECT attempts, last_error, run_at - now() AS wait FROM sqlaq_jobs WHERE id = :id"),
        {"id": waiting},
    ).one()
    assert (row.attempts, row.last_error, row.wait) == (0, None, timedelta(minutes=1))


def _handler(registry: sqlaq.Registry, kind: str) -> sqlaq.Handler:
    handler = registry.get(kind)
    assert handler is not None, f"the sample registers no handler for {kind!r}"
    return handler


@prelude("limits")
def limits_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and recording ``transcoder`` and ``geocoder``;
    then claims of the sample's kinds, as a worker makes them, take what the declared
    limits allow and no more."""
    transcoded: list[int] = []
    looked_up: list[int] = []
    namespace = _jobs_module(
        engine=committed,
        transcoder=SimpleNamespace(run=transcoded.append),
        geocoder=SimpleNamespace(lookup=looked_up.append),
    )
    yield namespace

    registry: sqlaq.Registry = namespace["registry"]
    videos, geocode = _handler(registry, "process_video"), _handler(registry, "geocode")
    assert (videos.concurrency, videos.rate) == (2, None)
    assert (geocode.concurrency, geocode.rate) == (None, sqlaq.Rate(5, timedelta(seconds=1)))
    limited = sorted(handler.kind for handler in registry if handler.limited)
    assert limited == ["geocode", "process_video"]
    worker_id = uuid.uuid4()
    with committed.connect() as conn:
        transaction = conn.begin()
        try:
            for video in (8, 9):  # the sample committed video 7
                registry.enqueue(conn, "process_video", {"video_id": video}, queue="videos")
            for address in range(8):
                registry.enqueue(conn, "geocode", {"address_id": address})

            def claim_limited(handler: sqlaq.Handler, queue: str) -> sqlaq.LimitedClaim:
                return sqlaq.claim_limited(
                    conn,
                    worker_id=worker_id,
                    kind=handler.kind,
                    queue=queue,
                    limit=10,
                    concurrency=handler.concurrency,
                    rate=handler.rate,
                )

            # Two videos at once, then the kind is full; video 9 stays queued.
            first = claim_limited(videos, "videos")
            assert [job.payload["video_id"] for job in first.jobs] == [7, 8]
            assert first.full
            again = claim_limited(videos, "videos")
            assert (again.jobs, again.full) == ([], True)
            # Five geocodes start in this second; the next may start a second later.
            geocoded = claim_limited(geocode, "default")
            assert len(geocoded.jobs) == 5
            assert geocoded.rate_wait == timedelta(seconds=1)
            # The plain claim, which skips the limited kinds, finds nothing to take.
            for queue in ("videos", "default"):
                plain = sqlaq.claim(
                    conn, worker_id=worker_id, queue=queue, limit=10, exclude_kinds=limited
                )
                assert plain == []
            for job in first.jobs + geocoded.jobs:
                _handler(registry, job.kind).func(job.payload)
            assert transcoded == [7, 8]
            assert looked_up == [0, 1, 2, 3, 4]
        finally:
            transaction.rollback()


@prelude("tenants", pages=["docs/how-to/tenants.md"])
def tenants_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and recording ``crm`` and ``ledger``; then claims
    of the sample's kinds, as a worker makes them, take what the key options allow: 3
    of tenant-42 beside tenant-7's one, and account-1's first entry only."""
    crm, ledger = Recorder(), Recorder()
    namespace = _jobs_module(engine=committed, crm=crm, ledger=ledger)
    yield namespace

    registry: sqlaq.Registry = namespace["registry"]
    sync, post = _handler(registry, "sync_account"), _handler(registry, "post_entry")
    assert (sync.key_concurrency, sync.ordered) == (3, False)
    assert (post.key_concurrency, post.ordered) == (1, True)
    worker_id = uuid.uuid4()

    def claim_limited(handler: sqlaq.Handler) -> sqlaq.LimitedClaim:
        with committed.begin() as conn:
            return sqlaq.claim_limited(
                conn,
                worker_id=worker_id,
                kind=handler.kind,
                limit=10,
                key_concurrency=handler.key_concurrency,
                ordered=handler.ordered,
            )

    synced = claim_limited(sync)
    assert sorted(job.payload["invoice"] for job in synced.jobs) == [1, 2, 3, 6]
    assert claim_limited(sync).jobs == []
    posted = claim_limited(post)
    assert [job.payload["amount"] for job in posted.jobs] == [100]
    assert claim_limited(post).jobs == []
    for job in synced.jobs + posted.jobs:
        _handler(registry, job.kind).func(job.payload)
    with committed.begin() as conn:
        sqlaq.complete(conn, posted.jobs[0].lease)
    (second,) = claim_limited(post).jobs
    _handler(registry, second.kind).func(second.payload)
    assert sorted(crm.calls["sync"]) == [1, 2, 3, 6]
    assert ledger.calls["post"] == [100, -30]


@prelude("tenants-give-up")
def tenants_give_up_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` and ``failed_id``: the first of two jobs of one key of an ordered kind,
    failed for good, so the second waits; after the sample, the second is claimed."""

    def claim() -> sqlaq.LimitedClaim:
        with committed.begin() as conn:
            return sqlaq.claim_limited(
                conn, worker_id=uuid.uuid4(), kind="post_entry", ordered=True
            )

    with committed.begin() as conn:
        first, second = (
            sqlaq.enqueue(conn, "post_entry", key="account-1", max_attempts=1).job_id
            for _ in range(2)
        )
    (job,) = claim().jobs
    with committed.begin() as conn:
        assert sqlaq.fail(conn, job.lease, "boom") == sqlaq.JobStatus.FAILED
    assert claim().jobs == []
    yield {"sqlaq": sqlaq, "engine": committed, "failed_id": first}

    assert [job.id for job in claim().jobs] == [second]


class Recorder:
    """Records the arguments of every call of any of its methods, by method name."""

    def __init__(self) -> None:
        self.calls: dict[str, list[Any]] = {}

    def __getattr__(self, name: str) -> Callable[[Any], None]:
        return self.calls.setdefault(name, []).append


@prelude("periodic")
def periodic_prelude(clean_conn: Connection) -> Iterator[dict[str, Any]]:
    """Recording ``reports`` and ``digests``; then the sample's schedules are walked
    through a Monday morning with a simulated clock: first sight, the 08:00 slot of
    each (once, however often asked), and the jobs run."""
    reports, digests = Recorder(), Recorder()
    namespace = _jobs_module(reports=reports, digests=digests)
    yield namespace

    registry: sqlaq.Registry = namespace["registry"]
    assert [
        (p.name, p.kind, p.schedule.expression, dict(p.payload), p.max_attempts)
        for p in registry.periodics
    ] == [
        ("daily_digest", "send_digest", "0 8 * * *", {"period": "day"}, 3),
        ("hourly_report", "hourly_report", "0 * * * *", {"scope": "all"}, 5),
        ("weekly_digest", "send_digest", "0 8 * * mon", {"period": "week"}, 3),
    ]
    monday = datetime(2026, 1, 5, tzinfo=UTC)

    def enqueue_periodic(at: timedelta) -> list[tuple[str, datetime]]:
        enqueued = sqlaq.enqueue_periodic(clean_conn, registry.periodics, now=monday + at)
        return sorted((job.name, job.slot) for job in enqueued)

    assert enqueue_periodic(timedelta(hours=7, minutes=30)) == []  # first sight
    eight = monday + timedelta(hours=8)
    assert enqueue_periodic(timedelta(hours=8, seconds=1)) == [
        ("daily_digest", eight),
        ("hourly_report", eight),
        ("weekly_digest", eight),
    ]
    assert enqueue_periodic(timedelta(hours=8, minutes=1)) == []  # each slot once
    keys = clean_conn.execute(text("SELECT dedupe_key FROM sqlaq_jobs ORDER BY id")).scalars()
    assert "periodic:hourly_report:2026-01-05T08:00:00+00:00" in list(keys)

    results = drain(clean_conn, registry)
    assert [result.status for result in results] == ["done"] * 3, results
    assert reports.calls == {"build": ["all"]}
    assert sorted(digests.calls["send"]) == ["day", "week"]


class ReportPages:
    """``render`` records pages; rendering page 1 takes until its job is cancelled (at
    most 10 s), the way a long step would."""

    def __init__(self) -> None:
        self.rendered: list[int] = []
        self.started = threading.Event()

    def report_pages(self, report_id: int) -> list[int]:
        return [1, 2, 3]

    def render(self, page: int) -> None:
        self.rendered.append(page)
        if page == 1:
            self.started.set()
            job = sqlaq.current_job()
            _wait_for(lambda: job.cancelled, "the cancel to reach the handler")


class _WorkingRegistry(sqlaq.Registry):
    """A registry that starts a real worker, in a thread, on its first ``enqueue``: the
    sample's handler is registered by then, and the worker claims the job once the
    sample's transaction commits."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self.worker: sqlaq.Worker | None = None
        self.thread: threading.Thread | None = None

    def enqueue(self, conn: Any, kind: str, payload: Any = None, **options: Any) -> Any:
        if self.worker is None:
            self.worker = sqlaq.Worker(self.engine, self, concurrency=1, maintenance=False)
            self.thread = threading.Thread(target=self.worker.run, daemon=True)
            self.thread.start()
        return super().enqueue(conn, kind, payload, **options)


@prelude("results")
def results_prelude(
    committed: Engine, capsys: pytest.CaptureFixture[str]
) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database, a ``renderer`` stub, and a ``registry`` that
    runs a real worker once the sample enqueues; then the stored result is checked."""
    rendered: list[int] = []

    def render(report_id: int) -> SimpleNamespace:
        rendered.append(report_id)
        return SimpleNamespace(url=f"https://reports.example/{report_id}.pdf", pages=12)

    registry = _WorkingRegistry(committed)
    namespace = _jobs_module(
        engine=committed, registry=registry, renderer=SimpleNamespace(render=render)
    )
    try:
        yield namespace
    finally:
        if registry.worker is not None:
            registry.worker.stop(now=True)
        if registry.thread is not None:
            registry.thread.join(10)
    assert rendered == [7]
    assert capsys.readouterr().out.splitlines() == ["https://reports.example/7.pdf"]
    with committed.connect() as conn:
        stored = conn.execute(text("SELECT status, result FROM sqlaq_jobs")).one()
    assert tuple(stored) == ("done", {"url": "https://reports.example/7.pdf", "pages": 12})


@prelude("transactional")
def transactional_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database, a host table ``invoices`` mapped as ``Invoice``
    (ORM), and a fresh ``registry``; then the invoice and the job's ``done`` are checked
    to have committed together, the invoice's id stored as the job's result."""

    class Base(DeclarativeBase):
        pass

    class Invoice(Base):
        __tablename__ = "docs_invoices"
        id: Mapped[int] = mapped_column(primary_key=True)
        order_id: Mapped[int]
        total: Mapped[int]

    Base.metadata.create_all(committed)
    try:
        yield _jobs_module(engine=committed, Invoice=Invoice)
        with committed.connect() as conn:
            invoices = conn.execute(text("SELECT id, order_id, total FROM docs_invoices"))
            (invoice,) = invoices.all()
            job = conn.execute(text("SELECT status, result FROM sqlaq_jobs")).one()
        assert tuple(invoice)[1:] == (7, 120)
        assert tuple(job) == ("done", invoice.id)
    finally:
        Base.metadata.drop_all(committed)


@prelude("cancel")
def cancel_prelude(committed: Engine, caplog: pytest.LogCaptureFixture) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database, ``log``, and ``report_pages`` and ``render``;
    then a worker runs an export job, the sample's ``stop_export`` cancels it while it
    runs, and the handler stops early with nothing written over the cancel."""
    pages = ReportPages()
    caplog.set_level(logging.INFO, logger="myapp.jobs")
    namespace = _jobs_module(
        engine=committed,
        log=logging.getLogger("myapp.jobs"),
        report_pages=pages.report_pages,
        render=pages.render,
    )
    yield namespace

    registry: sqlaq.Registry = namespace["registry"]
    with committed.begin() as conn:
        job_id = registry.enqueue(conn, "export_report", {"report_id": 7}).job_id
    results: list[sqlaq.JobResult] = []
    worker = sqlaq.Worker(
        committed, registry, concurrency=1, maintenance=False, on_job_finished=results.append
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        _wait_for(lambda: worker.listening, "the worker's listener")
        assert pages.started.wait(10), "the export did not start"
        namespace["stop_export"](job_id)
        _wait_for(lambda: results, "the job's outcome")
    finally:
        worker.stop(now=True)
        thread.join(10)
    assert not thread.is_alive()
    assert pages.rendered == [1]
    assert [result.status for result in results] == [sqlaq.JobStatus.CANCELLED]
    assert "export of report 7 cancelled" in caplog.messages
    with committed.connect() as conn:
        assert [tuple(row) for row in _jobs(conn)] == [
            ("export_report", {"report_id": 7}, "cancelled")
        ]


@prelude("operators")
def operators_prelude(
    committed: Engine, capsys: pytest.CaptureFixture[str]
) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and a ``registry`` with the sample's kind; then the
    printed reasons start with the pause, and the queue is resumed with its job waiting."""
    registry = sqlaq.Registry()
    registry.handler("export_report")(lambda payload: None)
    with committed.begin() as conn:
        conn.execute(text("TRUNCATE sqlaq_paused_queues"))
    try:
        yield {"engine": committed, "registry": registry}
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].startswith("paused: its queue 'reports' is paused (since "), printed
        assert "by deploy 2026-12-16)" in printed[0]
        with committed.connect() as conn:
            assert sqlaq.paused_queues(conn) == []
            assert [tuple(row) for row in _jobs(conn)] == [
                ("export_report", {"report_id": 7}, "queued")
            ]
    finally:
        with committed.begin() as conn:
            conn.execute(text("TRUNCATE sqlaq_paused_queues"))


@prelude("dashboard")
def dashboard_prelude(committed: Engine) -> Iterator[dict[str, Any]]:
    """``engine`` on the test database and ``registry`` (a kind limited to 2 at once);
    then the host's app the sample built serves the dashboard under ``/queue``: its
    pages answer there, every link stays under it, and the limit shows."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
        from starlette.testclient import TestClient

    registry = sqlaq.Registry()
    registry.add("send_email", lambda payload: None, concurrency=2)
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "send_email", {"user_id": 7})
    namespace: dict[str, Any] = {"engine": committed, "registry": registry}
    yield namespace

    with TestClient(namespace["app"], base_url="http://localhost") as client:
        page = client.get("/queue/")
        assert page.status_code == 200, page.text
        assert re.search(r"<td>default</td>\s*<td>send_email</td>", page.text)
        links = re.findall(r'(?:href|src|action)="(/[^"]*)"', page.text)
        assert links
        assert all(link.startswith("/queue/") for link in links), links
        workers = client.get("/queue/workers").text
        assert re.search(
            r'send_email</a></td>\s*<td class="num">0</td>\s*<td class="num">2<', workers
        )


@prelude("workflows", pages=["docs/how-to/workflows.md"])
def workflows_prelude(clean_conn: Connection) -> Iterator[dict[str, Any]]:
    """``conn`` on the test database (rolled back after) and a fresh ``registry``; then
    the workflow the sample enqueued is drained: every job ends ``done``, each after
    all of its parents, and a chord's callback sums its parents' results (but the jobs
    a sample cancelled, which never ran)."""
    registry = sqlaq.Registry()
    yield {**_jobs_module(registry=registry, Session=Session), "conn": clean_conn}

    order = [job.id for job in drain(clean_conn, registry)]
    rows = clean_conn.execute(
        text("SELECT id, kind, status, parent_ids, result FROM sqlaq_jobs ORDER BY id")
    ).all()
    assert rows, "the sample enqueued nothing"
    position = {job_id: i for i, job_id in enumerate(order)}  # empty: the sample drained
    for row in rows:
        if row.status == "cancelled" and row.id not in position:
            continue  # cancelled by the sample (sqlaq.cancel_workflow)
        assert row.status == "done", row
        for parent in (row.parent_ids or []) if order else []:
            assert position[parent] < position[row.id], (parent, row)
        if row.kind == "total_words":
            assert row.result == 6


def _imported_names(code: str) -> tuple[list[str], list[str]]:
    """The dotted names *code* takes from the modules it imports: (found, missing)."""
    tree = ast.parse(code)
    modules: dict[str, str] = {}  # bound name -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                modules[bound] = alias.name if alias.asname else bound
    found: list[str] = []
    missing: list[str] = []
    for node in ast.walk(tree):
        dotted = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
        root, _, rest = dotted.partition(".")
        if root in modules and re.fullmatch(r"[\w.]+", dotted):
            name = f"{modules[root]}.{rest}"
            (found if _resolves(name) else missing).append(name)
    return found, missing


def _resolves(dotted: str) -> bool:
    names = dotted.split(".")
    target: Any = importlib.import_module(names[0])
    for index, name in enumerate(names[1:], start=1):
        if not hasattr(target, name):
            try:
                importlib.import_module(".".join(names[: index + 1]))
            except ImportError:
                return False
        target = getattr(target, name)
    return True


#: How a skip reason names the test that runs the block instead.
_RUN_BY = re.compile(r"(?P<file>tests/[\w/]+\.py)::(?P<test>\w+)")


def run_instead_by(reason: str) -> str | None:
    """Why *reason* does not name an existing test as ``tests/test_x.py::test_name``
    (None when it does; every test it names must exist)."""
    named = list(_RUN_BY.finditer(reason))
    if not named:
        return "the reason names no test that runs it instead (tests/test_x.py::test_name)"
    for match in named:
        test_file = ROOT / match["file"]
        if not test_file.is_file():
            return f"{match['file']} does not exist"
        defined = {
            node.name
            for node in ast.walk(ast.parse(test_file.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        if match["test"] not in defined:
            return f"{match['file']} has no test {match['test']!r}"
    return None


def _python(block: Block, request: pytest.FixtureRequest) -> None:
    if "skip" in block.options:
        problem = run_instead_by(block.options.get("reason", ""))
        assert problem is None, f"{block.where}: skipped, but {problem}"
        found, missing = _imported_names(block.code)
        assert found, f"{block.where}: skipped, and uses no name that could be checked"
        assert not missing, f"{block.where} uses names that do not exist: {missing}"
        # Listed by `pytest -ra` with the blocks that have no language.
        pytest.skip(
            f"{block.where} not run here ({block.options['reason']}); "
            f"the names it uses exist: {', '.join(sorted(set(found)))}"
        )
    name = prelude_of(block)
    assert name is not None, block.where
    factory = PRELUDES[name]
    fixtures = {
        param: request.getfixturevalue(param) for param in inspect.signature(factory).parameters
    }
    if "block" in fixtures:
        fixtures["block"] = block
    # Blank lines in front: a traceback names the file's own line numbers.
    code = compile("\n" * block.line + block.code, str(ROOT / block.path), "exec")
    with factory(**fixtures) as namespace:
        # exec (S102) is the point: the documentation's sample runs as written.
        exec(code, namespace)  # noqa: S102


# -- sh blocks ---------------------------------------------------------------------

#: ``sqlaq`` subcommands that only read; each runs against the test database and must
#: print a line matching this (the data comes from the ``failed_emails`` fixture).
ADMIN_READ_ONLY = {
    "stats": r"^default +send_email +0 +0 +0 +2 +0$",  # queued running done failed cancelled
    "list": r"^1235 +default +send_email +failed +1/1 ",
    "show": r'^payload +\{"user_id": 7\}$',
    "check": rf"^sqlaq schema is at {sqlaq.migrations.HEAD} \(head\)$",
    "explain": r"^finished: failed at .* on attempt 1 of 1; last error: TimeoutError: the mail",
    "workers": r"^(worker +host +pid +queues|\(none\))",
    "workflow": r"^1234 \* +send_email +default +failed *$",  # a plain job: a workflow of one
}


@pytest.fixture
def failed_emails(committed: Engine) -> Engine:
    """Jobs 1234 and 1235, send_email, failed a moment ago: what the README's ``sqlaq``
    lines look at."""
    with Session(committed) as session:
        for job_id, user_id in ((1234, 7), (1235, 8)):
            payload = {"user_id": user_id}
            session.add(Job(id=job_id, kind="send_email", payload=payload, max_attempts=1))
        session.commit()
    with committed.begin() as conn:
        for job in sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=2):
            sqlaq.fail(conn, job.lease, "TimeoutError: the mail server did not answer")
    return committed


def exact(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """*parser*, and its subcommands' parsers, without abbreviated flags: argparse would
    take a README's ``--since`` for a flag renamed ``--since-time``."""
    parser.allow_abbrev = False
    # argparse has no public way to reach the subcommands' parsers; _actions and
    # _SubParsersAction have been stable since Python 3.2.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                exact(subparser)
    return parser


def _check_sqlaq(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    args = exact(admin.build_parser()).parse_args(argv[1:])  # UsageError on a bad flag
    if args.command not in ADMIN_READ_ONLY or getattr(args, "cancel", False):
        return  # it writes: parsed, not run
    request.getfixturevalue("failed_emails")
    environ = {"SQLAQ_DATABASE_URL": request.getfixturevalue("database_url")}
    out = io.StringIO()
    assert admin.run(argv[1:], environ, out=out) == 0, line
    assert re.search(ADMIN_READ_ONLY[args.command], out.getvalue(), re.MULTILINE), out.getvalue()


def _check_sqlaq_worker(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    exact(cli.build_parser()).parse_args(argv[1:])  # UsageError on a bad flag
    # Values are validated too (durations, queues, ranges); the URL may come from the
    # environment, as the README says.
    cli.parse_options(argv[1:], {"SQLAQ_DATABASE_URL": "postgresql://docs@localhost/docs"})


def _check_alembic(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    try:
        exact(CommandLine(prog="alembic").parser).parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"alembic rejects {line!r} (its message is above)")


def _check_in_ci(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert line in (ci_line.strip() for ci_line in ci), f"{line!r} is not a line of .ci/run"
    assert argv[argv.index("-s") + 1] in _nox_sessions()


def _check_nox_session(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    """A nox session that takes minutes (the benchmark): it must exist; not run here."""
    assert argv[4] in _nox_sessions(), f"{line!r}: noxfile.py has no session {argv[4]!r}"


def _nox_sessions() -> set[str]:
    noxfile = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    return {node.name for node in noxfile.body if isinstance(node, ast.FunctionDef)}


def _check_quickstart(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    script = ROOT / argv[1]
    assert script.is_file()
    url = request.getfixturevalue("empty_database_url")
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env={**os.environ, "SQLAQ_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"^job \d+ is done$", run.stdout, re.MULTILINE), run.stdout


def _check_workflow_example(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    """examples/workflow.py runs its chord to the end and prints the fan-in's sum."""
    url = request.getfixturevalue("empty_database_url")
    run = subprocess.run(
        [sys.executable, str(ROOT / argv[1])],
        cwd=ROOT,
        env={**os.environ, "SQLAQ_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "sum of squares of [1, 2, 3, 4, 5]: 55\n" in run.stdout, run.stdout


def _check_pip(argv: list[str], line: str, request: pytest.FixtureRequest) -> None:
    """Installs or builds packages: not run by a test. The extras it names in brackets
    must be sqlaq's, and a wheel file it names must be the one ``pip wheel`` builds
    from this version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for arg in argv[4:]:
        extras = re.search(r"\[([\w,-]+)\]$", arg)
        if extras is not None:
            unknown = set(extras[1].split(",")) - set(project["optional-dependencies"])
            assert not unknown, f"{line!r}: sqlaq has no extra {sorted(unknown)}"
        wheel = re.search(r"sqlaq-[^/\[]*\.whl", arg)
        if wheel is not None:
            assert wheel[0] == f"sqlaq-{project['version']}-py3-none-any.whl", line


ShCheck = Callable[[list[str], str, pytest.FixtureRequest], None]


def sh_rule(argv: list[str]) -> ShCheck | None:
    """How a command of a sh block is checked, or None if no rule covers it."""
    match argv:
        case ["sqlaq", *_]:
            return _check_sqlaq
        case ["sqlaq-worker", *_]:
            return _check_sqlaq_worker
        case ["alembic", *_]:
            return _check_alembic
        case ["python3", "-m", "pip", "install" | "wheel", *_]:
            return _check_pip
        case ["python3", "-m", "nox", "-s", "bench", *_]:
            return _check_nox_session
        case ["python3", "-m", "nox", "-s", *_]:
            return _check_in_ci
        case ["python3", "examples/quickstart.py"]:
            return _check_quickstart
        case ["python3", "examples/workflow.py"]:
            return _check_workflow_example
    return None


def sh_commands(code: str) -> Iterator[tuple[list[str], str]]:
    """Each command of a sh block, with the line it is on (``\\`` continuations joined,
    comments dropped, ``&&`` splitting a line into commands)."""
    for line in code.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        while tokens:
            end = tokens.index("&&") if "&&" in tokens else len(tokens)
            yield tokens[:end], line.strip()
            tokens = tokens[end + 1 :]


def _sh(block: Block, request: pytest.FixtureRequest) -> None:
    commands = list(sh_commands(block.code))
    assert commands, f"{block.where} holds no command"
    for argv, line in commands:
        check = sh_rule(argv)
        if check is None:
            pytest.fail(f"{block.where}: no rule checks {line!r}; add one to sh_rule")
        check(argv, line, request)


# -- ini blocks --------------------------------------------------------------------


def _alembic_section(code: str) -> configparser.SectionProxy | None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(code)
    return parser["alembic"] if parser.has_section("alembic") else None


def _ini(block: Block, request: pytest.FixtureRequest) -> None:
    section = _alembic_section(block.code)
    if section is None:
        pytest.fail(f"{block.where}: no rule checks an ini block without [alembic]")
    assert section["path_separator"] == "space"
    assert sqlaq.migrations.VERSION_LOCATION in section["version_locations"].split()
    # "This repository's own alembic.ini [is] written exactly that way."
    own = _alembic_section((ROOT / "alembic.ini").read_text(encoding="utf-8"))
    assert own is not None
    for key in ("path_separator", "version_locations"):
        assert own[key] == section[key], key
    # Given these settings, Alembic finds sqlaq's branch beside a host's own revisions.
    host = request.getfixturevalue("tmp_path")
    (host / "alembic" / "versions").mkdir(parents=True)
    (host / "alembic.ini").write_text(block.code, encoding="utf-8")
    config = Config(str(host / "alembic.ini"))
    config.set_main_option("script_location", str(host / "alembic"))
    assert ScriptDirectory.from_config(config).get_heads() == [sqlaq.migrations.HEAD]


# -- the cases ---------------------------------------------------------------------


def covered(block: Block) -> bool:
    """Whether a rule covers *block*: a new sample must not go unchecked by accident."""
    if block.lang == "python":
        if "skip" in block.options:
            return bool(block.options.get("reason"))
        return prelude_of(block) in PRELUDES
    if block.lang == "sh":
        return all(sh_rule(argv) for argv, _ in sh_commands(block.code))
    if block.lang == "ini":
        return _alembic_section(block.code) is not None
    return block.lang in NOT_RUN


#: Languages shown, not run: a diagram or sample output.
NOT_RUN = {"", "text", "console-output"}
RUNNERS: dict[str, Callable[[Block, pytest.FixtureRequest], None]] = {
    "python": _python,
    "sh": _sh,
    "ini": _ini,
}


@pytest.fixture
def block() -> None:
    """Placeholder: a prelude that takes ``block`` gets the block it runs (see
    :func:`earlier_blocks`)."""


@pytest.mark.parametrize("sample", BLOCKS, ids=[b.id for b in BLOCKS])
def test_sample(sample: Block, request: pytest.FixtureRequest) -> None:
    if not covered(sample):
        pytest.fail(
            f"{sample.where}: no rule covers this block. A python block needs a prelude: "
            f"a marker before it, '<!-- docs-test: prelude=NAME -->' (one of "
            f"{sorted(PRELUDES)}), or its page registered with @prelude(NAME, pages=...); "
            "or '<!-- docs-test: skip reason=\"... tests/test_x.py::test_name ...\" -->'. "
            "sh commands need a rule in sh_rule; other languages one in RUNNERS."
        )
    if sample.lang in NOT_RUN:
        first = sample.code.splitlines()[0] if sample.code.strip() else ""
        pytest.skip(f"{sample.where} not run: output or a diagram: {first[:50]!r}")
    RUNNERS[sample.lang](sample, request)


def test_docs_test_markers_are_attached_and_every_prelude_is_used() -> None:
    for document in DOCUMENTS:
        assert document.stray_markers == [], (
            f"{document.path}: docs-test markers not followed by a code block, at lines "
            f"{document.stray_markers}"
        )
    known = {"prelude", "skip", "reason"}
    for sample in BLOCKS:
        assert set(sample.options) <= known, f"{sample.where}: unknown marker option"
        if sample.options:
            assert sample.lang == "python", f"{sample.where}: markers are for python blocks"
        if "prelude" in sample.options:
            assert sample.options["prelude"] in PRELUDES, f"{sample.where}: no such prelude"
    used = {prelude_of(sample) for sample in BLOCKS if sample.lang == "python"}
    assert set(PRELUDES) <= used, f"preludes no sample uses: {set(PRELUDES) - used}"
    pages = {path for path, _ in PAGE_PRELUDES}
    assert pages <= set(docsamples.documentation_files()), "@prelude(pages=) names no page"


def test_a_skip_reason_must_name_an_existing_test() -> None:
    assert run_instead_by("needs PgBouncer") is not None
    assert run_instead_by("tests/test_nothing_here.py::test_x runs it") is not None
    assert run_instead_by("tests/docs/test_docs.py::test_no_such_test runs it") is not None
    assert run_instead_by("tests/docs/test_docs.py::test_sample runs it") is None
    both = "tests/docs/test_docs.py::test_sample and tests/docs/test_docs.py::test_no_such_test"
    assert run_instead_by(both) is not None


def test_blocks_are_found_in_admonitions_tabs_and_snippets() -> None:
    page = docsamples.parse(
        "docs/x.md",
        """# Page

!!! note
    <!-- docs-test: prelude=host -->
    ```python title="app.py"
    import sqlaq
    ```

=== "Sync"

    ```sh
    --8<-- ".ci/run"
    ```

<!-- docs-test: skip reason="x" -->
```python
```
""",
    )
    note, tab, last = page.blocks
    assert (note.lang, note.code, note.options, note.heading) == (
        "python",
        "import sqlaq\n",
        {"prelude": "host"},
        "Page",
    )
    assert tab.code == (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert last.options == {"skip": "", "reason": "x"}
    assert page.stray_markers == []


def test_repository_env_py_hides_sqlaq_from_autogenerate_as_the_readme_says() -> None:
    env_py = (ROOT / "alembic" / "env.py").read_text(encoding="utf-8")
    assert "include_name=sqlaq.migrations.include_name" in env_py
