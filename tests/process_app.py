"""Handlers of the process executor's tests (``executor="process"``).

A child process imports this module to find its handler (by module and name), so every
handler is a module-level function. They tell the tests what happened through what the
worker writes (their return value is the job's result: most return their pid), or
through files named in their payload (a handler that must be seen running before the
test acts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlaq

registry = sqlaq.Registry()

#: A slow import, as a module importing a large library has (set in the children's
#: environment by the test of a child's start-up, which a job's timeout must not count).
time.sleep(float(os.environ.get("PROCESS_APP_IMPORT_SECONDS", "0")))

#: What ``hog`` keeps alive in its child (its memory stays resident).
_HELD: list[bytes] = []


def spin(milliseconds: float) -> int:
    """Pure Python for about *milliseconds* of one core: the CPU-bound work."""
    end = time.perf_counter() + milliseconds / 1000
    count = 0
    while time.perf_counter() < end:
        for i in range(200):
            count += i * i
    return count


@registry.handler("pid")
def pid(payload: dict[str, Any]) -> int:
    """Return the process's pid."""
    return os.getpid()


@registry.handler("quick", timeout=timedelta(seconds=1))
def quick(payload: dict[str, Any]) -> int:
    """Return the pid at once, well within its timeout."""
    return os.getpid()


@registry.handler("cpu")
def cpu(payload: dict[str, Any]) -> int:
    """A few milliseconds of pure Python; return the pid."""
    spin(payload.get("ms", 5))
    return os.getpid()


def _write_whole(path: str, text: str) -> None:
    """Write *text* to *path* so that a reader finds the whole of it or no file: the
    tests wait for the file to exist, then read it (``write_text`` creates it empty
    first, and a reader in between read '')."""
    partial = Path(f"{path}.partial")
    partial.write_text(text)
    os.replace(partial, path)


@registry.handler("sleep", timeout=timedelta(seconds=1))
def sleep(payload: dict[str, Any]) -> None:
    """Stuck in C code (``time.sleep``) far past its timeout."""
    time.sleep(payload.get("seconds", 3600))


@registry.handler("spawner", timeout=timedelta(seconds=1))
def spawner(payload: dict[str, Any]) -> None:
    """Start a process of its own (its pid written to ``pid_file``), then get stuck."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    _write_whole(payload["pid_file"], str(grandchild.pid))
    time.sleep(3600)


@registry.handler("busy", timeout=timedelta(seconds=1))
def busy(payload: dict[str, Any]) -> None:
    """A busy loop past its timeout."""
    while True:
        pass


@registry.handler("die")
def die(payload: dict[str, Any]) -> None:
    """The process dies under the handler: SIGKILL or ``os._exit``."""
    if payload.get("how") == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


@registry.handler("hog")
def hog(payload: dict[str, Any]) -> int:
    """Keep *mib* MiB resident in this process; return the pid."""
    _HELD.append(b"\x01" * (payload["mib"] * 2**20))
    return os.getpid()


@registry.handler("wait_file")
def wait_file(payload: dict[str, Any]) -> int:
    """Say it started (create ``started``), then wait until ``release`` exists."""
    _write_whole(payload["started"], str(os.getpid()))
    release = Path(payload["release"])
    while not release.exists():
        time.sleep(0.01)
    return os.getpid()


@registry.handler("note")
def note(payload: dict[str, Any]) -> int:
    """Append the pid to the file ``notes`` as it starts (one line per start); return it."""
    with open(payload["notes"], "a") as notes:
        notes.write(f"{os.getpid()}\n")
    return os.getpid()


@registry.handler("hog_file")
def hog_file(payload: dict[str, Any]) -> int:
    """Keep *mib* MiB resident, say it started (create ``started``), wait until
    ``release`` exists; return the pid."""
    _HELD.append(b"\x01" * (payload["mib"] * 2**20))
    return wait_file(payload)


@registry.handler("context")
def context(payload: dict[str, Any]) -> dict[str, Any]:
    """What ``current_job()`` gives in a child; whether ``extend_lease`` is refused."""
    job = sqlaq.current_job()
    try:
        job.extend_lease()
        extend = "allowed"
    except RuntimeError as exc:
        extend = str(exc)
    return {
        "id": job.id,
        "kind": job.kind,
        "queue": job.queue,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "attempted_at": job.attempted_at.isoformat() if job.attempted_at else None,
        "cancelled": job.cancelled,
        "extend_lease": extend,
        "payload": payload,
        "pid": os.getpid(),
    }


@registry.handler("fail")
def fail(payload: dict[str, Any]) -> None:
    """Raise."""
    raise ValueError(f"boom {payload.get('n', 0)}")


class Unsendable(Exception):
    """An exception holding a lock: it cannot be pickled."""

    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


@registry.handler("unsendable_error")
def unsendable_error(payload: dict[str, Any]) -> None:
    """Raise an exception that cannot leave the process."""
    raise Unsendable


@registry.handler("unsendable_result")
def unsendable_result(payload: dict[str, Any]) -> object:
    """Return a value that cannot leave the process."""
    return threading.Lock()


@registry.handler("snooze")
def snooze(payload: dict[str, Any]) -> None:
    """Snooze (the Snooze exception crosses the pipe)."""
    raise sqlaq.Snooze(timedelta(hours=1))


@registry.handler("retried", retry=ValueError)
def retried(payload: dict[str, Any]) -> None:
    """Raise a ValueError, which its retry policy (by exception type) retries."""
    raise ValueError("try again")
