"""An async FastAPI application that enqueues jobs in its request's transaction.

``POST /orders`` creates an order and enqueues its ``ship_order`` job in the same
``AsyncSession`` transaction: both commit, or (an error in the endpoint) neither. A
worker runs inside the app's lifespan, on the app's event loop; ``ship_order`` is a
transactional handler, so marking the order shipped commits with the job's ``done``.
``GET /jobs/{job_id}?wait_seconds=5`` waits up to 5 s for the job to finish
(``sqlaq.asyncio.wait``: woken by its notification, the event loop free meanwhile).

Run it (the database must have sqlaq's tables and ``orders``: ``init_database`` makes
them)::

    export DATABASE_URL=postgresql+psycopg_async://postgres@127.0.0.1/shop
    uvicorn examples.fastapi_app.app:app

or serve the web app without its worker and run the worker apart::

    SHOP_WORKER=off uvicorn examples.fastapi_app.app:app
    sqlaq-worker examples.fastapi_app.app:registry
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Response
from pydantic import BaseModel
from sqlalchemy import Engine, String
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sqlaq
from sqlaq.asyncio import enqueue, wait

DATABASE_URL = os.environ.get(
    "DATABASE_URL", "postgresql+psycopg_async://postgres@127.0.0.1:5432/shop"
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(100))
    shipped: Mapped[bool] = mapped_column(default=False)


registry = sqlaq.Registry()


@registry.handler("ship_order")
async def ship_order(payload: dict[str, Any], session: AsyncSession) -> None:
    """Mark the order shipped: in the job's transaction, so it commits with the job."""
    order = await session.get(Order, payload["order_id"])
    if order is None:
        raise sqlaq.PermanentError(f"no order {payload['order_id']}")
    order.shipped = True


class NewOrder(BaseModel):
    item: str
    fail_after_enqueue: bool = False  # to show the rollback: order and job both vanish


def init_database(engine: Engine) -> None:
    """sqlaq's tables (its shipped revisions) and the app's own, on a sync Engine."""
    with engine.begin() as conn:
        sqlaq.migrations.upgrade(conn)
        Base.metadata.create_all(conn)


def create_app(database_url: str = DATABASE_URL, *, worker: bool | None = None) -> FastAPI:
    """The app; with *worker* (default: unless ``SHOP_WORKER=off``) a sqlaq worker runs
    in its lifespan."""
    if worker is None:
        worker = os.environ.get("SHOP_WORKER", "on") != "off"
    engine = create_async_engine(database_url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if worker:
                # Stops gracefully when the app does: the grace period, then hand-back.
                async with sqlaq.Worker(engine, registry, sessionmaker=sessions):
                    yield
            else:
                yield
        finally:
            await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    async def session() -> AsyncIterator[AsyncSession]:
        async with sessions() as s:
            yield s

    # (No ``from __future__ import annotations`` in this module: FastAPI reads these
    # annotations at run time, and ``Db`` is local to this function.)
    Db = Annotated[AsyncSession, Depends(session)]

    @app.post("/orders")
    async def create_order(body: NewOrder, db: Db) -> dict[str, int]:
        async with db.begin():  # one transaction: the order and its job
            order = Order(item=body.item)
            db.add(order)
            await db.flush()
            job = await enqueue(db, "ship_order", {"order_id": order.id})
            if body.fail_after_enqueue:
                raise HTTPException(status_code=409, detail="refused: nothing was saved")
        return {"order_id": order.id, "job_id": job.job_id}

    @app.get("/orders/{order_id}")
    async def read_order(order_id: int, db: Db) -> dict[str, Any]:
        order = await db.get(Order, order_id)
        if order is None:
            raise HTTPException(status_code=404, detail="no such order")
        return {"order_id": order.id, "item": order.item, "shipped": order.shipped}

    @app.get("/jobs/{job_id}")
    async def read_job(job_id: int, response: Response, wait_seconds: float = 0.0) -> Any:
        """The job's outcome, once it finished or *wait_seconds* (``?wait_seconds=5``)
        have passed: 202 while it is still pending, 404 for no such job."""
        try:
            outcome = await wait(engine, job_id, timeout=wait_seconds)
        except sqlaq.WaitTimeoutError as pending:
            response.status_code = 202
            outcome = pending.outcome
        except sqlaq.JobNotFoundError:
            raise HTTPException(status_code=404, detail="no such job") from None
        return {"job_id": job_id, "status": str(outcome.status), "error": outcome.error}

    return app


app = create_app()
