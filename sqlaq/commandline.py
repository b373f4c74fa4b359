"""What both commands (``sqlaq-worker`` and ``sqlaq``) share: errors, parsers, the database.

This module owns :class:`UsageError` (a bad command line, variable or environment,
printed as one line, exit 2), the argument parser that reports its errors that way,
the database URL's resolution and engine (async URLs mapped to psycopg), and the
worker's start check as usage errors (:mod:`sqlaq.worker.startup` owns it). It is the bottom of the
command layer: ``cli.py`` and ``admin.py`` import it, and nothing below them imports
any of the three. It reads no environment itself: the commands hand it theirs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from sqlalchemy import Engine, create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from sqlaq.bounds import set_max_payload_bytes
from sqlaq.dsn import ASYNC_DRIVERS, SYNC_DRIVER, sync_url
from sqlaq.errors import ConfigError, SchemaOutOfDateError, one_line
from sqlaq.option import Domain, Integer, PrepareThreshold, Text
from sqlaq.registry import Registry
from sqlaq.worker import startup
from sqlaq.worker.startup import WORKER_PRIVILEGES

__all__ = [
    "EXIT_USAGE",
    "WORKER_PRIVILEGES",
    "CommandParser",
    "UsageError",
    "check_database",
    "database_engine",
    "database_url",
    "db_error",
    "load_registry",
    "one_line",
    "payload_limit",
    "redact",
    "typed",
]

T = TypeVar("T")

#: The exit code of a usage or configuration error (one line on stderr).
EXIT_USAGE = 2

_MAX_PORT = 65535


class UsageError(Exception):
    """A bad command line, variable or environment; printed as one line, exit 2."""


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one-line :class:`UsageError` s, without
    abbreviated flags (a shortened flag could start meaning another one later)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Raise *message* as a UsageError (argparse prints usage and exits)."""
        raise UsageError(f"{message} (see {self.prog} --help)")


def typed(domain: Domain[T], label: str) -> Callable[[str], T]:
    """An argparse ``type=`` that parses with *domain*, naming *label* on error.

    It raises :class:`UsageError`, which argparse lets through untouched (it catches
    only ValueError, TypeError and ArgumentTypeError), so the message stays ours.
    """

    def convert(text: str) -> T:
        try:
            return domain.parse(text, label)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None

    convert.__name__ = label
    return convert


def payload_limit(environ: Mapping[str, str]) -> None:
    """Set the process's payload limit from ``SQLAQ_MAX_PAYLOAD_BYTES``, if set (see
    :func:`sqlaq.bounds.set_max_payload_bytes`).

    Raises:
        UsageError: it is not a number of bytes from 2 to 255 MiB.
    """
    text = environ.get("SQLAQ_MAX_PAYLOAD_BYTES")
    if text:
        limit = typed(Integer(2, 255 * 1024 * 1024), "SQLAQ_MAX_PAYLOAD_BYTES")(text)
        set_max_payload_bytes(limit)


