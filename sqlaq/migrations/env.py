"""Alembic environment of sqlaq's standalone path (``sqlaq migrate``).

Used only when sqlaq's revisions run on their own, for a database with no Alembic of
its own; a host project runs them through its own env.py instead. The revisions are
recorded in their own version table (``sqlaq_alembic_version``), so they never collide
with a host's ``alembic_version``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from sqlaq.schema import VERSION_TABLE, metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or "postgresql://",
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    given = config.attributes.get("connection")
    if given is not None:
        _run(given)
    else:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        try:
            with engine.connect() as connection:
                _run(connection)
                connection.commit()
        finally:
            engine.dispose()
