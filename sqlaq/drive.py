"""Plans and the sync driver: every operation written once, for sync and async callers.

This module owns how an operation of :mod:`sqlaq.ops` (or :mod:`sqlaq.periodic`) meets
a connection. It must not know any operation: it holds no SQL and no queue logic.

An operation is written as a **plan**: a generator that validates its input, yields
each step it needs run on the caller's connection, is sent that step's result, and
returns the operation's result. A plan does no I/O, so the same plan serves both kinds
of caller (sans-IO, as h11 or the ``hyper-h2`` state machines do):

* :func:`operation` turns a plan into the sync operation, run here by :func:`run` on a
  :class:`~sqlalchemy.engine.Connection` or :class:`~sqlalchemy.orm.Session`;
* :func:`sqlaq.asyncio.asynchronous` turns the same plan into its ``async`` twin, run by
  the async driver on an ``AsyncConnection`` or ``AsyncSession``.

Validation, statements, parameters, result shaping and retry loops live in the plan, so
a twin cannot drift from its original; a driver only runs steps. The steps a plan may
yield:

* ``(statement, params)``: execute it; the result is the buffered ``CursorResult`` (both
  drivers hand over rows already fetched);
* :class:`Savepoint`: execute a statement inside a ``SAVEPOINT`` (on an autocommit
  connection, where each statement is its own transaction, without one); the result,
  or the :class:`~sqlalchemy.exc.DBAPIError` that rolled the savepoint back, for the
  plan to judge;
* :data:`AUTOCOMMIT`: whether the connection is in autocommit;
* :class:`Copy`: ``COPY`` rows into a table through the driver's own connection, in the
  caller's transaction; the number of rows;
* :class:`PerEngine`: what a plan of its own returns, run once per engine (its first
  caller's connection) and cached: e.g. whether the job table is distributed on Citus.

A sync operation handed an async object (and an async one handed a sync object) raises
:class:`~sqlaq.errors.ConfigError` naming the function to use, before any SQL: both
drivers tell the kinds apart here (:func:`kind_of`, :func:`wrong_kind`). A statement
that finds no sqlaq table or column raises :class:`~sqlaq.errors.SchemaOutOfDateError`
naming the fix, from both drivers (:func:`schema_error`).
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Generator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeAlias, TypeVar

import psycopg
import psycopg.sql
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from sqlaq.errors import ConfigError, SchemaOutOfDateError

if TYPE_CHECKING:
    # Not at run time: a process that never imports the ORM (a worker) has no Session
    # to pass, and importing sqlalchemy.orm costs it ~6 MiB.
    from sqlalchemy.orm import Session

__all__ = [
    "AUTOCOMMIT",
    "Copy",
    "Executor",
    "PerEngine",
    "Plan",
    "Savepoint",
    "kind_of",
    "operation",
    "per_engine",
    "plan_of",
    "run",
    "schema_error",
    "wrong_kind",
]

P = ParamSpec("P")
R = TypeVar("R")

#: What a sync operation runs on: a Core connection or an ORM session.
Executor: TypeAlias = "Connection | Session"


@dataclass(frozen=True, slots=True)
class Savepoint:
    """Step: execute *statement* inside a savepoint; the result, or the DBAPIError."""

    statement: Any
    params: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Copy:
    """Step: ``COPY`` *rows* into a table; the row count.

    Attributes:
        statement: ``COPY ... FROM STDIN`` for psycopg (from :mod:`sqlaq.queries`).
        table: The table's name, for drivers that take the parts (asyncpg).
        columns: The columns the rows fill, in order.
        rows: The rows, tuples in *columns* order.
        operation: The operation's name, for messages.
    """

    statement: psycopg.sql.Composed
    table: str
    columns: Sequence[str]
    rows: Sequence[tuple[Any, ...]]
    operation: str


@dataclass(frozen=True, slots=True, eq=False)
class PerEngine:
    """Step: what *plan* returns, run on the caller's connection the first time an
    engine meets this step, then read from *cache* (keyed by the sync
    :class:`~sqlalchemy.engine.Engine`, weakly) for every connection of that engine.

    Attributes:
        plan: Makes the plan to run (statements only).
        cache: Where the answer per engine is kept, e.g. a ``WeakKeyDictionary``.
    """

    plan: Callable[[], Plan[Any]]
    cache: MutableMapping[Engine, Any]


class _Autocommit:
    """Step: whether the connection is in autocommit (see :data:`AUTOCOMMIT`)."""

    def __repr__(self) -> str:
        return "AUTOCOMMIT"


#: Step: whether the caller's connection is in autocommit (a bool).
AUTOCOMMIT = _Autocommit()

#: What a plan yields: ``(statement, params)``, or one of the step objects above.
Step: TypeAlias = tuple[Any, Mapping[str, Any] | None] | Savepoint | Copy | PerEngine | _Autocommit
#: A plan: yields steps, is sent their results, returns the operation's result.
Plan: TypeAlias = Generator[Step, Any, R]

# The plan behind each operation, for plan_of and the async twins.
_PLANS: dict[Callable[..., Any], Callable[..., Plan[Any]]] = {}
# The types the sync driver takes without a second look (anything with .execute goes;
# a Session's type joins on first use, see check_sync).
_SYNC_TYPES: set[type] = {Connection}


def operation(plan: Callable[P, Plan[R]]) -> Callable[Concatenate[Executor, P], R]:
    """The sync operation of *plan*: ``op(conn, *args, **kwargs)`` runs
    ``plan(*args, **kwargs)`` on *conn* with :func:`run`.

    The operation takes the plan's name, docstring and signature, with ``conn`` first.
    """
    name = plan.__name__

    def op(conn: Executor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if type(conn) not in _SYNC_TYPES:
            check_sync(conn, name, plan.__module__)
        return run(conn, plan(*args, **kwargs))

    op.__name__ = name
    op.__qualname__ = plan.__qualname__
    op.__doc__ = plan.__doc__
    op.__module__ = plan.__module__
    op.__signature__ = with_conn(plan, "Connection | Session")  # type: ignore[attr-defined]
    _PLANS[op] = plan
    return op


def plan_of(op: Callable[Concatenate[Executor, P], R]) -> Callable[P, Plan[R]]:
    """The plan behind the operation *op* (made by :func:`operation`): to run it inside
    another plan (``result = yield from plan_of(ops.enqueue_many)(jobs)``), or to make
    its async twin."""
    try:
        return _PLANS[op]
    except KeyError:
        raise TypeError(f"{op!r} is not an operation made by sqlaq.drive.operation") from None


def with_conn(plan: Callable[..., Any], annotation: str) -> inspect.Signature:
    """*plan*'s signature as its operation's: a positional ``conn`` parameter first, and
    what the plan returns (``Plan[X]`` gives ``X``)."""
    signature = inspect.signature(plan)
    conn = inspect.Parameter("conn", inspect.Parameter.POSITIONAL_ONLY, annotation=annotation)
    returns = signature.return_annotation
    if isinstance(returns, str) and returns.startswith("Plan[") and returns.endswith("]"):
        returns = returns[len("Plan[") : -1]
    return signature.replace(
        parameters=[conn, *signature.parameters.values()], return_annotation=returns
    )


def run(conn: Executor, plan: Plan[R]) -> R:
    """Run *plan* on *conn*, step by step; return what it returns.

    Raises:
        SchemaOutOfDateError: a statement found no sqlaq table or column (see
            :func:`schema_error`); the caller's transaction is left as the database
            left it (aborted).
    """
    try:
        step = plan.send(None)
        while True:
            # Plain statements are nearly every step: they go first, with no lookup.
            if type(step) is tuple:
                step = plan.send(conn.execute(step[0], step[1]))
            else:
                step = plan.send(_special(conn, step))
    except StopIteration as done:
        value: R = done.value
        return value
    except Exception as exc:
        error = schema_error(exc)
        if error is None:
            raise
        raise error from exc


# The relation a "does not exist" message names, schema-qualified or not.
_RELATION = re.compile(r'relation "(?:[^"]*\.)?([^".]+)"')
# SQLSTATEs: undefined_table, undefined_column.
_UNDEFINED_TABLE = "42P01"
_UNDEFINED_COLUMN = "42703"


def schema_error(exc: BaseException) -> SchemaOutOfDateError | None:
    """The :class:`~sqlaq.errors.SchemaOutOfDateError` that *exc* means, or None.

    A statement of sqlaq's that finds no ``sqlaq_`` table (undefined_table, SQLSTATE
    42P01) or a missing column of one (undefined_column, 42703) means the database
    lacks sqlaq's schema or is behind this sqlaq: the error names the fix. Any other
    error (another table's, another SQLSTATE) is None: raised as it is. Both drivers
    (psycopg, asyncpg), wrapped by SQLAlchemy or not (a COPY).
    """
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    code = getattr(orig, "sqlstate", None)
    if code not in (_UNDEFINED_TABLE, _UNDEFINED_COLUMN):
        return None
    message = str(getattr(orig, "__cause__", None) or orig).strip().splitlines()
    first = message[0] if message else ""
    named = _RELATION.search(first)
    if code == _UNDEFINED_TABLE:
        if named is None or not named.group(1).startswith("sqlaq_"):
            return None
    elif named is not None:  # 'column "x" of relation "t" does not exist'
        if not named.group(1).startswith("sqlaq_"):
            return None
    elif "sqlaq_" not in first and "sqlaq_" not in str(getattr(exc, "statement", "") or ""):
        return None
    return SchemaOutOfDateError(
        f"sqlaq's schema is missing or out of date in this database ({first}): run "
        "'alembic upgrade heads' in your project, or 'sqlaq migrate' without Alembic"
    )


def _special(conn: Executor, step: Step) -> Any:
    if isinstance(step, Savepoint):
        try:
            if autocommit(conn):
                return conn.execute(step.statement, step.params)
            with conn.begin_nested():
                return conn.execute(step.statement, step.params)
        except DBAPIError as exc:
            return exc
    if step is AUTOCOMMIT:
        return autocommit(conn)
    if isinstance(step, Copy):
        return _copy(conn, step)
    if isinstance(step, PerEngine):
        return per_engine(conn, step)
    raise TypeError(f"a plan yielded {step!r}, which is not a step")  # pragma: no cover


def per_engine(conn: Executor, step: PerEngine) -> Any:
    """The answer to *step* for *conn*'s engine: cached, or found by running its plan on
    *conn* (see :class:`PerEngine`)."""
    engine = conn.engine if isinstance(conn, Connection) else conn.connection().engine
    try:
        return step.cache[engine]
    except KeyError:
        pass
    value = run(conn, step.plan())
    step.cache[engine] = value
    return value


def autocommit(conn: Executor) -> bool:
    """Whether *conn* is in autocommit (a Session never is, unless bound otherwise)."""
    if not isinstance(conn, Connection):
        return False  # a Session, or a scoped_session: its transaction is a real one
    # The driver's own flag: set however autocommit was asked for (engine or connection).
    return bool(getattr(conn.connection.dbapi_connection, "autocommit", False))


def _copy(conn: Executor, step: Copy) -> int:
    connection = conn if isinstance(conn, Connection) else conn.connection()
    if not connection.in_transaction():
        connection.begin()  # what executing a statement would do: the caller commits
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        if isinstance(driver, psycopg.AsyncConnection) or hasattr(driver, "copy_records_to_table"):
            hint = f"this connection runs an async driver: use sqlaq.asyncio.{step.operation}"
        else:
            hint = "use the psycopg driver (postgresql+psycopg://)"
        raise ConfigError(f"{step.operation} needs COPY, which {driver!r} cannot run here: {hint}")
    with driver.cursor() as cursor, cursor.copy(step.statement) as copy:
        for row in step.rows:
            copy.write_row(row)
    return len(step.rows)


#: The kinds of object :func:`kind_of` tells apart.
SYNC = "sync"
ASYNC = "async"
ENGINE = "Engine"
ASYNC_ENGINE = "AsyncEngine"
OTHER = "other"


def kind_of(target: object) -> str:
    """Which kind of object *target* is: a sync executor (:data:`SYNC`: a Connection,
    Session or scoped_session), an async one (:data:`ASYNC`: an AsyncConnection,
    AsyncSession or async_scoped_session), an :data:`ENGINE`, an :data:`ASYNC_ENGINE`,
    or :data:`OTHER`.

    The one place sqlaq tells them apart. The ORM and SQLAlchemy's asyncio are looked
    up, never imported: an object of theirs exists only once they are.
    """
    if isinstance(target, Connection):
        return SYNC
    if isinstance(target, Engine):
        return ENGINE
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None and isinstance(target, orm.Session | orm.scoped_session):
        return SYNC
    aio = sys.modules.get("sqlalchemy.ext.asyncio")
    if aio is not None:
        if isinstance(target, aio.AsyncConnection | aio.AsyncSession | aio.async_scoped_session):
            return ASYNC
        if isinstance(target, aio.AsyncEngine):
            return ASYNC_ENGINE
    return OTHER


def _an(kind: str) -> str:
    return f"an {kind}" if kind[:1] in tuple("AEIOU") else f"a {kind}"


def wrong_kind(
    target: object, name: str, module: str, *, awaited: bool, engines: bool = False
) -> ConfigError | None:
    """The error for a function given what it cannot run on, before any SQL; None when
    *target* will do.

    *name* and *module* name the sync function (``sqlaq.<name>`` if exported, else
    ``<module>.<name>``); its async twin is ``sqlaq.asyncio.<name>``. *awaited* tells
    which of the two was called; *engines*, that it takes an engine of its kind too
    (``wait``). Anything else with an ``execute`` is given a chance (a scoped session of
    a kind sqlaq does not know). The message is one line naming the function to use,
    e.g. ``sqlaq.pause() was given an AsyncConnection: use sqlaq.asyncio.pause
    (awaited)``.
    """
    sync, twin = public_name(name, module), f"sqlaq.asyncio.{name}"
    kind = kind_of(target)
    if awaited:
        called, other, how = twin, sync, "not awaited"
        right, engine, wrong = ASYNC, ASYNC_ENGINE, (SYNC, ENGINE)
        executors, theirs = "an AsyncConnection or AsyncSession", "a Connection or Session"
        example = f"async with engine.begin() as conn: await {twin}(conn, ...)"
    else:
        called, other, how = sync, twin, "awaited"
        right, engine, wrong = SYNC, ENGINE, (ASYNC, ASYNC_ENGINE)
        executors, theirs = "a Connection or Session", "an AsyncConnection or AsyncSession"
        example = f"with engine.begin() as conn: {sync}(conn, ...)"
    if kind == right or (engines and kind == engine):
        return None
    given = f"{called}() was given {_an(type(target).__name__)}"
    if kind in wrong:
        on = f" on {theirs}" if kind == wrong[1] and not engines else ""
        return ConfigError(f"{given}: use {other} ({how}){on}")
    if kind == engine:
        return ConfigError(f"{given}: it runs in your transaction, pass {executors} ('{example}')")
    if hasattr(target, "execute"):
        return None
    if engines:
        executors = f"{executors}, or its engine"
    return ConfigError(f"{given}: pass {executors}")


def check_sync(conn: object, name: str, module: str) -> None:
    """Refuse, before any SQL, what the sync function *name* cannot run on (see
    :func:`wrong_kind`)."""
    error = wrong_kind(conn, name, module, awaited=False)
    if error is not None:
        raise error
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None and type(conn) is orm.Session:
        _SYNC_TYPES.add(orm.Session)  # no second look next time


def public_name(name: str, module: str) -> str:
    """Where a sync function is best imported from: ``sqlaq.<name>`` if exported, else
    the shortest package of *module* that exports it (``sqlaq.ops.notify_queues``)."""
    # Looked up, not imported (a package is imported before its modules), so that this
    # low layer does not depend on the package's top.
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        package = ".".join(parts[:end])
        if hasattr(sys.modules.get(package), name):
            return f"{package}.{name}"
    return f"{module}.{name}"
