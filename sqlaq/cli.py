"""The ``sqlaq-worker`` command (argv and environment -> config -> Worker), and both
commands' entry points.

This module owns the worker command's own options (:data:`COMMAND_OPTIONS`; the worker's
come from :data:`sqlaq.config.WORKER_OPTIONS`), logging set-up, signal handling and exit
codes, and is the worker command's error boundary: a usage or configuration error prints
one line to stderr and exits 2, without a traceback; so does a schema that is not this
sqlaq's head, at start or changed under the running worker (the worker's start check,
:mod:`sqlaq.worker.startup`). A database still unavailable after ``--start-timeout``
exits 1: a supervisor may restart the command later. The commands are the only modules
that read ``os.environ``, and nothing writes it. Precedence: flag > variable > default.

Signals: the worker runs in its own thread; the main thread only reads a pipe. A signal
writes its number to that pipe (``signal.set_wakeup_fd``: the interpreter's C-level
handler does, in whichever thread the signal lands) and nothing else runs in the
handler (it may interrupt any code, so it must not take a lock); the worker thread
writes a zero when it ends. The main thread acts on what it reads: the first
SIGTERM/SIGINT asks for a graceful stop, the second hands running jobs back at once
(exit 1), and the third exits the process at once (exit 1), however wedged the worker
is.

The shared helpers live in :mod:`sqlaq.commandline` (and :mod:`sqlaq.option`); the names
of earlier releases (``UsageError``, ``parse_duration``, ``database_engine``...) are
re-exported from here.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy import Engine

from sqlaq.commandline import (
    EXIT_USAGE,
    CommandParser,
    UsageError,
    check_database,
    database_engine,
    database_url,
    load_registry,
    one_line,
    payload_limit,
    typed,
)
from sqlaq.config import WORKER_OPTIONS, WorkerConfig
from sqlaq.errors import ConfigError, DatabaseUnavailableError, SchemaOutOfDateError
from sqlaq.logformat import configure_logging
from sqlaq.option import Boolean, Choice, Integer, Option, Text, parse_bool, parse_duration
from sqlaq.worker import WORKER_APPLICATION_NAME, Worker
from sqlaq.worker import pool as worker_pool

if TYPE_CHECKING:
    from sqlaq.admin import main as admin_main
    from sqlaq.metrics import WorkerMetrics
else:

    def __getattr__(name: str) -> Any:
        # admin_main (the ``sqlaq`` command's entry point) on first use: the worker
        # command does without the admin command's modules.
        if name == "admin_main":
            from sqlaq.admin import main

            return main
        raise AttributeError(f"module 'sqlaq.cli' has no attribute {name!r}")


__all__ = [
    "COMMAND_OPTIONS",
    "EXIT_FORCED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "GC_THRESHOLD",
    "UsageError",
    "WorkerOptions",
    "admin_main",
    "build_parser",
    "check_database",
    "database_engine",
    "load_registry",
    "one_line",
    "parse_bool",
    "parse_duration",
    "parse_options",
    "run_worker",
    "tune_garbage_collector",
    "worker_main",
]

#: Stopped as asked: the queue drained (``--burst``), or a single signal's graceful stop.
EXIT_OK = 0
#: Stopped by a second (or third) signal: running jobs were handed back, or abandoned.
EXIT_FORCED = 1
#: The database stayed unavailable for the whole ``start_timeout`` (worth restarting).
EXIT_UNAVAILABLE = 1
#: Interrupted (Ctrl-C) while starting, before signals were handled: 128 + SIGINT.
EXIT_INTERRUPTED = 130
PROG = "sqlaq-worker"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")

# Named, not __name__: run as "python -m sqlaq.cli" the module is "__main__".
_log = logging.getLogger("sqlaq.cli")

#: The command's own options, beside the worker's (:data:`sqlaq.config.WORKER_OPTIONS`).
COMMAND_OPTIONS: tuple[Option, ...] = (
    Option("app", Text(), None, "module:attribute naming a sqlaq.Registry",
           positional=True, shown="none", metavar="APP"),
    Option("database_url", Text(), None, "the queue's database",
           shown="$DATABASE_URL", metavar="URL"),
    Option("metrics_port", Integer(0, 65535), 0,
           "serve Prometheus /metrics on this port (needs sqlaq[prometheus]); 0: off",
           metavar="PORT"),
    Option("log_level", Choice(LOG_LEVELS), "info", "log threshold"),
    Option("log_format", Choice(LOG_FORMATS), "text", "log line format"),
)  # fmt: skip
_OPTIONS = (COMMAND_OPTIONS[0], COMMAND_OPTIONS[1], *WORKER_OPTIONS, *COMMAND_OPTIONS[2:])


# -- options ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``sqlaq-worker`` argument parser.

    A flag not given is absent from the namespace (``argparse.SUPPRESS``), so that a
    flag given as ``forever`` (None) still beats its variable.
    """
    parser = CommandParser(
        prog=PROG,
        description="Run sqlaq jobs: claim due jobs of the given queues and run their "
        "handlers until stopped (SIGTERM/SIGINT: graceful; a second one: hand running "
        "jobs back at once; a third: exit at once).",
        epilog="Durations: seconds (30, 2.5) or with a unit (500ms, 30s, 5m, 1h, 7d), "
        "at most 100 years.",
        argument_default=argparse.SUPPRESS,
    )
    for option in _OPTIONS:
        help_text = option.help_text().replace("%", "%%")
        metavar = option.metavar or option.domain.metavar
        if option.positional:
            parser.add_argument(
                option.name,
                nargs="?",
                type=typed(option.domain, metavar),
                metavar=metavar,
                help=help_text,
            )
        elif isinstance(option.domain, Boolean):
            parser.add_argument(
                option.flag_name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(
                option.flag_name,
                dest=option.name,
                action="append" if option.repeatable else "store",
                type=typed(option.domain, option.flag_name),
                metavar=metavar,
                help=help_text,
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
        UsageError: a bad flag, variable or value; the message is one line and names
            the flag or variable.
    """
    given = vars(build_parser().parse_args(argv))
    values = {option.name: _resolve(option, given, environ) for option in _OPTIONS}
    if not values["app"]:
        raise UsageError(
            "missing APP: name the registry as module:attribute, e.g. myapp.jobs:registry"
        )
    try:
        config = WorkerConfig(**{option.name: values[option.name] for option in WORKER_OPTIONS})
    except ConfigError as exc:  # each value was checked already; kept as a safety net
        raise UsageError(str(exc)) from None
    return WorkerOptions(
        app=values["app"],
        database_url=database_url(values["database_url"], environ),
        config=config,
        log_level=values["log_level"],
        log_format=values["log_format"],
        metrics_port=values["metrics_port"],
    )


def _resolve(option: Option, given: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    """Flag > variable > default; a value from a flag was parsed by argparse already."""
    if option.name in given:  # even None: "--retain-done forever"
        flag_value = given[option.name]
        if option.repeatable:  # one tuple per repetition of the flag
            flat = tuple(name for names in flag_value for name in names)
            return _checked(option, flat, option.flag_name)
        return flag_value
    text = environ.get(option.env)
    if text is None or text == "":
        return option.default
    try:
        return option.domain.parse(text, option.env)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _checked(option: Option, value: Any, label: str) -> Any:
    try:
        return option.domain.check(value, label)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


# -- running ---------------------------------------------------------------------------

#: What the worker thread writes to the signal pipe when :meth:`Worker.run` returns.
_WORKER_ENDED = 0


@contextmanager
def _signal_pipe(*, keep: bool = False) -> Iterator[tuple[int, int]]:
    """A pipe that SIGTERM and SIGINT write their numbers to; all restored on exit
    (*keep*: but the handlers, which then ignore both until the process ends: by
    ``SIG_IGN``, not the Python-level handler, which the interpreter's finalization puts
    back to the default action, so a signal landing while it exits would end it).

    The write is the interpreter's C-level handler's (``signal.set_wakeup_fd``), in
    whichever thread the signal lands: a Python-level handler runs only in the main
    thread, and only once it executes bytecode, so a signal taken by another thread
    would never wake a main thread blocked in ``os.read``. The Python-level handler
    is installed (the default action would end the process) and does nothing.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield read_end, write_end
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_IGN if keep else old)
        signal.set_wakeup_fd(previous_fd)
        os.close(read_end)
        os.close(write_end)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler of SIGTERM and SIGINT: the wakeup fd did the work."""


def _run_until_signalled(worker: Worker, body: Callable[[], None], *, exiting: bool = False) -> int:
    """Run *body* (the worker, then its clean-up) in a thread; act on signals until it
    ends. Returns the exit code. *exiting*: see :func:`run_worker`."""
    failure: list[BaseException] = []
    with _signal_pipe(keep=exiting) as (read_end, write_end):

        def target() -> None:
            try:
                body()
            except BaseException as exc:
                failure.append(exc)
            finally:
                os.write(write_end, bytes([_WORKER_ENDED]))

        # A daemon: after a third signal the process exits without waiting for it.
        thread = threading.Thread(target=target, name="sqlaq-worker", daemon=True)
        thread.start()
        signals = 0
        while (received := os.read(read_end, 1)[0]) != _WORKER_ENDED:
            signals += 1
            _on_signal(worker, signal.Signals(received).name, signals)
        thread.join()
    if failure:
        raise failure[0]
    return EXIT_FORCED if signals > 1 else EXIT_OK


def _on_signal(worker: Worker, name: str, count: int) -> None:
    """The *count*-th stop signal: graceful stop, then hand back now, then exit now."""
    if count == 1:
        _log.info("received %s: stopping; send it again to hand running jobs back now", name)
        worker.stop()
    elif count == 2:
        _log.warning("received %s again: handing running jobs back now; a third exits", name)
        worker.stop(now=True)
    else:
        _log.error("received %s a third time: exiting now, without waiting for the worker", name)
        logging.shutdown()  # flush the log line; os._exit skips every clean-up
        os._exit(EXIT_FORCED)


def run_worker(
    argv: Sequence[str] | None, environ: Mapping[str, str], *, exiting: bool = False
) -> int:
    """``sqlaq-worker`` with explicit arguments and environment; returns the exit code.

    *exiting*: the process ends when this returns (the ``sqlaq-worker`` command), so
    SIGTERM and SIGINT stay ignored once the worker has stopped: the last signal of a
    quick burst that lands after a forced stop leaves the exit code to the command
    instead of ending the process by its default action. Otherwise (a worker run inside
    another program) the program's own handlers are put back.
    """
    try:
        payload_limit(environ)
        options = parse_options(argv, environ)
        configure_logging(options.log_level, options.log_format)
        registry = load_registry(options.app)
        pool_size, max_overflow = worker_pool.sized(options.config, registry)
        engine = database_engine(
            options.database_url,
            application_name=WORKER_APPLICATION_NAME,
            notice=_log.warning,
            pool_size=pool_size,
            max_overflow=max_overflow + (1 if options.metrics_port else 0),
        )
        try:
            metrics = _start_metrics(engine, options.metrics_port)
            worker = Worker(
                engine,
                registry,
                options.config,
                on_job_started=metrics.job_started if metrics else None,
                on_job_finished=metrics.job_finished if metrics else None,
            )
        except BaseException:
            engine.dispose()
            raise
        tune_garbage_collector()

        def body() -> None:
            # Clean-up runs in the worker's thread too, so a signal during it is still
            # acted on (a third one exits at once).
            try:
                worker.run()
            finally:
                if metrics is not None:
                    metrics.close()
                engine.dispose()

        return _run_until_signalled(worker, body, exiting=exiting)
    except (UsageError, ConfigError, SchemaOutOfDateError) as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except DatabaseUnavailableError as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:  # before the signal pipe was in place
        return EXIT_INTERRUPTED


#: Objects allocated (net of those freed) between two collections of the youngest
#: generation in a worker process; Python's default is 700.
GC_THRESHOLD = 50_000


def tune_garbage_collector() -> None:
    """Tune the garbage collector of a worker process (the command's: its process is
    its own; an application running :class:`~sqlaq.Worker` itself decides for its own).

    - What the process holds once started (modules, the ORM, compiled statements) is
      frozen (``gc.freeze()``): no later collection walks it again.
    - The youngest generation is collected after :data:`GC_THRESHOLD` new objects
      instead of 700. A job's objects (its run, context, task, payload...) live as long
      as the job and are freed by their reference counts, not by the collector; at 700,
      the collector ran every few milliseconds of a drain, walked every job in hand,
      and moved them on to older generations, whose full collections then walked them
      again. Cycles (a caught exception and its traceback...) wait a little longer.

    A 10 ms async drain (``bench/drain_probe.py 60000 400 200 async``) spent 750-880 ms
    of its 5 s in the collector at the defaults, 12-23 ms tuned (bench/RESULTS.md,
    "The wake-up's thread, the garbage collector, less Python per job").
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, older, oldest)


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
    sys.exit(run_worker(argv, os.environ, exiting=True))


if __name__ == "__main__":
    worker_main()
