"""Handlers for the benchmark's worker processes: ``sqlaq-worker bench.app:registry``.

Each handler notes its run in memory (``list.append``, well under a microsecond, so the
note does not weigh on the figures) and the notes are written to the file named by
``SQLAQ_BENCH_LEDGER`` when the process exits: a ``--burst`` worker exits by itself, a
long-running one on SIGTERM (a graceful stop, so ``atexit`` runs). One line per run:
``<job id> <kind> <time.time() at the handler's start>``, then ``0 peak_rss_kib <KiB>``.
The benchmark reads the file to check that every job ran exactly once and, for the
wake-up scenario, when each handler started (``time.time()`` is one clock for every
process on the machine).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
from datetime import timedelta
from typing import Any

import sqlaq

LEDGER_VARIABLE = "SQLAQ_BENCH_LEDGER"

registry = sqlaq.Registry()
_runs: list[tuple[int, str, float]] = []  # appended from many threads: atomic under the GIL


@registry.handler("noop")
def noop(_payload: dict[str, Any]) -> None:
    """Does nothing: measures the queue, not the work."""
    _runs.append((sqlaq.current_job().id, "noop", 0.0))


@registry.handler("txn_noop")
def txn_noop(_payload: dict[str, Any], session: Any) -> None:
    """Does nothing, in the job's transaction: what a transactional handler costs."""
    _runs.append((sqlaq.current_job().id, "txn_noop", 0.0))


@registry.handler("sleep10")
def sleep10(_payload: dict[str, Any]) -> None:
    """Waits 10 ms, like a handler waiting on I/O (the GIL is released meanwhile)."""
    time.sleep(0.010)
    _runs.append((sqlaq.current_job().id, "sleep10", 0.0))


@registry.handler("wake")
def wake(_payload: dict[str, Any]) -> None:
    """Notes when it started, for the wake-up latency scenario."""
    started = time.time()
    _runs.append((sqlaq.current_job().id, "wake", started))


def peak_rss_kib() -> int:
    """This process's peak resident set (``VmHWM``), in KiB.

    Read from ``/proc/self/status`` rather than ``getrusage``: a child's ``ru_maxrss``
    starts from its parent's resident set at ``fork`` (Linux carries it over ``exec``),
    so a worker started by a large benchmark process would report the benchmark's size.
    """
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0  # pragma: no cover - not Linux


def _write_ledger() -> None:
    path = os.environ.get(LEDGER_VARIABLE)
    if not path:
        return
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(f"{job_id} {kind} {started!r}\n" for job_id, kind, started in _runs)
        out.write(f"0 peak_rss_kib {peak_rss_kib()}\n")


atexit.register(_write_ledger)


@registry.handler("asleep10")
async def asleep10(_payload: dict[str, Any]) -> None:
    """Waits 10 ms on the worker's event loop (an async handler: no thread)."""
    await asyncio.sleep(0.010)
    _runs.append((sqlaq.current_job().id, "asleep10", 0.0))


#: The limits scenario's registry (``bench.app:limited_registry``): a kind with a global
#: concurrency limit and a rate, both far above what one worker reaches, so the drain
#: measures what enforcing them costs, not the limits themselves.
limited_registry = sqlaq.Registry()


@limited_registry.handler("limited", concurrency=100_000, rate="2000/100ms")
def limited(_payload: dict[str, Any]) -> None:
    """Does nothing, under a concurrency limit and a rate."""
    _runs.append((sqlaq.current_job().id, "limited", 0.0))


#: The process executor's registry (``bench.app:cpu_registry``): a CPU-bound handler, run
#: by a worker on threads and by one with ``--executor process``, and two handlers stuck
#: past their timeout (in C code, and in a Python loop) that the process executor kills.
#: Only these kinds, so a worker whose handlers all run in processes takes its default
#: concurrency from its processes.
cpu_registry = sqlaq.Registry()

#: Iterations of the CPU-bound handler's loop: a few milliseconds of pure Python (the
#: benchmark times one call alone and prints it). Fixed work, not a fixed time: on
#: threads the calls share one core and take longer each.
CPU_ITERATIONS = 50_000
#: The stuck handlers' timeout.
STUCK_TIMEOUT = timedelta(seconds=1)


def cpu_work(iterations: int = CPU_ITERATIONS) -> int:
    """Pure Python arithmetic: holds the GIL all along."""
    total = 0
    for i in range(iterations):
        total += i * i % 7
    return total


@cpu_registry.handler("cpu")
def cpu(_payload: dict[str, Any]) -> None:
    """A few milliseconds of pure Python (run in a child process, its ledger line is lost
    with the child: the scenario checks its jobs in the table)."""
    cpu_work()
    _runs.append((sqlaq.current_job().id, "cpu", 0.0))


@cpu_registry.handler("stuck_sleep", timeout=STUCK_TIMEOUT)
def stuck_sleep(_payload: dict[str, Any]) -> None:
    """Stuck in C code (``time.sleep``) for an hour, far past its timeout."""
    time.sleep(3600)


@cpu_registry.handler("stuck_busy", timeout=STUCK_TIMEOUT)
def stuck_busy(_payload: dict[str, Any]) -> None:
    """Stuck in a busy loop for ever."""
    while True:
        cpu_work(1000)
