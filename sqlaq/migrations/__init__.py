"""sqlaq's shipped Alembic revisions, and the glue to run or include them.

Two ways to install the schema:

* **Inside a host's Alembic** (the usual way). In the host's ``alembic.ini``::

      path_separator = space
      version_locations = %(here)s/alembic/versions sqlaq:migrations/versions

  and in its env.py ``context.configure(..., include_name=sqlaq.migrations.include_name)``
  so autogenerate never proposes dropping sqlaq's objects. Then ``alembic upgrade
  heads`` (plural: sqlaq is a branch of its own). The host's first own revision needs
  ``alembic revision --head=base ...``. ``path_separator`` must not be ``os`` (":" on
  POSIX): it would split ``sqlaq:migrations/versions`` in two and the sqlaq branch would
  vanish without an error.
* **Standalone** (:func:`upgrade`, ``sqlaq migrate``): the same revisions applied
  programmatically, recorded in their own ``sqlaq_alembic_version`` table.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from sqlaq.errors import SchemaOutOfDateError
from sqlaq.queries import has_schema_revision_stmt, schema_revision_stmt
from sqlaq.schema import (
    CLAIM_INDEX,
    DEBOUNCE_INDEX,
    DEDUPE_INDEX,
    DEPS_TABLE,
    FAIR_INDEX,
    FINISHED_INDEX,
    KEY_INDEX,
    PARENTS_INDEX,
    PAUSED_TABLE,
    PERIODIC_TABLE,
    RATES_TABLE,
    RUNNING_INDEX,
    TABLE_NAME,
    UNIQUE_HOLDS_TABLE,
    VERSION_TABLE,
    WAITING_INDEX,
    WORKERS_TABLE,
)

if TYPE_CHECKING:
    # Alembic is imported only where revisions are applied: `import sqlaq` (and a
    # worker's start-up, which only reads the schema's revision) does without it.
    from alembic.config import Config

    from sqlaq.migrations.drift import Difference, SchemaDriftError, differences

__all__ = [
    "BRANCH",
    "HEAD",
    "SCRIPT_LOCATION",
    "VERSION_LOCATION",
    "Difference",
    "SchemaDriftError",
    "check",
    "current_revision",
    "differences",
    "downgrade",
    "head_revision",
    "include_name",
    "standalone_config",
    "standalone_revision",
    "upgrade",
    "upgrade_sql",
]

#: The deep check's names, from :mod:`sqlaq.migrations.drift`: imported on first use (a
#: worker's start-up check reads the revision only).
_DRIFT = ("Difference", "SchemaDriftError", "differences")


def __getattr__(name: str) -> Any:
    if name in _DRIFT:
        from sqlaq.migrations import drift

        value = getattr(drift, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_DRIFT})


#: The newest shipped revision: what this sqlaq needs. A test pins it to the head of the
#: revision files, so it cannot drift from them.
HEAD = "sqlaq_0010"
#: The branch label of sqlaq's revisions: ``alembic downgrade sqlaq@base``.
BRANCH = "sqlaq"
#: For a host's ``version_locations`` (needs ``path_separator = space`` or similar).
VERSION_LOCATION = "sqlaq:migrations/versions"
#: The standalone environment (this package, with its own env.py).
SCRIPT_LOCATION = "sqlaq:migrations"

_OWN_TABLES = frozenset(
    {
        TABLE_NAME,
        RATES_TABLE,
        PERIODIC_TABLE,
        PAUSED_TABLE,
        WORKERS_TABLE,
        UNIQUE_HOLDS_TABLE,
        DEPS_TABLE,
        VERSION_TABLE,
    }
)
_OWN_INDEXES = frozenset(
    {
        CLAIM_INDEX,
        DEDUPE_INDEX,
        FINISHED_INDEX,
        RUNNING_INDEX,
        DEBOUNCE_INDEX,
        WAITING_INDEX,
        KEY_INDEX,
        FAIR_INDEX,
        PARENTS_INDEX,
    }
)


def include_name(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
    """Alembic ``include_name`` hook that hides sqlaq's objects from a host's autogenerate.

    Pass it as ``context.configure(include_name=sqlaq.migrations.include_name)``. If the
    host already has a hook, call both: ``lambda *a: mine(*a) and include_name(*a)``.
    """
    if type_ == "table":
        return name not in _OWN_TABLES
    if parent_names.get("table_name") in _OWN_TABLES:
        return False
    return not (type_ == "index" and name in _OWN_INDEXES)


def standalone_config(url: str | None = None, *, connection: Connection | None = None) -> Config:
    """An Alembic Config for the standalone path, on *connection* or *url*."""
    from alembic.config import Config

    cfg = Config(stdout=io.StringIO())
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.set_main_option("path_separator", "space")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision of sqlaq's branch, e.g. ``"sqlaq_0010"`` (:data:`HEAD`)."""
    return HEAD


