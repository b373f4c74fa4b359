"""The operator command ``sqlaq``: look at the queue and fix it, from a shell.

Subcommands: ``migrate``, ``check`` (``--deep``), ``stats``, ``list``, ``show``,
``explain``, ``retry``, ``cancel``, ``prune``, ``enqueue``, ``pause``, ``resume``,
``workers``, ``dashboard`` (serves :mod:`sqlaq.dashboard`). Each takes
``--database-url`` (else ``SQLAQ_DATABASE_URL``, else ``DATABASE_URL``). This module
turns argv into calls of :mod:`sqlaq.ops`, :mod:`sqlaq.control`, :mod:`sqlaq.explain`
and :mod:`sqlaq.migrations` and prints the result; its statements come from
:mod:`sqlaq.queries`. Only :func:`main` reads ``os.environ``; :func:`run` is handed
the environment. Its shared parts (errors, the database URL and engine) are
:mod:`sqlaq.commandline`'s; it imports nothing of ``cli.py``.

Exit codes: 0 done; 1 ``check`` found the schema out of date (or, with ``--deep``,
different from what its revision creates), or ``show`` or ``explain`` found no such
job; 2 a usage error (a bad flag or value: out of range, not text, bad JSON; a payload
``enqueue`` refuses; an unreachable database; a schema older than this sqlaq, with the
command to run), printed as one line without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NoReturn, TextIO

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc

from sqlaq import citus, control, migrations, ops, queries
from sqlaq.bounds import SMALLINT_MAX, SMALLINT_MIN
from sqlaq.commandline import (
    EXIT_USAGE,
    CommandParser,
    UsageError,
    database_engine,
    database_url,
    db_error,
    load_registry,
    one_line,
    payload_limit,
    typed,
)
from sqlaq.config import DEFAULT_RETENTION
from sqlaq.errors import SchemaOutOfDateError, SqlaqError
from sqlaq.explain import DEFAULT_STALE_AFTER, explain
from sqlaq.option import COUNT, JOB_ID, PRIORITY, Choice, Duration, Integer, Text
from sqlaq.results import JobNotFoundError
from sqlaq.schema import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, FINISHED_STATUSES, JobStatus

__all__ = ["BATCH_SIZE", "build_parser", "main", "run"]

PROG = "sqlaq"
#: Rows per statement in bulk retry, cancel and prune: short transactions, steady locks.
BATCH_SIZE = 1000
#: SQLSTATEs of a statement naming a column, table or function the schema lacks: the
#: schema is older (or newer) than this sqlaq.
_UNDEFINED = frozenset({"42703", "42P01", "42883"})

#: The HTTP Basic user of ``sqlaq dashboard`` when a password is set and no user named.
DASHBOARD_USER = "sqlaq"


def _status(text: str) -> JobStatus:
    return JobStatus(typed(Choice(tuple(s.value for s in JobStatus)), "--status")(text))


def _payload(text: str) -> dict[str, Any]:
    def reject(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    typed(Text(), "--payload")(text)
    try:
        value = json.loads(text, parse_constant=reject)
    except ValueError as exc:
        raise UsageError(f"--payload: invalid JSON payload: {exc}") from None
    except RecursionError:
        raise UsageError("--payload: invalid JSON payload: nested too deeply") from None
    if not isinstance(value, dict):
        raise UsageError("--payload: the payload must be a JSON object, e.g. '{\"id\": 7}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``sqlaq`` argument parser.

    Every value is parsed into range: durations at most 100 years, ids within bigint,
    text without NUL or undecodable bytes; a bad one raises a one-line UsageError.
    """
    common = CommandParser(add_help=False)
    common.add_argument(
        "--database-url",
        help="PostgreSQL URL (env: SQLAQ_DATABASE_URL, then DATABASE_URL)",
    )
    parser = CommandParser(prog=PROG, description="Operate a sqlaq job queue.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", parents=[common], help="apply sqlaq's revisions (no Alembic)")
    p.add_argument("--sql", action="store_true", help="print the DDL instead of running it")
    p = sub.add_parser(
        "check", parents=[common], help="exit 1 unless the schema is at sqlaq's head"
    )
    p.add_argument(
        "--deep",
        action="store_true",
        help="also compare every index, constraint, trigger, function and storage setting "
        "with what the head revision creates; print each difference and its fix",
    )

    p = sub.add_parser("stats", parents=[common], help="counts, oldest due job, expired leases")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("list", parents=[common], help="list jobs, newest first")
    _add_filters(p)
    p.add_argument(
        "--since", type=typed(Duration(), "--since"), help="created within this long (30m, 2h)"
    )
    p.add_argument(
        "--limit", type=typed(JOB_ID, "--limit"), default=50, help="at most this many (default 50)"
    )
    p.add_argument("--json", action="store_true", help="print JSON lines")

    p = sub.add_parser("show", parents=[common], help="one job, every column")
    p.add_argument("id", type=typed(JOB_ID, "ID"), help="the job's id")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "workflow",
        parents=[common],
        help="every job of a job's workflow, in dependency order (or --cancel it)",
    )
    p.add_argument("id", type=typed(JOB_ID, "ID"), help="any job of the workflow")
    p.add_argument(
        "--limit",
        type=typed(JOB_ID, "--limit"),
        default=200,
        help="at most this many (default 200)",
    )
    p.add_argument(
        "--cancel", action="store_true", help="cancel its queued and running jobs instead"
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("explain", parents=[common], help="why a job is not running")
    p.add_argument("id", type=typed(JOB_ID, "ID"), help="the job's id")
    p.add_argument(
        "--app",
        type=typed(Text(), "--app"),
        help="module:attribute naming the sqlaq.Registry, to check its limits and handlers",
    )
    p.add_argument(
        "--stale-after",
        type=typed(Duration(minimum=timedelta(seconds=1)), "--stale-after"),
        default=DEFAULT_STALE_AFTER,
        help="a worker not seen for this long does not serve its queues (default 5m)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    for name, what in (("retry", "failed or cancelled"), ("cancel", "queued or running")):
        p = sub.add_parser(name, parents=[common], help=f"{name} {what} jobs by id or filter")
        p.add_argument("ids", type=typed(JOB_ID, "ID"), nargs="*", help="job ids")
        p.add_argument("--all", action="store_true", help=f"every {what} job matching filters")
        p.add_argument("--kind", type=typed(Text(), "--kind"), help="only this kind")
        p.add_argument("--queue", type=typed(Text(), "--queue"), help="only this queue")
        if name == "retry":
            p.add_argument("--failed", action="store_true", help="the failed jobs (bulk)")

    p = sub.add_parser("prune", parents=[common], help="delete old finished jobs in batches")
    for status, default in DEFAULT_RETENTION.items():
        flag = f"--{status.value}-older-than"
        p.add_argument(
            flag,
            type=typed(Duration(), flag),
            default=default,
            help=f"delete {status.value} jobs finished longer ago than this "
            f"(default {default.days}d)",
        )

    p = sub.add_parser("enqueue", parents=[common], help="enqueue one job (for testing)")
    p.add_argument("kind", type=typed(Text(), "KIND"), help="the job's kind (its handler's name)")
    p.add_argument("--payload", type=_payload, default={}, help="a JSON object")
    p.add_argument(
        "--queue",
        type=typed(Text(), "--queue"),
        default=DEFAULT_QUEUE,
        help=f"the job's queue (default {DEFAULT_QUEUE!r})",
    )
    p.add_argument(
        "--priority",
        type=typed(PRIORITY, "--priority"),
        default=0,
        help=f"higher runs first among due jobs, {SMALLINT_MIN} to {SMALLINT_MAX} (default 0)",
    )
    p.add_argument(
        "--delay",
        type=typed(Duration(), "--delay"),
        default=timedelta(0),
        help="run no sooner than now + this (30s, 5m)",
    )
    p.add_argument(
        "--max-attempts",
        type=typed(COUNT, "--max-attempts"),
        default=DEFAULT_MAX_ATTEMPTS,
        help=f"how many times the job may be claimed (default {DEFAULT_MAX_ATTEMPTS})",
    )
    p.add_argument(
        "--dedupe-key",
        type=typed(Text(), "--dedupe-key"),
        help="at most one queued or running job of the kind with this key",
    )
    p.add_argument(
        "--key",
        type=typed(Text(), "--key"),
        help="the job's key (a tenant, an account): what per-key limits and strict order "
        "count over",
    )
    p.add_argument(
        "--run-at",
        type=_aware_time,
        help="run no sooner than this ISO 8601 time with its zone (2030-01-01T09:00+02:00, "
        "or ...Z); instead of --delay",
    )
    positive = Duration(minimum=timedelta(milliseconds=1))
    p.add_argument(
        "--timeout",
        type=typed(positive, "--timeout"),
        help="this job's attempt timeout, over its handler's (30s, 5m)",
    )
    p.add_argument(
        "--unique-for",
        type=typed(positive, "--unique-for"),
        help="with --dedupe-key: no second job of the kind and key for this long after "
        "this one, whatever its status (1h, 1d)",
    )
    p.add_argument(
        "--debounce-key",
        type=typed(Text(), "--debounce-key"),
        help="with --debounce: the key whose queued job a later enqueue updates",
    )
    p.add_argument(
        "--debounce",
        type=typed(positive, "--debounce"),
        help="run at now + this; an enqueue of the same kind and --debounce-key while the "
        "job is still queued replaces its payload and pushes it back again",
    )
    p.add_argument(
        "--max-wait",
        type=typed(positive, "--max-wait"),
        help="with --debounce: run no later than this after the first enqueue",
    )

    p = sub.add_parser("pause", parents=[common], help="stop every worker claiming from a queue")
    p.add_argument("queue", type=typed(Text(), "QUEUE"), metavar="QUEUE", help="the queue")
    p.add_argument("--by", type=typed(Text(), "--by"), help="who pauses it (default: user@host)")
    p = sub.add_parser("resume", parents=[common], help="let workers claim from a queue again")
    p.add_argument("queue", type=typed(Text(), "QUEUE"), metavar="QUEUE", help="the queue")

    p = sub.add_parser("workers", parents=[common], help="the workers' heartbeat rows")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "citus-distribute",
        parents=[common],
        help="distribute sqlaq_jobs by queue on Citus (after 'alembic upgrade heads')",
    )
    p.add_argument("--dry-run", action="store_true", help="print the DDL instead of running it")

    p = sub.add_parser("dashboard", parents=[common], help="serve the web dashboard")
    p.add_argument(
        "--host",
        type=typed(Text(), "--host"),
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only)",
    )
    p.add_argument(
        "--port",
        type=typed(Integer(1, 65535), "--port"),
        default=8000,
        help="the port to listen on (default 8000)",
    )
    p.add_argument("--read-only", action="store_true", help="hide and refuse actions")
    p.add_argument(
        "--allowed-host",
        type=typed(Text(), "--allowed-host"),
        action="append",
        metavar="NAME",
        help="a host name the dashboard is served under, as browsers send it in the "
        "Host header (repeatable; env: SQLAQ_DASHBOARD_ALLOWED_HOSTS, comma-separated; "
        "default: localhost, 127.0.0.1, ::1 and --host)",
    )
    p.add_argument(
        "--user",
        type=typed(Text(), "--user"),
        help=f"the HTTP Basic user (env: SQLAQ_DASHBOARD_USER; default: {DASHBOARD_USER})",
    )
    p.add_argument(
        "--password-file",
        type=typed(Text(), "--password-file"),
        metavar="PATH",
        help="ask for HTTP Basic auth with the password in this file (its first line; "
        "env: SQLAQ_DASHBOARD_PASSWORD holds the password itself)",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-local --host without a password (only behind a proxy that authenticates)",
    )
    return parser


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--status", type=_status, action="append", help="repeatable")
    p.add_argument("--kind", type=typed(Text(), "--kind"), help="only this kind")
    p.add_argument("--queue", type=typed(Text(), "--queue"), help="only this queue")


