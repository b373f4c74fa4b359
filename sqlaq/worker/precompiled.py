"""Running a plan's statements on the driver's cursor, compiled once: what the worker
does with the statements it runs thousands of times a second (the plain claim, the
complete of a batch of successes). No state but the compiled SQL and the cursor of the
connection it last ran on.

A statement run this way skips SQLAlchemy's execution path (its per-execution setup and
its result rows), about a fifth of a millisecond of the GIL per statement, and more per
row returned. Its rows come back in PostgreSQL's binary format: the server sends a
``timestamptz`` as its microseconds rather than formatting it in the session's time zone
(the claim returns two, and a ``uuid``, an ``interval`` and two ``jsonb``), which takes
about 0.04 ms off a claim right after an idle moment (``bench/RESULTS.md``, "A fourth
machine"); psycopg reads each type to the same Python value as from text. Its ``jsonb``
columns are read by the JSON scanner itself: psycopg's default hands the bytes to
``json.loads``, which first guesses their encoding and then matches whitespace around
the value twice, and the server's ``jsonb`` is UTF-8 text (after a version byte, in
binary), with no byte order mark and no whitespace around the value. The value is the
one ``json.loads`` returns (text it would refuse goes to it, to be refused as it would
be); an engine given a ``json_deserializer`` of its own keeps it.

Each statement is prepared on the server at its first run (psycopg's own threshold waits
for the sixth), unless the URL turned preparing off (``prepare_threshold=none``, for
PgBouncer in transaction pooling): a statement psycopg has not prepared yet is parsed
and planned at every run, and PostgreSQL plans a prepared one anew at each of its first
five runs before it settles on a generic plan. The claim is the heaviest statement to
plan (0.5-1 ms): a worker that had just started paid it on its first ten or so claims,
the wake-ups of its first jobs; now on its first five.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.errors import DataError
from psycopg.pq import Format
from psycopg.types.json import JsonbBinaryLoader
from sqlalchemy import Connection

from sqlaq.drive import PerEngine, Plan, per_engine
from sqlaq.ops._citus import DISTRIBUTED
from sqlaq.queries import relaxed_stmt

__all__ = ["Precompiled"]

R = TypeVar("R")
_MAX_CACHED = 256  # statements compiled per Precompiled, at most
_JSONB_OID = 3802  # pg_type's oid of jsonb, fixed since PostgreSQL 9.4
#: A statement's entry: the statement, the form run, its SQL, its fixed values.
_Entry = tuple[Any, Any, str | None, dict[str, Any] | None]

# json.loads's decoder's scanner, in C (typeshed does not declare the attribute).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json_value(text: str) -> Any:
    """One JSON value scanned from the start of *text* to its end, as ``json.loads``
    reads it (text it refuses goes to it, to be refused as it would be)."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:  # not JSON: json.loads says why
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


class _JsonbBinary(Loader):
    """``jsonb`` in binary, as ``json.loads`` reads it: a version byte (1, the only one
    there is; psycopg's own loader refuses any other likewise), then UTF-8 text
    (``surrogatepass``, as ``json.loads`` decodes bytes) holding one value."""

    format = Format.BINARY

    def load(self, data: Buffer) -> Any:
        view = memoryview(data)
        if view and view[0] != 1:
            raise DataError(f"unknown jsonb binary format: {view[0]}")
        return _json_value(str(view[1:], "utf-8", "surrogatepass"))


class _Rows(list[Any]):
    """Rows fetched from the cursor, as a plan reads a buffered result (``.all()``)."""

    def all(self) -> list[Any]:
        return self


