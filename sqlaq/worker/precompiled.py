"""Running a plan's statements on the driver's cursor, compiled once: what the worker
does with the statements it runs thousands of times a second (the plain claim, the
complete of a batch of successes). No state but the compiled SQL.

A statement run this way skips SQLAlchemy's execution path (its per-execution setup and
its result rows), about a fifth of a millisecond of the GIL per statement, and more per
row returned. Its ``jsonb`` columns are read by the JSON scanner itself: psycopg's
default hands the bytes to ``json.loads``, which first guesses their encoding and then
matches whitespace around the value twice, and the server's ``jsonb`` text is UTF-8,
with no byte order mark and no whitespace around the value. The value is the one
``json.loads`` returns (text it would refuse goes to it, to be refused as it would be);
an engine given a ``json_deserializer`` of its own keeps it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from psycopg import Pipeline
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.types.json import JsonbLoader
from sqlalchemy import Connection

from sqlaq.drive import PerEngine, Plan, per_engine
from sqlaq.queries import relaxed_commit_stmt

__all__ = ["Precompiled"]

R = TypeVar("R")
_MAX_CACHED = 256  # statements compiled per Precompiled, at most
_RELAXED = relaxed_commit_stmt()
_PIPELINES = Pipeline.is_supported()  # libpq 14 or later
_JSONB_OID = 3802  # pg_type's oid of jsonb, fixed since PostgreSQL 9.4

# json.loads's decoder's scanner, in C (typeshed does not declare the attribute).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


class _JsonbText(Loader):
    """``jsonb`` in text, as ``json.loads`` reads it: UTF-8 (``surrogatepass``, as it
    decodes bytes) to str, then one value scanned from its start to its end."""

    def load(self, data: Buffer) -> Any:
        text = str(data, "utf-8", "surrogatepass")
        try:
            value, end = _scan(text, 0)
        except StopIteration:  # not JSON: json.loads says why
            return json.loads(text)
        return value if end == len(text) else json.loads(text)


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
        # id(statement) -> (statement, its SQL or None, its fixed values or None); the
        # statement is kept so its id cannot be reused while cached.
        self._sql: dict[int, tuple[Any, str | None, dict[str, Any] | None]] = {}

    def run(self, conn: Connection, plan: Plan[R], *, relaxed: bool = False) -> R:
        """Run *plan* on *conn* (in autocommit); return what it returns.

        *relaxed*: each of its statements run here commits without waiting for its WAL
        flush (:func:`~sqlaq.queries.relaxed_commit_stmt`, sent with the statement in
        one pipeline: one implicit transaction, one round trip). Where the driver's
        libpq has no pipeline mode (before PostgreSQL 14's), they commit as usual. A
        statement SQLAlchemy must run (see the class) is relaxed in a transaction of
        its own: ``BEGIN``, the setting, the statement, ``COMMIT``.
        """
        # The setting's SQL, compiled once like any statement here (None: not relaxed).
        relax = self._compiled(_RELAXED, conn, None)[1] if relaxed else None
        try:
            step = plan.send(None)
            while True:
                if isinstance(step, PerEngine):  # answered once per engine, then cached
                    step = plan.send(per_engine(conn, step))
                    continue
                if type(step) is not tuple:
                    raise TypeError(f"Precompiled runs plain statements only, not {step!r}")
                statement, params = step
                _, sql, fixed = self._compiled(statement, conn, params)
                if sql is None:
                    if relax is not None:  # a transaction of its own (SQLAlchemy reads at once)
                        driver = conn.connection.driver_connection
                        with driver.transaction():  # type: ignore[union-attr]
                            driver.execute(relax)  # type: ignore[union-attr]
                            result = conn.execute(statement, params)
                        step = plan.send(result)  # its rows are in hand: a client cursor's
                        continue
                    step = plan.send(conn.execute(statement, params))
                    continue
                if fixed is not None:  # values of the statement's own (a where clause's)
                    params = {**fixed, **(params or {})}
                driver = conn.connection.driver_connection
                cursor = driver.cursor()  # type: ignore[union-attr]
                # Only in place of psycopg's own loader: a json_deserializer the engine
                # was given (psycopg's set_json_loads) is the application's to keep.
                if driver.adapters.get_loader(_JSONB_OID, Format.TEXT) is JsonbLoader:  # type: ignore[union-attr]
                    cursor.adapters.register_loader(_JSONB_OID, _JsonbText)
                try:
                    if relax is not None and _PIPELINES:
                        # The pipeline's exit sends its Sync: the statements' implicit
                        # transaction commits there, and their results come back.
                        with driver.pipeline():  # type: ignore[union-attr]
                            driver.execute(relax)  # type: ignore[union-attr]
                            cursor.execute(sql, params)
                    else:
                        cursor.execute(sql, params)
                    rows = _Rows(cursor.fetchall() if cursor.description else ())
                except Exception:
                    conn.invalidate()
                    raise
                finally:
                    cursor.close()
                step = plan.send(rows)
        except StopIteration as done:
            value: R = done.value
            return value

    def _compiled(
        self, statement: Any, conn: Connection, params: Any
    ) -> tuple[Any, str | None, dict[str, Any] | None]:
        """The statement's entry: its SQL (None: run it by SQLAlchemy), and the values
        bound in the statement itself that the plan's *params* do not give (a clause
        passed as ``where=``, ``kind = 'a'``): SQLAlchemy sends those from the
        statement, the driver's cursor needs them with the others."""
        cached = self._sql.get(id(statement))
        if cached is not None:
            return cached
        compiled = statement.compile(dialect=conn.dialect)
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
        entry = self._sql[id(statement)] = (statement, sql, fixed)
        return entry
