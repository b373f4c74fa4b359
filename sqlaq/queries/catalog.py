"""The schema as the database has it (:func:`sqlaq.migrations.check` with
``deep=True``, the revision marker, the role's privileges).

Each reads the catalog for sqlaq's objects found on the search path (``to_regclass``,
``to_regprocedure``), as every statement resolves them, and returns PostgreSQL's own
rendering of each definition with the schema's name (``quote_ident``) beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Select,
    Text,
    bindparam,
    cast,
    column,
    exists,
    func,
    literal_column,
    select,
    table,
)
from sqlalchemy.dialects.postgresql import ARRAY

from sqlaq.schema import (
    REVISION_FUNCTION,
)

_pg_class = table(
    "pg_class",
    column("oid"),
    column("relname"),
    column("relnamespace"),
    column("reloptions", ARRAY(Text)),
    schema="pg_catalog",
)

_pg_namespace = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")

_pg_index = table(
    "pg_index",
    column("indexrelid"),
    column("indrelid"),
    column("indisvalid", Boolean),
    schema="pg_catalog",
)

_pg_constraint = table(
    "pg_constraint",
    column("oid"),
    column("conname"),
    column("conrelid"),
    column("contype"),
    column("conindid"),
    schema="pg_catalog",
)

_pg_trigger = table(
    "pg_trigger",
    column("oid"),
    column("tgname"),
    column("tgrelid"),
    column("tgenabled"),
    column("tgisinternal", Boolean),
    schema="pg_catalog",
)

_pg_proc = table(
    "pg_proc", column("oid"), column("proname"), column("pronamespace"), schema="pg_catalog"
)


def _regclasses(tables: Sequence[str]) -> ColumnElement[Any]:
    """``ANY(ARRAY(SELECT to_regclass(t) FROM unnest(:b_tables) AS t))``: the oids of
    *tables* found on the search path."""
    names = (
        func.unnest(bindparam("b_tables", list(tables), ARRAY(Text)))
        .table_valued("t")
        .render_derived(name="named")
    )
    return func.any(func.array(select(func.to_regclass(names.c.t)).scalar_subquery()))


def _schema_of(relation: Any) -> ColumnElement[str]:
    return (
        select(func.quote_ident(_pg_namespace.c.nspname))
        .where(_pg_namespace.c.oid == relation)
        .scalar_subquery()
    )


def catalog_tables_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select each of *tables*: ``name, schema`` (NULL: not found on the search path)
    and ``reloptions`` (its storage parameters, ``{'k=v', ...}``)."""
    wanted = (
        func.unnest(bindparam("b_tables", list(tables), ARRAY(Text)))
        .table_valued("name")
        .render_derived(name="wanted")
    )
    found = _pg_class.c.oid == func.to_regclass(wanted.c.name)
    return (
        select(wanted.c.name, _schema_of(_pg_class.c.relnamespace).label("schema"))
        .add_columns(_pg_class.c.reloptions)
        .select_from(wanted.outerjoin(_pg_class, found))
        .order_by(wanted.c.name)
    )


def catalog_indexes_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select every index of *tables*: ``table, name, definition``
    (``pg_get_indexdef``), ``valid`` (``indisvalid``: false after a failed ``CREATE
    INDEX CONCURRENTLY``), ``constraint`` (it backs a primary key or unique
    constraint), ``schema``."""
    table_ = _pg_class.alias("tbl")
    index_ = _pg_class.alias("idx")
    backs = exists().where(_pg_constraint.c.conindid == _pg_index.c.indexrelid)
    return (
        select(
            table_.c.relname.label("table"),
            index_.c.relname.label("name"),
            func.pg_get_indexdef(_pg_index.c.indexrelid, type_=Text).label("definition"),
            _pg_index.c.indisvalid.label("valid"),
            backs.label("constraint"),
            _schema_of(table_.c.relnamespace).label("schema"),
        )
        .select_from(_pg_index)
        .join(table_, table_.c.oid == _pg_index.c.indrelid)
        .join(index_, index_.c.oid == _pg_index.c.indexrelid)
        .where(_pg_index.c.indrelid == _regclasses(tables))
        .order_by(table_.c.relname, index_.c.relname)
    )


def catalog_constraints_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select the constraints of *tables* but NOT NULL ones: ``table, name,
    definition`` (``pg_get_constraintdef``), ``schema``."""
    table_ = _pg_class.alias("tbl")
    return (
        select(
            table_.c.relname.label("table"),
            _pg_constraint.c.conname.label("name"),
            func.pg_get_constraintdef(_pg_constraint.c.oid, type_=Text).label("definition"),
            _schema_of(table_.c.relnamespace).label("schema"),
        )
        .select_from(_pg_constraint)
        .join(table_, table_.c.oid == _pg_constraint.c.conrelid)
        .where(
            _pg_constraint.c.conrelid == _regclasses(tables),
            _pg_constraint.c.contype != literal_column("'n'"),
        )
        .order_by(table_.c.relname, _pg_constraint.c.conname)
    )