def run(argv: Sequence[str], environ: Mapping[str, str], out: TextIO | None = None) -> int:
    """``sqlaq`` with explicit arguments and environment; returns the exit code.

    The error boundary: a usage error, any :class:`~sqlaq.errors.SqlaqError` (a bad
    payload, an out-of-date schema) and any database error print one line on stderr
    and return 2.
    """
    out = out or sys.stdout
    try:
        args = build_parser().parse_args(list(argv))
        if args.command == "migrate" and args.sql:
            out.write(migrations.upgrade_sql())
            return 0
        if args.command == "dashboard":
            _dashboard_access(args, environ)
        if args.command == "pause" and args.by is None:
            user = environ.get("USER") or environ.get("LOGNAME") or "unknown"
            args.by = f"{user}@{socket.gethostname()}"
        payload_limit(environ)
        url = database_url(args.database_url, environ)
        engine = database_engine(url, application_name="sqlaq-admin", notice=_notice)
        try:
            return _COMMANDS[args.command](engine, args, out)
        except sa_exc.DBAPIError as exc:
            raise UsageError(_database_error(engine, exc)) from None
        finally:
            engine.dispose()
    except (UsageError, SqlaqError) as exc:
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


def _notice(message: str) -> None:
    print(f"{PROG}: notice: {message}", file=sys.stderr)


