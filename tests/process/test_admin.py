"""The operator command ``sqlaq``: each subcommand against a real database.

On a schema older than this sqlaq, it says to migrate in one line (before: ``sqlaq list``
on a schema one revision behind said "column attempted_at does not exist" with no hint
of the fix). ``sqlaq enqueue`` with --timeout, --unique-for,
--debounce-key/--debounce/--max-wait: what each enqueue did is said on its line; bad
input is one line, exit 2.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import pytest
from cmdkit import one_line_error, sqlaq_cmd
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

import sqlaq
from sqlaq import NewJob, admin, migrations


@pytest.fixture
def queue_with_history(committed: Engine) -> dict[str, int]:
    """One job in each state, on two queues."""
    with committed.begin() as conn:
        ids = {
            "queued": sqlaq.enqueue(conn, "email", {"to": "a"}).job_id,
            "later": sqlaq.enqueue(conn, "email", delay=timedelta(hours=1)).job_id,
            "running": sqlaq.enqueue(conn, "video", queue="media").job_id,
            "failed": sqlaq.enqueue(conn, "video", queue="media", max_attempts=1).job_id,
            "done": sqlaq.enqueue(conn, "email", queue="media").job_id,
        }
        conn.execute(
            text("UPDATE sqlaq_jobs SET run_at = now() - interval '10 minutes' WHERE id = :id"),
            {"id": ids["queued"]},
        )
    with committed.begin() as conn:
        worker = uuid.uuid4()
        claimed = {j.id: j for j in sqlaq.claim(conn, worker_id=worker, queue="media", limit=3)}
        sqlaq.fail(conn, claimed[ids["failed"]].lease, "RuntimeError: boom")
        sqlaq.complete(conn, claimed[ids["done"]].lease)
        conn.execute(
            text("UPDATE sqlaq_jobs SET run_at = now() - interval '1 minute' WHERE id = :id"),
            {"id": ids["running"]},
        )
    return ids


def test_stats_counts_states_and_reports_queue_health(
    database_url: str, queue_with_history: dict[str, int]
) -> None:
    code, out = sqlaq_cmd(database_url, "stats")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["queue", "kind", "queued", "running", "done", "failed", "cancelled"]
    assert ["default", "email", "2", "0", "0", "0", "0"] in [line.split() for line in lines]
    assert ["media", "video", "0", "1", "0", "1", "0"] in [line.split() for line in lines]
    health = {
        line.split()[0]: line.split()[1:]
        for line in lines
        if line.startswith(("default", "media")) and len(line.split()) == 5
    }
    assert health["default"][0] == "1"  # one due job
    assert health["default"][1].endswith("m")  # oldest due: ~10 minutes
    assert health["media"][2:] == ["1", "1"]  # an expired lease, a failure this hour

    code, out = sqlaq_cmd(database_url, "stats", "--json")
    data = json.loads(out)
    queues = {q["queue"]: q for q in data["queues"]}
    assert queues["default"]["due"] == 1
    assert 590 < queues["default"]["oldest_due_seconds"] < 700
    assert queues["media"]["expired_leases"] == 1
    assert queues["media"]["failed_last_hour"] == 1
    assert {"queue": "media", "kind": "video", "status": "failed", "count": 1} in data["counts"]


def test_list_filters_and_show_prints_every_column(
    database_url: str, queue_with_history: dict[str, int]
) -> None:
    code, out = sqlaq_cmd(database_url, "list", "--status", "failed")
    assert code == 0
    rows = out.splitlines()[1:]
    assert len(rows) == 1
    assert rows[0].split()[:4] == [str(queue_with_history["failed"]), "media", "video", "failed"]
    assert "RuntimeError: boom" in rows[0]

    code, out = sqlaq_cmd(database_url, "list", "--kind", "email", "--queue", "default", "--json")
    listed = [json.loads(line) for line in out.splitlines()]
    assert [j["id"] for j in listed] == [queue_with_history["later"], queue_with_history["queued"]]

    code, out = sqlaq_cmd(database_url, "show", str(queue_with_history["queued"]), "--json")
    shown = json.loads(out)
    assert (shown["kind"], shown["payload"], shown["status"]) == ("email", {"to": "a"}, "queued")
    code, out = sqlaq_cmd(database_url, "show", str(queue_with_history["failed"]))
    assert "last_error    RuntimeError: boom" in out


def test_show_of_an_unknown_id_exits_1(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = sqlaq_cmd(database_url, "show", "987654321")
    assert code == 1
    assert one_line_error(capsys) == "sqlaq: no job 987654321\n"


def test_workflow_lists_a_workflow_from_any_job_and_cancels_it(
    database_url: str, committed: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with committed.begin() as conn:
        chord = sqlaq.chord(conn, [NewJob("count"), NewJob("count")], NewJob("total"))
        sqlaq.enqueue(conn, "unrelated")
    assert chord.callback_id is not None
    members = [str(i) for i in chord.job_ids]
    code, out = sqlaq_cmd(database_url, "workflow", members[1])
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "kind", "queue", "status", "after"]
    assert [line.split() for line in lines[1:]] == [
        [members[0], "count", "default", "queued"],
        [members[1], "*", "count", "default", "queued"],
        [str(chord.callback_id), "total", "default", "waiting", f"{members[0]},", members[1]],
    ]
    code, out = sqlaq_cmd(database_url, "workflow", members[0], "--limit", "1", "--json")
    shown = json.loads(out)
    assert [j["job_id"] for j in shown["jobs"]] == [chord.job_ids[0]]
    assert (shown["total"], shown["more"]) == (3, 2)

    code, out = sqlaq_cmd(database_url, "workflow", str(chord.callback_id), "--cancel")
    assert code == 0
    assert out == (
        f"cancelled 3 job(s) of job {chord.callback_id}'s workflow: "
        f"{members[0]}, {members[1]}, {chord.callback_id}\n"
    )
    code, out = sqlaq_cmd(database_url, "workflow", members[0])
    assert [line.split()[-1] for line in out.splitlines()[1:]] == [
        "cancelled",
        "cancelled",
        members[1],
    ]
    code, _ = sqlaq_cmd(database_url, "workflow", "987654321", "--cancel")
    assert code == 1
    assert one_line_error(capsys) == "sqlaq: no job 987654321\n"


def test_retry_and_cancel_by_id_and_in_bulk(
    database_url: str, committed: Engine, queue_with_history: dict[str, int]
) -> None:
    code, out = sqlaq_cmd(database_url, "retry", str(queue_with_history["failed"]))
    assert (code, out) == (0, "retried 1 of 1 job(s)\n")
    code, out = sqlaq_cmd(database_url, "cancel", "--all", "--kind", "email")
    assert (code, out) == (0, "cancelled 2 of 2 job(s)\n")
    code, out = sqlaq_cmd(database_url, "retry", "--failed")
    assert out == "retried 0 of 0 job(s)\n"
    with committed.connect() as conn:
        statuses = dict(conn.execute(text("SELECT id, status FROM sqlaq_jobs")).all())
    assert statuses[queue_with_history["failed"]] == "queued"
    assert statuses[queue_with_history["queued"]] == "cancelled"
    assert statuses[queue_with_history["later"]] == "cancelled"
    assert statuses[queue_with_history["running"]] == "running"


def test_prune_deletes_old_finished_jobs_only(database_url: str, committed: Engine) -> None:
    with committed.begin() as conn:
        results = sqlaq.enqueue_many(conn, [NewJob("k") for _ in range(2500)])
        keep = sqlaq.enqueue(conn, "k").job_id
        conn.execute(
            text(
                "UPDATE sqlaq_jobs SET status = 'done', finished_at = now() - interval '8 days'"
                " WHERE id <> :keep"
            ),
            {"keep": keep},
        )
        old_failed = results[0].job_id
        conn.execute(
            text("UPDATE sqlaq_jobs SET status = 'failed' WHERE id = :id"), {"id": old_failed}
        )
    code, out = sqlaq_cmd(database_url, "prune", "--done-older-than", "7d")
    assert (code, out) == (0, "pruned 2499 job(s)\n")
    code, out = sqlaq_cmd(database_url, "prune", "--failed-older-than", "1d")
    assert out == "pruned 1 job(s)\n"
    with committed.connect() as conn:
        assert conn.execute(text("SELECT id FROM sqlaq_jobs")).scalars().all() == [keep]


def test_enqueue_and_its_dedupe(database_url: str, committed: Engine) -> None:
    code, out = sqlaq_cmd(
        database_url,
        "enqueue",
        "report",
        "--payload",
        '{"day": "2026-12-02"}',
        "--queue",
        "reports",
        "--dedupe-key",
        "day-1",
        "--delay",
        "5m",
    )
    assert code == 0
    job_id = int(out.split()[1])
    code, out = sqlaq_cmd(database_url, "enqueue", "report", "--dedupe-key", "day-1")
    assert out == f"job {job_id} (duplicate of a pending job)\n"
    with committed.connect() as conn:
        row = conn.execute(
            text("SELECT queue, payload, run_at - created_at AS delay FROM sqlaq_jobs")
        ).one()
    assert (row.queue, row.payload, row.delay) == (
        "reports",
        {"day": "2026-12-02"},
        timedelta(minutes=5),
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["enqueue", "k", "--payload", "{not json"], "invalid JSON payload"),
        (["enqueue", "k", "--payload", "[1]"], "the payload must be a JSON object"),
        (["enqueue", "k", "--payload", '{"x": NaN}'], "NaN is not JSON"),
        (["enqueue", "", "--payload", "{}"], "kind must be a non-empty name"),
        (["prune", "--done-older-than", "soon"], "invalid duration 'soon'"),
        (["list", "--status", "sleeping"], "--status: invalid choice 'sleeping'"),
        (["retry"], "give job ids, or --all with filters"),
        (["cancel", "1", "--all"], "give job ids, or --all with filters"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["list", "--sinc", "2h"], "unrecognized arguments: --sinc"),  # no abbreviations
    ],
)
def test_usage_errors_exit_2_with_one_line(
    database_url: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _ = sqlaq_cmd(database_url if argv[0] != "frobnicate" else None, *argv)
    assert code == 2
    assert message in one_line_error(capsys)


def test_unreachable_database_and_missing_url_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _ = sqlaq_cmd("postgresql://postgres@127.0.0.1:1/none", "stats")
    assert code == 2
    assert "sqlaq:" in one_line_error(capsys)
    # Without sqlaq[embedded] (hidden; with it, see test_embedded.py).
    monkeypatch.setitem(sys.modules, "sqlaq.embedded", None)
    monkeypatch.delattr(sqlaq, "embedded", raising=False)
    code, _ = sqlaq_cmd(None, "stats")
    assert code == 2
    assert "no database URL" in one_line_error(capsys)


def test_database_url_comes_from_the_environment(database_url: str, committed: Engine) -> None:
    code, out = sqlaq_cmd(None, "enqueue", "k", env={"DATABASE_URL": database_url})
    assert code == 0
    code, out = sqlaq_cmd(
        None,
        "check",
        env={"SQLAQ_DATABASE_URL": database_url, "DATABASE_URL": "postgresql://nowhere:1/x"},
    )
    assert (code, out) == (0, f"sqlaq schema is at {sqlaq.migrations.head_revision()} (head)\n")


def test_migrate_and_check_on_a_fresh_database(
    empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = empty_database_url
    code, _ = sqlaq_cmd(url, "check")
    assert code == 1
    assert "run 'alembic upgrade heads'" in one_line_error(capsys)
    code, out = sqlaq_cmd(url, "migrate")
    assert (code, out) == (0, f"sqlaq schema: none -> {sqlaq.migrations.HEAD}\n")
    code, out = sqlaq_cmd(url, "migrate")
    assert (code, out) == (0, f"sqlaq schema: {sqlaq.migrations.HEAD} -> {sqlaq.migrations.HEAD}\n")
    code, out = sqlaq_cmd(url, "check")
    assert code == 0


def test_migrate_sql_prints_ddl_without_a_database() -> None:
    code, out = sqlaq_cmd(None, "migrate", "--sql")
    assert code == 0
    assert "CREATE TABLE sqlaq_jobs" in out


def test_console_script_runs(database_url: str, committed: Engine) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from sqlaq.cli import admin_main; admin_main()", "stats", "--json"],
        env={"SQLAQ_DATABASE_URL": database_url, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"paused": [], "counts": [], "queues": []}


def test_migrate_leaves_a_schema_installed_by_the_hosts_alembic_alone(
    database_url: str,
) -> None:
    """The suite's database was migrated through alembic.ini, like a host project's."""
    code, out = sqlaq_cmd(database_url, "migrate")
    assert (code, out) == (0, f"sqlaq schema is at {sqlaq.migrations.HEAD} (head): nothing to do\n")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_on_a_terminal_only() -> None:
    terminal = _Terminal()
    progress = admin._Progress("pruned", 4000, stream=terminal)
    progress.show(1000)
    progress.show(4000)
    progress.end()
    frames = terminal.getvalue().split("\r")[1:]
    assert frames[0] == "[" + "#" * 8 + "-" * 22 + "] 1,000/4,000 pruned"
    assert frames[1] == "[" + "#" * 30 + "] 4,000/4,000 pruned\n"
    piped = io.StringIO()
    quiet = admin._Progress("pruned", 4000, stream=piped)
    quiet.show(1000)
    quiet.end()
    assert piped.getvalue() == ""


# -- a schema behind this sqlaq --------------------------------------------------------


def _sqlaq(url: str, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return admin.run([argv[0], "--database-url", url, *argv[1:]], {}, out=out), out.getvalue()


def test_admin_on_a_schema_behind_this_sqlaq_says_to_migrate(
    empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            migrations.upgrade(conn, "sqlaq_0001")
        for argv in (["list"], ["show", "1"], ["list", "--status", "failed", "--json"]):
            code, _ = _sqlaq(empty_database_url, *argv)
            err: Any = capsys.readouterr().err
            assert (code, err.count("\n")) == (2, 1), err
            assert "Traceback" not in err
            assert f"database is at sqlaq_0001, this sqlaq needs {migrations.HEAD}" in err, err
            assert "'sqlaq migrate'" in err
        code, _ = _sqlaq(empty_database_url, "migrate")
        assert code == 0
        assert _sqlaq(empty_database_url, "list") == (0, "(none)\n")
    finally:
        engine.dispose()


# -- enqueue's keys and durations -------------------------------------------------------


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


def test_enqueue_with_a_key(
    database_url: str, committed: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = sqlaq_cmd(database_url, "enqueue", "sync", "--key", "tenant-42")
    assert code == 0
    job_id = int(out.split()[1])
    with committed.connect() as conn:
        key = conn.execute(text("SELECT key FROM sqlaq_jobs WHERE id = :id"), {"id": job_id})
        assert key.scalar_one() == "tenant-42"
    capsys.readouterr()
    code, out = sqlaq_cmd(database_url, "enqueue", "sync", "--key", " ")
    assert (code, out) == (2, "")
    err = capsys.readouterr().err
    assert "key must be a non-empty name" in err
    assert err.count("\n") == 1
    with committed.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 1


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
