"""The deep check: the live schema against what the head revision creates.

``sqlaq.migrations.check(conn)`` reads the revision marker; ``check(conn, deep=True)``
also compares, object by object, what the database holds with what the head revision
creates: the tables, their indexes (definitions and validity), constraints, the
triggers (definitions and whether they are enabled), the trigger functions, and the
tables' storage settings (autovacuum). Each difference comes back as a
:class:`Difference` naming the object, what is wrong, and the statement that fixes it.

The expected definitions below are PostgreSQL's own renderings (``pg_get_indexdef``,
``pg_get_constraintdef``, ``pg_get_triggerdef``, ``pg_get_functiondef``, with the
schema's name and runs of whitespace taken out), written down here rather than read
from a scratch database at each check: ``tests/db/test_check_deep.py`` compares them with
a freshly migrated head, so they cannot drift from the revisions. A revision that
changes one of these objects changes this table in the same commit.

On a Citus coordinator where ``sqlaq_jobs`` is distributed (``sqlaq citus-distribute``),
the expected shape is the converted one (:data:`CITUS_INDEXES`, :data:`CITUS_CONSTRAINTS`,
no trigger on the job table), and the distribution itself is checked: the job table
distributed by ``queue``, the paused queues a reference table.

It reads the catalog only (statements from :mod:`sqlaq.queries`) and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from sqlaq import queries
from sqlaq.errors import SchemaOutOfDateError
from sqlaq.queries import citus as citus_queries
from sqlaq.schema import (
    DEPS_FUNCTION,
    DEPS_TABLE,
    DEPS_TRIGGER,
    FINISH_FUNCTION,
    FINISH_TRIGGER,
    NOTIFY_FUNCTION,
    NOTIFY_TRIGGER,
    PAUSED_TABLE,
    PERIODIC_TABLE,
    RATES_TABLE,
    STORAGE_PARAMETERS,
    TABLE_NAME,
    UNIQUE_HOLDS_TABLE,
    WORKERS_TABLE,
)

__all__ = [
    "CITUS_CONSTRAINTS",
    "CITUS_INDEXES",
    "EXPECTED_CONSTRAINTS",
    "EXPECTED_FUNCTIONS",
    "EXPECTED_INDEXES",
    "EXPECTED_STORAGE",
    "EXPECTED_TABLES",
    "EXPECTED_TRIGGERS",
    "Difference",
    "SchemaDriftError",
    "differences",
]

#: The tables of the head revision (the version table is Alembic's, not compared).
EXPECTED_TABLES = (
    TABLE_NAME,
    RATES_TABLE,
    PERIODIC_TABLE,
    PAUSED_TABLE,
    WORKERS_TABLE,
    UNIQUE_HOLDS_TABLE,
    DEPS_TABLE,
)

_PENDING = "(status = ANY (ARRAY['queued'::text, 'running'::text]))"
_FINISHED = "(status = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text]))"

#: Index name -> (table, definition): the indexes that back no constraint.
EXPECTED_INDEXES: Mapping[str, tuple[str, str]] = {
    "sqlaq_jobs_claim_idx": (
        TABLE_NAME,
        "CREATE INDEX sqlaq_jobs_claim_idx ON sqlaq_jobs USING btree "
        f"(queue, priority DESC, run_at, id) WHERE {_PENDING}",
    ),
    "sqlaq_jobs_dedupe_idx": (
        TABLE_NAME,
        "CREATE UNIQUE INDEX sqlaq_jobs_dedupe_idx ON sqlaq_jobs USING btree "
        f"(kind, dedupe_key) WHERE ({_PENDING} AND (dedupe_key IS NOT NULL))",
    ),
    "sqlaq_jobs_finished_idx": (
        TABLE_NAME,
        f"CREATE INDEX sqlaq_jobs_finished_idx ON sqlaq_jobs USING btree (finished_at) "
        f"WHERE {_FINISHED}",
    ),
    "sqlaq_jobs_running_idx": (
        TABLE_NAME,
        "CREATE INDEX sqlaq_jobs_running_idx ON sqlaq_jobs USING btree (kind, run_at) "
        "WHERE (status = 'running'::text)",
    ),
    "sqlaq_jobs_debounce_idx": (
        TABLE_NAME,
        "CREATE UNIQUE INDEX sqlaq_jobs_debounce_idx ON sqlaq_jobs USING btree "
        "(kind, debounce_key) WHERE ((status = 'queued'::text) AND (attempted_at IS NULL) "
        "AND (debounce_key IS NOT NULL))",
    ),
    "sqlaq_unique_holds_expires_at_idx": (
        UNIQUE_HOLDS_TABLE,
        "CREATE INDEX sqlaq_unique_holds_expires_at_idx ON sqlaq_unique_holds USING btree "
        "(expires_at)",
    ),
    "sqlaq_jobs_waiting_idx": (
        TABLE_NAME,
        "CREATE INDEX sqlaq_jobs_waiting_idx ON sqlaq_jobs USING btree (id) "
        "WHERE ((status = 'queued'::text) AND (parent_ids IS NOT NULL))",
    ),
    "sqlaq_jobs_key_idx": (
        TABLE_NAME,
        "CREATE INDEX sqlaq_jobs_key_idx ON sqlaq_jobs USING btree (kind, key, id) "
        "WHERE ((key IS NOT NULL) AND (status = ANY (ARRAY['queued'::text, 'running'::text, "
        "'failed'::text])))",
    ),
    "sqlaq_jobs_fair_idx": (
        TABLE_NAME,
        "CREATE INDEX sqlaq_jobs_fair_idx ON sqlaq_jobs USING btree (queue, key, "
        "priority DESC, run_at, id) WHERE ((status = ANY (ARRAY['queued'::text, "
        "'running'::text])) AND (key IS NOT NULL))",
    ),
    "sqlaq_jobs_parents_idx": (
        TABLE_NAME,
        "CREATE INDEX sqlaq_jobs_parents_idx ON sqlaq_jobs USING gin (parent_ids) "
        "WITH (fastupdate=off) WHERE (parent_ids IS NOT NULL)",
    ),
    "sqlaq_job_deps_child_id_idx": (
        DEPS_TABLE,
        "CREATE INDEX sqlaq_job_deps_child_id_idx ON sqlaq_job_deps USING btree "
        "(child_id, parent_id)",
    ),
}

#: Constraint name -> (table, definition); NOT NULL constraints are the columns'.
EXPECTED_CONSTRAINTS: Mapping[str, tuple[str, str]] = {
    "sqlaq_jobs_pkey": (TABLE_NAME, "PRIMARY KEY (id)"),
    "sqlaq_jobs_status_check": (
        TABLE_NAME,
        "CHECK ((status = ANY (ARRAY['queued'::text, 'running'::text, 'done'::text, "
        "'failed'::text, 'cancelled'::text])))",
    ),
    "sqlaq_jobs_max_attempts_check": (TABLE_NAME, "CHECK ((max_attempts > 0))"),
    "sqlaq_rates_pkey": (RATES_TABLE, "PRIMARY KEY (kind)"),
    "sqlaq_periodic_pkey": (PERIODIC_TABLE, "PRIMARY KEY (name)"),
    "sqlaq_paused_queues_pkey": (PAUSED_TABLE, "PRIMARY KEY (queue)"),
    "sqlaq_workers_pkey": (WORKERS_TABLE, "PRIMARY KEY (worker_id)"),
    "sqlaq_unique_holds_pkey": (UNIQUE_HOLDS_TABLE, "PRIMARY KEY (kind, key)"),
    "sqlaq_jobs_on_parent_failure_check": (
        TABLE_NAME,
        "CHECK ((on_parent_failure = ANY (ARRAY['cancel'::text, 'run'::text, 'fail'::text])))",
    ),
    "sqlaq_job_deps_pkey": (DEPS_TABLE, "PRIMARY KEY (parent_id, child_id)"),
}

#: Trigger name -> (table, definition).
EXPECTED_TRIGGERS: Mapping[str, tuple[str, str]] = {
    NOTIFY_TRIGGER: (
        TABLE_NAME,
        f"CREATE TRIGGER {NOTIFY_TRIGGER} AFTER INSERT ON sqlaq_jobs REFERENCING NEW TABLE "
        f"AS sqlaq_new_jobs FOR EACH STATEMENT EXECUTE FUNCTION {NOTIFY_FUNCTION}()",
    ),
    FINISH_TRIGGER: (
        TABLE_NAME,
        f"CREATE TRIGGER {FINISH_TRIGGER} AFTER UPDATE OF status ON sqlaq_jobs FOR EACH ROW "
        f"WHEN ((new.awaited AND (new.status = ANY (ARRAY['done'::text, 'failed'::text, "
        f"'cancelled'::text])))) EXECUTE FUNCTION {FINISH_FUNCTION}()",
    ),
    DEPS_TRIGGER: (
        TABLE_NAME,
        "CREATE TRIGGER sqlaq_jobs_deps_trg AFTER UPDATE OF status ON sqlaq_jobs FOR EACH"
        " ROW WHEN (((new.has_dependents OR (old.parent_ids IS NOT NULL)) AND (new.status"
        " = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text])))) EXECUTE "
        "FUNCTION sqlaq_jobs_settle_children()",
    ),
}

#: Function name -> definition (each is also the statement that restores it). The
#: revision marker, ``sqlaq_jobs_schema_revision()``, is the shallow check's.
EXPECTED_FUNCTIONS: Mapping[str, str] = {
    NOTIFY_FUNCTION: (
        f"CREATE OR REPLACE FUNCTION {NOTIFY_FUNCTION}() RETURNS trigger LANGUAGE plpgsql "
        "AS $function$ BEGIN IF coalesce(current_setting('sqlaq.notify', true), '') <> 'off' "
        "THEN PERFORM pg_notify('sqlaq_jobs', q.queue || coalesce(' ' || q.priority || ' ' "
        "|| (extract(epoch FROM q.run_at) * 1000000)::bigint, '')) FROM (SELECT queue, "
        "max(priority) AS priority, CASE WHEN isfinite(min(run_at)) THEN min(run_at) END AS "
        "run_at FROM sqlaq_new_jobs WHERE run_at <= now() GROUP BY queue) AS q; END IF; "
        "RETURN NULL; END $function$"
    ),
    FINISH_FUNCTION: (
        f"CREATE OR REPLACE FUNCTION {FINISH_FUNCTION}() RETURNS trigger LANGUAGE plpgsql "
        "AS $function$ BEGIN PERFORM pg_notify('sqlaq_finished', NEW.id::text); "
        "RETURN NULL; END $function$"
    ),
    DEPS_FUNCTION: (
        "CREATE OR REPLACE FUNCTION sqlaq_jobs_settle_children() RETURNS trigger LANGUAGE "
        "plpgsql AS $function$ DECLARE children bigint[]; child bigint; other bigint; free "
        "boolean; finishing boolean; released_queue text; BEGIN IF OLD.parent_ids IS NOT NULL "
        "THEN DELETE FROM sqlaq_job_deps WHERE child_id = NEW.id; END IF; IF NOT "
        "NEW.has_dependents THEN RETURN NULL; END IF; WITH gone AS (DELETE FROM "
        "sqlaq_job_deps WHERE parent_id = NEW.id RETURNING child_id) SELECT "
        "array_agg(child_id) INTO children FROM gone; IF children IS NULL THEN RETURN NULL; "
        "END IF; IF NEW.status <> 'done' THEN UPDATE sqlaq_jobs SET status = CASE WHEN "
        "on_parent_failure = 'fail' THEN 'failed' ELSE 'cancelled' END, finished_at = now(), "
        "last_error = format('parent job %s %s', NEW.id, NEW.status) WHERE id = ANY "
        "(children) AND status = 'queued' AND run_at >= '9900-01-01 00:00:00+00' AND "
        "coalesce(on_parent_failure, 'cancel') <> 'run'; END IF; FOREACH child IN ARRAY "
        "children LOOP -- A parent left that is not finishing now (its edge's xmax is 0: no "
        "-- transaction deletes it)? It settles this child when it finishes: -- nothing to do "
        "here. Walk up, then down, from this parent's own edge, -- one ordered probe per "
        "edge: the nearest live edge comes first, not -- the dead ones of earlier parents, "
        "and edges being deleted (a few: -- those of the parents finishing in flight) are "
        "stepped over. free := false; finishing := false; other := NEW.id; LOOP SELECT "
        "d.parent_id, d.xmax = '0'::xid INTO other, free FROM sqlaq_job_deps d WHERE "
        "d.child_id = child AND d.parent_id > other ORDER BY d.parent_id LIMIT 1; EXIT WHEN "
        "other IS NULL OR free; finishing := true; END LOOP; CONTINUE WHEN free; other := "
        "NEW.id; LOOP SELECT d.parent_id, d.xmax = '0'::xid INTO other, free FROM "
        "sqlaq_job_deps d WHERE d.child_id = child AND d.parent_id < other ORDER BY "
        "d.parent_id DESC LIMIT 1; EXIT WHEN other IS NULL OR free; finishing := true; END "
        "LOOP; CONTINUE WHEN free; IF finishing THEN -- Each parent left is finishing in a "
        "transaction in flight: check -- again after commit (whoever listens on sqlaq_release "
        "waits for -- those transactions, then looks). PERFORM pg_notify('sqlaq_release', "
        "child::text); ELSE released_queue := NULL; UPDATE sqlaq_jobs SET run_at = now() "
        "WHERE id = child AND status = 'queued' AND run_at >= '9900-01-01 00:00:00+00' "
        "RETURNING queue INTO released_queue; IF released_queue IS NOT NULL THEN PERFORM "
        "pg_notify('sqlaq_jobs', released_queue); END IF; END IF; END LOOP; RETURN NULL; END "
        "$function$"
    ),
}

#: Index name -> (table, definition) on a job table distributed by Citus, over
#: :data:`EXPECTED_INDEXES`: the unique indexes lead with ``queue`` (the distribution
#: column), as :func:`sqlaq.queries.citus.distribute_ddl` makes them.
CITUS_INDEXES: Mapping[str, tuple[str, str]] = {
    "sqlaq_jobs_dedupe_idx": (
        TABLE_NAME,
        "CREATE UNIQUE INDEX sqlaq_jobs_dedupe_idx ON sqlaq_jobs USING btree "
        f"(queue, kind, dedupe_key) WHERE ({_PENDING} AND (dedupe_key IS NOT NULL))",
    ),
    "sqlaq_jobs_debounce_idx": (
        TABLE_NAME,
        "CREATE UNIQUE INDEX sqlaq_jobs_debounce_idx ON sqlaq_jobs USING btree "
        "(queue, kind, debounce_key) WHERE ((status = 'queued'::text) AND (attempted_at IS "
        "NULL) AND (debounce_key IS NOT NULL))",
    ),
}

#: Constraint name -> (table, definition) on a job table distributed by Citus, over
#: :data:`EXPECTED_CONSTRAINTS`: the primary key holds the distribution column.
CITUS_CONSTRAINTS: Mapping[str, tuple[str, str]] = {
    "sqlaq_jobs_pkey": (TABLE_NAME, "PRIMARY KEY (id, queue)"),
}

#: Table -> its storage parameters (none but sqlaq_jobs's autovacuum settings).
EXPECTED_STORAGE: Mapping[str, Mapping[str, str]] = {
    table: (STORAGE_PARAMETERS if table == TABLE_NAME else {}) for table in EXPECTED_TABLES
}


@dataclass(frozen=True, slots=True)
class Difference:
    """One way the live schema differs from what the head revision creates.

    Attributes:
        kind: ``table``, ``index``, ``constraint``, ``trigger``, ``function``,
            ``storage`` or ``citus`` (the distribution, on a Citus coordinator).
        name: The object (for ``storage``, the table).
        problem: What is wrong: missing, differs (found and expected), invalid,
            disabled, not sqlaq's.
        statements: The SQL that makes it what the head creates, in order (each runs
            in autocommit: ``CONCURRENTLY`` cannot run in a transaction block); empty
            when no statement can (a missing table).
        note: What to weigh before running them, if anything.
    """

    kind: str
    name: str
    problem: str
    statements: tuple[str, ...]
    note: str = ""

    @property
    def fix(self) -> str:
        """The statements (and the note) as one line."""
        fix = "; ".join(self.statements)
        return f"{fix}, {self.note}" if fix and self.note else fix or self.note

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.problem}; fix: {self.fix}"


class SchemaDriftError(SchemaOutOfDateError):
    """The schema records the head revision but differs from what it creates.

    Attributes:
        differences: Each difference, with its fix.
    """

    def __init__(self, revision: str, differences: Sequence[Difference]) -> None:
        self.differences = list(differences)
        lines = "\n".join(f"- {d}" for d in self.differences)
        super().__init__(
            f"the schema is at {revision} but differs from what {revision} creates "
            f"({len(self.differences)} difference(s)):\n{lines}"
        )


def differences(connection: Connection) -> list[Difference]:
    """Compare the live schema with what the head revision creates (catalog reads only).

    Returns:
        Every difference, tables first, then indexes, constraints, triggers,
        functions and storage settings; empty when the schema is as created.
    """
    found: list[Difference] = []
    tables = {
        row.name: row
        for row in connection.execute(queries.catalog_tables_stmt(tables=EXPECTED_TABLES))
    }
    present = [name for name in EXPECTED_TABLES if tables[name].schema is not None]
    for name in EXPECTED_TABLES:
        if name not in present:
            found.append(
                Difference(
                    "table",
                    name,
                    "missing",
                    (),
                    "recreate it with the revisions' DDL ('sqlaq migrate --sql' prints it)",
                )
            )
    indexes, constraints, triggers = EXPECTED_INDEXES, EXPECTED_CONSTRAINTS, EXPECTED_TRIGGERS
    if TABLE_NAME in present and (citus := _citus(connection)) is not None:
        found += citus
        indexes = {**EXPECTED_INDEXES, **CITUS_INDEXES}
        constraints = {**EXPECTED_CONSTRAINTS, **CITUS_CONSTRAINTS}
        triggers = {}  # Citus refuses triggers on a distributed table
    if present:
        found += _indexes(connection, present, indexes)
        found += _constraints(connection, present, constraints)
        found += _triggers(connection, present, triggers)
    found += _functions(connection)
    found += [d for name in present if (d := _storage(name, tables[name].reloptions))]
    return found


def _citus(connection: Connection) -> list[Difference] | None:
    """None unless ``sqlaq_jobs`` is a Citus table here; else how its distribution
    differs from what ``sqlaq citus-distribute`` makes (empty: as made)."""
    if connection.execute(citus_queries.citus_version_stmt()).first() is None:
        return None
    jobs = connection.execute(citus_queries.citus_distribution_stmt()).first()
    if jobs is None:
        return None
    found = []
    column = citus_queries.DISTRIBUTION_COLUMN
    if jobs.column != column:
        found.append(
            Difference(
                "citus",
                TABLE_NAME,
                f"distributed by {jobs.column or jobs.method!r}, not by {column}",
                (
                    f"SELECT alter_distributed_table('{TABLE_NAME}', "
                    f"distribution_column := '{column}')",
                ),
                "moves every row: in a quiet hour, with the workers stopped",
            )
        )
    for name in citus_queries.REFERENCE_TABLES:
        stmt = citus_queries.citus_distribution_stmt()
        row = connection.execute(stmt, {"b_table": name}).first()
        if row is None or row.method != "n":
            found.append(
                Difference(
                    "citus",
                    name,
                    "not a reference table (every claim on a worker node reads it)",
                    (f"SELECT create_reference_table('{name}')",),
                )
            )
    return found


def _plain(definition: str, schema: str | None) -> str:
    """*definition* on one line, runs of whitespace as one space, without ``schema.``."""
    text = " ".join(definition.split())
    return text.replace(f" {schema}.", " ") if schema else text


def _indexes(
    connection: Connection, tables: Sequence[str], expected_indexes: Mapping[str, tuple[str, str]]
) -> list[Difference]:
    found: list[Difference] = []
    live: dict[str, Any] = {}
    for index in connection.execute(queries.catalog_indexes_stmt(tables=tables)):
        live[index.name] = index
        if not index.valid:
            found.append(
                Difference(
                    "index",
                    index.name,
                    "invalid (a CREATE INDEX CONCURRENTLY or REINDEX that failed): "
                    "PostgreSQL maintains it but never reads it",
                    (f"REINDEX INDEX CONCURRENTLY {index.name}",),
                )
            )
    for name, (table, expected) in expected_indexes.items():
        if table not in tables:
            continue
        row = live.get(name)
        create = expected.replace("INDEX ", "INDEX CONCURRENTLY ", 1)
        if row is None:
            found.append(Difference("index", name, "missing", (create,)))
            continue
        definition = _plain(row.definition, row.schema)
        if definition != expected:
            fresh = expected.replace(f"INDEX {name} ON", f"INDEX CONCURRENTLY {name}_new ON", 1)
            found.append(
                Difference(
                    "index",
                    name,
                    f"differs: found {definition!r}, expected {expected!r}",
                    (
                        fresh,
                        f"DROP INDEX CONCURRENTLY {name}",
                        f"ALTER INDEX {name}_new RENAME TO {name}",
                    ),
                )
            )
    for name, row in live.items():
        if name not in expected_indexes and not row.constraint:
            found.append(
                Difference(
                    "index",
                    name,
                    f"on {row.table}, not created by sqlaq",
                    (f"DROP INDEX CONCURRENTLY {name}",),
                    "unless it is yours on purpose (every index on a queue table slows "
                    "each enqueue and claim)",
                )
            )
    return found


def _constraints(
    connection: Connection,
    tables: Sequence[str],
    expected_constraints: Mapping[str, tuple[str, str]],
) -> list[Difference]:
    found: list[Difference] = []
    live = {
        row.name: row for row in connection.execute(queries.catalog_constraints_stmt(tables=tables))
    }
    for name, (table, expected) in expected_constraints.items():
        if table not in tables:
            continue
        constraint = f"ADD CONSTRAINT {name} {expected}"
        add = f"ALTER TABLE {table} {constraint}"
        row = live.get(name)
        if row is None:
            found.append(Difference("constraint", name, "missing", (add,)))
        elif (definition := _plain(row.definition, row.schema)) != expected:
            found.append(
                Difference(
                    "constraint",
                    name,
                    f"differs: found {definition!r}, expected {expected!r}",
                    (f"ALTER TABLE {table} DROP CONSTRAINT {name}, {constraint}",),
                )
            )
    for name, row in live.items():
        if name not in expected_constraints:
            found.append(
                Difference(
                    "constraint",
                    name,
                    f"on {row.table}, not created by sqlaq",
                    (f"ALTER TABLE {row.table} DROP CONSTRAINT {name}",),
                    "unless it is yours on purpose",
                )
            )
    return found


def _triggers(
    connection: Connection, tables: Sequence[str], expected_triggers: Mapping[str, tuple[str, str]]
) -> list[Difference]:
    found: list[Difference] = []
    live = {
        row.name: row for row in connection.execute(queries.catalog_triggers_stmt(tables=tables))
    }
    for name, (table, expected) in expected_triggers.items():
        if table not in tables:
            continue
        row = live.get(name)
        if row is None:
            found.append(Difference("trigger", name, "missing", (expected,)))
            continue
        definition = _plain(row.definition, row.schema)
        if definition != expected:
            found.append(
                Difference(
                    "trigger",
                    name,
                    f"differs: found {definition!r}, expected {expected!r}",
                    (f"DROP TRIGGER {name} ON {table}", expected),
                )
            )
        if row.enabled == "D":
            found.append(
                Difference(
                    "trigger",
                    name,
                    "disabled (ALTER TABLE ... DISABLE TRIGGER)",
                    (f"ALTER TABLE {table} ENABLE TRIGGER {name}",),
                    "unless disabled on purpose",
                )
            )
    for name, row in live.items():
        if name not in expected_triggers:
            found.append(
                Difference(
                    "trigger",
                    name,
                    f"on {row.table}, not created by sqlaq",
                    (f"DROP TRIGGER {name} ON {row.table}",),
                    "unless it is yours on purpose",
                )
            )
    return found


def _functions(connection: Connection) -> list[Difference]:
    found: list[Difference] = []
    stmt = queries.catalog_functions_stmt(functions=list(EXPECTED_FUNCTIONS))
    for row in connection.execute(stmt):
        expected = EXPECTED_FUNCTIONS[row.name]
        if row.definition is None:
            found.append(Difference("function", f"{row.name}()", "missing", (expected,)))
        elif (definition := _plain(row.definition, row.schema)) != expected:
            found.append(
                Difference(
                    "function",
                    f"{row.name}()",
                    f"differs: found {definition!r}, expected {expected!r}",
                    (expected,),
                )
            )
    return found


def _storage(table: str, reloptions: Sequence[str] | None) -> Difference | None:
    live = dict(option.split("=", 1) for option in reloptions or ())
    expected = EXPECTED_STORAGE[table]
    if live == expected:
        return None
    problems = [
        f"{key} is {live.get(key, 'not set')}, expected {value}"
        for key, value in expected.items()
        if live.get(key) != value
    ]
    extra = sorted(set(live) - set(expected))
    problems += [f"{key} is {live[key]}, expected not set" for key in extra]
    fixes = []
    wrong = {k: v for k, v in expected.items() if live.get(k) != v}
    if wrong:
        settings = ", ".join(f"{k} = {v}" for k, v in wrong.items())
        fixes.append(f"ALTER TABLE {table} SET ({settings})")
    if extra:
        fixes.append(f"ALTER TABLE {table} RESET ({', '.join(extra)})")
    return Difference("storage", table, "; ".join(problems), tuple(fixes))
