"""sqlaq on Citus: converting an installed schema to a job table distributed by queue,
and knowing at run time that it is.

When one PostgreSQL primary is no longer enough, Citus (distributed PostgreSQL) spreads
``sqlaq_jobs`` over worker nodes, **by queue**: every job of a queue lives in one shard,
so each claim, heartbeat and outcome is a *router* statement that one node runs whole.
See docs/how-to/outgrowing-one-primary.md.

* :func:`distribute` (the ``sqlaq citus-distribute`` command) converts a schema that
  ``alembic upgrade heads`` (or ``sqlaq migrate``) installed: it checks the
  preconditions (:func:`problems`), then runs :func:`sqlaq.queries.citus.distribute_ddl`
  in one transaction. Idempotent: a second run says it is already distributed.
* :func:`is_distributed` tells whether the job table is distributed, from Citus's
  catalog, once per engine (cached): the operations ask the same question (a
  :class:`sqlaq.drive.PerEngine` step) and choose their Citus-shaped statements
  (:mod:`sqlaq.queries.citus`) then; on plain PostgreSQL nothing changes.

What changes on Citus: dedupe and debounce keys are unique *per queue*; no foreign key
of another table may reference ``sqlaq_jobs``; no trigger on it (new jobs are announced
by a NOTIFY statement of their own, on the coordinator); a lease names its queue
(:attr:`sqlaq.Lease.queue`). What does not run there yet refuses with a
:class:`~sqlaq.errors.ConfigError` naming why (see the how-to page).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine

from sqlaq import migrations
from sqlaq.drive import Plan, run
from sqlaq.errors import ConfigError, SchemaOutOfDateError
from sqlaq.ops._citus import DISTRIBUTED
from sqlaq.queries import citus as citus_queries
from sqlaq.schema import TABLE_NAME

__all__ = ["Distribution", "distribute", "forget", "is_distributed", "problems"]


def _distributed() -> Plan[bool]:
    return bool((yield DISTRIBUTED))


def is_distributed(conn: Connection) -> bool:
    """Whether ``sqlaq_jobs`` is a distributed table of Citus on *conn*'s database.

    Read from Citus's catalog (``pg_extension``, ``pg_dist_partition``) the first time an
    engine asks, then cached for that engine, as the operations read it: an engine
    created before ``sqlaq citus-distribute`` ran keeps the answer it had (restart the
    workers after converting, or call :func:`forget`).
    """
    return run(conn, _distributed())


def forget(engine: Engine) -> None:
    """Forget what :func:`is_distributed` cached for *engine*: the next operation reads
    Citus's catalog again."""
    DISTRIBUTED.cache.pop(engine, None)


@dataclass(frozen=True)
class Distribution:
    """What :func:`distribute` did (or, with ``dry_run``, would do).

    Attributes:
        already: The job table was distributed by queue before: nothing was done.
        ddl: The statements run (or to run), in order.
    """

    already: bool
    ddl: list[str] = field(default_factory=list)


def problems(conn: Connection) -> list[str]:
    """What stops the conversion of *conn*'s database, one line each (empty: none).

    Checked: the Citus extension is installed; sqlaq's schema is at its head revision;
    the job table is not distributed by another column; no foreign key of another table
    references ``sqlaq_jobs``; it has no trigger but sqlaq's own (Citus refuses a
    distributed table with triggers).
    """
    if conn.execute(citus_queries.citus_version_stmt()).first() is None:
        return [
            "this server has no Citus extension in this database (CREATE EXTENSION citus, "
            "on a Citus coordinator): sqlaq_jobs can only be distributed on Citus"
        ]
    found: list[str] = []
    try:
        migrations.check(conn)
    except SchemaOutOfDateError as exc:
        found.append(f"{exc} (then run sqlaq citus-distribute again)")
        return found
    row = conn.execute(citus_queries.citus_distribution_stmt()).first()
    if row is not None and row.column != citus_queries.DISTRIBUTION_COLUMN:
        how = f"by {row.column}" if row.column else f"as a Citus table of kind {row.method!r}"
        found.append(
            f"{TABLE_NAME} is already distributed {how}, not by queue: undistribute it first "
            f"(SELECT undistribute_table('{TABLE_NAME}'))"
        )
    for name, table in conn.execute(citus_queries.foreign_keys_to_jobs_stmt()).all():
        found.append(
            f"foreign key {name} of table {table} references {TABLE_NAME}: Citus cannot keep "
            "it once the jobs are distributed; drop it (keep the job id as a plain column)"
        )
    own = set(citus_queries.JOB_TRIGGERS)
    for (name,) in conn.execute(citus_queries.jobs_triggers_stmt()).all():
        if name not in own:
            found.append(
                f"trigger {name} on {TABLE_NAME} is not sqlaq's: Citus refuses triggers on a "
                "distributed table; drop it first"
            )
    return found


def distribute(conn: Connection, *, dry_run: bool = False) -> Distribution:
    """Distribute ``sqlaq_jobs`` by queue on Citus, in *conn*'s transaction (the caller
    commits); with *dry_run*, only say which DDL it would run.

    Run it after ``alembic upgrade heads`` (or ``sqlaq migrate``), with the workers
    stopped: the conversion drops the job table's triggers, rebuilds its primary key
    ``(id, queue)`` and its dedupe/debounce indexes (leading with ``queue``), makes
    ``sqlaq_paused_queues`` a reference table, and moves the rows to the shards
    (``create_distributed_table``). See :func:`sqlaq.queries.citus.distribute_ddl`.

    Returns:
        What was (or would be) done; ``already`` when the table was distributed by queue
        before (nothing to do).

    Raises:
        ConfigError: a precondition fails (:func:`problems`), one line per problem.
    """
    found = problems(conn)
    if found:
        raise ConfigError("; ".join(found))
    row = conn.execute(citus_queries.citus_distribution_stmt()).first()
    if row is not None:
        return Distribution(already=True)
    triggers = {name for (name,) in conn.execute(citus_queries.jobs_triggers_stmt()).all()}
    ddl = citus_queries.distribute_ddl(triggers=triggers)
    if not dry_run:
        for statement in ddl:
            conn.execute(citus_queries.ddl_stmt(statement))
        forget(conn.engine)
    return Distribution(already=False, ddl=ddl)
