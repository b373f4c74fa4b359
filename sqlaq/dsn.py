"""Connection arguments for the connections sqlaq opens outside an engine's pool.

A LISTEN must live on a connection of its own (a pooled one would carry the LISTEN to
its next user), so the worker's listener and :func:`sqlaq.wait` open raw psycopg
connections. This module owns how: the engine's URL as psycopg ``connect()`` keyword
arguments, with a name to find the backend by and TCP keepalives to notice a dead
peer. No SQL, no connection of its own.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import URL, Dialect, Engine
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

__all__ = ["ASYNC_DRIVERS", "KEEPALIVES", "SYNC_DRIVER", "connection_params", "sync_url"]

#: The driver of every blocking connection sqlaq makes itself: psycopg (3).
SYNC_DRIVER = "postgresql+psycopg"
#: Async drivers an application's ``DATABASE_URL`` often names; where sqlaq needs a
#: blocking connection (the commands, a worker's threads, the pytest plugin), it uses
#: :data:`SYNC_DRIVER` on the same URL instead.
ASYNC_DRIVERS = frozenset({"postgresql+asyncpg", "postgresql+psycopg_async"})

#: Reads a URL as psycopg's ``connect()`` arguments.
_PSYCOPG: Dialect = PGDialect_psycopg()  # type: ignore[no-untyped-call]

#: TCP keepalives of a long-lived connection: a dead peer is noticed within a minute.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def sync_url(url: URL) -> URL:
    """*url* with a blocking driver: an async one (``postgresql+asyncpg``,
    ``postgresql+psycopg_async``) and a bare ``postgresql``/``postgres`` become psycopg
    (:data:`SYNC_DRIVER`); any other driver is kept as it is."""
    if url.drivername in ASYNC_DRIVERS or url.drivername in {"postgresql", "postgres"}:
        return url.set(drivername=SYNC_DRIVER)
    return url


def connection_params(target: Engine | URL, application_name: str) -> dict[str, Any]:
    """psycopg ``connect()`` keyword arguments for the database *target* points at: an
    Engine, or the URL of any engine (an ``AsyncEngine``'s, asyncpg's included: the
    connection is psycopg's whatever the URL's driver).

    Taken from the URL (``connect_args`` given to ``create_engine`` are not visible
    from outside the pool, so put settings such as ``sslmode`` in the URL).
    *application_name* is used unless the URL names one, so the backend is easy to find
    in ``pg_stat_activity``.
    """
    url = target if isinstance(target, URL) else target.url
    _, params = _PSYCOPG.create_connect_args(url.set(drivername="postgresql+psycopg"))
    params = {k: v for k, v in params.items() if k != "context"}
    params.setdefault("application_name", application_name)
    params.setdefault("connect_timeout", 10)
    for key, value in KEEPALIVES.items():
        params.setdefault(key, value)
    return params
