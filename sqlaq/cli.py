"""The commands: ``sqlaq-worker`` (argv and environment -> config -> Worker) and ``sqlaq``.

This module owns flags, ``SQLAQ_*`` variables, logging set-up, signal handling and exit
codes, and is the error boundary: a usage or configuration error prints one line to
stderr and exits 2, without a traceback. It is the only module that reads
``os.environ``, and nothing writes it. Precedence: flag > variable > default.

Signals: the worker runs in its own thread and the main thread only waits for it, so a
signal handler never interrupts code holding one of the worker's locks. The first
SIGTERM/SIGINT asks for a graceful stop; a second one hands running jobs back at once.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy import Engine, create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from sqlaq import migrations
from sqlaq.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GRACE_PERIOD,
    DEFAULT_LEASE,
    DEFAULT_MAINTENANCE_INTERVAL,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_QUEUES,
    DEFAULT_RETAIN_DONE,
    DEFAULT_RETAIN_FAILED,
    WorkerConfig,
)
from sqlaq.errors import ConfigError, SchemaOutOfDateError
from sqlaq.logformat import configure_logging
from sqlaq.registry import Registry
from sqlaq.worker import WORKER_APPLICATION_NAME, Worker

if TYPE_CHECKING:
    from sqlaq.metrics import WorkerMetrics

__all__ = [
    "UsageError",
    "admin_main",
    "database_engine",
    "one_line",
    "parse_duration",
    "run_worker",
    "worker_main",
]

EXIT_OK = 0
EXIT_FORCED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
PROG = "sqlaq-worker"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")

# Named, not __name__: run as "python -m sqlaq.cli" the module is "__main__".
_log = logging.getLogger("sqlaq.cli")


class UsageError(Exception):
    """A bad command line, variable or environment; printed as one line, exit 2."""


# -- parsing -------------------------------------------------------------------------


def parse_duration(text: str) -> timedelta:
    """``"30"``, ``"2.5"``, ``"500ms"``, ``"30s"``, ``"5m"``, ``"1h"``, ``"7d"`` -> timedelta.

    Raises:
        ValueError: not a duration.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*", text)
    if match is None:
        raise ValueError(
            f"invalid duration {text!r}: use seconds (30, 2.5) or a unit (500ms, 30s, 5m, 1h, 7d)"
        )
    unit = {"ms": "milliseconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    return timedelta(**{unit[match.group(2) or "s"]: float(match.group(1))})


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` and ``0/false/no/off`` (any case) -> bool.

    Raises:
        ValueError: anything else.
    """
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"invalid boolean {text!r}: use true or false")


def _parse_retention(text: str) -> timedelta | None:
    """A duration, or ``forever`` (None: never deleted)."""
    return None if text.strip().lower() == "forever" else parse_duration(text)


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"invalid integer {text!r}") from None


def _parse_queues(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _parse_choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"invalid choice {text!r}: use one of {', '.join(choices)}")
        return value

    return parse


@dataclass(frozen=True, slots=True)
class _Option:
    """One option: its flag, its variable, how to parse either, its default."""

    flag: str  # "--lease"; for the positional, its name
    env: str
    help: str
    parse: Callable[[str], Any]  # the text of the flag or the variable -> value
    default: Any
    metavar: str | None = None
    kind: str = "value"  # or "positional", "bool" (--x/--no-x), "append" (repeatable)
    shown: str | None = None  # the default as --help shows it, if not derived

    @property
    def dest(self) -> str:
        name = self.flag.lstrip("-").replace("-", "_")
        return "queues" if name == "queue" else name

    def help_text(self) -> str:
        shown = self.shown
        if shown is None:
            value = self.default
            if isinstance(value, timedelta):
                shown = f"{value.total_seconds():g}s"
            elif isinstance(value, tuple):
                shown = ",".join(value)
            else:
                shown = str(value).lower()
        return f"{self.help} (env: {self.env}; default: {shown})".replace("%", "%%")


_DURATION = "DURATION"
# Hand-aligned, one option per entry: the formatter would spread each over eight lines.
_OPTIONS = (
    _Option("app", "SQLAQ_APP", "module:attribute naming a sqlaq.Registry",
            str, None, metavar="APP", kind="positional", shown="none"),
    _Option("--database-url", "SQLAQ_DATABASE_URL", "the queue's database",
            str, None, metavar="URL", shown="$DATABASE_URL"),
    _Option("--queue", "SQLAQ_QUEUES", "queues to serve, comma-separated; repeatable",
            _parse_queues, DEFAULT_QUEUES, metavar="NAME", kind="append"),
    _Option("--concurrency", "SQLAQ_CONCURRENCY", "jobs run at once",
            _parse_int, DEFAULT_CONCURRENCY, metavar="N"),
    _Option("--prefetch", "SQLAQ_PREFETCH", "jobs claimed ahead of free slots, so a "
            "freed slot starts its next job at once",
            _parse_int, 0, metavar="N"),
    _Option("--lease", "SQLAQ_LEASE", "how long a claim holds a job; renewed every "
            "third of it while the job runs",
            parse_duration, DEFAULT_LEASE, metavar=_DURATION),
    _Option("--poll-interval", "SQLAQ_POLL_INTERVAL", "look for due jobs at least this "
            "often, notified or not",
            parse_duration, DEFAULT_POLL_INTERVAL, metavar=_DURATION),
    _Option("--grace-period", "SQLAQ_GRACE_PERIOD", "on stop, how long running jobs "
            "may finish before they are handed back",
            parse_duration, DEFAULT_GRACE_PERIOD, metavar=_DURATION),
    _Option("--burst", "SQLAQ_BURST", "run what is due, then exit 0",
            parse_bool, False, kind="bool"),
    _Option("--listen", "SQLAQ_LISTEN", "wake on NOTIFY (--no-listen: poll only)",
            parse_bool, True, kind="bool"),
    _Option("--maintenance", "SQLAQ_MAINTENANCE", "enqueue periodic jobs and take part "
            "in the leader election for pruning and the lease sweep",
            parse_bool, True, kind="bool"),
    _Option("--maintenance-interval", "SQLAQ_MAINTENANCE_INTERVAL", "how often "
            "maintenance runs (and how soon a new leader takes over)",
            parse_duration, DEFAULT_MAINTENANCE_INTERVAL, metavar=_DURATION),
    _Option("--retain-done", "SQLAQ_RETAIN_DONE", "the leader deletes done and "
            "cancelled jobs finished longer ago; 'forever' keeps them",
            _parse_retention, DEFAULT_RETAIN_DONE, metavar=_DURATION),
    _Option("--retain-failed", "SQLAQ_RETAIN_FAILED", "the leader deletes failed jobs "
            "finished longer ago; 'forever' keeps them",
            _parse_retention, DEFAULT_RETAIN_FAILED, metavar=_DURATION),
    _Option("--metrics-port", "SQLAQ_METRICS_PORT", "serve Prometheus /metrics on this "
            "port (needs sqlaq[prometheus]); 0: off",
            _parse_int, 0, metavar="PORT"),
    _Option("--log-level", "SQLAQ_LOG_LEVEL", "log threshold",
            _parse_choice(LOG_LEVELS), "info", metavar="|".join(LOG_LEVELS)),
    _Option("--log-format", "SQLAQ_LOG_FORMAT", "log line format",
            _parse_choice(LOG_FORMATS), "text", metavar="|".join(LOG_FORMATS)),
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the usage and the message on two or more lines; the contract
        # is one line.
        raise UsageError(f"{message} (see {self.prog} --help)")


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    """The ``sqlaq-worker`` argument parser (every flag's default is None: unset)."""
    parser = _Parser(
        prog=PROG,
        description="Run sqlaq jobs: claim due jobs of the given queues and run their "
        "handlers until stopped (SIGTERM/SIGINT: graceful; a second one: at once).",
        epilog="Durations: seconds (30, 2.5) or with a unit (500ms, 30s, 5m, 1h).",
        allow_abbrev=False,
    )
    for option in _OPTIONS:
        if option.kind == "positional":
            parser.add_argument(
                option.dest, nargs="?", metavar=option.metavar, help=option.help_text()
            )
        elif option.kind == "bool":
            action = argparse.BooleanOptionalAction
            parser.add_argument(option.flag, action=action, help=option.help_text())
        else:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                action="append" if option.kind == "append" else "store",
                type=_flag_type(option.parse),
                metavar=option.metavar,
                help=option.help_text(),
            )
    return parser


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """The resolved command line: what to run, where, and how to log."""

    app: str
    database_url: str
    config: WorkerConfig
    log_level: str
    log_format: str
    metrics_port: int = 0


def parse_options(argv: Sequence[str] | None, environ: Mapping[str, str]) -> WorkerOptions:
    """Resolve flags, ``SQLAQ_*`` variables and defaults into options.

    Raises:
        UsageError: a bad flag, variable or value; the message is one line.
    """
    args = vars(build_parser().parse_args(argv))
    values = {option.dest: _resolve(option, args[option.dest], environ) for option in _OPTIONS}
    if not values["app"]:
        raise UsageError(
            "missing APP: name the registry as module:attribute, e.g. myapp.jobs:registry"
        )
    url = values["database_url"] or environ.get("DATABASE_URL")
    if not url:
        raise UsageError(
            "no database URL: pass --database-url or set SQLAQ_DATABASE_URL (or DATABASE_URL)"
        )
    names = (
        "queues",
        "concurrency",
        "prefetch",
        "lease",
        "poll_interval",
        "grace_period",
        "burst",
        "listen",
        "maintenance",
        "maintenance_interval",
        "retain_done",
        "retain_failed",
    )
    try:
        config = WorkerConfig(**{name: values[name] for name in names})
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    port = values["metrics_port"]
    if not 0 <= port <= 65535:
        raise UsageError(f"--metrics-port must be between 0 and 65535, got {port}")
    return WorkerOptions(
        values["app"], url, config, values["log_level"], values["log_format"], port
    )


def _resolve(option: _Option, flag_value: Any, environ: Mapping[str, str]) -> Any:
    """Flag > variable > default."""
    if flag_value is not None:
        if option.kind == "append":  # one tuple per repetition of the flag
            return tuple(name for names in flag_value for name in names)
        return flag_value
    text = environ.get(option.env)
    if text is None or text == "":
        return option.default
    try:
        return option.parse(text)
    except ValueError as exc:
        raise UsageError(f"{option.env}: {exc}") from None


# -- loading the registry and the database ---------------------------------------------


def load_registry(spec: str) -> Registry:
    """Import ``module:attribute`` and return it if it is a :class:`~sqlaq.Registry`.

    The current directory is importable, as when running ``python -m``.

    Raises:
        UsageError: a malformed spec, a module that cannot be imported, a missing
            attribute, or an attribute that is not a Registry.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"APP must be module:attribute, e.g. myapp.jobs:registry; got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        # A missing module (ours or a dependency of it) is an environment problem: say
        # which module; an error inside the module's own code keeps its traceback.
        raise UsageError(f"cannot import {module_name!r} (from APP {spec!r}): {exc}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(target, Registry):
        raise UsageError(f"{spec} is a {type(target).__name__}, not a sqlaq.Registry")
    return target


def database_engine(
    url: str, *, application_name: str, pool_size: int = 2, max_overflow: int = 8
) -> Engine:
    """An engine for a command: psycopg, named *application_name* in pg_stat_activity.

    ``postgresql://`` and ``postgres://`` URLs get the psycopg driver; an
    ``application_name`` in the URL wins. No ``pool_pre_ping``: the worker classifies a
    dead connection as transient and retries the turn, which costs nothing while the
    database is up (a ping would cost a round trip per turn).

    Raises:
        UsageError: the URL cannot be parsed or is not PostgreSQL.
    """
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError:
        raise UsageError(f"invalid database URL {_redact(url)!r}") from None
    if parsed.drivername in {"postgresql", "postgres"}:
        parsed = parsed.set(drivername="postgresql+psycopg")
    if not parsed.drivername.startswith("postgresql"):
        raise UsageError(f"sqlaq needs PostgreSQL; got a {parsed.drivername!r} URL")
    connect_args: dict[str, Any] = {"connect_timeout": 10}
    if "application_name" not in parsed.query:
        connect_args["application_name"] = application_name
    try:
        return create_engine(
            parsed, pool_size=pool_size, max_overflow=max_overflow, connect_args=connect_args
        )
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as exc:
        raise UsageError(f"cannot use database URL {parsed!r}: {one_line(exc)}") from None


def check_database(engine: Engine) -> None:
    """Connect once and check the schema is at sqlaq's head.

    Raises:
        UsageError: the database cannot be reached, or its schema is not sqlaq's head
            (the message names the command to run).
    """
    try:
        with engine.connect() as conn:
            migrations.check(conn)
    except SchemaOutOfDateError as exc:
        raise UsageError(str(exc)) from None
    except sa_exc.DBAPIError as exc:
        cause = exc.orig if exc.orig is not None else exc
        raise UsageError(f"cannot use the database at {engine.url!r}: {one_line(cause)}") from None


def _redact(url: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def one_line(error: object) -> str:
    """*error*'s text on one line (driver messages span several)."""
    return " ".join(str(error).split())


# -- running -------------------------------------------------------------------------


@contextmanager
def _signals_stop(worker: Worker) -> Iterator[list[int]]:
    received: list[int] = []

    def handle(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            _log.info("received %s: stopping; send it again to stop at once", name)
            worker.stop()
        else:
            _log.warning("received %s again: handing running jobs back now", name)
            worker.stop(now=True)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _run_in_thread(worker: Worker) -> None:
    failure: list[BaseException] = []

    def target() -> None:
        try:
            worker.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="sqlaq-worker")
    thread.start()
    thread.join()  # interrupted by signals, which run their handler and wait again
    if failure:
        raise failure[0]


def run_worker(argv: Sequence[str] | None, environ: Mapping[str, str]) -> int:
    """``sqlaq-worker`` with explicit arguments and environment; returns the exit code."""
    try:
        options = parse_options(argv, environ)
        configure_logging(options.log_level, options.log_format)
        registry = load_registry(options.app)
        engine = database_engine(
            options.database_url,
            application_name=WORKER_APPLICATION_NAME,
            max_overflow=options.config.concurrency,
        )
        try:
            check_database(engine)
            metrics = _start_metrics(engine, options.metrics_port)
            worker = Worker(
                engine,
                registry,
                options.config,
                on_job_started=metrics.job_started if metrics else None,
                on_job_finished=metrics.job_finished if metrics else None,
            )
            try:
                with _signals_stop(worker) as received:
                    _run_in_thread(worker)
            finally:
                if metrics is not None:
                    metrics.close()
        finally:
            engine.dispose()
    except (UsageError, ConfigError) as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the worker's own handlers were in place
        return EXIT_INTERRUPTED
    return EXIT_FORCED if len(received) > 1 else EXIT_OK


def _start_metrics(engine: Engine, port: int) -> WorkerMetrics | None:
    if not port:
        return None
    from sqlaq.metrics import WorkerMetrics  # only with the prometheus extra

    metrics = WorkerMetrics(engine)
    try:
        metrics.serve(port)
    except OSError as exc:
        raise UsageError(f"cannot serve metrics on port {port}: {one_line(exc)}") from None
    _log.info("serving metrics", extra={"port": port})
    return metrics


def worker_main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``sqlaq-worker``."""
    sys.exit(run_worker(argv, os.environ))


def admin_main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of ``sqlaq``, the operator command (see :mod:`sqlaq.admin`)."""
    from sqlaq import admin  # imported here: admin builds on this module's helpers

    sys.exit(admin.run(sys.argv[1:] if argv is None else argv, os.environ))


if __name__ == "__main__":
    worker_main()
