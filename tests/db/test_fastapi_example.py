"""examples/fastapi_app: an async FastAPI app enqueueing in its request's AsyncSession
transaction, with a worker in its lifespan, driven through an HTTP client."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import docsamples
import pytest
from sqlalchemy import create_engine, text

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shop(empty_database_url: str) -> Iterator[str]:
    """A database with sqlaq's tables and the shop's; the app module importable."""
    sys.path.insert(0, str(ROOT))
    try:
        module = importlib.import_module("examples.fastapi_app.app")
        engine = create_engine(empty_database_url)
        try:
            module.init_database(engine)
        finally:
            engine.dispose()
        yield empty_database_url
    finally:
        sys.path.remove(str(ROOT))


def counts(url: str) -> tuple[int, int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            orders = conn.execute(text("SELECT count(*) FROM orders")).scalar_one()
            jobs = conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one()
            return orders, jobs
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_an_order_and_its_job_commit_together_and_the_lifespan_worker_ships_it(shop: str) -> None:
    from examples.fastapi_app.app import create_app

    async_url = shop.replace("postgresql+psycopg://", "postgresql+psycopg_async://")
    with TestClient(create_app(async_url, worker=True)) as client:
        created = client.post("/orders", json={"item": "teapot"})
        assert created.status_code == 200
        order_id, job_id = created.json()["order_id"], created.json()["job_id"]
        # The endpoint awaits sqlaq.asyncio.wait: it answers when the lifespan's worker
        # (on the same event loop) has shipped the order.
        finished = client.get(f"/jobs/{job_id}", params={"wait_seconds": 20})
        assert (finished.status_code, finished.json()["status"]) == (200, "done")
        assert client.get(f"/orders/{order_id}").json()["shipped"] is True
        assert client.get("/jobs/987654321").status_code == 404
        refused = client.post("/orders", json={"item": "kettle", "fail_after_enqueue": True})
        assert refused.status_code == 409
    # The refused request left neither its order nor its job; the first left both.
    assert counts(shop) == (1, 1)
    engine = create_engine(shop)
    try:
        with engine.connect() as conn:
            status = conn.execute(text("SELECT status FROM sqlaq_jobs")).scalar_one()
    finally:
        engine.dispose()
    assert status == "done"


@pytest.mark.timeout(60)
def test_without_its_worker_the_app_only_enqueues(shop: str) -> None:
    from examples.fastapi_app.app import create_app

    async_url = shop.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    with TestClient(create_app(async_url, worker=False)) as client:
        created = client.post("/orders", json={"item": "cup"}).json()
        assert client.get(f"/orders/{created['order_id']}").json()["shipped"] is False
        pending = client.get(f"/jobs/{created['job_id']}", params={"wait_seconds": 0.2})
        assert (pending.status_code, pending.json()["status"]) == (202, "queued")
    assert counts(shop) == (1, 1)


def test_the_async_tutorial_shows_this_app_as_it_is() -> None:
    """Every python block of the documentation whose skip marker names this test (the
    async tutorial's three) is an excerpt of the app these tests run: its lines (but
    comments of its own) appear in app.py, in the same order."""
    this_test = "tests/db/test_fastapi_example.py::test_the_async_tutorial_shows_this_app_as_it_is"
    blocks = [
        block
        for block in docsamples.all_blocks()
        if block.lang == "python" and this_test in block.options.get("reason", "")
    ]
    assert [block.path for block in blocks] == ["docs/tutorial/async.md"] * 3
    app = [line.strip() for line in (ROOT / "examples/fastapi_app/app.py").read_text().splitlines()]
    for block in blocks:
        position = 0
        for line in (line.strip() for line in block.code.splitlines()):
            if not line or (line.startswith("#") and line not in app):
                continue
            assert line in app[position:], (
                f"{block.where}: not in app.py (or out of order): {line!r}"
            )
            position = app.index(line, position) + 1


def test_every_query_parameter_the_example_names_is_an_endpoint_parameter() -> None:
    """``?name=`` in the app's docstrings and comments names a parameter of one of its
    functions (an endpoint's query parameter), not a stale spelling of one."""
    import ast
    import re

    source = (ROOT / "examples/fastapi_app/app.py").read_text(encoding="utf-8")
    named = set(re.findall(r"\?(\w+)=", source))
    assert named, "the example names no query parameter any more"
    tree = ast.parse(source)
    parameters = {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for arg in node.args.args + node.args.kwonlyargs
    }
    assert named <= parameters, f"not a parameter of the app: {sorted(named - parameters)}"
