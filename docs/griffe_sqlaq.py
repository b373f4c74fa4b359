"""A Griffe extension: what mkdocstrings' static reading of sqlaq misses, from the package.

Named in mkdocs.yml (mkdocstrings' ``extensions``). mkdocstrings reads the source without
importing it; three things of sqlaq are only right at run time, and are taken from the
imported package here:

* **Operations** (``@operation`` in :mod:`sqlaq.drive`): the source defines the plan,
  ``enqueue(kind, ...)``; the operation users call takes the caller's connection first,
  ``enqueue(conn, kind, ...)``. The signature shown is the operation's (its
  ``__signature__``).
* **Made functions**: ``enqueue = asynchronous(ops.enqueue)`` in :mod:`sqlaq.asyncio` is
  an assignment to the source, a function with a docstring and a signature at run time:
  documented as that function.
* **``#:`` comments**: a constant documented by ``#:`` lines just above it (Sphinx's
  convention, used throughout sqlaq) gets them as its docstring.

And the docstrings' Sphinx roles (``:func:`~sqlaq.enqueue```, ``:class:`Worker```...)
become links to the reference page of their target (autorefs), found from the scope
of the docstring like Sphinx does; a target outside sqlaq is shown as code.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _annotation(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _parameters(
    signature: inspect.Signature, known: griffe.Parameters | None = None
) -> griffe.Parameters:
    """*signature*'s parameters; those the source declares keep its annotations (which
    mkdocstrings links to their definitions)."""
    made = []
    for parameter in signature.parameters.values():
        if known is not None and parameter.name in known:
            made.append(known[parameter.name])
            continue
        default = None
        if parameter.default is not inspect.Parameter.empty:
            default = repr(parameter.default)
        made.append(
            griffe.Parameter(
                parameter.name,
                annotation=_annotation(parameter.annotation),
                kind=_KINDS[parameter.kind],
                default=default,
            )
        )
    return griffe.Parameters(*made)


def _runtime(obj: griffe.Object) -> Any:
    module = importlib.import_module(obj.module.path)
    value: Any = module
    for name in obj.path[len(obj.module.path) + 1 :].split("."):
        value = getattr(value, name, None)
    return value


def _comment_docstring(attribute: griffe.Attribute) -> str | None:
    """The ``#:`` lines right above *attribute*'s assignment, as text."""
    if attribute.lineno is None:
        return None
    lines = attribute.module.lines
    found: list[str] = []
    number = attribute.lineno - 2  # the line above, 0-based
    while number >= 0 and lines[number].lstrip().startswith("#:"):
        found.insert(0, lines[number].lstrip()[2:].strip())
        number -= 1
    return "\n".join(found) or None


_ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|attr|data|mod|exc|obj|const|type):"
    r"`(?:(?P<title>[^`<]+?)\s*<(?P<linked>~?[\w.]+)>|(?P<target>~?[\w.]+?))(?:\(\))?`"
)


def _exists(pkg: griffe.Module, path: str) -> bool:
    if path == pkg.path:
        return True
    if not path.startswith(pkg.path + "."):
        return False
    try:
        pkg[path[len(pkg.path) + 1 :]]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _identifier(pkg: griffe.Module, obj: griffe.Object, target: str) -> str | None:
    """The full path *target* names, seen from *obj*'s scope; None outside the package."""
    scope: griffe.Object | None = obj
    while scope is not None:
        if _exists(pkg, f"{scope.path}.{target}"):
            return f"{scope.path}.{target}"
        scope = scope.parent
    for candidate in (target, f"{pkg.path}.{target}"):
        if _exists(pkg, candidate):
            return candidate
    return None


def _link_roles(pkg: griffe.Module, obj: griffe.Object, text: str) -> str:
    def link(match: re.Match[str]) -> str:
        target = match["linked"] or match["target"]
        short = target.startswith("~")
        target = target.lstrip("~")
        shown = match["title"] or (target.rsplit(".", 1)[-1] if short else target)
        identifier = _identifier(pkg, obj, target)
        if identifier is None:
            return f"`{shown}`"
        # optional: a target that has no page of its own is shown as text, not an error.
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    return _ROLE.sub(link, text)


class SqlaqRuntime(griffe.Extension):
    """See the module's docstring."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._visit(pkg)
        self._link(pkg, pkg)

    def _link(self, pkg: griffe.Module, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _link_roles(pkg, obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias and member.path != "sqlaq.migrations.env":
                self._link(pkg, member)  # type: ignore[arg-type]

    def _visit(self, obj: griffe.Object) -> None:
        for name, member in list(obj.members.items()):
            if member.is_alias or member.path == "sqlaq.migrations.env":
                continue  # env.py is Alembic's script, run inside Alembic: not imported
            if isinstance(member, griffe.Module | griffe.Class):
                self._visit(member)
            elif isinstance(member, griffe.Function):
                self._function(member)
            elif isinstance(member, griffe.Attribute):
                self._attribute(obj, name, member)

    def _function(self, function: griffe.Function) -> None:
        if not any("operation" in str(d.value) for d in function.decorators):
            return
        value = _runtime(function)
        signature = inspect.signature(value)
        function.parameters = _parameters(signature, function.parameters)
        function.returns = _annotation(signature.return_annotation)

    def _attribute(self, parent: griffe.Object, name: str, attribute: griffe.Attribute) -> None:
        if isinstance(parent, griffe.Module) and not name.startswith("_"):
            value = _runtime(attribute)
            if (
                inspect.isfunction(value)
                and value.__module__ == parent.path
                and value.__name__ == name
                and value.__doc__
            ):
                signature = inspect.signature(value)
                function = griffe.Function(
                    name,
                    lineno=attribute.lineno,
                    endlineno=attribute.endlineno,
                    parameters=_parameters(signature),
                    returns=_annotation(signature.return_annotation),
                )
                function.docstring = griffe.Docstring(
                    inspect.cleandoc(value.__doc__), parent=function
                )
                if inspect.iscoroutinefunction(value):
                    function.labels.add("async")
                parent.set_member(name, function)
                return
        if attribute.docstring is None:
            text = _comment_docstring(attribute)
            if text:
                attribute.docstring = griffe.Docstring(
                    text, lineno=attribute.lineno, parent=attribute
                )