def database_url(flag: str | None, environ: Mapping[str, str]) -> str:
    """The database URL: *flag*, else ``SQLAQ_DATABASE_URL``, else ``DATABASE_URL``, else,
    with ``sqlaq[embedded]`` installed, the embedded server's (:mod:`sqlaq.embedded`,
    in ``SQLAQ_EMBEDDED_DIR`` or ``.sqlaq``: started or joined here, after one notice
    line on stderr saying that no URL was given and what is created or started where).
    With a URL given, nothing embedded is started.

    Raises:
        UsageError: none is set and the extra is not installed, the embedded server did
            not start, or the URL is not text PostgreSQL can take.
    """
    for label, url in (
        ("--database-url", flag),
        ("SQLAQ_DATABASE_URL", environ.get("SQLAQ_DATABASE_URL")),
        ("DATABASE_URL", environ.get("DATABASE_URL")),
    ):
        if url:
            return typed(Text(), label)(url)
    try:
        from sqlaq import embedded
    except ImportError:
        raise UsageError(
            "no database URL: pass --database-url or set SQLAQ_DATABASE_URL (or DATABASE_URL),"
            " or pip install 'sqlaq[embedded]' for a local server of sqlaq's own"
        ) from None
    folder = environ.get("SQLAQ_EMBEDDED_DIR") or None

    def say(sentence: str) -> None:  # before anything is created or started
        print(
            "notice: no database URL given (--database-url, SQLAQ_DATABASE_URL, "
            f"DATABASE_URL): {sentence}",
            file=sys.stderr,
            flush=True,
        )

    try:
        return embedded.database_url(folder, notice=say)
    except (embedded.EmbeddedServerError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise UsageError(f"no database URL, and {reason}") from None


def database_engine(
    url: str,
    *,
    application_name: str,
    notice: Callable[[str], None],
    pool_size: int = 2,
    max_overflow: int = 8,
) -> Engine:
    """An engine for a command: psycopg, named *application_name* in pg_stat_activity.

    ``postgresql://`` and ``postgres://`` URLs get the psycopg driver; so do async ones
    (``postgresql+asyncpg://``, ``postgresql+psycopg_async://``, what async applications
    keep in ``DATABASE_URL``), with a *notice* saying so. An ``application_name`` in the
    URL wins. No ``pool_pre_ping``: the worker classifies a dead connection as transient
    and retries the turn, which costs nothing while the database is up.

    A ``prepare_threshold`` query parameter (``?prepare_threshold=none``, or a number)
    becomes psycopg's ``prepare_threshold`` connect argument: ``none`` turns prepared
    statements off, as PgBouncer in *transaction* pooling needs (SQLAlchemy would pass
    the text ``"none"`` to psycopg, which fails).

    Raises:
        UsageError: the URL cannot be parsed, is not PostgreSQL, names a driver that is
            not installed, or holds a ``prepare_threshold`` that is not none or a number.
    """
    parsed = _parse_url(url)
    if parsed.drivername in ASYNC_DRIVERS:
        notice(
            f"{parsed.drivername} is an async driver; this command is synchronous and "
            f"uses {SYNC_DRIVER} (psycopg) on the same URL"
        )
    parsed = sync_url(parsed)
    if not parsed.drivername.startswith("postgresql"):
        raise UsageError(f"sqlaq needs PostgreSQL; got a {parsed.drivername!r} URL")
    connect_args: dict[str, Any] = {"connect_timeout": 10}
    if "prepare_threshold" in parsed.query:
        connect_args["prepare_threshold"] = _prepare_threshold(parsed)
        parsed = parsed.difference_update_query(["prepare_threshold"])
    if "application_name" not in parsed.query:
        connect_args["application_name"] = application_name
    try:
        engine = create_engine(
            parsed, pool_size=pool_size, max_overflow=max_overflow, connect_args=connect_args
        )
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as exc:
        raise UsageError(f"cannot use database URL {parsed!r}: {one_line(exc)}") from None
    if engine.dialect.is_async:  # another async driver: it would fail at connect
        engine.dispose()
        raise UsageError(
            f"cannot use database URL {parsed!r}: {parsed.drivername} is an async driver; "
            f"use {SYNC_DRIVER}"
        )
    return engine


def _prepare_threshold(url: URL) -> int | None:
    value = url.query["prepare_threshold"]
    if not isinstance(value, str):  # ?prepare_threshold=1&prepare_threshold=2: a tuple
        raise UsageError(f"invalid database URL {url!r}: prepare_threshold is given more than once")
    try:
        return PrepareThreshold().parse(value, "prepare_threshold")
    except ConfigError as exc:
        raise UsageError(f"invalid database URL {url!r}: {exc}") from None


def _parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError:
        raise UsageError(f"invalid database URL {redact(url)!r}: not a URL") from None
    except ValueError:  # make_url's int() of a port such as "abc"
        parsed = None
    if parsed is None or not 0 <= (parsed.port or 0) <= _MAX_PORT:
        raise UsageError(
            f"invalid database URL {redact(url)!r}: the port must be a number from 0 to {_MAX_PORT}"
        ) from None
    return parsed


def check_database(engine: Engine, listen_url: str | None = None) -> None:
    """The worker's start check (:func:`sqlaq.worker.startup.check_database`, and
    :func:`~sqlaq.worker.startup.check_listen_url` with *listen_url*), tried once, as
    :class:`UsageError` s.

    Raises:
        UsageError: the database cannot be reached, its schema is not sqlaq's head
            (the message names the command to run), the role lacks a privilege the
            worker needs (the message names each missing one), or the listen URL
            reaches another database.
    """
    try:
        startup.check_database(engine)
        if listen_url:
            startup.check_listen_url(engine, listen_url)
    except (SchemaOutOfDateError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    except sa_exc.DBAPIError as exc:
        raise UsageError(f"cannot use the database at {engine.url!r}: {db_error(exc)}") from None


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


def db_error(exc: sa_exc.DBAPIError) -> str:
    """The driver's message of *exc* on one line (SQLAlchemy's adds the statement)."""
    return one_line(exc.orig if exc.orig is not None else exc)


def redact(url: str) -> str:
    """*url* with its password replaced by ``***``."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)
