"""Every flag and variable of both commands is parsed into range: one line, exit 2.

Durations are at most 100 years (``sqlaq.bounds.MAX_DURATION``), integers within their
column's or the OS's range, text free of NUL and of bytes that are not UTF-8 (which
reach Python as lone surrogates). Before, ``--lease 9999999999d`` or
``SQLAQ_RETAIN_DONE=9999999999d`` printed an OverflowError traceback,
``--poll-interval 999999999d`` was accepted and later killed a thread, and a filter
with undecodable bytes died in the driver. The property tests feed arbitrary text to
each parser: a value in range or the documented error, never another exception.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from cmdkit import assert_one_line, run_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqlaq import admin
from sqlaq.bounds import MAX_DURATION
from sqlaq.cli import UsageError, parse_options
from sqlaq.config import WORKER_OPTIONS, WorkerConfig
from sqlaq.errors import ConfigError
from sqlaq.option import AutoInteger, Boolean, Choice, Condition, Duration, Integer, Names, Text

pytestmark = pytest.mark.timeout(120)

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
        return bool(value) and all(isinstance(n, str) and n.strip() for n in value)
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
