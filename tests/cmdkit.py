"""Shared tools of the command tests: ``sqlaq`` in process, and either command as a real
process, with the one-line error checks."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

import pytest
from workerkit import TESTS_DIR, worker_env

from sqlaq import admin


def sqlaq_cmd(url: str | None, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    out = io.StringIO()
    args = [*argv] if url is None else [*argv[:1], "--database-url", url, *argv[1:]]
    return admin.run(args, env or {}, out=out), out.getvalue()


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def run_process(command: str, *args: str, timeout: float = 60, **env: str) -> Any:
    """``sqlaq-worker`` (``command="cli"``) or ``sqlaq`` (``"admin"``) as a real process.

    *args* and *env* may hold lone surrogates: they reach the process as the bytes
    they stand for (``"\\udcff"`` -> ``b"\\xff"``), as a shell would pass them.
    """
    code = {
        "cli": "from sqlaq.cli import worker_main; worker_main()",
        "admin": "from sqlaq.cli import admin_main; admin_main()",
    }[command]
    environment = worker_env("")
    del environment["SQLAQ_DATABASE_URL"]
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=TESTS_DIR,
        env=environment,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=timeout,
        check=False,
    )


def assert_one_line(result: Any, prefix: str, *fragments: str) -> None:
    """Exit 2, one line on stderr starting with *prefix*, holding each fragment."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(prefix), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
