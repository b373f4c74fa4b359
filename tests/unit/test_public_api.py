"""The public surface: sorted, complete, documented."""

from __future__ import annotations

import inspect

import sqlaq
from sqlaq import queries

DESIGN_NAMES = {
    "metadata",
    "jobs",
    "Job",
    "JobStatus",
    "queries",
    "migrations",
    "enqueue",
    "enqueue_many",
    "claim",
    "extend_lease",
    "complete",
    "fail",
    "retry",
    "cancel",
    "prune",
    "PermanentError",
}
DESIGN_BUILDERS = {
    "enqueue_stmt",
    "claim_stmt",
    "extend_lease_stmt",
    "complete_stmt",
    "fail_stmt",
    "retry_stmt",
    "cancel_stmt",
    "prune_stmt",
}


def _isort_key(name: str) -> tuple[int, str]:
    # The order ruff's RUF022 keeps: CONSTANTS, then Classes, then the rest.
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_all_is_sorted_and_names_only_what_exists() -> None:
    assert sqlaq.__all__ == sorted(sqlaq.__all__, key=_isort_key)
    assert len(set(sqlaq.__all__)) == len(sqlaq.__all__)
    for name in sqlaq.__all__:
        assert hasattr(sqlaq, name), name


def test_all_holds_every_name_of_the_design() -> None:
    assert set(sqlaq.__all__) >= DESIGN_NAMES
    assert set(queries.__all__) >= DESIGN_BUILDERS


def test_every_public_callable_and_class_is_documented() -> None:
    for module, names in ((sqlaq, sqlaq.__all__), (queries, queries.__all__)):
        for name in names:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value) or inspect.ismodule(value):
                assert inspect.getdoc(value), f"{module.__name__}.{name} has no docstring"