def upgrade(connection: Connection, revision: str = "heads") -> None:
    """Apply sqlaq's revisions on *connection* (standalone path).

    On a connection with no transaction open, each revision is committed as it is
    applied. On a connection already in a transaction (any earlier statement autobegins
    one), the DDL runs inside it and nothing is committed: the caller decides.
    """
    from alembic import command

    command.upgrade(standalone_config(connection=connection), revision)


def downgrade(connection: Connection, revision: str = "base") -> None:
    """Revert sqlaq's revisions on *connection* (standalone path)."""
    from alembic import command

    command.downgrade(standalone_config(connection=connection), revision)


def upgrade_sql(revision: str = "heads") -> str:
    """The DDL of the standalone upgrade, as SQL text, without touching a database."""
    buffer = io.StringIO()
    cfg = standalone_config("postgresql://")
    cfg.output_buffer = buffer  # offline DDL goes here (sys.stdout when unset)
    from alembic import command

    command.upgrade(cfg, revision, sql=True)
    return buffer.getvalue()


def current_revision(connection: Connection) -> str | None:
    """The sqlaq revision the schema records, or None when sqlaq is not installed.

    Read from the schema itself (the ``sqlaq_jobs_schema_revision()`` function every
    revision replaces), not from a version table: a host revision that depends on
    ``sqlaq_0001`` makes Alembic record only the host's revision, and a host may name
    its version table as it likes.
    """
    if not connection.execute(has_schema_revision_stmt()).scalar_one():
        return None
    return str(connection.execute(schema_revision_stmt()).scalar_one())


def standalone_revision(connection: Connection) -> str | None:
    """The revision the standalone path recorded (``sqlaq_alembic_version``), or None.

    None with a :func:`current_revision` means the schema came through a host's Alembic.
    """
    from alembic.migration import MigrationContext

    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def check(connection: Connection, *, deep: bool = False) -> str:
    """Return the current sqlaq revision if it is this sqlaq's head, else raise.

    The revision marker alone says which revision ran, not that its objects are still
    as it made them: with *deep*, every table, index, constraint, trigger, trigger
    function and storage setting the head creates is compared with the live catalog
    too (:func:`differences`; reads only, a few milliseconds).

    Raises:
        SchemaOutOfDateError: no sqlaq revision, or another one than the head; the
            message names the command to run.
        SchemaDriftError: with *deep*, the schema is at the head but some object
            differs from what it creates; ``differences`` names each, with its fix.
    """
    head = head_revision()
    current = current_revision(connection)
    if current == head:
        if deep:
            from sqlaq.migrations.drift import SchemaDriftError, differences

            if found := differences(connection):
                raise SchemaDriftError(current, found)
        return current
    if current is None:
        raise SchemaOutOfDateError(
            f"sqlaq's schema is not installed (this sqlaq needs {head}): run "
            "'alembic upgrade heads' in your project, or 'sqlaq migrate' without Alembic"
        )
    if current > head:
        raise SchemaOutOfDateError(
            f"database is at {current}, newer than this sqlaq ({head}): upgrade sqlaq"
        )
    raise SchemaOutOfDateError(
        f"database is at {current}, this sqlaq needs {head}: run 'alembic upgrade heads' "
        "(or 'sqlaq migrate' without Alembic)"
    )