def _database_error(engine: Engine, exc: sa_exc.DBAPIError) -> str:
    """One line for *exc*; where it names something the schema lacks, what to run."""
    if getattr(exc.orig, "sqlstate", None) not in _UNDEFINED:
        return f"database error: {db_error(exc)}"
    # "column attempted_at does not exist", without the statement psycopg adds.
    diag = getattr(exc.orig, "diag", None)
    missing = getattr(diag, "message_primary", None) or db_error(exc)
    try:
        with engine.connect() as conn:
            migrations.check(conn)
    except SchemaOutOfDateError as out_of_date:
        return f"{out_of_date} (database error: {missing})"
    except sa_exc.DBAPIError:
        pass
    return f"database error: {missing}; the schema differs from this sqlaq's: see 'sqlaq check'"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``sqlaq`` (installed as ``sqlaq.cli:admin_main`` too)."""
    sys.exit(run(sys.argv[1:] if argv is None else argv, os.environ))


# -- commands --------------------------------------------------------------------------


def _migrate(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.connect() as conn:
        before = migrations.current_revision(conn)
        own = migrations.standalone_revision(conn)
        conn.rollback()
        if before is not None and own is None:
            # Installed through a host's own Alembic history: upgrading here would run
            # the revisions a second time. That history is where it is upgraded.
            if before == migrations.HEAD:
                print(f"sqlaq schema is at {before} (head): nothing to do", file=out)
                return 0
            raise UsageError(
                f"sqlaq's schema ({before}) was installed by your project's Alembic "
                "history: run 'alembic upgrade heads' there instead"
            )
        migrations.upgrade(conn)
        after = migrations.current_revision(conn)
    print(f"sqlaq schema: {before or 'none'} -> {after}", file=out)
    return 0


def _check(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.connect() as conn:
        try:
            revision = migrations.check(conn, deep=args.deep)
        except SchemaOutOfDateError as exc:  # SchemaDriftError: one line per difference
            print(f"sqlaq: {exc}", file=sys.stderr)
            return 1
    print(f"sqlaq schema is at {revision} (head)", file=out)
    if args.deep:
        print(
            "its tables, indexes, constraints, triggers, functions and storage settings "
            f"are as {revision} creates them",
            file=out,
        )
    return 0


def _stats(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.connect() as conn:
        counts = conn.execute(queries.stats_counts_stmt()).all()
        health = conn.execute(queries.stats_health_stmt()).all()
        paused = control.paused_queues(conn)
    if args.json:
        data = {
            "paused": [
                {"queue": p.queue, "paused_at": p.paused_at.isoformat(), "paused_by": p.paused_by}
                for p in paused
            ],
            "counts": [{"queue": q, "kind": k, "status": s, "count": n} for q, k, s, n in counts],
            "queues": [
                {
                    "queue": h.queue,
                    "due": h.due,
                    "oldest_due_seconds": _seconds(h.oldest_due_age),
                    "expired_leases": h.expired_leases,
                    "failed_last_hour": h.failed_last_hour,
                }
                for h in health
            ],
        }
        print(json.dumps(data, indent=2), file=out)
        return 0
    statuses = [s.value for s in JobStatus]
    table: dict[tuple[str, str], dict[str, int]] = {}
    for queue, kind, status, count in counts:
        table.setdefault((queue, kind), {})[status] = count
    rows = [[q, k, *(str(by.get(s, 0)) for s in statuses)] for (q, k), by in table.items()]
    _print_table(out, ["queue", "kind", *statuses], rows)
    print(file=out)
    _print_table(
        out,
        ["queue", "due", "oldest due", "expired leases", "failed (1h)"],
        [
            [
                h.queue,
                str(h.due),
                _age(h.oldest_due_age),
                str(h.expired_leases),
                str(h.failed_last_hour),
            ]
            for h in health
        ],
    )
    if paused:
        print(file=out)
        _print_table(
            out,
            ["paused queue", "since", "by"],
            [[p.queue, _time(p.paused_at), p.paused_by or "-"] for p in paused],
        )
    return 0


def _list(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    stmt = queries.find_jobs_stmt(
        statuses=args.status or (),
        kind=args.kind,
        queue=args.queue,
        since=args.since,
        limit=args.limit,
        newest_first=True,
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    if args.json:
        for row in rows:
            print(json.dumps(_jsonable(row._asdict())), file=out)
        return 0
    _print_table(
        out,
        ["id", "queue", "kind", "status", "attempts", "run_at", "last_error"],
        [
            [
                str(r.id),
                r.queue,
                r.kind,
                r.status,
                f"{r.attempts}/{r.max_attempts}",
                _time(r.run_at),
                _first_line(r.last_error),
            ]
            for r in rows
        ],
    )
    return 0


#: Left out of ``sqlaq show``'s text for a job outside any workflow.
_WORKFLOW_COLUMNS = ("has_dependents", "on_parent_failure", "parent_ids")


def _show(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.connect() as conn:
        row = conn.execute(queries.get_job_stmt(job_id=args.id)).first()
    if row is None:
        print(f"sqlaq: no job {args.id}", file=sys.stderr)
        return 1
    data = _jsonable(row._asdict())
    if args.json:
        print(json.dumps(data, indent=2), file=out)
        return 0
    if not data.get("has_dependents") and data.get("parent_ids") is None:
        # Not part of a workflow: its workflow columns say nothing.
        for key in _WORKFLOW_COLUMNS:
            data.pop(key, None)
    width = max(len(k) for k in data)
    for key, value in data.items():
        # JSON columns as JSON: a result may be a string, which must read as one.
        shown = json.dumps(value) if key in ("payload", "result") else value
        text = "\n".join(f"{'':{width + 2}}{line}" for line in str(shown).splitlines()[1:])
        first = str(shown).splitlines()[0] if str(shown) else ""
        print(f"{key:<{width}}  {first}" + (f"\n{text}" if text else ""), file=out)
    return 0


def _workflow(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    if args.cancel:
        with engine.begin() as conn:
            exists = conn.execute(queries.get_job_stmt(job_id=args.id)).first() is not None
            cancelled = ops.cancel_workflow(conn, args.id) if exists else []
        if not exists:
            print(f"sqlaq: no job {args.id}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"cancelled": sorted(cancelled)}), file=out)
        else:
            shown = ", ".join(str(i) for i in sorted(cancelled)) or "none (all finished)"
            print(
                f"cancelled {len(cancelled)} job(s) of job {args.id}'s workflow: {shown}", file=out
            )
        return 0
    with engine.connect() as conn:
        flow = ops.read_workflow(conn, args.id, limit=args.limit)
    if not flow.jobs:
        print(f"sqlaq: no job {args.id}", file=sys.stderr)
        return 1
    more = f"{flow.more}{'' if flow.counted_all else '+'}"
    if args.json:
        data = {
            "job_id": flow.job_id,
            "total": flow.total,
            "more": flow.more,
            "counted_all": flow.counted_all,
            "jobs": [
                {**_jsonable(dataclasses.asdict(job)), "parent_ids": list(job.parent_ids)}
                for job in flow.jobs
            ],
        }
        print(json.dumps(data, indent=2), file=out)
        return 0
    _print_table(
        out,
        ["id", "kind", "queue", "status", "after"],
        [
            [
                f"{job.job_id}{' *' if job.job_id == flow.job_id else ''}",
                job.kind,
                job.queue,
                "waiting" if job.waiting else job.status,
                ", ".join(str(p) for p in job.parent_ids),
            ]
            for job in flow.jobs
        ],
    )
    if flow.more:
        print(f"... {more} more job(s) (--limit)", file=out)
    return 0


def _explain(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    registry = load_registry(args.app) if args.app else None
    with engine.connect() as conn:
        try:
            reasons = explain(conn, args.id, registry=registry, stale_after=args.stale_after)
        except JobNotFoundError:
            print(f"sqlaq: no job {args.id}", file=sys.stderr)
            return 1
    if args.json:
        data = [{"code": str(r.code), "message": r.message} for r in reasons]
        print(json.dumps(data, indent=2), file=out)
        return 0
    for reason in reasons:
        print(reason, file=out)
    return 0


def _pause(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.begin() as conn:
        paused = control.pause(conn, args.queue, by=args.by)
    state = "paused" if paused else "was paused already"
    print(f"queue {args.queue!r} {state}: no worker claims its jobs until it is resumed", file=out)
    return 0


def _resume(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.begin() as conn:
        resumed = control.resume(conn, args.queue)
    state = "resumed: its workers were woken" if resumed else "was not paused"
    print(f"queue {args.queue!r} {state}", file=out)
    return 0


def _workers(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.connect() as conn:
        found = control.list_workers(conn)
    if args.json:
        data = [
            {
                "worker_id": str(w.worker_id),
                "hostname": w.hostname,
                "pid": w.pid,
                "queues": list(w.queues),
                "concurrency": w.concurrency,
                "started_at": w.started_at.isoformat(),
                "last_seen_at": w.last_seen_at.isoformat(),
                "seen_seconds_ago": _seconds(w.seen_ago),
            }
            for w in found
        ]
        print(json.dumps(data, indent=2), file=out)
        return 0
    _print_table(
        out,
        ["worker", "host", "pid", "queues", "concurrency", "started", "last seen"],
        [
            [
                str(w.worker_id),
                w.hostname,
                str(w.pid),
                ",".join(w.queues),
                str(w.concurrency),
                _time(w.started_at),
                f"{_age(w.seen_ago)} ago",
            ]
            for w in found
        ],
    )
    return 0


def _bulk_ids(
    conn: Connection, args: argparse.Namespace, statuses: Iterable[JobStatus]
) -> Iterator[list[int]]:
    if args.ids:
        for start in range(0, len(args.ids), BATCH_SIZE):
            yield args.ids[start : start + BATCH_SIZE]
        return
    after = 0
    while True:
        stmt = queries.find_jobs_stmt(
            statuses=list(statuses),
            kind=args.kind,
            queue=args.queue,
            after_id=after,
            limit=BATCH_SIZE,
        )
        ids = [row.id for row in conn.execute(stmt)]
        if not ids:
            return
        yield ids
        after = ids[-1]


def _bulk(
    engine: Engine,
    args: argparse.Namespace,
    out: TextIO,
    statuses: set[JobStatus],
    apply: Callable[[Connection, list[int]], list[int]],
    verb: str,
) -> int:
    bulk = getattr(args, "all", False) or getattr(args, "failed", False)
    if bool(args.ids) == bulk:
        raise UsageError(f"{args.command}: give job ids, or --all with filters (not both)")
    if args.ids and (args.kind or args.queue):
        raise UsageError(f"{args.command}: --kind and --queue filter bulk runs, not ids")
    done = seen = 0
    skipped: list[ops.SkippedRetry] = []
    with engine.connect() as conn:
        if args.ids:
            total = len(args.ids)
        else:
            count = queries.count_jobs_stmt(statuses=statuses, kind=args.kind, queue=args.queue)
            total = conn.execute(count).scalar_one()
        progress = _Progress(verb, total)
        for ids in _bulk_ids(conn, args, statuses):
            seen += len(ids)
            changed = apply(conn, ids)
            done += len(changed)
            if isinstance(changed, ops.RetryResult):
                skipped.extend(changed.skipped)
            conn.commit()
            progress.show(done)
    progress.end()
    for skip in skipped:
        print(skip.reason, file=out)
    summary = f"{verb} {done} of {seen} job(s)"
    if skipped:
        summary += f", skipped {len(skipped)} whose key another job holds"
    print(summary, file=out)
    return 0


def _retry(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    statuses = {JobStatus.FAILED} if args.failed else {JobStatus.FAILED, JobStatus.CANCELLED}
    return _bulk(engine, args, out, statuses, ops.retry, "retried")


def _cancel(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    statuses = {JobStatus.QUEUED, JobStatus.RUNNING}
    return _bulk(engine, args, out, statuses, ops.cancel, "cancelled")


def _prune(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    ages = {
        JobStatus.DONE: args.done_older_than,
        JobStatus.CANCELLED: args.cancelled_older_than,
        JobStatus.FAILED: args.failed_older_than,
    }
    total = 0
    with engine.connect() as conn:
        expected = sum(
            ops.count_prunable(conn, older_than=ages[status], statuses=[status])
            for status in FINISHED_STATUSES
        )
        conn.rollback()
        progress = _Progress("pruned", expected)
        for status in sorted(FINISHED_STATUSES):
            while True:
                deleted = ops.prune(
                    conn, older_than=ages[status], statuses=[status], limit=BATCH_SIZE
                )
                conn.commit()
                total += deleted
                progress.show(total)
                if deleted < BATCH_SIZE:
                    break
    progress.end()
    print(f"pruned {total} job(s)", file=out)
    return 0


def _aware_time(text: str) -> datetime:
    """``--run-at``: an ISO 8601 time with its zone; a naive one is refused."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--run-at: {text[:40]!r} is not an ISO 8601 time (e.g. 2030-01-01T09:00+02:00)"
        ) from None
    if value.tzinfo is None:
        raise UsageError(
            f"--run-at: {text[:40]!r} has no time zone: add one (+02:00, or Z for UTC)"
        )
    return value


