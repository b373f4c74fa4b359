"""``sqlaq-worker`` and ``sqlaq``: options, configuration errors, burst runs.

Configuration errors run the command as a real process, to see exactly what reaches
stderr and the exit code; option resolution is tested on ``parse_options`` with an
explicit environment (nothing here reads or writes ``os.environ`` of the test process).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from datetime import timedelta
from typing import Any

import docsamples
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from workerkit import TESTS_DIR, count_status, ledger_table, rows, worker_env

import sqlaq
from sqlaq.cli import COMMAND_OPTIONS, GC_THRESHOLD, UsageError, parse_duration, parse_options
from sqlaq.config import WORKER_OPTIONS, WorkerConfig

README = TESTS_DIR.parent / "README.md"
# Each test that starts processes or threads sets its own, tighter bound.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ledger(committed: Engine) -> Iterator[Engine]:
    """The ledger table (on a truncated queue), dropped after the test."""
    yield from ledger_table(committed)


def run_cli(
    *args: str, database_url: str | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``sqlaq-worker *args`` to completion (from the tests directory)."""
    environment = worker_env(database_url or "", **env)
    if database_url is None:
        del environment["SQLAQ_DATABASE_URL"]
    return subprocess.run(
        [sys.executable, "-m", "sqlaq.cli", *args],
        cwd=TESTS_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_usage_error(
    result: subprocess.CompletedProcess[str], *fragments: str, code: int = 2
) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sqlaq-worker: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# -- configuration errors: one line, exit 2 --------------------------------------------


@pytest.mark.timeout(60)
def test_bad_flag_is_one_line_exit_2(database_url: str) -> None:
    result = run_cli("worker_app:registry", "--bogus", database_url=database_url)
    assert_usage_error(result, "unrecognized arguments: --bogus", "--help")
    result = run_cli("worker_app:registry", "--concurrency", "many", database_url=database_url)
    assert_usage_error(result, "--concurrency", "invalid integer 'many'")
    result = run_cli("worker_app:registry", "--concurrency", "0", database_url=database_url)
    assert_usage_error(result, "concurrency must be between 1")


@pytest.mark.timeout(60)
def test_unknown_module_attribute_or_not_a_registry_is_one_line_exit_2(
    database_url: str,
) -> None:
    assert_usage_error(
        run_cli("no_such_module:registry", database_url=database_url),
        "cannot import 'no_such_module'",
    )
    assert_usage_error(
        run_cli("worker_app:nothing_here", database_url=database_url),
        "module 'worker_app' has no attribute 'nothing_here'",
    )
    assert_usage_error(
        run_cli("worker_app:NOT_A_REGISTRY", database_url=database_url),
        "worker_app:NOT_A_REGISTRY is a dict, not a sqlaq.Registry",
    )
    assert_usage_error(run_cli("worker_app", database_url=database_url), "module:attribute")


@pytest.mark.timeout(60)
def test_unreachable_database_is_one_line_exit_1_after_the_start_timeout() -> None:
    """Unavailable, not misconfigured: a supervisor may start the command again."""
    result = run_cli(
        "worker_app:registry",
        "--database-url",
        "postgresql://postgres:secret@127.0.0.1:1/nowhere",
        "--start-timeout",
        "0",
    )
    assert_usage_error(
        result, "the database at", "127.0.0.1:1", "unavailable after 0s (start_timeout)", code=1
    )
    assert "secret" not in result.stderr


@pytest.mark.timeout(60)
def test_missing_database_url_or_bad_variable_is_one_line_exit_2(database_url: str) -> None:
    # Without sqlaq[embedded] (hidden from this process; with it, see test_embedded.py).
    environment = worker_env("")
    del environment["SQLAQ_DATABASE_URL"]
    without_embedded = (
        "import sys; sys.modules['sqlaq.embedded'] = None; "
        "from sqlaq.cli import worker_main; worker_main()"
    )
    missing = subprocess.run(
        [sys.executable, "-c", without_embedded, "worker_app:registry"],
        cwd=TESTS_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert_usage_error(missing, "no database URL", "SQLAQ_DATABASE_URL", "sqlaq[embedded]")
    assert_usage_error(
        run_cli("worker_app:registry", database_url=database_url, SQLAQ_LEASE="soon"),
        "SQLAQ_LEASE: invalid duration 'soon'",
    )


@pytest.mark.timeout(60)
def test_database_without_the_schema_is_one_line_exit_2(empty_database_url: str) -> None:
    result = run_cli("worker_app:registry", database_url=empty_database_url)
    assert_usage_error(result, "schema is not installed", "alembic upgrade heads", "sqlaq migrate")
    # The documentation shows this very line as the example of a configuration error.
    (shown,) = docsamples.find_blocks("", "sqlaq-worker: error: sqlaq's schema is not installed")
    assert shown.code.strip() == result.stderr.strip(), shown.where


# -- running ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_burst_runs_sync_and_async_handlers_then_exits_0(ledger: Engine, database_url: str) -> None:
    with ledger.begin() as conn:
        sqlaq.enqueue_many(
            conn, [sqlaq.NewJob(kind) for kind in ("record", "async_record") for _ in range(50)]
        )
        sqlaq.enqueue(conn, "record", delay=timedelta(hours=1))  # not due: not waited for
    result = run_cli(
        "worker_app:registry",
        "--burst",
        "--log-format",
        "json",
        "--log-level",
        "debug",  # "job done" is a DEBUG line
        database_url=database_url,
    )
    assert result.returncode == 0, result.stderr
    assert count_status(ledger, "done") == 100
    notes = rows(ledger, "SELECT note, count(*) FROM sqlaq_test_ledger GROUP BY note ORDER BY 1")
    assert [tuple(r) for r in notes] == [("", 50), ("async", 50)]
    assert '"message": "job done"' in result.stderr
    assert '"job_id": ' in result.stderr


def test_the_command_tunes_its_process_s_garbage_collector(
    ledger: Engine, database_url: str
) -> None:
    """What the process held once started is frozen, and the youngest generation waits
    for GC_THRESHOLD objects (sqlaq.cli.tune_garbage_collector)."""
    with ledger.begin() as conn:
        sqlaq.enqueue(conn, "gc_settings")
    result = run_cli("worker_app:registry", "--burst", database_url=database_url)
    assert result.returncode == 0, result.stderr
    (note,) = rows(ledger, "SELECT note FROM sqlaq_test_ledger")
    assert note[0] == f"threshold={GC_THRESHOLD} frozen=True"


@pytest.mark.timeout(60)
def test_burst_with_a_flaky_handler_retries_with_backoff(ledger: Engine, database_url: str) -> None:
    with ledger.begin() as conn:
        job_id = sqlaq.enqueue(conn, "flaky", {"succeed_on": 2}).job_id
    result = run_cli("worker_app:registry", "--burst", database_url=database_url)
    assert result.returncode == 0, result.stderr
    # Burst mode stops once nothing is due: the retry is scheduled, not run.
    row = rows(
        ledger, "SELECT status, attempts, last_error FROM sqlaq_jobs WHERE id = :id", id=job_id
    )[0]
    assert (row.status, row.attempts) == ("queued", 1)
    assert row.last_error.startswith("OSError: flaky failure")
    assert "job failed, will retry" in result.stderr


def test_help_names_the_variable_of_every_flag() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    shown = " ".join(result.stdout.split())
    for option in (*COMMAND_OPTIONS, *WORKER_OPTIONS):
        assert f"(env: {option.env};" in shown
        assert option.positional or f"{option.flag_name} " in shown


def test_every_worker_option_is_declared_once_on_its_field() -> None:
    """WorkerConfig's fields are the worker's options: same names, same defaults."""
    assert [o.name for o in WORKER_OPTIONS] == [f.name for f in fields(WorkerConfig)]
    defaults = WorkerConfig()
    for option in WORKER_OPTIONS:
        assert option.default == getattr(defaults, option.name)
        assert option.env == "SQLAQ_" + option.name.upper()


def _generated_reference() -> Any:
    """docs/gen_reference.py, which writes the reference pages of the documentation."""
    path = README.parent / "docs" / "gen_reference.py"
    spec = importlib.util.spec_from_file_location("sqlaq_docs_gen_reference", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_lists_every_flag_and_variable() -> None:
    """The documentation's configuration table, generated from the declared options."""
    text = _generated_reference().configuration_markdown()
    table = [line for line in text.splitlines() if line.startswith("| `")]
    for option in (*COMMAND_OPTIONS, *WORKER_OPTIONS):
        flag = option.name.upper() if option.positional else option.flag_name
        assert any(f"`{flag}`" in row and f"`{option.env}`" in row for row in table), flag


def test_flag_beats_variable_beats_default() -> None:
    environ = {
        "SQLAQ_DATABASE_URL": "postgresql://from-sqlaq-variable/db",
        "DATABASE_URL": "postgresql://from-plain-variable/db",
        "SQLAQ_CONCURRENCY": "5",
        "SQLAQ_LEASE": "10s",
        "SQLAQ_QUEUES": "a, b",
        "SQLAQ_BURST": "true",
    }
    options = parse_options(["app:registry", "--concurrency", "3", "--no-burst"], environ)
    assert options.config.concurrency == 3
    assert options.config.burst is False
    assert options.config.lease == timedelta(seconds=10)
    assert options.config.queues == ("a", "b")
    assert options.config.poll_interval == sqlaq.WorkerConfig().poll_interval
    assert options.database_url == "postgresql://from-sqlaq-variable/db"
    assert (options.log_level, options.log_format) == ("info", "text")

    options = parse_options(
        ["--queue", "x", "--queue", "y,z", "--database-url", "postgresql://flag/db"],
        {"SQLAQ_APP": "app:registry", "DATABASE_URL": "postgresql://plain/db"},
    )
    assert options.app == "app:registry"
    assert options.config.queues == ("x", "y", "z")
    assert options.database_url == "postgresql://flag/db"
    assert parse_options(["a:b"], {"DATABASE_URL": "postgresql://plain/db"}).database_url == (
        "postgresql://plain/db"
    )


def test_durations_take_seconds_or_a_unit() -> None:
    assert parse_duration("30") == timedelta(seconds=30)
    assert parse_duration("2.5") == timedelta(seconds=2.5)
    assert parse_duration("500ms") == timedelta(milliseconds=500)
    assert parse_duration("5m") == timedelta(minutes=5)
    assert parse_duration("1h") == timedelta(hours=1)
    assert parse_duration("7d") == timedelta(days=7)
    for bad in ("", "-1", "soon", "5 parsecs"):
        with pytest.raises(ValueError, match="invalid duration"):
            parse_duration(bad)
    with pytest.raises(UsageError, match="SQLAQ_POLL_INTERVAL"):
        parse_options(["a:b"], {"DATABASE_URL": "postgresql://x/y", "SQLAQ_POLL_INTERVAL": "x"})


def test_maintenance_prefetch_and_retention_options() -> None:
    environ = {"DATABASE_URL": "postgresql://x/y", "SQLAQ_RETAIN_FAILED": "forever"}
    options = parse_options(
        [
            "a:b",
            "--prefetch", "50",
            "--no-maintenance",
            "--maintenance-interval", "2s",
            "--retain-done", "1d",
        ],
        environ,
    )  # fmt: skip
    config = options.config
    assert (config.prefetch, config.maintenance) == (50, False)
    assert config.maintenance_interval == timedelta(seconds=2)
    assert (config.retain_done, config.retain_failed) == (timedelta(days=1), None)
    defaults = parse_options(["a:b"], {"DATABASE_URL": "postgresql://x/y"}).config
    assert (defaults.retain_done, defaults.retain_failed) == (
        timedelta(days=7),
        timedelta(days=30),
    )
    assert (defaults.prefetch, defaults.maintenance) == (None, True)  # prefetch: auto
    with pytest.raises(UsageError, match="prefetch must be between 0"):
        parse_options(["a:b", "--prefetch", "-1"], environ)
    with pytest.raises(UsageError, match="invalid duration 'someday'"):
        parse_options(["a:b", "--retain-done", "someday"], environ)


# -- PgBouncer: --listen-url and ?prepare_threshold= ------------------------------------


def test_listen_url_option_flag_variable_and_python_api() -> None:
    environ = {"DATABASE_URL": "postgresql://x/y", "SQLAQ_LISTEN_URL": "postgresql://env/db"}
    assert parse_options(["a:b"], environ).config.listen_url == "postgresql://env/db"
    options = parse_options(["a:b", "--listen-url", "postgres://u:pw@direct:5432/db"], environ)
    assert options.config.listen_url == "postgres://u:pw@direct:5432/db"
    assert "pw" not in repr(options.config)  # a password stays out of logs and reprs
    defaults = parse_options(["a:b"], {"DATABASE_URL": "postgresql://x/y"}).config
    assert defaults.listen_url is None
    config = WorkerConfig(listen_url=make_url("postgresql+asyncpg://u:pw@h/d"))
    assert config.listen_url == "postgresql+asyncpg://u:pw@h/d"  # kept as text
    for bad, fragment in (
        ("mysql://u:secret@h/d", "is not a PostgreSQL URL"),
        ("not a url", "invalid URL 'not a url'"),
        ("postgresql://h:70000/d", "the port must be 0 to 65535"),
        ("postgresql://h/d?prepare_threshold=soon", "prepare_threshold: invalid integer 'soon'"),
        ("   ", "empty; leave it unset"),
    ):
        with pytest.raises(UsageError, match=r"^--listen-url: ") as flag_error:
            parse_options(["a:b", "--listen-url", bad], environ)
        assert fragment in str(flag_error.value)
        assert "secret" not in str(flag_error.value)
        with pytest.raises(UsageError, match=r"^SQLAQ_LISTEN_URL: "):
            parse_options(["a:b"], {**environ, "SQLAQ_LISTEN_URL": bad})
    with pytest.raises(sqlaq.ConfigError, match="listen_url must be a database URL"):
        WorkerConfig(listen_url=5432)


def with_query(url: str, **params: str) -> str:
    """*url* with *params* added to its query (which may hold ``?host=`` already)."""
    return make_url(url).update_query_dict(params).render_as_string(hide_password=False)


@pytest.mark.timeout(60)
def test_bad_listen_url_or_prepare_threshold_is_one_line_exit_2(
    database_url: str, empty_database_url: str
) -> None:
    assert_usage_error(
        run_cli("worker_app:registry", "--listen-url", "mysql://x/y", database_url=database_url),
        "--listen-url: 'mysql://x/y' is not a PostgreSQL URL",
    )
    bad_threshold = with_query(database_url, prepare_threshold="sometimes")
    assert_usage_error(
        run_cli("worker_app:registry", "--database-url", bad_threshold),
        "invalid database URL",
        "prepare_threshold: invalid integer 'sometimes'; use none",
    )
    assert_usage_error(
        run_cli(
            "worker_app:registry",
            "--listen-url",
            "postgresql://postgres:secret@127.0.0.1:1/nowhere",
            "--start-timeout",
            "0",
            database_url=database_url,
        ),
        "the listen URL",
        "127.0.0.1:1",
        "unavailable after 0s",
        code=1,
    )
    # Another database: its NOTIFY and advisory locks are not the queue's.
    result = run_cli(
        "worker_app:registry", "--listen-url", empty_database_url, database_url=database_url
    )
    assert_usage_error(result, "reaches database", "not the queue's", "directly")


@pytest.mark.timeout(60)
def test_burst_with_prepare_threshold_none_and_a_listen_url(
    ledger: Engine, database_url: str
) -> None:
    with ledger.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("record") for _ in range(20)])
    result = run_cli(
        "worker_app:registry",
        "--burst",
        "--database-url",
        with_query(database_url, prepare_threshold="none"),
        "--listen-url",
        database_url,
        database_url=database_url,
    )
    assert result.returncode == 0, result.stderr
    assert count_status(ledger, "done") == 20
