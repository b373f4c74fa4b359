"""MkDocs hooks: the reference, generated at build time from the package itself.

Named in mkdocs.yml (``hooks: [docs/hooks.py]``). The pages come from
``docs/gen_reference.py`` (plain functions, also used by the tests): one page per public
module (a mkdocstrings ``::: module`` block), the commands' ``--help``, and the table of
the worker's options. They are added to the build as generated files (never written to
docs/) and to the nav's "Reference" section. After the build, every public name must be
in the inventory mkdocstrings wrote (``objects.inv``), or the build fails.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files


def _load_generator():  # type: ignore[no-untyped-def]
    path = Path(__file__).with_name("gen_reference.py")
    spec = importlib.util.spec_from_file_location("sqlaq_docs_gen_reference", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
_MODULES: list[str] = []


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    _MODULES[:] = gen.public_modules()
    for item in config.nav or []:
        if isinstance(item, dict) and "Reference" in item:
            item["Reference"] += [
                {"Command line": f"{gen.REFERENCE}/cli.md"},
                {"Configuration": f"{gen.REFERENCE}/configuration.md"},
                {"API": gen.nav_tree(_MODULES)},
            ]
            break
    else:
        raise PluginError("mkdocs.yml's nav has no 'Reference' section for the generated pages")
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    try:
        pages = {
            f"{gen.REFERENCE}/cli.md": gen.cli_markdown(),
            f"{gen.REFERENCE}/configuration.md": gen.configuration_markdown(),
        }
    except gen.GenerationError as exc:
        raise PluginError(str(exc)) from None
    for module in _MODULES:
        pages[gen.page(module, _MODULES)] = gen.module_markdown(module)
    for uri, content in pages.items():
        if files.get_file_from_path(uri) is not None:
            raise PluginError(f"docs/{uri} is generated: remove the file from docs/")
        files.append(File.generated(config, uri, content=content))
    return files


def on_post_build(config: MkDocsConfig) -> None:
    built = Path(config.site_dir) / "objects.inv"
    if not built.is_file():
        raise PluginError(f"{built} was not written: is the mkdocstrings plugin enabled?")
    missing = gen.missing_from_inventory(gen.inventory(built), _MODULES)
    if missing:
        raise PluginError(
            f"{len(missing)} public names are not in the built reference (objects.inv): "
            + ", ".join(missing)
            + ". Each needs a docstring that mkdocstrings renders."
        )
