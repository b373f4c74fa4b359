"""``sqlaq enqueue`` with --timeout, --unique-for, --debounce-key/--debounce/--max-wait:
what each enqueue did is said on its line; bad input is one line, exit 2."""

from __future__ import annotations

from datetime import timedelta

import pytest
from cmdkit import sqlaq_cmd
from sqlalchemy import Engine, text


def test_enqueue_with_a_timeout_and_unique_for(database_url: str, committed: Engine) -> None:
    argv = ["enqueue", "report", "--dedupe-key", "day-1", "--unique-for", "1h"]
    code, out = sqlaq_cmd(database_url, *argv, "--timeout", "90s")
    assert code == 0
    job_id = int(out.split()[1])
    with committed.begin() as conn:
        conn.execute(text("UPDATE sqlaq_jobs SET status = 'done', finished_at = now()"))
    code, out = sqlaq_cmd(database_url, *argv)
    assert (code, out) == (0, f"job {job_id} (held: enqueued within --unique-for)\n")
    with committed.connect() as conn:
        assert conn.execute(text("SELECT timeout FROM sqlaq_jobs")).scalar_one() == timedelta(
            seconds=90
        )


def test_enqueue_debounced(database_url: str, committed: Engine) -> None:
    argv = ["enqueue", "digest", "--debounce-key", "user-7", "--debounce", "10m"]
    code, out = sqlaq_cmd(database_url, *argv, "--payload", '{"n": 1}', "--max-wait", "1h")
    assert code == 0
    job_id = int(out.split()[1])
    code, out = sqlaq_cmd(database_url, *argv, "--payload", '{"n": 2}')
    assert (code, out) == (0, f"job {job_id} (debounced: the queued job was updated)\n")
    with committed.connect() as conn:
        row = conn.execute(
            text("SELECT payload, run_at - now() > '9 minutes' AS later FROM sqlaq_jobs")
        ).one()
    assert (row.payload, row.later) == ({"n": 2}, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--timeout", "0"], "--timeout must be at least 0.001s"),
        (["--timeout", "36526d"], "--timeout must be at most 100 years"),
        (["--unique-for", "1h"], "unique_for needs a dedupe_key"),
        (["--unique-for", "soon", "--dedupe-key", "k"], "--unique-for: invalid duration"),
        (["--debounce", "1m"], "debounce needs a debounce_key"),
        (["--debounce-key", "k"], "go with debounce=timedelta"),
        (["--debounce-key", "k", "--debounce", "1h", "--max-wait", "1m"], "must be at least"),
        (["--debounce-key", "k", "--debounce", "1h", "--dedupe-key", "k"], "does not go with"),
        (["--debounce-key", "\x00", "--debounce", "1h"], "--debounce-key"),
    ],
)
def test_bad_keys_and_durations_are_one_line_exit_2(
    database_url: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _ = sqlaq_cmd(database_url, "enqueue", "k", *argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert err.startswith("sqlaq: ")
    assert message in err
