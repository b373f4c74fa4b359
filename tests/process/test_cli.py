"""``sqlaq-worker`` and ``sqlaq``: options, configuration errors, burst runs, inputs
out of range, signals.

Configuration errors run the command as a real process, to see exactly what reaches
stderr and the exit code; option resolution is tested on ``parse_options`` with an
explicit environment (nothing here reads or writes ``os.environ`` of the test process).

Every flag and variable of both commands is parsed into range: one line, exit 2.
Durations are at most 100 years (``sqlaq.bounds.MAX_DURATION``), integers within their
column's or the OS's range, text free of NUL and of bytes that are not UTF-8 (which
reach Python as lone surrogates). Before, ``--lease 9999999999d`` or
``SQLAQ_RETAIN_DONE=9999999999d`` printed an OverflowError traceback,
``--poll-interval 999999999d`` was accepted and later killed a thread, and a filter
with undecodable bytes died in the driver. The property tests feed arbitrary text to
each parser: a value in range or the documented error, never another exception.

``sqlaq-worker``'s signals, on real processes: however fast they come, it ends.
The first SIGTERM/SIGINT stops gracefully, the second hands running jobs back at once,
the third exits at once. A signal handler only writes to a pipe: one that called
``Worker.stop()`` itself deadlocked when a second signal arrived while the first
handler held an event's lock, and then nothing but SIGKILL ended the process.

What the worker command does with the database it is given: async URLs, the role's
privileges. Each ends in one line, never a traceback. Before: an async app's
``DATABASE_URL`` (``postgresql+asyncpg://``) printed a 64-line MissingGreenlet
traceback; a role with SELECT and INSERT only passed the start-up check and died at its
first claim.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields
from datetime import timedelta
from typing import Any

import docsamples
import pytest
from cmdkit import assert_one_line, run_process
from helpers import login_role
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from workerkit import (
    MANY_WORKERS,
    START_TIMEOUT,
    TESTS_DIR,
    count_status,
    ledger_runs,
    ledger_table,
    rows,
    wait_until,
    worker_env,
    worker_processes,
)

import sqlaq
from sqlaq import admin
from sqlaq.bounds import MAX_DURATION
from sqlaq.cli import (
    COMMAND_OPTIONS,
    EXIT_FORCED,
    GC_THRESHOLD,
    UsageError,
    build_parser,
    parse_duration,
    parse_options,
)
from sqlaq.config import WORKER_OPTIONS, WorkerConfig
from sqlaq.errors import ConfigError
from sqlaq.option import (
    MAX_WEIGHT,
    AutoInteger,
    Boolean,
    Choice,
    Condition,
    Duration,
    Integer,
    Names,
    Text,
    Weights,
)
from sqlaq.worker import WORKER_APPLICATION_NAME

# Each test that starts processes or threads sets its own, tighter bound.
pytestmark = pytest.mark.timeout(120)

README = TESTS_DIR.parent / "README.md"


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
    engine: Engine, database_url: str, empty_database_url: str
) -> None:
    # engine: the suite's database migrated, so that the worker gets past its schema
    # check to the listen URL (alone, the test found no schema and exited 2).
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


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Text as a command line can carry it: any code point, lone surrogates included
#: (undecodable argv bytes), but no NUL (which argv and environ cannot hold).
ARGV_TEXT = st.text(st.characters(blacklist_characters="\x00"), max_size=40)
ANY_TEXT = st.text(max_size=40)
#: Numbers with a unit: how durations go wrong (huge, fractional, too small).
DURATION_TEXT = st.builds(
    "{}{}".format,
    st.one_of(
        st.integers(min_value=0, max_value=10**30).map(str),
        st.floats(min_value=0, allow_nan=False, allow_infinity=False).map(lambda f: f"{f:f}"),
    ),
    st.sampled_from(["", "ms", "s", "m", "h", "d"]),
)
ENV = {"DATABASE_URL": "postgresql://u@localhost/db"}


# -- sqlaq-worker ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "fragments"),
    [
        (["--lease", "9999999999d"], {}, ["--lease must be at most 100 years (36525d)"]),
        ([], {"SQLAQ_RETAIN_DONE": "9999999999d"}, ["SQLAQ_RETAIN_DONE must be at most 100"]),
        (["--poll-interval", "999999999d"], {}, ["--poll-interval must be at most 100 years"]),
        (["--maintenance-interval", "999999999d"], {}, ["--maintenance-interval must be at"]),
        (["--queue", "ok,b\udcffad"], {}, ["--queue", "is not valid UTF-8 text"]),
        ([], {"SQLAQ_QUEUES": "b\udcffad"}, ["SQLAQ_QUEUES", "is not valid UTF-8 text"]),
        (["--database-url", "postgresql+psycopg://u@h:abc/db"], {}, ["port must be a number"]),
        (["--metrics-port", "65536"], {}, ["--metrics-port must be between 0 and 65535"]),
    ],
)
def test_worker_flags_and_variables_out_of_range_are_one_line_exit_2(
    database_url: str, args: list[str], env: dict[str, str], fragments: list[str]
) -> None:
    url = [] if "--database-url" in args else ["--database-url", database_url]
    result = run_process("cli", "worker_app:registry", *url, *args, **env)
    assert_one_line(result, "sqlaq-worker: error: ", *fragments)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--grace-period", "36526d"], {}, "--grace-period must be at most 100 years"),
        (["--retain-failed", "1e400"], {}, "--retain-failed: invalid duration"),
        (["--concurrency", "10001"], {}, "--concurrency must be between 1 and 10000"),
        ([], {"SQLAQ_PREFETCH": "9" * 5000}, "SQLAQ_PREFETCH must be between 0 and 10000"),
        ([], {"SQLAQ_LEASE": "50ms"}, "SQLAQ_LEASE must be at least 0.1s"),
        (["--log-level", "loud"], {}, "--log-level: invalid choice 'loud'"),
        ([], {"SQLAQ_BURST": "maybe"}, "SQLAQ_BURST: invalid boolean 'maybe'"),
        (["--database-url", "postgresql://h/\x00"], {}, "--database-url"),
        ([], {"SQLAQ_APP": "\udcff:registry"}, "SQLAQ_APP"),
    ],
)
def test_parse_options_names_the_flag_or_variable_and_the_limit(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    app = [] if "SQLAQ_APP" in environ else ["app:registry"]
    with pytest.raises(UsageError, match=message) as raised:
        parse_options([*app, *argv], {**ENV, **environ})
    assert "\n" not in str(raised.value)


def test_durations_up_to_100_years_are_accepted_and_forever_keeps_for_ever() -> None:
    options = parse_options(
        ["a:b", "--lease", "36525d", "--retain-done", "forever", "--grace-period", "0"], ENV
    )
    assert options.config.lease == MAX_DURATION
    assert options.config.retain_done is None
    assert options.config.grace_period == timedelta(0)


def test_worker_config_refuses_what_the_command_refuses() -> None:
    too_long = MAX_DURATION + timedelta(microseconds=1)
    for name in ("lease", "poll_interval", "grace_period", "maintenance_interval"):
        with pytest.raises(ConfigError, match=f"{name} must be at most 100 years"):
            WorkerConfig.from_options(**{name: too_long})
    for name in ("retain_done", "retain_failed"):
        with pytest.raises(ConfigError, match=f"{name} must be at most 100 years"):
            WorkerConfig.from_options(**{name: timedelta.max})
    with pytest.raises(ConfigError, match="queues: queue contains a lone surrogate"):
        WorkerConfig(queues=["ok", "b\udcffad"])
    with pytest.raises(ConfigError, match="concurrency must be between 1 and 10000"):
        WorkerConfig(concurrency=10**100)


# -- sqlaq -----------------------------------------------------------------------------


def sqlaq_cmd(url: str | None, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    args = [*argv] if url is None else [*argv[:1], "--database-url", url, *argv[1:]]
    return admin.run(args, {}, out=out), out.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["list", "--since", "9999999999d"], "--since must be at most 100 years (36525d)"),
        (["prune", "--failed-older-than", "99999999999999999999999s"], "--failed-older-than"),
        (["enqueue", "k", "--delay", "36526d"], "--delay must be at most 100 years"),
        (["list", "--limit", "0"], "--limit must be between 1 and 9223372036854775807"),
        (["show", str(2**63)], "ID must be between 1 and 9223372036854775807"),
        (["retry", "0"], "ID must be between 1"),
        (["cancel", "-5"], "ID must be between 1"),
        (["enqueue", "k", "--priority", "40000"], "--priority must be between -32768 and"),
        (["enqueue", "k", "--max-attempts", "0"], "--max-attempts must be between 1 and"),
        (["list", "--kind", "b\udcffad"], "--kind: 'b\\udcffad' is not valid UTF-8 text"),
        (["list", "--queue", "nul\x00"], "--queue: 'nul\\x00' contains a NUL character"),
        (["retry", "--all", "--kind", "\udcff"], "--kind"),
        (["cancel", "--all", "--queue", "\udcff"], "--queue"),
        (["enqueue", "k\udcff"], "KIND: 'k\\udcff' is not valid UTF-8 text"),
        (["enqueue", "k", "--queue", "q\udcff"], "--queue"),
        (["enqueue", "k", "--dedupe-key", "\x00"], "--dedupe-key"),
        (["enqueue", "k", "--key", "\x00"], "--key"),
        (["enqueue", "k", "--payload", '{"x": "\udcff"}'], "--payload"),
        (["enqueue", "k", "--payload", '{"x": "a\\ud800b"}'], "payload['x'] contains a lone"),
        (["enqueue", "k", "--payload", "[" * 100_000], "--payload: invalid JSON payload"),
        (["enqueue", "k", "--payload", '{"x": ' + "9" * 5000 + "}"], "invalid JSON payload"),
    ],
)
def test_admin_values_out_of_range_or_not_text_are_one_line_exit_2(
    database_url: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _ = sqlaq_cmd(database_url, *argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert err.startswith("sqlaq: ")
    assert message in err


def test_admin_as_a_process_with_undecodable_argv_or_huge_duration(database_url: str) -> None:
    result = run_process("admin", "list", "--database-url", database_url, "--kind", "b\udcffad")
    assert_one_line(result, "sqlaq: --kind: ", "not valid UTF-8 text")
    result = run_process("admin", "list", "--database-url", database_url, "--since", "9999999999d")
    assert_one_line(result, "sqlaq: --since must be at most 100 years")


@pytest.mark.parametrize("command", ["cli", "admin"])
def test_a_port_that_is_not_a_number_is_one_line_exit_2(command: str) -> None:
    url = "postgresql+psycopg://u@h:abc/db"
    args = ["worker_app:registry", "--database-url", url] if command == "cli" else ["stats"]
    result = run_process(command, *args, SQLAQ_DATABASE_URL=url)
    prefix = "sqlaq-worker: error: " if command == "cli" else "sqlaq: "
    assert_one_line(result, prefix, "invalid database URL", "port must be a number")


def test_other_unusable_urls_are_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for url, message in [
        ("mysql://u@h/db", "sqlaq needs PostgreSQL; got a 'mysql' URL"),
        ("postgresql+nosuchdriver://u@h/db", "cannot use database URL"),
        ("postgresql://u@h:99999/db", "port must be a number from 0 to 65535"),
        ("not a url", "invalid database URL 'not a url'"),
    ]:
        code, _ = sqlaq_cmd(url, "stats")
        err = capsys.readouterr().err
        assert (code, err.count("\n")) == (2, 1), err
        assert message in err


# -- properties ------------------------------------------------------------------------

DOMAINS = [
    Duration(),
    Duration(minimum=timedelta(milliseconds=100), forever=True),
    Integer(1, 10_000),
    Integer(-32768, 32767),
    Integer(1, 2**63 - 1),
    AutoInteger(0, 10_000),
    Boolean(),
    Names(),
    Names(empty=True),
    Weights(),
    Choice(("debug", "info")),
    Text(),
    Condition(),
]


def attempt(call: Callable[[], Any], error: type[Exception]) -> tuple[Any, str | None]:
    """``(call(), None)``, or ``(None, message)`` when *call* raises *error*."""
    try:
        return call(), None
    except error as exc:
        return None, str(exc)


def _in_domain(domain: Any, value: Any) -> bool:
    if isinstance(domain, Duration):
        return (
            value is None
            if domain.forever and value is None
            else (domain.minimum <= value <= MAX_DURATION)
        )
    if isinstance(domain, Integer):
        return domain.low <= value <= domain.high
    if isinstance(domain, AutoInteger):  # None: 'auto'
        return value is None or (isinstance(value, int) and domain.low <= value <= domain.high)
    if isinstance(domain, Names):
        return (bool(value) or domain.empty) and all(
            isinstance(n, str) and n.strip() for n in value
        )
    if isinstance(domain, Weights):
        return isinstance(value, tuple) and all(
            isinstance(k, str) and k.strip() and 1 <= w <= MAX_WEIGHT for k, w in value
        )
    if isinstance(domain, Choice):
        return value in domain.choices
    if isinstance(domain, Condition):  # None: no condition; text is never blank
        return value is None or (isinstance(value, str) and bool(value.strip()))
    if value is None:  # only an optional URL (listen_url) takes None: the database URL
        return type(domain).__name__ == "DatabaseUrl"
    return isinstance(value, bool | str)


@PROPERTY
@given(
    domain=st.sampled_from(DOMAINS),
    text=st.one_of(ANY_TEXT, DURATION_TEXT, st.integers().map(str)),
)
def test_every_domain_parses_any_text_into_range_or_refuses_it(domain: Any, text: str) -> None:
    value, error = attempt(lambda: domain.parse(text, "--flag"), ConfigError)
    if error is not None:
        assert "\n" not in error
        return
    assert _in_domain(domain, value), value
    assert domain.check(value, "flag") == value  # what the command takes, the API takes


@PROPERTY
@given(
    option=st.sampled_from(WORKER_OPTIONS),
    text=st.one_of(ARGV_TEXT, DURATION_TEXT, st.integers().map(str)),
    as_variable=st.booleans(),
)
def test_every_worker_flag_and_variable_parses_or_is_a_usage_error(
    option: Any, text: str, as_variable: bool
) -> None:
    if as_variable:
        argv, environ = ["a:b"], {**ENV, option.env: text}
    elif isinstance(option.domain, Boolean):
        argv, environ = ["a:b", option.flag_name], ENV
    else:
        argv, environ = ["a:b", f"{option.flag_name}={text}"], ENV
    options, error = attempt(lambda: parse_options(argv, environ), UsageError)
    if error is not None:
        assert "\n" not in error
        assert option.flag_name in error or option.env in error
        return
    value = getattr(options.config, option.name)
    assert _in_domain(option.domain, value), value


ADMIN_ARGS = [
    ["list", "--since"],
    ["list", "--limit"],
    ["list", "--kind"],
    ["list", "--queue"],
    ["show"],
    ["retry"],
    ["cancel", "--all", "--kind"],
    ["prune", "--done-older-than"],
    ["enqueue", "k", "--delay"],
    ["enqueue", "k", "--priority"],
    ["enqueue", "k", "--max-attempts"],
    ["enqueue", "k", "--payload"],
    ["enqueue", "k", "--dedupe-key"],
    ["enqueue", "k", "--key"],
    ["enqueue"],
]


@PROPERTY
@given(
    args=st.sampled_from(ADMIN_ARGS),
    text=st.one_of(ARGV_TEXT, DURATION_TEXT, st.integers().map(str)),
)
def test_every_admin_value_parses_or_is_a_usage_error(args: list[str], text: str) -> None:
    last = args[-1]
    argv = [*args[:-1], f"{last}={text}"] if last.startswith("--") else [*args, "--", text]
    parsed, error = attempt(lambda: admin.build_parser().parse_args(argv), UsageError)
    if error is not None:
        assert "\n" not in error
        return
    for value in vars(parsed).values():
        if isinstance(value, timedelta):
            assert timedelta(0) <= value <= MAX_DURATION
        elif isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**63
        elif isinstance(value, str):
            value.encode("utf-8")  # storable: no lone surrogate
            assert "\x00" not in value


@PROPERTY
@given(
    name=st.sampled_from([o.name for o in WORKER_OPTIONS]),
    value=st.one_of(
        st.timedeltas(),
        st.integers(),
        st.booleans(),
        st.none(),
        ANY_TEXT,
        st.lists(ANY_TEXT, max_size=3),
    ),
)
def test_worker_config_takes_any_value_in_range_or_raises_config_error(
    name: str, value: Any
) -> None:
    config, error = attempt(lambda: WorkerConfig.from_options(**{name: value}), ConfigError)
    if error is not None:
        assert "\n" not in error
        assert name in error
        return
    option = next(o for o in WORKER_OPTIONS if o.name == name)
    assert _in_domain(option.domain, getattr(config, name))


WORKERS = 10
#: Long enough that nothing but a signal ends the worker within the test.
SLOW = {"seconds": 60}


@MANY_WORKERS
@pytest.mark.timeout(270)
def test_two_or_three_signals_in_quick_succession_always_end_the_worker(
    ledger: Engine, database_url: str
) -> None:
    queues = [f"signals_{i}" for i in range(WORKERS)]
    with ledger.begin() as conn:
        ids = [sqlaq.enqueue(conn, "sleep", SLOW, queue=q).job_id for q in queues]
    with worker_processes(database_url) as start:
        workers = [
            start("--queue", q, "--concurrency", "1", "--grace-period", "60s", "--no-maintenance")
            for q in queues
        ]
        # Ten processes starting at once on a loaded machine: their start-up (imports,
        # connections) is not what is tested. Each job runs once its worker has started.
        wait_until(
            lambda: all(ledger_runs(ledger, job_id) for job_id in ids),
            2 * START_TIMEOUT,
            "every worker's job to start",
        )
        for i, worker in enumerate(workers):
            # Two different signals never merge into one pending signal; a third may
            # merge with the first, which then makes two: exit 1 either way.
            burst = [signal.SIGTERM, signal.SIGINT, signal.SIGTERM][: 2 + i % 2]
            for sig in burst:
                worker.signal(sig)
            assert worker.wait(timeout=10) == EXIT_FORCED, worker.output()
            assert "Traceback" not in worker.output()
        # Handed back (or, after an exit at once, still leased): never done nor lost.
        # (Inside the block: a failure prints every worker's log.)
        jobs = rows(
            ledger,
            "SELECT id, status, attempts, last_error FROM sqlaq_jobs WHERE id = any(:ids)",
            ids=ids,
        )
        assert len(jobs) == WORKERS, jobs
        assert all(job.status in ("queued", "running") for job in jobs), jobs
        assert count_status(ledger, "done") == 0


@pytest.mark.timeout(120)
def test_third_signal_ends_a_worker_wedged_in_its_hand_back(
    ledger: Engine, database_url: str
) -> None:
    with ledger.begin() as conn:
        job_id = sqlaq.enqueue(conn, "sleep", SLOW, queue="wedged").job_id
    with worker_processes(database_url) as start, ledger.connect() as blocker:
        worker = start("--queue", "wedged", "--lease", "60s", "--grace-period", "60s")
        # After the process's start-up, which is not what is tested.
        wait_until(lambda: ledger_runs(ledger, job_id), START_TIMEOUT, "the job to start")
        # Hold the job's row: the hand-back's UPDATE waits for it, for ever.
        blocker.execute(text("SELECT id FROM sqlaq_jobs WHERE id = :id FOR UPDATE"), {"id": job_id})
        worker.signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in worker.output(), 10, "the first signal")
        worker.signal(signal.SIGINT)
        wait_until(lambda: _waiting_for_a_lock(ledger), 10, "the hand-back to wait on the row")
        assert worker.alive()
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=5) == EXIT_FORCED, worker.output()
        assert "a third time: exiting now" in worker.output()
        blocker.rollback()


def _waiting_for_a_lock(engine: Engine) -> bool:
    return bool(
        rows(
            engine,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = :name AND wait_event_type = 'Lock'",
            name=WORKER_APPLICATION_NAME,
        )
    )


# -- the database given: async URLs -----------------------------------------------------


def _with_driver(url: str, driver: str) -> str:
    return make_url(url).set(drivername=driver).render_as_string(hide_password=False)


@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg_async"])
def test_async_urls_run_on_psycopg_with_a_notice(
    committed: Engine, database_url: str, driver: str
) -> None:
    url = _with_driver(database_url, driver)
    with committed.begin() as conn:
        job_id = sqlaq.enqueue(conn, "noop").job_id

    worker = run_process("cli", "worker_app:registry", "--burst", DATABASE_URL=url)
    assert worker.returncode == 0, worker.stderr
    assert "Traceback" not in worker.stderr
    assert f"{driver} is an async driver" in worker.stderr
    assert count_status(committed, "done") == 1

    shown = run_process("admin", "show", str(job_id), "--json", SQLAQ_DATABASE_URL=url)
    assert shown.returncode == 0, shown.stderr
    assert f'"id": {job_id}' in shown.stdout
    assert shown.stderr.splitlines() == [
        f"sqlaq: notice: {driver} is an async driver; this command is synchronous and "
        "uses postgresql+psycopg (psycopg) on the same URL"
    ]


# -- privileges ------------------------------------------------------------------------


@pytest.fixture
def role(engine: Engine, database_url: str) -> Iterator[tuple[str, str]]:
    """A LOGIN role of the test's own (roles are cluster-wide: a unique name) and the
    suite's database URL as that role; dropped after the test, whatever happened."""
    with login_role(database_url, "sqlaq_test_role", grant_all=False) as made:
        yield made