_ENQUEUED_NOTES = {
    ops.EnqueueOutcome.INSERTED: "",
    ops.EnqueueOutcome.DUPLICATE: " (duplicate of a pending job)",
    ops.EnqueueOutcome.DEBOUNCED: " (debounced: the queued job was updated)",
    ops.EnqueueOutcome.HELD: " (held: enqueued within --unique-for)",
}


def _enqueue(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.begin() as conn:
        result = ops.enqueue(
            conn,
            args.kind,
            args.payload,
            queue=args.queue,
            priority=args.priority,
            delay=args.delay,
            max_attempts=args.max_attempts,
            dedupe_key=args.dedupe_key,
            run_at=args.run_at,
            timeout=args.timeout,
            key=args.key,
            unique_for=args.unique_for,
            debounce_key=args.debounce_key,
            debounce=args.debounce,
            max_wait=args.max_wait,
        )
    note = _ENQUEUED_NOTES[result.outcome]
    print(f"job {result.job_id}{note}", file=out)
    return 0


#: Addresses that bind every interface: no name of their own to answer.
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})  # noqa: S104 - names, not binds


def _dashboard_access(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Settle who may reach ``sqlaq dashboard`` before anything connects: the host
    names it answers (``args.allowed_hosts``) and its Basic auth (``args.auth``).

    Raises:
        UsageError: the dashboard extra is missing, an unreadable or empty password
            file, or a non-local ``--host`` without a password nor ``--insecure-no-auth``.
        ConfigError: a host name the dashboard cannot match.
    """
    try:
        from sqlaq.dashboard import guard
    except ImportError as exc:
        raise UsageError(f"dashboard: pip install 'sqlaq[dashboard]' ({exc})") from None
    args.hosts_given = True
    if args.allowed_host:
        hosts = list(args.allowed_host)
    elif environ.get("SQLAQ_DASHBOARD_ALLOWED_HOSTS", "").strip():
        given = environ["SQLAQ_DASHBOARD_ALLOWED_HOSTS"].replace(",", " ").split()
        hosts = [typed(Text(), "SQLAQ_DASHBOARD_ALLOWED_HOSTS")(h) for h in given]
    else:
        args.hosts_given = False
        hosts = list(guard.LOCAL_HOSTS)
        if args.host.lower() not in _WILDCARDS:
            hosts.append(args.host)
    args.allowed_hosts = guard.trusted_hosts(hosts)
    args.user = args.user or environ.get("SQLAQ_DASHBOARD_USER") or DASHBOARD_USER
    typed(Text(), "SQLAQ_DASHBOARD_USER")(args.user)
    password = None
    if args.password_file is not None:
        try:
            with open(args.password_file, encoding="utf-8") as file:
                password = file.readline().rstrip("\r\n")
        except (OSError, UnicodeError) as exc:
            raise UsageError(f"--password-file: cannot read {args.password_file}: {exc}") from None
        if not password:
            raise UsageError(f"--password-file: {args.password_file} holds no password")
    elif environ.get("SQLAQ_DASHBOARD_PASSWORD"):
        password = typed(Text(), "SQLAQ_DASHBOARD_PASSWORD")(environ["SQLAQ_DASHBOARD_PASSWORD"])
    args.auth = None if password is None else guard.basic_auth(args.user, password)
    args.local = guard.is_local(args.host)
    if password is None and not args.local and not args.insecure_no_auth:
        raise UsageError(
            f"dashboard: --host {args.host} lets other machines connect, and the dashboard "
            "can retry, cancel and delete jobs: set a password (SQLAQ_DASHBOARD_PASSWORD or "
            "--password-file), or pass --insecure-no-auth if a proxy authenticates"
        )


def _dashboard(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    from sqlaq import dashboard  # importable: checked by _dashboard_access

    if args.auth is not None:
        if not args.local:
            _notice(
                f"serving on {args.host} over plain HTTP: Basic auth sends the password "
                "in clear text; put an HTTPS proxy in front"
            )
    elif not args.local:
        _notice(f"serving on {args.host} without authentication (--insecure-no-auth)")
    if args.host.lower() in _WILDCARDS and not args.hosts_given:
        _notice(
            f"answering requests for {', '.join(args.allowed_hosts)} only: name the "
            "others with --allowed-host (or SQLAQ_DASHBOARD_ALLOWED_HOSTS)"
        )
    dashboard.serve(
        engine,
        host=args.host,
        port=args.port,
        read_only=args.read_only,
        allowed_hosts=args.allowed_hosts,
        auth=args.auth,
    )
    return 0


def _citus_distribute(engine: Engine, args: argparse.Namespace, out: TextIO) -> int:
    with engine.begin() as conn:
        found = citus.problems(conn)
        for problem in found:
            print(f"{PROG}: cannot distribute: {problem}", file=sys.stderr)
        if found:
            return 1
        done = citus.distribute(conn, dry_run=args.dry_run)
    if done.already:
        print("sqlaq_jobs is already distributed by queue on Citus: nothing to do", file=out)
    elif args.dry_run:
        out.write("".join(f"{statement};\n" for statement in done.ddl))
    else:
        print(f"sqlaq_jobs distributed by queue on Citus ({len(done.ddl)} statements)", file=out)
    return 0


_COMMANDS: dict[str, Callable[[Engine, argparse.Namespace, TextIO], int]] = {
    "migrate": _migrate,
    "check": _check,
    "stats": _stats,
    "list": _list,
    "show": _show,
    "explain": _explain,
    "workflow": _workflow,
    "retry": _retry,
    "cancel": _cancel,
    "prune": _prune,
    "enqueue": _enqueue,
    "pause": _pause,
    "resume": _resume,
    "workers": _workers,
    "dashboard": _dashboard,
    "citus-distribute": _citus_distribute,
}


# -- output ----------------------------------------------------------------------------


class _Progress:
    """A progress bar on stderr, redrawn in place; drawn only when stderr is a terminal.

    *total* is counted before the work starts; rows that appear meanwhile may take the
    count past it, so the bar is capped at full.
    """

    WIDTH = 30

    def __init__(self, verb: str, total: int, stream: TextIO | None = None) -> None:
        self.verb = verb
        self.total = total
        self.stream = stream or sys.stderr
        self.active = self.stream.isatty()
        self.shown = False

    def show(self, count: int) -> None:
        if not self.active:
            return
        share = min(1.0, count / self.total) if self.total else 1.0
        filled = round(share * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\r[{bar}] {count:,}/{self.total:,} {self.verb}")
        self.stream.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")


def _print_table(out: TextIO, header: list[str], rows: list[list[str]]) -> None:
    if not rows:
        print("(none)", file=out)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for line in (header, *rows):
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip(),
            file=out,
        )


def _seconds(age: timedelta | None) -> float | None:
    return None if age is None else round(age.total_seconds(), 3)


def _age(age: timedelta | None) -> str:
    if age is None:
        return "-"
    seconds = age.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(sep=" ", timespec="seconds")


def _first_line(text: str | None, width: int = 60) -> str:
    line = (text or "").splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def _jsonable(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value.isoformat()
        if isinstance(value, datetime)
        else str(value)
        if value is not None and not isinstance(value, int | float | str | dict | list)
        else value
        for key, value in row.items()
    }
