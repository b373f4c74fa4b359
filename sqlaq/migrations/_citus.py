"""What sqlaq's revisions do on a job table distributed by Citus (private to the
revisions: each calls :func:`prepare` first, in its upgrade and its downgrade).

``sqlaq citus-distribute`` converts a schema at sqlaq's head; later revisions, and
downgrades, then run on the distributed table, through ``sqlaq migrate`` or a host's
``alembic upgrade heads`` alike, so the revisions themselves adapt (the host's env.py
is not sqlaq's to change):

* a revision's DDL runs its multi-shard commands one connection per node (Citus runs
  DDL on the shards in parallel, then refuses a function command in the same
  transaction);
* sqlaq keeps no trigger on a distributed ``sqlaq_jobs`` (Citus refuses them; the
  operations notify by statements of their own): a revision's trigger DDL on it is
  skipped there (:func:`jobs_trigger`);
* what Citus cannot take refuses in one line naming why (:func:`refuse`).

On plain PostgreSQL, and in offline mode (``--sql``), nothing here changes a statement.
"""

from __future__ import annotations

from alembic import context, op
from sqlalchemy import Connection

from sqlaq.errors import SchemaOutOfDateError
from sqlaq.queries import citus as citus_queries
from sqlaq.schema import TABLE_NAME


def _distributed(connection: Connection) -> bool:
    if connection.execute(citus_queries.citus_version_stmt()).first() is None:
        return False
    return connection.execute(citus_queries.citus_distribution_stmt()).first() is not None


def distributed() -> bool:
    """Whether this revision runs on a ``sqlaq_jobs`` distributed by Citus (read from
    Citus's catalog each time: a revision may run before or after the conversion).
    Always False in offline mode."""
    if context.is_offline_mode():
        return False
    return _distributed(op.get_bind())


def prepare() -> bool:
    """First call of every revision's upgrade and downgrade: on a distributed job table,
    make the rest of the migration's transaction run its multi-shard commands one
    connection per node (:func:`sqlaq.queries.citus.sequential_mode_stmt`). Returns
    whether the table is distributed."""
    if not distributed():
        return False
    op.get_bind().execute(citus_queries.sequential_mode_stmt())
    return True


def jobs_trigger(statement: str) -> None:
    """Run *statement* (a CREATE or DROP of a trigger on ``sqlaq_jobs``) unless the table
    is distributed: there sqlaq keeps no trigger (``sqlaq citus-distribute`` dropped them,
    and Citus refuses even ``DROP TRIGGER IF EXISTS`` on a distributed table)."""
    if not distributed():
        op.execute(statement)


def refuse(revision: str, step: str, why: str) -> None:
    """Raise :class:`~sqlaq.errors.SchemaOutOfDateError` if the job table is distributed:
    *step* of *revision* does not run on Citus, for the reason *why* (one line)."""
    if distributed():
        raise SchemaOutOfDateError(
            f"{revision} {step} is refused on Citus ({TABLE_NAME} is distributed): {why}; "
            f"run SELECT undistribute_table('{TABLE_NAME}') first, then 'sqlaq "
            "citus-distribute' again once at sqlaq's head"
        )
