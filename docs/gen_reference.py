"""The reference, generated from the package itself: what docs/hooks.py writes.

Plain functions, no MkDocs (``tests/process/test_cli.py`` uses them
too). Nothing here is kept by hand:

* **One page per public module** (``reference/api/...``): every module of the package
  whose dotted name has no ``_``-prefixed part, found by walking the source tree, each
  page a mkdocstrings ``::: module`` block. A new module gets its page.
* **The command line** (``reference/cli.md``): the ``--help`` of ``sqlaq-worker``, of
  ``sqlaq`` and of each of its subcommands, printed by their own argument parsers.
* **The configuration** (``reference/configuration.md``): one row per option the
  worker declares (:data:`sqlaq.cli.COMMAND_OPTIONS` and
  :data:`sqlaq.config.WORKER_OPTIONS`): flag, environment variable, default, the
  :class:`~sqlaq.WorkerConfig` field, meaning. A new option gets its row.
* **A check after the build**: every name of each documented module's ``__all__`` (or,
  for a module without one, every public name it defines) must be in the built
  ``objects.inv``, mkdocstrings' inventory of what it rendered. A public name that the
  reference lost fails the build.

A problem is a :class:`GenerationError`, which the hook turns into a failed build.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "sqlaq"
#: Where the generated pages go, under docs/ (never written to disk there).
REFERENCE = "reference"
#: Width of the ``--help`` text, as a terminal of this many columns prints it.
HELP_COLUMNS = 88


class GenerationError(Exception):
    """The reference cannot be generated, or the built one lacks public names."""


# -- the public modules -----------------------------------------------------------------


def public_modules() -> list[str]:
    """Every module of the package whose dotted name has no ``_``-prefixed part, the
    package first, then in name order.

    Walks the source tree: a folder is a package when it holds ``__init__.py`` (so the
    Alembic revisions under ``migrations/versions`` are not modules). Alembic's
    ``env.py`` is a script Alembic runs inside its own context, never imported: left out.
    """
    base = ROOT / PACKAGE
    found = []
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if not all((folder / "__init__.py").is_file() for folder in path.parents[: len(parts) - 1]):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts):
            continue
        if parts[-2:] == ("migrations", "env"):
            continue
        found.append(".".join(parts))
    return sorted(found, key=lambda name: (name != PACKAGE, name.split(".")))


def _defined_names(module: str) -> list[str]:
    """The public functions and classes a module without ``__all__`` defines at its top
    level (its constants are shown when documented, not required)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise GenerationError(f"{module}: no source found")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    return [n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")]


def expected_names(module: str) -> list[str]:
    """The names *module* makes public: its ``__all__``, else what it defines."""
    exported = getattr(importlib.import_module(module), "__all__", None)
    return list(exported) if exported is not None else _defined_names(module)


def page(module: str, modules: list[str]) -> str:
    """The page of *module*, relative to docs/: a package is the index of its folder."""
    parts = module.split(".")
    has_children = any(other.startswith(module + ".") for other in modules)
    name = "/".join(parts) + ("/index.md" if has_children else ".md")
    return f"{REFERENCE}/api/{name}"


def module_markdown(module: str) -> str:
    return f"::: {module}\n    options:\n      heading_level: 1\n"


# -- the command line -------------------------------------------------------------------


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help to ``$COLUMNS``: the same width wherever the site is built."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse has no public way to reach the subcommands' parsers; _actions and
    # _SubParsersAction have been stable since Python 3.2.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_block(parser: argparse.ArgumentParser) -> str:
    return "```text\n" + parser.format_help().rstrip() + "\n```\n"


def cli_markdown() -> str:
    """The command-line reference: each command's own ``--help``."""
    from sqlaq import admin, cli

    with _columns(HELP_COLUMNS):
        worker = cli.build_parser()
        operator = admin.build_parser()
        out = [
            "# Command line\n",
            "Generated at build time from the commands' own `--help`: what you read here "
            "is what they print. The worker's options are also listed, with their "
            "environment variables, in [Configuration](configuration.md).\n",
            # Anchors of their own: "#sqlaq" is the package's reference.
            "## `sqlaq-worker` { #command-sqlaq-worker }\n",
            _help_block(worker),
            "## `sqlaq` { #command-sqlaq }\n",
            _help_block(operator),
        ]
        for name, parser in _subcommands(operator).items():
            out += [f"### `sqlaq {name}` {{ #command-sqlaq-{name} }}\n", _help_block(parser)]
    return "\n".join(out)


# -- the configuration ------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configuration_markdown() -> str:
    """The table of the worker's options, in ``sqlaq-worker --help``'s order."""
    from sqlaq import cli, config
    from sqlaq.option import Boolean

    declared = {option.name: option for option in (*cli.COMMAND_OPTIONS, *config.WORKER_OPTIONS)}
    fields = {option.name for option in config.WORKER_OPTIONS}
    order = [a.dest for a in cli.build_parser()._actions if a.dest in declared]
    missing = set(declared) - set(order)
    if missing:
        raise GenerationError(f"options declared but not in sqlaq-worker's parser: {missing}")
    rows = [
        "| Flag | Environment variable | Default | `WorkerConfig` field | Meaning |",
        "|---|---|---|---|---|",
    ]
    for name in order:
        option = declared[name]
        if option.positional:
            flag = f"`{option.metavar or option.name.upper()}` (argument)"
        elif isinstance(option.domain, Boolean):
            flag = f"`{option.flag_name}` / `--no-{option.flag_name[2:]}`"
        else:
            metavar = option.metavar or option.domain.metavar
            flag = f"`{option.flag_name}` *{metavar}*"
            if option.repeatable:
                flag += " (repeatable)"
        shown = option.domain.show(option.default) if option.shown is None else option.shown
        field = f"`{name}`" if name in fields else "(command only)"
        cells = [_cell(flag), f"`{option.env}`", f"`{_cell(shown)}`", field, _cell(option.help)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(
        [
            "# Configuration\n",
            "Every option of `sqlaq-worker`, generated at build time from the options the "
            "worker declares: a flag beats its environment variable, which beats the "
            "default. The options with a `WorkerConfig` field are also the keyword "
            "arguments of [`WorkerConfig`][sqlaq.WorkerConfig] (and of "
            "[`Worker`][sqlaq.Worker]) in Python, with the same bounds.\n",
            *rows,
            "",
            "Durations are seconds (`30`, `2.5`) or a number with a unit (`500ms`, `30s`, "
            "`5m`, `1h`, `7d`), at most 100 years. The operator command `sqlaq` takes "
            "`--database-url` too, falling back on `SQLAQ_DATABASE_URL`, then "
            "`DATABASE_URL`; see [Command line](cli.md).\n",
        ]
    )


# -- the built site ----------------------------------------------------------------------


def nav_tree(modules: list[str]) -> list[object]:
    """The API section: the package first, then each subpackage a section of its own."""
    nav: list[object] = []
    sections: dict[str, list[object]] = {}
    for module in modules:
        entry = {module: page(module, modules)}
        parent = module.rpartition(".")[0]
        if page(module, modules).endswith("/index.md") and module != PACKAGE:
            sections[module] = [page(module, modules)]
            target = sections.get(parent, nav) if parent != PACKAGE else nav
            target.append({module: sections[module]})
        else:
            (sections.get(parent, nav) if parent != PACKAGE else nav).append(entry)
    return nav


def inventory(path: Path) -> set[str]:
    """The object names of a Sphinx inventory (``objects.inv``, version 2)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):  # four header lines, then zlib-compressed entries
        header_end = data.index(b"\n", header_end) + 1
    lines = zlib.decompress(data[header_end:]).decode("utf-8").splitlines()
    return {re.split(r"\s+", line, maxsplit=1)[0] for line in lines if line.strip()}


def missing_from_inventory(names: set[str], modules: list[str]) -> list[str]:
    """The public names (``module.name``) of *modules* that *names* lacks."""
    missing = []
    for module in modules:
        if module not in names:
            missing.append(module)
        missing += [
            f"{module}.{name}" for name in expected_names(module) if f"{module}.{name}" not in names
        ]
    return missing
