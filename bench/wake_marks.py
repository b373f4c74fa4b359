"""The registry ``bench/wake_probe.py`` runs in ``sqlaq-worker``: one no-op handler
(``def``, or ``async`` with ``WAKE_MARKS_FLAVOUR=async``; ``sleep``: an ``async`` one
that then sleeps 10 ms, the peer bench's 10 ms handler) and timestamps of the run
thread's steps through a wake-up, taken by wrapping the worker's methods in the worker's
own process (a probe, not a test). At exit it writes them to ``WAKE_MARKS_OUT``,
tab-separated: stage, ``perf_counter``, extra (the handler's: its job's ``seq`` and the
wall clock, which the probe sets beside the enqueue's commit).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

import sqlaq
from sqlaq.worker import core, fetcher, listener, outbox, precompiled, runner

registry = sqlaq.Registry()
_marks: list[tuple[str, float, str]] = []
_run_thread: list[int | None] = [None]  # the thread in Worker.run


def _mark(stage: str, extra: str = "") -> None:
    _marks.append((stage, time.perf_counter(), extra))


def _around(cls: Any, name: str, before: str | None, after: str | None) -> None:
    """Mark *before* and *after* a call of ``cls.name`` made on the run thread."""
    original: Callable[..., Any] = getattr(cls, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mine = threading.get_ident() == _run_thread[0]
        if mine and before:
            _mark(before)
        result = original(*args, **kwargs)
        if mine and after:
            _mark(after)
        return result

    setattr(cls, name, wrapped)


_run = core.Worker.run


def _run_on(worker: core.Worker) -> None:
    _run_thread[0] = threading.get_ident()
    _run(worker)


core.Worker.run = _run_on  # type: ignore[method-assign,assignment]
_around(listener.Waker, "wait", "waits", "woken")
_around(core.Worker, "_notified", "notified", None)
_around(psycopg.Cursor, "execute", "claim sent", "claim answered")
_around(listener.Waker, "clear", None, "cleared")
_around(listener.Listener, "read", "reading", "read")
_around(core.Worker, "_collect", None, "collected")
_around(outbox.Outbox, "turn", None, "outbox turned")
_around(fetcher.Fetcher, "_fetch", "queue chosen", None)
_around(fetcher.Fetcher, "fetch", None, "jobs built")
_around(fetcher.Fetcher, "_claim", "claim entered", None)
_around(precompiled.Precompiled, "run", "plan run", None)
_around(precompiled.Precompiled, "_compiled", "compiled lookup", None)
_around(precompiled.Precompiled, "_cursor_of", "cursor", None)
_around(runner.Runner, "submit", "held", "handed over")


def _record(payload: dict[str, Any]) -> None:
    _mark("handler", f"{payload['seq']} {time.time():.6f}")


if os.environ.get("WAKE_MARKS_FLAVOUR") == "sleep":

    @registry.handler("noop")
    async def sleep_async(payload: dict[str, Any]) -> None:
        _record(payload)
        await asyncio.sleep(0.01)  # the peer bench's 10 ms handler

elif os.environ.get("WAKE_MARKS_FLAVOUR") == "async":

    @registry.handler("noop")
    async def noop_async(payload: dict[str, Any]) -> None:
        _record(payload)

else:

    @registry.handler("noop")
    def noop(payload: dict[str, Any]) -> None:
        _record(payload)


@atexit.register
def _write() -> None:
    out = os.environ.get("WAKE_MARKS_OUT")
    if out:
        with open(out, "w") as file:
            file.writelines(f"{stage}\t{at:.7f}\t{extra}\n" for stage, at, extra in _marks)
