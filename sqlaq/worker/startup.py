"""The start check every worker runs before it claims: one implementation for
``sqlaq-worker``, ``async with Worker(...)``, :meth:`Worker.run_async` and
:meth:`Worker.run`.

It connects, checks the schema is at this sqlaq's head, the role holds the privileges
a worker needs and, with ``listen_url``, that the URL reaches the same database. A
transient fault (:func:`sqlaq.transient.is_transient`: a server restarting, refused or
dropped connections) is retried with backoff (tenacity) for the ``start_timeout``
option, then :class:`~sqlaq.errors.DatabaseUnavailableError`; anything else fails at
once with a one-line sqlaq error. :func:`schema_mismatch` tells a running worker whether
a statement failed because the schema changed under it. No statement of its own: the
builders of :mod:`sqlaq.queries` and :func:`sqlaq.migrations.check`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from datetime import timedelta

import tenacity
from sqlalchemy import Engine, func, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from sqlaq import migrations, queries
from sqlaq.errors import ConfigError, DatabaseUnavailableError, SchemaOutOfDateError
from sqlaq.maintenance import direct_engine
from sqlaq.schema import (
    PAUSED_TABLE,
    PERIODIC_TABLE,
    RATES_TABLE,
    TABLE_NAME,
    UNIQUE_HOLDS_TABLE,
    WORKERS_TABLE,
)
from sqlaq.transient import DATABASE_BACKOFF, describe, is_transient

__all__ = [
    "WORKER_PRIVILEGES",
    "check_database",
    "check_listen_url",
    "check_privileges",
    "schema_mismatch",
    "start_check",
]

_log = logging.getLogger("sqlaq.worker")

#: What a worker does on each of sqlaq's tables: claims and outcomes update jobs,
#: periodic jobs and handlers insert them, the leader deletes finished ones; limited
#: claims keep their rate log up to date (an upsert), periodic slots are locked and
#: advanced (``FOR UPDATE`` needs UPDATE too); every claim reads the paused queues; each
#: worker keeps its heartbeat row, and the leader deletes stale ones; handlers' enqueues
#: take ``unique_for`` holds (an upsert), and the leader deletes expired ones.
WORKER_PRIVILEGES: Mapping[str, tuple[str, ...]] = {
    TABLE_NAME: ("SELECT", "INSERT", "UPDATE", "DELETE"),
    RATES_TABLE: ("SELECT", "INSERT", "UPDATE"),
    PERIODIC_TABLE: ("SELECT", "INSERT", "UPDATE"),
    PAUSED_TABLE: ("SELECT",),
    WORKERS_TABLE: ("SELECT", "INSERT", "UPDATE", "DELETE"),
    UNIQUE_HOLDS_TABLE: ("SELECT", "INSERT", "UPDATE", "DELETE"),
}


def start_check(
    engine: Engine,
    *,
    listen_url: str | None,
    start_timeout: timedelta,
    interrupted: threading.Event | None = None,
) -> bool:
    """Check *engine*'s database (and *listen_url*) for a worker; retry transient faults.

    Returns False if *interrupted* was set while retrying (the worker is stopping: it
    never started), True once the database passed.

    Raises:
        SchemaOutOfDateError: the schema is not this sqlaq's head.
        ConfigError: the role lacks privileges, the listen URL reaches another
            database, or the database refused the worker (not transiently).
        DatabaseUnavailableError: transient faults for all of *start_timeout*.
    """
    stop = interrupted or threading.Event()
    failures = 0

    def log_retry(state: tenacity.RetryCallState) -> None:
        nonlocal failures
        failures += 1
        error = state.outcome.exception() if state.outcome is not None else None
        _log.warning(
            "database unavailable at start (attempt %d), retrying in %.2fs: %s",
            state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
            describe(error) if error is not None else "",
        )

    def stop_or_sleep(seconds: float) -> None:
        stop.wait(seconds)  # a stop cuts it short: the next attempt returns at once

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        stop=tenacity.stop_after_delay(start_timeout.total_seconds()),
        wait=lambda state: DATABASE_BACKOFF(state.attempt_number).total_seconds(),
        sleep=stop_or_sleep,
        before_sleep=log_retry,
        reraise=True,
    )
    target = f"the database at {engine.url!r}"
    try:
        for attempt in retrying:
            with attempt:
                if stop.is_set():
                    return False
                target = f"the database at {engine.url!r}"
                check_database(engine)
                if listen_url:
                    target = f"the listen URL {make_url(listen_url)!r}"
                    check_listen_url(engine, listen_url)
    except sa_exc.DBAPIError as exc:
        if stop.is_set():
            return False
        if is_transient(exc):
            raise DatabaseUnavailableError(
                f"{target} is unavailable after {start_timeout.total_seconds():g}s "
                f"(start_timeout): {describe(exc)}"
            ) from None
        raise ConfigError(f"cannot use {target}: {describe(exc)}") from None
    if failures:
        _log.info("database available after %d failed attempt(s) at start", failures)
    return True


def check_database(engine: Engine) -> None:
    """Connect once; check the schema is at sqlaq's head and the role may run a worker.

    Raises:
        SchemaOutOfDateError: the schema is not sqlaq's head (the message names the
            command to run).
        ConfigError: the role lacks a privilege the worker needs (the message names
            each missing one).
        sqlalchemy.exc.DBAPIError: the database could not be used.
    """
    with engine.connect() as conn:
        migrations.check(conn)
        check_privileges(conn.execute(queries.privileges_stmt(needed=WORKER_PRIVILEGES)))


def schema_mismatch(engine: Engine) -> SchemaOutOfDateError | None:
    """The schema's mismatch with this sqlaq, read now; None if it is at the head (or
    the database cannot tell now): what a running worker asks when a statement fails
    in a way no wait cures."""
    try:
        with engine.connect() as conn:
            migrations.check(conn)
    except SchemaOutOfDateError as exc:
        return exc
    except sa_exc.DBAPIError:
        return None
    return None


def check_listen_url(engine: Engine, url: str) -> None:
    """Connect once to a worker's ``listen_url`` and check it reaches *engine*'s database.

    NOTIFY and advisory locks belong to one database of one server: a listen URL naming
    another database, or another server (a replica), would leave the listener deaf and
    elect leaders apart, silently. Both sides must report the same
    ``current_database()`` and ``pg_postmaster_start_time()``.

    Raises:
        ConfigError: the URL reaches another database or server, or refuses the worker
            (not transiently).
        sqlalchemy.exc.DBAPIError: a transient fault (retried by :func:`start_check`).
    """
    same = select(func.current_database(), func.pg_postmaster_start_time())
    direct = direct_engine(url, "sqlaq-worker")
    try:
        with engine.connect() as conn:
            expected = tuple(conn.execute(same).one())
        try:
            with direct.connect() as conn:
                found = tuple(conn.execute(same).one())
        except sa_exc.DBAPIError as exc:
            if is_transient(exc):
                raise
            raise ConfigError(
                f"cannot use the listen URL {direct.url!r}: {describe(exc)}"
            ) from None
    finally:
        direct.dispose()
    if found != expected:
        raise ConfigError(
            f"the listen URL {direct.url!r} reaches database {found[0]!r} on a server started "
            f"at {found[1]:%Y-%m-%d %H:%M:%S}, not the queue's ({expected[0]!r}, started at "
            f"{expected[1]:%Y-%m-%d %H:%M:%S}): point it at the same database, directly"
        )


def check_privileges(missing: Iterable[tuple[str, str]]) -> None:
    """Raise if *missing* (rows of ``queries.privileges_stmt``: table, privilege) has any.

    Raises:
        ConfigError: one line naming every missing privilege and the GRANT to run.
    """
    by_table: dict[str, list[str]] = {}
    for table, privilege in missing:
        by_table.setdefault(table, []).append(privilege)
    if not by_table:
        return
    lacking = "; ".join(f"{', '.join(p)} on {t}" for t, p in by_table.items())
    grants = "; ".join(f"GRANT {', '.join(p)} ON {t} TO <role>" for t, p in by_table.items())
    raise ConfigError(f"the database role lacks privileges the worker needs: {lacking} ({grants})")
