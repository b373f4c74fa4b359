"""What importing sqlaq costs: a worker process imports neither the ORM nor what only
other commands, the asyncio driver or tracing use; the public names still resolve."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sqlaq

ROOT = Path(__file__).resolve().parents[2]

#: Modules a worker process (``sqlaq-worker``, i.e. ``sqlaq.cli``) must not import: each
#: costs memory and start-up time for code the worker never runs.
NOT_IN_A_WORKER = (
    "sqlalchemy.orm",
    "sqlalchemy.ext.asyncio",
    "sqlaq.models",
    "sqlaq.asyncio",
    "sqlaq.admin",
    "sqlaq.dashboard",
    "sqlaq.control",
    "alembic",
    "opentelemetry.trace",
    "opentelemetry.context",
    # the process executor (and multiprocessing): imported by a worker with a handler
    # that runs in a child process only
    "sqlaq.worker.processes",
    "sqlaq.worker.child",
    "multiprocessing",
    # the did-you-mean of a misspelt option
    "difflib",
    # the deep schema check (sqlaq-admin check --deep): a worker checks the revision
    "sqlaq.migrations.drift",
)


def _modules_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after *statement*."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout
    return set(json.loads(out))


def test_the_worker_command_does_not_import_the_orm_or_other_commands() -> None:
    loaded = _modules_after("import sqlaq.cli, sqlaq.worker")
    assert "sqlaq.worker" in loaded
    assert sorted(set(NOT_IN_A_WORKER) & loaded) == []


def test_importing_the_package_imports_no_orm() -> None:
    loaded = _modules_after("import sqlaq")
    assert sorted(set(NOT_IN_A_WORKER) & loaded) == []


#: What neither ``import sqlaq`` nor ``import sqlaq.asyncio`` may load, with every module
#: under it: the worker, the test helpers, the ORM (and SQLAlchemy's asyncio, which
#: imports the ORM): an application that only enqueues never runs them.
NOT_ON_IMPORT = ("sqlaq.worker", "sqlaq.testing", "sqlalchemy.orm", "sqlalchemy.ext.asyncio")


def _under(loaded: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(f"{p}.") for p in packages))


@pytest.mark.parametrize("statement", ["import sqlaq", "import sqlaq.asyncio"])
def test_importing_sqlaq_or_its_asyncio_loads_no_worker_test_helper_or_orm(
    statement: str,
) -> None:
    loaded = _modules_after(statement)
    assert _under(loaded, NOT_ON_IMPORT) == []
    assert statement.split()[1] in loaded


def test_the_async_test_helpers_import_sqlaq_testing_when_first_used() -> None:
    loaded = _modules_after(
        "import sys, sqlaq.asyncio as aq\n"
        "assert 'sqlaq.testing' not in sys.modules\n"
        "assert 'travel' in dir(aq) and 'travel' in aq.__all__\n"
        "from sqlaq.asyncio import travel\n"
        "assert aq.travel is travel and travel.__name__ == 'travel'\n"
        "assert not hasattr(aq, 'travell')"
    )
    assert "sqlaq.testing" in loaded


def test_lazy_names_resolve_and_stay_resolved() -> None:
    loaded = _modules_after(
        "import sqlaq\n"
        "from sqlaq import Job\n"
        "assert sqlaq.Job is Job and Job.__module__ == 'sqlaq.models'\n"
        "import sqlaq.explain\n"  # the module shares its name with the function
        "assert callable(sqlaq.explain) and sqlaq.explain.__module__ == 'sqlaq.explain'\n"
        "assert sqlaq.queries.__name__ == 'sqlaq.queries'\n"
        "for name in sqlaq.__all__: getattr(sqlaq, name)"
    )
    assert "sqlalchemy.orm" in loaded  # Job is the ORM's: imported when asked for


def test_an_unknown_name_is_an_attribute_error() -> None:
    assert not hasattr(sqlaq, "enqueu")
    assert set(sqlaq.__all__) <= set(dir(sqlaq))


def test_the_lazy_table_and_the_type_checkers_imports_agree() -> None:
    # sqlaq/__init__.py names each lazy name twice: in _LAZY (run time) and in its
    # TYPE_CHECKING block (mypy); both, with the eager imports, are exactly __all__.
    tree = ast.parse((ROOT / "sqlaq" / "__init__.py").read_text())
    typed: set[str] = set()
    eager: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for sub in node.body:
                assert isinstance(sub, ast.ImportFrom)
                typed |= {alias.asname or alias.name for alias in sub.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlaq"):
            eager |= {alias.asname or alias.name for alias in node.names}
    lazy = set(sqlaq._LAZY)
    assert typed == lazy
    assert not eager & lazy
    assert eager | lazy == set(sqlaq.__all__)


def test_a_worker_with_a_process_handler_imports_the_process_executor() -> None:
    # The other side of NOT_IN_A_WORKER's process executor: it is imported when needed.
    loaded = _modules_after(
        "import sqlaq, sqlaq.worker.core as core\n"
        "from sqlaq.config import WorkerConfig\n"
        "registry = sqlaq.Registry()\n"
        "registry.handler('t', executor='process')(print)\n"
        "assert core._process_pool(registry, WorkerConfig(executor='thread')) is not None\n"
    )
    assert {"sqlaq.worker.processes", "sqlaq.worker.child"} <= set(loaded)


def test_a_worker_builds_none_of_the_statements_kept_for_first_use() -> None:
    # The statements of paths a plain worker never takes (sqlaq.ops._common.on_first_use:
    # Citus's, the fair and limited claims, debounce, unique_for) are not built at
    # import; each is built once, at its first use.
    code = (
        "import functools, sys, sqlaq.cli, sqlaq.worker\n"
        "lazy = {f'{m.__name__}.{n}': v for m in list(sys.modules.values())\n"
        "        if m.__name__.startswith('sqlaq.') for n, v in vars(m).items()\n"
        "        if isinstance(v, functools._lru_cache_wrapper)\n"
        "        and isinstance(v.__wrapped__, functools.partial)}\n"
        "built = sorted(n for n, v in lazy.items() if v.cache_info().currsize)\n"
        "assert not built, built\n"
        "assert {f'sqlaq.ops.{n}' for n in ('claiming._claim_fair_stmt',\n"
        "    'claiming._citus_claim_stmt', 'settling._citus_complete_stmt',\n"
        "    'enqueuing._enqueue_debounce_stmt', 'retention._citus_sweep_stmt')} <= set(lazy)\n"
        "for name, accessor in lazy.items():\n"
        "    assert accessor() is accessor(), name\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_deep_checks_names_resolve_on_first_use() -> None:
    loaded = _modules_after(
        "import sys, sqlaq.migrations as m\n"
        "assert 'sqlaq.migrations.drift' not in sys.modules\n"
        "assert {'Difference', 'SchemaDriftError', 'differences'} <= set(dir(m))\n"
        "from sqlaq.migrations import SchemaDriftError\n"
        "from sqlaq.migrations.drift import SchemaDriftError as defined, differences\n"
        "assert SchemaDriftError is defined and m.differences is differences\n"
        "assert not hasattr(m, 'differencse')"
    )
    assert "sqlaq.migrations.drift" in loaded
