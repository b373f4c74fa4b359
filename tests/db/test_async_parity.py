"""One implementation for sync and async: every operation is a plan, run by two drivers.

These tests fail when a sync operation has no async twin (or the reverse), when a twin's
signature drifts from its original, or when logic is written in sqlaq/asyncio.py (or a
connection is used directly in sqlaq/ops/) instead of in the one plan both share.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import drive

PACKAGE = Path(sqlaq.__file__).parent

#: What a parameter's annotation names when the function runs on the caller's database
#: objects (``Executor`` is ``Connection | Session``).
SYNC_OBJECTS = {"Connection", "Session", "Engine", "Executor"}

#: Alembic's scripts, run by Alembic (env.py reads Alembic's context at import): no
#: module of sqlaq's API.
NOT_MODULES = ("sqlaq.migrations.env", "sqlaq.migrations.versions")

#: Public functions that take a Connection, Session or Engine and have no async twin in
#: sqlaq.asyncio, each with its reason. Keep it short: a function left out here without
#: a twin fails test_every_public_function_on_a_connection_has_its_async_twin.
_ALEMBIC = "Alembic's migrations run on a sync Connection (async apps: run_sync)"
_DASHBOARD = "the dashboard is a server of its own, on its own sync Engine"
_CLI = "start-up checks of the sqlaq commands, on the command's sync Engine"
NO_TWIN: dict[str, str] = {
    "sqlaq.testing.drain": "its async twin is sqlaq.testing.drain_async",
    "sqlaq.drive.run": "the sync driver; sqlaq.asyncio holds the async one",
    "sqlaq.dsn.connection_params": "reads an engine's URL, runs nothing on it",
    "sqlaq.worker.writer.write_outcomes": "the worker's own writer, on its sync connection",
    "sqlaq.commandline.check_database": _CLI,
    **dict.fromkeys(
        (
            "sqlaq.worker.startup.start_check",
            "sqlaq.worker.startup.check_database",
            "sqlaq.worker.startup.check_listen_url",
            "sqlaq.worker.startup.schema_mismatch",
            "sqlaq.worker.transaction.check_connection",
        ),
        "the worker's start and schema checks, on the worker's own sync Engine",
    ),
    **dict.fromkeys(
        (
            "sqlaq.migrations.check",
            "sqlaq.migrations.current_revision",
            "sqlaq.migrations.downgrade",
            "sqlaq.migrations.standalone_config",
            "sqlaq.migrations.standalone_revision",
            "sqlaq.migrations.upgrade",
            "sqlaq.migrations.drift.differences",
        ),
        _ALEMBIC,
    ),
    **dict.fromkeys(
        (
            "sqlaq.dashboard.serve",
            "sqlaq.dashboard.actions.cancel_job",
            "sqlaq.dashboard.actions.count_prunable",
            "sqlaq.dashboard.actions.pause_queue",
            "sqlaq.dashboard.actions.prune",
            "sqlaq.dashboard.actions.resume_queue",
            "sqlaq.dashboard.actions.retry_group",
            "sqlaq.dashboard.actions.retry_job",
            "sqlaq.dashboard.reads.failure_groups",
            "sqlaq.dashboard.reads.job",
            "sqlaq.dashboard.reads.job_value",
            "sqlaq.dashboard.reads.jobs_page",
            "sqlaq.dashboard.reads.overview",
            "sqlaq.dashboard.reads.schedules",
            "sqlaq.dashboard.reads.workers",
        ),
        _DASHBOARD,
    ),
}
#: What sqlaq/asyncio.py exports that is no twin.
NOT_TWINS = {"AsyncExecutor", "asynchronous"}


def _modules() -> Iterator[Any]:
    yield sqlaq
    for info in pkgutil.walk_packages(sqlaq.__path__, "sqlaq."):
        if info.name != "sqlaq.asyncio" and not info.name.startswith(NOT_MODULES):
            yield importlib.import_module(info.name)


def _runs_on_sync_objects(function: Callable[..., Any]) -> bool:
    for parameter in inspect.signature(function).parameters.values():
        annotation = parameter.annotation
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        if {part.strip().rsplit(".", 1)[-1] for part in text.split("|")} & SYNC_OBJECTS:
            return True
    return False


def _found() -> dict[str, Callable[..., Any]]:
    """Every public function (named in its module's ``__all__``) that takes a sync
    Connection, Session or Engine, by where it is defined."""
    found: dict[str, Callable[..., Any]] = {}
    for module in _modules():
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if inspect.isfunction(value) and _runs_on_sync_objects(value):
                found.setdefault(f"{value.__module__}.{value.__name__}", value)
    return found


FOUND = _found()
#: The sync functions that must have a twin, by name.
SYNC = {where.rsplit(".", 1)[1]: f for where, f in FOUND.items() if where not in NO_TWIN}


def test_the_functions_are_found_by_their_signatures() -> None:
    """The scan finds what it must: the operations, the operators' controls, explain,
    the results, the test helpers, wait; and every allowed exception still exists."""
    assert set(SYNC) >= {
        "enqueue",
        "claim",
        "complete",
        "notify_queues",
        "enqueue_periodic",
        "pause",
        "resume",
        "paused_queues",
        "list_workers",
        "explain",
        "result",
        "complete_with_result",
        "wait",
        "travel",
        "enqueued_jobs",
        "assert_enqueued",
    }
    assert set(NO_TWIN) <= set(FOUND), set(NO_TWIN) - set(FOUND)
    assert len(SYNC) == len({f.__name__ for f in SYNC.values()})  # no two of one name


def test_every_public_function_on_a_connection_has_its_async_twin() -> None:
    missing = sorted(name for name in SYNC if not hasattr(aq, name))
    assert missing == [], f"no async twin in sqlaq.asyncio for {missing}"
    assert set(aq.__all__) - NOT_TWINS == set(SYNC), "sqlaq.asyncio exports a non-twin"
    assert aq.__all__ == sorted(aq.__all__, key=lambda n: (not n[0].isupper(), n))


def test_every_public_function_of_ops_is_an_operation_made_from_a_plan() -> None:
    for name in sqlaq.ops.__all__:
        value = getattr(sqlaq.ops, name)
        if inspect.isfunction(value):
            assert value in drive._PLANS, f"ops.{name} is not made by @operation"


def test_each_twin_runs_the_same_plan_with_the_same_signature() -> None:
    for name, sync in SYNC.items():
        twin = getattr(aq, name)
        assert inspect.iscoroutinefunction(twin), name
        sync_params = list(inspect.signature(sync).parameters.values())
        twin_params = list(inspect.signature(twin).parameters.values())
        assert sync_params[0].name == twin_params[0].name, name
        assert sync_params[1:] == twin_params[1:], name
        assert twin.__doc__
        assert sync.__doc__
        if name == "wait":  # its steps are shared; see the test below
            continue
        assert sync in drive._PLANS, f"{name} is not made from a plan by @operation"
        assert drive.plan_of(sync).__name__ == name
        assert sync_params[0].name == "conn"
        assert (
            inspect.signature(sync).return_annotation == inspect.signature(twin).return_annotation
        ), name
        assert sync.__doc__ in twin.__doc__


def _args_for(function: Callable[..., Any]) -> tuple[list[Any], dict[str, Any]]:
    """Placeholders for the required arguments after the first: the kind check comes
    before any of them is looked at."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for parameter in list(inspect.signature(function).parameters.values())[1:]:
        if parameter.default is inspect.Parameter.empty:
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
                kwargs[parameter.name] = 1
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
                args.append(1)
    return args, kwargs


_REFUSAL = re.compile(
    r"^(?P<called>[\w.]+)\(\) was given an? (?P<kind>\w+): use (?P<other>[\w.]+) "
    r"\((?P<how>awaited|not awaited)\)( on an? \w+ or \w+)?$"
)


def _refusal(error: pytest.ExceptionInfo[sqlaq.ConfigError]) -> dict[str, str]:
    message = str(error.value)
    match = _REFUSAL.match(message)
    assert match, message
    return match.groupdict()


@pytest.mark.asyncio
async def test_every_sync_function_refuses_async_objects_naming_its_twin(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.connect() as conn:
        given = {
            "AsyncConnection": conn,
            "AsyncSession": AsyncSession(async_engine),
            "AsyncEngine": async_engine,
        }
        for name, sync in SYNC.items():
            args, kwargs = _args_for(sync)
            for kind, target in given.items():
                with pytest.raises(sqlaq.ConfigError) as refused:
                    sync(target, *args, **kwargs)
                assert _refusal(refused) == {
                    "called": drive.public_name(name, sync.__module__),
                    "kind": kind,
                    "other": f"sqlaq.asyncio.{name}",
                    "how": "awaited",
                }, name
        assert not conn.in_transaction()  # nothing ran


@pytest.mark.asyncio
async def test_every_twin_refuses_sync_objects_naming_the_sync_function(engine: Engine) -> None:
    with engine.connect() as conn, Session(engine) as session:
        given = {"Connection": conn, "Session": session, "Engine": engine}
        for name, sync in SYNC.items():
            twin = getattr(aq, name)
            args, kwargs = _args_for(twin)
            for kind, target in given.items():
                with pytest.raises(sqlaq.ConfigError) as refused:
                    await twin(target, *args, **kwargs)
                assert _refusal(refused) == {
                    "called": f"sqlaq.asyncio.{name}",
                    "kind": kind,
                    "other": drive.public_name(name, sync.__module__),
                    "how": "not awaited",
                }, name
        assert not conn.in_transaction()
        assert not session.in_transaction()


def test_the_refusal_is_the_line_the_docs_promise() -> None:
    with pytest.raises(sqlaq.ConfigError) as refused:
        sqlaq.pause(AsyncConnection(_engine()), "q")  # type: ignore[arg-type]
    assert str(refused.value) == (
        "sqlaq.pause() was given an AsyncConnection: use sqlaq.asyncio.pause (awaited)"
    )


def _engine() -> AsyncEngine:
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine("postgresql+psycopg://nobody@localhost:1/none")


def _calls_named(node: ast.AST, attribute: str) -> list[ast.Call]:
    return [
        call
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == attribute
    ]


def test_sqlaq_asyncio_holds_a_driver_and_twins_only() -> None:
    tree = ast.parse((PACKAGE / "asyncio.py").read_text())
    driver = {"_run", "_special", "_copy"}  # the only code that may touch a connection
    plan_made = {name for name, sync in SYNC.items() if sync in drive._PLANS}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in driver:
            assert not _calls_named(node, "execute"), f"{node.name} executes SQL itself"
    for node in tree.body:  # module level: every operation is asynchronous(<the original>)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in plan_made:
                value = node.value
                assert isinstance(value, ast.Call), name
                assert isinstance(value.func, ast.Name)
                assert value.func.id == "asynchronous"
                (arg,) = value.args
                assert isinstance(arg, ast.Attribute | ast.Name)
                assert (arg.attr if isinstance(arg, ast.Attribute) else arg.id).endswith(name)
    for name in aq._LAZY:  # made on first use, by asynchronous too
        assert drive.plan_of(SYNC[name]).__name__ == name
        assert getattr(aq, name).__signature__ == aq.asynchronous(SYNC[name]).__signature__
    for node in tree.body:  # a class here is I/O only: the wait's listener, its LISTEN
        if isinstance(node, ast.ClassDef):
            for call in _calls_named(node, "execute"):
                (statement,) = call.args
                assert isinstance(statement, ast.Call), node.name
                assert isinstance(statement.func, ast.Attribute), node.name
                assert statement.func.attr == "listen_stmt", node.name


def test_the_async_wait_takes_its_steps_from_the_sync_waits_logic() -> None:
    """sqlaq.asyncio.wait and sqlaq.wait both run sqlaq.results.waiting's steps; the
    reads are plans run by each driver, the deadline and the timeout error are there."""
    for module, name in (("asyncio.py", "wait"), ("results.py", "wait")):
        tree = ast.parse((PACKAGE / module).read_text())
        (waiter,) = [
            n
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ]
        called = {
            c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(waiter)
            if isinstance(c, ast.Call)
        }
        assert "waiting" in called, module
        assert {"_run", "run"} & called, module  # the plans, through the driver
        assert "execute" not in called, module
        assert "WaitTimeoutError" not in called, module
    sync, twin = inspect.signature(sqlaq.wait), inspect.signature(aq.wait)
    assert list(sync.parameters)[1:] == list(twin.parameters)[1:]
    assert inspect.iscoroutinefunction(aq.wait)


def test_operations_never_touch_a_connection_themselves() -> None:
    modules = [
        *sorted((PACKAGE / "ops").glob("*.py")),
        *(PACKAGE / name for name in ("periodic.py", "explain.py", "control.py")),
    ]
    assert len(modules) > 2, "sqlaq/ops/ holds the operations' modules"
    for path in modules:
        module = path.name
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                assert "conn" not in names, f"{module}: {node.name} takes a connection"
        assert not _calls_named(tree, "execute"), module


def test_the_sync_driver_takes_a_session_and_a_connection(engine: Engine) -> None:
    with Session(engine) as session:
        assert not sqlaq.enqueue(session, "k").duplicate
        session.rollback()
    with engine.connect() as conn:
        assert isinstance(conn, Connection)
        assert sqlaq.complete(conn, []) == []