def catalog_triggers_stmt(*, tables: Sequence[str]) -> Select[Any]:
    """Select the triggers of *tables* (not the internal ones of foreign keys):
    ``table, name, definition`` (``pg_get_triggerdef``), ``enabled`` (``tgenabled``:
    ``'O'`` on, ``'D'`` disabled), ``schema``."""
    table_ = _pg_class.alias("tbl")
    return (
        select(
            table_.c.relname.label("table"),
            _pg_trigger.c.tgname.label("name"),
            func.pg_get_triggerdef(_pg_trigger.c.oid, type_=Text).label("definition"),
            cast(_pg_trigger.c.tgenabled, Text).label("enabled"),
            _schema_of(table_.c.relnamespace).label("schema"),
        )
        .select_from(_pg_trigger)
        .join(table_, table_.c.oid == _pg_trigger.c.tgrelid)
        .where(_pg_trigger.c.tgrelid == _regclasses(tables), ~_pg_trigger.c.tgisinternal)
        .order_by(table_.c.relname, _pg_trigger.c.tgname)
    )


def catalog_functions_stmt(*, functions: Sequence[str]) -> Select[Any]:
    """Select each of *functions* (names of functions without arguments): ``name,
    definition`` (``pg_get_functiondef``; NULL: not found on the search path),
    ``schema``."""
    wanted = (
        func.unnest(bindparam("b_functions", list(functions), ARRAY(Text)))
        .table_valued("name")
        .render_derived(name="wanted")
    )
    found = _pg_proc.c.oid == func.to_regprocedure(func.concat(wanted.c.name, "()"))
    return (
        select(
            wanted.c.name,
            func.pg_get_functiondef(_pg_proc.c.oid, type_=Text).label("definition"),
            _schema_of(_pg_proc.c.pronamespace).label("schema"),
        )
        .select_from(wanted.outerjoin(_pg_proc, found))
        .order_by(wanted.c.name)
    )


def has_schema_revision_stmt() -> Any:
    """Select whether the revision marker function exists (on the search path)."""
    return select(
        func.to_regprocedure(literal_column(f"'{REVISION_FUNCTION}()'", Text)).is_not(None)
    )


def ping_stmt() -> Any:
    """Select 1: a round trip proving a connection is alive (a transactional handler's,
    in its transaction, before the handler runs)."""
    return select(literal_column("1"))


def schema_revision_stmt() -> Any:
    """Select the sqlaq revision the schema records (fails if the marker is missing)."""
    return select(getattr(func, REVISION_FUNCTION)())


def privileges_stmt(*, needed: Mapping[str, Sequence[str]]) -> Select[Any]:
    """Select the privileges of *needed* (table name -> privileges) the role lacks.

    Renders ``SELECT needed.table_name, needed.privilege FROM unnest(:b_tables,
    :b_privileges) AS needed(table_name, privilege) WHERE NOT
    has_table_privilege(needed.table_name, needed.privilege)``: no row, nothing missing.
    Tables are looked up on the search path, like every other statement; each must exist.
    """
    pairs = [(table, privilege) for table, privileges in needed.items() for privilege in privileges]
    rows = (
        func.unnest(
            bindparam("b_tables", [t for t, _ in pairs], ARRAY(Text)),
            bindparam("b_privileges", [p for _, p in pairs], ARRAY(Text)),
        )
        .table_valued("table_name", "privilege")
        .render_derived(name="needed")
    )
    granted = func.has_table_privilege(rows.c.table_name, rows.c.privilege, type_=Boolean)
    return select(rows.c.table_name, rows.c.privilege).select_from(rows).where(~granted)
