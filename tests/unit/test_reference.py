"""The generated reference of the documentation (docs/gen_reference.py): which modules get
a page, and the check that fails the build when a public name is missing from it."""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen() -> Any:
    spec = importlib.util.spec_from_file_location(
        "sqlaq_docs_gen_reference", ROOT / "docs" / "gen_reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_module_gets_a_page_and_no_private_one(gen: Any) -> None:
    modules = gen.public_modules()
    assert modules[0] == "sqlaq"
    for name in (
        "sqlaq.asyncio",
        "sqlaq.ops",
        "sqlaq.queries",
        "sqlaq.testing",
        "sqlaq.testing.pytest_plugin",
        "sqlaq.dashboard",
        "sqlaq.migrations",
        "sqlaq.errors",
        "sqlaq.tracing",
        "sqlaq.metrics",
    ):
        assert name in modules
    assert not [m for m in modules if any(part.startswith("_") for part in m.split("."))]
    assert "sqlaq.migrations.env" not in modules  # Alembic's script, not a module
    assert not [m for m in modules if ".versions" in m]  # revisions: not a package
    pages = [gen.page(module, modules) for module in modules]
    assert len(set(pages)) == len(pages)
    assert gen.page("sqlaq.worker", modules) == "reference/api/sqlaq/worker/index.md"
    assert gen.page("sqlaq.errors", modules) == "reference/api/sqlaq/errors.md"


def _inventory_file(path: Path, names: list[str]) -> Path:
    header = b"# Sphinx inventory version 2\n# Project: x\n# Version: 0\n# zlib\n"
    body = "".join(f"{name} py:function 1 page/#$ -\n" for name in names).encode()
    path.write_bytes(header + zlib.compress(body))
    return path


def test_a_public_name_missing_from_the_inventory_is_reported(gen: Any, tmp_path: Path) -> None:
    expected = ["sqlaq.errors", *(f"sqlaq.errors.{n}" for n in gen.expected_names("sqlaq.errors"))]
    assert "sqlaq.errors.ConfigError" in expected  # no __all__: the classes it defines
    complete = gen.inventory(_inventory_file(tmp_path / "all.inv", expected))
    assert gen.missing_from_inventory(complete, ["sqlaq.errors"]) == []
    lacking = set(complete) - {"sqlaq.errors.ConfigError"}
    assert gen.missing_from_inventory(lacking, ["sqlaq.errors"]) == ["sqlaq.errors.ConfigError"]
    # A module with __all__: every name in it.
    assert "sqlaq.enqueue" in gen.missing_from_inventory(set(), ["sqlaq"])


def test_the_cli_reference_holds_every_subcommand_s_help(gen: Any) -> None:
    from sqlaq import admin

    text = gen.cli_markdown()
    assert "## `sqlaq-worker` { #command-sqlaq-worker }" in text
    assert "usage: sqlaq-worker" in text
    for name in gen._subcommands(admin.build_parser()):
        assert f"### `sqlaq {name}` {{ #command-sqlaq-{name} }}" in text
        assert f"usage: sqlaq {name}" in text
    assert "### `sqlaq dashboard` { #command-sqlaq-dashboard }" in text
