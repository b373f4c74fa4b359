"""``sqlaq-worker --executor process``: its flags and variables, one-line refusals, and
the command running handlers in child processes (tests/process_app.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from cmdkit import assert_one_line, run_process
from sqlalchemy import Engine
from workerkit import START_TIMEOUT, enqueue, job, wait_started, wait_until, worker_processes

from sqlaq.cli import parse_options

pytestmark = pytest.mark.timeout(90)

URL = {"DATABASE_URL": "postgresql://x/y"}


def test_flags_and_variables_of_the_process_executor() -> None:
    config = parse_options(["a:b"], URL).config
    assert (config.executor, config.processes) == ("thread", None)
    assert (config.max_jobs_per_child, config.max_memory_per_child) == (0, 0)
    config = parse_options(
        [
            "a:b",
            "--executor",
            "process",
            "--processes",
            "3",
            "--max-jobs-per-child",
            "500",
            "--max-memory-per-child",
            "512",
        ],
        URL,
    ).config
    assert (config.executor, config.processes) == ("process", 3)
    assert (config.max_jobs_per_child, config.max_memory_per_child) == (500, 512)
    environ = {
        **URL,
        "SQLAQ_EXECUTOR": "PROCESS",
        "SQLAQ_PROCESSES": "auto",
        "SQLAQ_MAX_JOBS_PER_CHILD": "10",
        "SQLAQ_MAX_MEMORY_PER_CHILD": "256",
    }
    config = parse_options(["a:b"], environ).config
    assert (config.executor, config.processes) == ("process", None)
    assert (config.max_jobs_per_child, config.max_memory_per_child) == (10, 256)
    config = parse_options(["a:b", "--executor", "thread"], environ).config
    assert config.executor == "thread"  # the flag beats the variable


@pytest.mark.parametrize(
    ("args", "env", "fragments"),
    [
        (["--executor", "fork"], {}, ["executor: invalid choice 'fork'", "thread, process"]),
        (["--processes", "0"], {}, ["processes must be between 1 and 1024"]),
        (["--max-memory-per-child", "-5"], {}, ["--max-memory-per-child must be between 0"]),
        ([], {"SQLAQ_EXECUTOR": "forks"}, ["SQLAQ_EXECUTOR: invalid choice 'forks'"]),
        ([], {"SQLAQ_MAX_JOBS_PER_CHILD": "many"}, ["SQLAQ_MAX_JOBS_PER_CHILD", "'many'"]),
    ],
)
def test_a_bad_value_is_one_line_exit_2(
    args: list[str], env: dict[str, str], fragments: list[str]
) -> None:
    result = run_process("cli", "process_app:registry", *args, **URL, **env)
    assert_one_line(result, "sqlaq-worker: error: ", *fragments)


@pytest.mark.timeout(240)
def test_the_command_runs_handlers_in_children_and_they_ignore_its_signals(
    committed: Engine, database_url: str, tmp_path: Path
) -> None:
    payload = {"started": str(tmp_path / "started"), "release": str(tmp_path / "release")}
    waiting = enqueue(committed, "wait_file", payload)
    cpu = [enqueue(committed, "cpu", {"ms": 5}) for _ in range(20)]
    with worker_processes(database_url) as start:
        worker = start(
            "--executor", "process", "--processes", "2", "--poll-interval", "0.2",
            app="process_app:registry",
        )  # fmt: skip
        # Two start-ups, one after the other, each as slow as the machine's load makes it:
        # the command's (it logs "worker started"), then its children's (before its first
        # claim). Neither is what is tested.
        wait_started(worker)
        wait_until(lambda: Path(payload["started"]).exists(), START_TIMEOUT, "the handler to start")
        child = int(Path(payload["started"]).read_text())
        assert child != worker.pid
        # A supervisor that signals the whole group (systemd's control group, a Ctrl-C
        # in a terminal): the child ignores it, the worker stops gracefully.
        os.kill(child, signal.SIGTERM)
        os.kill(child, signal.SIGINT)
        worker.signal(signal.SIGTERM)
        wait_until(lambda: "worker stopping" in worker.output(), 30, "the graceful stop")
        Path(payload["release"]).touch()
        assert worker.wait(60) == 0, worker.output()
    row = job(committed, waiting)
    assert (row.status, row.result) == ("done", child)
    pids = {job(committed, i).result for i in cpu if job(committed, i).status == "done"}
    assert worker.pid not in pids
    assert len(pids) <= 2
