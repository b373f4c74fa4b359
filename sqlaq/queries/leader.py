"""The leader's statements: its advisory lock, periodic schedules, the database clock,
and the vacuum a worker runs during deep drains (:mod:`sqlaq.worker.vacuum`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    Insert,
    Integer,
    Select,
    Text,
    Update,
    bindparam,
    case,
    cast,
    column,
    false,
    func,
    literal_column,
    or_,
    select,
    table,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import REGCLASS, TIMESTAMP, insert
from sqlalchemy.sql.elements import TextClause

from sqlaq.queries._common import _NOW
from sqlaq.schema import (
    LEADER_LOCK,
    jobs,
    periodic,
)


def clock_stmt() -> Select[Any]:
    """``SELECT now()``: the database's clock, the only one sqlaq reads."""
    return select(_NOW)


def periodic_insert_stmt(*, name: str, slot: datetime) -> Insert:
    """Record periodic job *name* at *slot* if it has no row yet; ``RETURNING name``
    (no row: it had one). Waits for a concurrent first insert of the same name."""
    stmt = insert(periodic).values(
        name=bindparam("b_name", name, Text),
        last_slot=bindparam("b_slot", slot, TIMESTAMP(timezone=True)),
    )
    return stmt.on_conflict_do_nothing(index_elements=[periodic.c.name]).returning(periodic.c.name)


def periodic_lock_stmt(*, name: str) -> Select[Any]:
    """``SELECT last_slot FROM sqlaq_periodic WHERE name = :b_name FOR UPDATE``: waits
    for any other transaction holding the row, then reads what it committed."""
    return (
        select(periodic.c.last_slot)
        .where(periodic.c.name == bindparam("b_name", name, Text))
        .with_for_update()
    )


def periodic_advance_stmt(*, name: str, slot: datetime) -> Update:
    """Move periodic job *name* to *slot* (the caller holds its row lock)."""
    return (
        update(periodic)
        .where(periodic.c.name == bindparam("b_name", name, Text))
        .values(last_slot=bindparam("b_slot", slot, TIMESTAMP(timezone=True)), updated_at=_NOW)
    )


# The leader lock's two keys, inlined like the other constants of schema.py.
_LEADER_KEY = tuple(literal_column(str(k), Integer) for k in LEADER_LOCK)


def try_lead_stmt() -> Select[Any]:
    """``SELECT pg_try_advisory_lock(<LEADER_LOCK>)``: true for the one session that
    holds the maintenance leader's lock (until it unlocks or its connection ends)."""
    return select(func.pg_try_advisory_lock(*_LEADER_KEY))


def resign_stmt() -> Select[Any]:
    """``SELECT pg_advisory_unlock(<LEADER_LOCK>)``: give leadership up."""
    return select(func.pg_advisory_unlock(*_LEADER_KEY))


def vacuum_need_stmt() -> Any:
    """One row: the jobs table's dead and live row versions by the statistics
    (``pg_stat_user_tables.n_dead_tup``, ``n_live_tup``; 0 before any report),
    whether this role may ``VACUUM`` it (a member of its owner's role, a superuser, or,
    on PostgreSQL 17 and later, a role granted ``MAINTAIN`` on it: asked only there,
    older servers do not know the privilege's name), and how many vacuums of it have
    ended (``vacuum_count + autovacuum_count``). A vacuum sets the dead count to the
    versions it found dead but could not remove.
    """
    rel = table("pg_class", column("oid"), column("relowner"), schema="pg_catalog")
    stats = table(
        "pg_stat_user_tables",
        column("relid"),
        column("n_dead_tup"),
        column("n_live_tup"),
        column("vacuum_count"),
        column("autovacuum_count"),
        schema="pg_catalog",
    )
    roles = table("pg_roles", column("rolname"), column("rolsuper"), schema="pg_catalog")
    superuser = (
        select(roles.c.rolsuper).where(roles.c.rolname == func.current_user()).scalar_subquery()
    )
    maintain = case(
        (
            cast(func.current_setting(literal_column("'server_version_num'")), Integer) >= 170000,
            func.has_table_privilege(rel.c.oid, literal_column("'MAINTAIN'")),
        ),
        else_=false(),
    )
    return (
        select(
            func.coalesce(stats.c.n_dead_tup, 0),
            func.coalesce(stats.c.n_live_tup, 0),
            or_(func.pg_has_role(rel.c.relowner, literal_column("'USAGE'")), superuser, maintain),
            func.coalesce(stats.c.vacuum_count + stats.c.autovacuum_count, 0),
        )
        .select_from(rel.outerjoin(stats, stats.c.relid == rel.c.oid))
        .where(rel.c.oid == cast(literal_column(f"'{jobs.fullname}'", Text), REGCLASS))
    )


def vacuum_stmt() -> TextClause:
    """``VACUUM (SKIP_LOCKED) sqlaq_jobs``: skipped at once, not waited for, while
    another vacuum (autovacuum's, another worker's) holds the table. Runs outside a
    transaction: execute it on a connection in autocommit."""
    return text(f"VACUUM (SKIP_LOCKED) {jobs.fullname}")
