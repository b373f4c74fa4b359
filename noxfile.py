"""nox is the source of truth for checks: `nox -s tests lint types`; `nox -s bench` benchmarks."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "types"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = None  # the interpreter nox runs on (>= 3.11)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite against a real PostgreSQL (see tests/conftest.py)."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and the layering contract (import-linter)."""
    session.install("ruff", "import-linter>=2.1", "-e", ".")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark (bench/run.py) on the local PostgreSQL; writes bench/results.json.

    Needs only the package itself; pass options after --, e.g. ``nox -s bench --
    --rounds 1 --only drain``. Not in the default sessions: it takes a few minutes.
    """
    session.install(".")
    session.run("python", "bench/run.py", *session.posargs)


@nox.session(python=PYTHON)
def types(session: nox.Session) -> None:
    """mypy --strict over the package."""
    session.install("-e", ".[prometheus,embedded]", "mypy")
    session.run("mypy")
