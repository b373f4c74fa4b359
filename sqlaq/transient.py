"""Which database errors a wait can cure: the one place the worker decides it.

The worker backs off and retries its turn on these (a restarted server, a terminated
backend, a dropped network, a serialization failure, a deadlock) and raises anything
else (a missing table, a bug), so a misconfiguration stops the process instead of
spinning. This module owns that classification and the backoff between attempts; it
runs nothing.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg
from sqlalchemy import exc as sa_exc

from sqlaq.backoff import Backoff
from sqlaq.errors import one_line

__all__ = ["DATABASE_BACKOFF", "describe", "is_transient"]

#: Waits between attempts while the database is unavailable: 50 ms doubling to 5 s.
DATABASE_BACKOFF = Backoff(base=timedelta(milliseconds=50), cap=timedelta(seconds=5))


#: SQLSTATEs that waiting may cure: connection exceptions (08), insufficient resources
#: (53: too many connections, out of memory or disk), an administrator's or a crash's
#: shutdown and "the database system is starting up" (57P01-03), serialization
#: failures and deadlocks.
_TRANSIENT_STATES = ("08", "53", "57P01", "57P02", "57P03", "40001", "40P01")


def is_transient(error: BaseException) -> bool:
    """True for a database error that waiting may cure.

    A connection lost or invalidated (server restart, ``pg_terminate_backend``,
    network), a pool timeout, and PostgreSQL's operational errors, which include
    serialization failures (40001), deadlocks (40P01), admin shutdown, "the database
    system is starting up" and "too many connections" (53300), whichever driver
    reports them.
    """
    if isinstance(error, sa_exc.DBAPIError):
        return (
            error.connection_invalidated
            or isinstance(error, sa_exc.OperationalError | sa_exc.InterfaceError)
            # A driver that does not say OperationalError (asyncpg's "too many
            # connections" is a plain DBAPIError): its SQLSTATE says it.
            or str(getattr(error.orig, "sqlstate", None) or "").startswith(_TRANSIENT_STATES)
        )
    if isinstance(error, sa_exc.TimeoutError | psycopg.OperationalError | psycopg.InterfaceError):
        return True
    # A driver's own error that SQLAlchemy did not wrap (asyncpg's at connect time with
    # SQLAlchemy 2.0): its SQLSTATE says it.
    return str(getattr(error, "sqlstate", None) or "").startswith(_TRANSIENT_STATES)


def describe(error: BaseException) -> str:
    """One line for a log: the driver's error (SQLAlchemy's wrapper repeats the whole
    statement), as ``Type: message``."""
    if isinstance(error, sa_exc.DBAPIError) and error.orig is not None:
        error = error.orig
    return f"{type(error).__name__}: {one_line(error)}"[:500]
