"""One implementation for sync and async: every operation is a plan, run by two drivers.

These tests fail when a sync operation has no async twin (or the reverse), when a twin's
signature drifts from its original, or when logic is written in sqlaq/asyncio.py (or a
connection is used directly in sqlaq/ops/) instead of in the one plan both share.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

import sqlaq
import sqlaq.asyncio as aq
from sqlaq import drive, ops, periodic

PACKAGE = Path(sqlaq.__file__).parent
#: The sync operations, by name: every plan-made function of the operation modules.
SYNC = {
    name: getattr(module, name)
    for module in (ops, periodic)
    for name in module.__all__
    if callable(getattr(module, name)) and getattr(module, name) in drive._PLANS
}
#: The read-only test helpers, which sqlaq.asyncio runs through run_sync.
HELPERS = {"enqueued_jobs", "assert_enqueued"}
#: What sqlaq/asyncio.py exports that is not an operation.
NOT_OPERATIONS = {"AsyncExecutor", "asynchronous"}
#: sqlaq.wait's twin: the steps of sqlaq.results.waiting, with async I/O.
WAITERS = {"wait"}


def test_every_operation_has_its_async_twin_and_nothing_else_is_there() -> None:
    assert set(SYNC) >= {
        "enqueue",
        "enqueue_many",
        "enqueue_copy",
        "claim",
        "claim_limited",
        "extend_lease",
        "complete",
        "fail",
        "retry",
        "cancel",
        "cancelled_among",
        "notify_queues",
        "prune",
        "handback",
        "snooze",
        "sweep",
        "enqueue_periodic",
    }
    assert set(aq.__all__) - NOT_OPERATIONS - HELPERS - WAITERS == set(SYNC)
    assert aq.__all__ == sorted(aq.__all__, key=lambda n: (not n[0].isupper(), n))


def test_every_public_function_of_ops_is_an_operation_made_from_a_plan() -> None:
    for name in ops.__all__:
        value = getattr(ops, name)
        if inspect.isfunction(value):
            assert value in drive._PLANS, f"ops.{name} is not made by @operation"


def test_each_twin_runs_the_same_plan_with_the_same_signature() -> None:
    for name, sync in SYNC.items():
        twin = getattr(aq, name)
        assert inspect.iscoroutinefunction(twin), name
        sync_params = list(inspect.signature(sync).parameters.values())
        twin_params = list(inspect.signature(twin).parameters.values())
        assert next(p.name for p in sync_params) == "conn" == next(p.name for p in twin_params)
        assert sync_params[1:] == twin_params[1:], name
        assert (
            inspect.signature(sync).return_annotation == inspect.signature(twin).return_annotation
        )
        assert drive.plan_of(sync).__name__ == name
        assert twin.__doc__
        assert sync.__doc__
        assert sync.__doc__ in twin.__doc__


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
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in driver:
            assert not _calls_named(node, "execute"), f"{node.name} executes SQL itself"
    for node in tree.body:  # module level: every operation is asynchronous(<the original>)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in SYNC:
                value = node.value
                assert isinstance(value, ast.Call), name
                assert isinstance(value.func, ast.Name)
                assert value.func.id == "asynchronous"
                (arg,) = value.args
                assert isinstance(arg, ast.Attribute)
                assert arg.attr == name
    helpers = [n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name in HELPERS]
    for helper in helpers:  # the sync helper, through run_sync, and nothing more
        assert len(_calls_named(helper, "run_sync")) == 1
        assert not _calls_named(helper, "execute")
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
    modules = [*sorted((PACKAGE / "ops").glob("*.py")), PACKAGE / "periodic.py"]
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