class Precompiled:
    """Runs a plan's statements compiled once per dialect to the driver's SQL, on the
    psycopg cursor of a SQLAlchemy connection in autocommit.

    A statement whose compiled form needs SQLAlchemy at each execution (parameters it
    converts, or expands: an ``IN`` list, an array of excluded kinds) is run by
    SQLAlchemy as usual. Any step other than a statement (a plan that asks for a
    transaction or the driver connection) is refused with ``TypeError``: the plans run
    here have none. A driver error discards the connection (SQLAlchemy would have, had
    it seen a lost connection) and propagates as the driver raised it
    (:func:`sqlaq.transient.is_transient` knows both).
    """

    def __init__(self) -> None:
        # (id(statement), relaxed) -> (statement, the form run, its SQL or None, its
        # fixed values or None); the statement is kept so its id cannot be reused while
        # cached.
        self._sql: dict[tuple[int, bool], _Entry] = {}
        # The psycopg connection last run on, and its cursor (see _cursor_of).
        self._cursor: tuple[Any, Any] | None = None

    def run(self, conn: Connection, plan: Plan[R], *, relaxed: bool = False) -> R:
        """Run *plan* on *conn* (in autocommit); return what it returns.

        *relaxed*: each of its statements (UPDATEs: the claims) commits without
        waiting for its WAL flush, the setting inside the statement itself
        (:func:`~sqlaq.queries.relaxed_stmt`: one statement, one round trip). Not on a
        job table distributed on Citus, which refuses a volatile function in an UPDATE
        of a distributed table: there they commit as usual.
        """
        relax = relaxed and not per_engine(conn, DISTRIBUTED)
        try:
            step = plan.send(None)
            while True:
                if isinstance(step, PerEngine):  # answered once per engine, then cached
                    step = plan.send(per_engine(conn, step))
                    continue
                if type(step) is not tuple:
                    raise TypeError(f"Precompiled runs plain statements only, not {step!r}")
                statement, params = step
                _, form, sql, fixed = self._compiled(statement, conn, params, relax)
                if sql is None:
                    step = plan.send(conn.execute(form, params))
                    continue
                if fixed is not None:  # values of the statement's own (a where clause's)
                    params = {**fixed, **(params or {})}
                try:
                    driver: Any = conn.connection.driver_connection
                    cursor = self._cursor_of(driver)
                    # Prepared at its first run, not psycopg's sixth: see the module's
                    # docstring (never where the URL turned preparing off).
                    cursor.execute(sql, params, prepare=driver.prepare_threshold is not None)
                    # Rows only where the statement returns some (its result has
                    # columns); not cursor.description, which builds an object per
                    # column at each call.
                    result = cursor.pgresult
                    rows = _Rows(cursor.fetchall() if result is not None and result.nfields else ())
                except Exception:
                    self._cursor = None
                    conn.invalidate()
                    raise
                step = plan.send(rows)
        except StopIteration as done:
            value: R = done.value
            return value

    def _cursor_of(self, driver: Any) -> Any:
        """The cursor statements run on for the psycopg connection *driver*: one per
        connection, kept while the worker uses the same one (a cursor costs tens of
        microseconds to make and set up; the claim and the complete run thousands of
        times a second)."""
        cached = self._cursor
        if cached is not None and cached[0] is driver and not cached[1].closed:
            return cached[1]
        cursor = driver.cursor(binary=True)
        # Only in place of psycopg's own loaders: a json_deserializer the engine was
        # given (psycopg's set_json_loads) is the application's to keep.
        adapters = driver.adapters
        if adapters.get_loader(_JSONB_OID, Format.BINARY) is JsonbBinaryLoader:
            cursor.adapters.register_loader(_JSONB_OID, _JsonbBinary)
        self._cursor = (driver, cursor)
        return cursor

    def _compiled(self, statement: Any, conn: Connection, params: Any, relaxed: bool) -> _Entry:
        """The statement's entry: the form run (*relaxed*: its
        :func:`~sqlaq.queries.relaxed_stmt`), its SQL (None: run it by SQLAlchemy), and
        the values bound in the statement itself that the plan's *params* do not give (a
        clause passed as ``where=``, ``kind = 'a'``): SQLAlchemy sends those from the
        statement, the driver's cursor needs them with the others."""
        key = (id(statement), relaxed)
        cached = self._sql.get(key)
        if cached is not None:
            return cached
        form = relaxed_stmt(statement) if relaxed else statement
        compiled = form.compile(dialect=conn.dialect)
        plain = not (
            compiled._bind_processors
            or compiled.post_compile_params
            or compiled.literal_execute_params
            or any(
                column[3].dialect_impl(conn.dialect).result_processor(conn.dialect, None)
                for column in compiled._result_columns
            )
        )
        sql = compiled.string if plain and conn.dialect.driver == "psycopg" else None
        given = params if isinstance(params, dict) else {}
        fixed = {k: v for k, v in compiled.params.items() if k not in given} or None
        if len(self._sql) >= _MAX_CACHED:
            # A worker runs a handful of statements; more means statements built anew
            # (a claim narrowed by a clause, rebuilt once evicted from its own cache):
            # start over rather than grow.
            self._sql.clear()
        entry = self._sql[key] = (statement, form, sql, fixed)
        return entry
