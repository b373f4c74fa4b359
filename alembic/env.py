"""The repository's Alembic environment, written the way a host project's would be.

What a host copies from here: ``target_metadata`` is the host's own MetaData (here an
empty one, standing in for it), and ``include_name=sqlaq.migrations.include_name`` keeps
autogenerate from proposing to drop sqlaq's table. sqlaq's revisions come in through
``version_locations`` in alembic.ini.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import MetaData, create_engine

import sqlaq.migrations

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

# A host puts its own models' MetaData here.
target_metadata = config.attributes.get("target_metadata", MetaData())


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("SQLAQ_DATABASE_URL")
    if not url:
        raise SystemExit("set sqlalchemy.url in alembic.ini or SQLAQ_DATABASE_URL")
    return url


def run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        include_name=sqlaq.migrations.include_name,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(_url())
        with engine.connect() as connection:
            _configure_and_run(connection)
            connection.commit()
        engine.dispose()
    else:
        _configure_and_run(connection)


def _configure_and_run(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_name=sqlaq.migrations.include_name,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