def _grant(engine: Engine, role: str, grants: dict[str, str]) -> None:
    with engine.begin() as conn:
        for table, privileges in grants.items():
            conn.execute(text(f'GRANT {privileges} ON {table} TO "{role}"'))


def test_a_role_without_update_or_delete_is_refused_at_start_naming_what_is_missing(
    committed: Engine, role: tuple[str, str]
) -> None:
    name, url = role
    _grant(
        committed,
        name,
        {"sqlaq_jobs": "SELECT, INSERT", "sqlaq_rates": "SELECT", "sqlaq_periodic": "SELECT"},
    )
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "noop")
    result = run_process("cli", "worker_app:registry", SQLAQ_DATABASE_URL=url)
    assert_one_line(
        result,
        "sqlaq-worker: error: ",
        "lacks privileges the worker needs",
        "UPDATE, DELETE on sqlaq_jobs",
        "INSERT, UPDATE on sqlaq_rates",
        "INSERT, UPDATE on sqlaq_periodic",
        "GRANT UPDATE, DELETE ON sqlaq_jobs TO <role>",
    )
    assert count_status(committed, "queued") == 1  # nothing was claimed


def test_a_role_with_the_privileges_the_worker_needs_runs_it(
    committed: Engine, role: tuple[str, str]
) -> None:
    name, url = role
    _grant(
        committed,
        name,
        {
            "sqlaq_jobs": "SELECT, INSERT, UPDATE, DELETE",
            "sqlaq_rates": "SELECT, INSERT, UPDATE",
            "sqlaq_periodic": "SELECT, INSERT, UPDATE",
            "sqlaq_paused_queues": "SELECT",
            "sqlaq_workers": "SELECT, INSERT, UPDATE, DELETE",
            "sqlaq_unique_holds": "SELECT, INSERT, UPDATE, DELETE",
        },
    )
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "noop")
    result = run_process("cli", "worker_app:registry", "--burst", SQLAQ_DATABASE_URL=url)
    assert result.returncode == 0, result.stderr
    assert count_status(committed, "done") == 1


def test_every_argument_of_both_commands_says_what_it_is() -> None:
    # --help is the command's own documentation (the reference prints it): no flag or
    # positional left bare.
    bare = []
    for name, parser in (("sqlaq-worker", build_parser()), ("sqlaq", admin.build_parser())):
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        commands = [(name, parser)]
        for subs in subparsers:
            commands += [(f"{name} {sub}", p) for sub, p in subs.choices.items()]
        for command, p in commands:
            bare += [
                f"{command} {action.option_strings or action.dest}"
                for action in p._actions
                if not action.help and not isinstance(action, argparse._SubParsersAction)
            ]
    assert bare == []
