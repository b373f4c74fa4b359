"""How many slot threads a runner has: when one starts and when one ends; no SQL.

The runner (:mod:`sqlaq.worker.runner`) runs ``def`` handlers on long-lived threads fed
by one queue. This module owns the one decision about them, their number, and nothing
they run: the runner tells it what happens (runs handed in, taken, ended, withdrawn) and
gives it the function a thread runs.

The rule:

- A thread is started while sync runs wait and no thread is between runs, up to the
  runs in hand and the worker's concurrency: on each hand-in, and by each thread that
  takes a run with more waiting behind it. Handlers that block (I/O, a sleep) get a
  thread each within a few milliseconds; quick ones, which a few threads take as fast
  as they come, never start the rest.
- Once a kind's runs have been measured (:class:`Demand`), no more threads are
  started than the kinds' runs can use (one for a handler that only computes), unless
  the threads have been busy for :data:`STALL` with no run ended (every thread stuck in
  a long run): threads that only take turns at the GIL run no faster than one, and each
  turn is a hand-over that the worker's own thread waits behind. A refused start is
  looked at again after :data:`STALL` by a watch thread (``sqlaq-slots-watch``).
- A thread ends after a quick run when there are a quarter more threads than the kinds'
  runs can use and another thread ended a run lately. The last thread stays.

How many threads a kind's runs can use (:class:`Demand`) starts from the sizing rule of
a pool of threads (Goetz et al., *Java Concurrency in Practice*, 8.2): on *N*
processors, a task that computes for *C* and waits for *W* (I/O, a sleep, a lock) keeps
``N * (1 + W / C)`` threads busy; more only take turns. Python code runs on one
processor at a time, whatever the machine (the GIL), so *N* is 1. The wait counts
twice, ``1 + 2 W / C``: a worker's runs come a claim at a time, and its own threads take
the GIL too, so threads that block queue for it between their waits; at ``1 + W / C`` a
drain of ``def`` handlers sleeping 10 ms ran on about 190 threads and a seventh slower
than with as many as waited (about 310), at twice the wait as fast. A handler that only
computes gets one thread, one that sleeps 10 ms (computing 50 us) about four hundred.

Both are measured on the runs themselves, per kind, in windows of :data:`WINDOW` runs:

- *C*, the mean CPU time of a run (the thread's own clock, ``time.thread_time``, read on
  one run in :data:`SAMPLE`: it costs half a microsecond to read);
- *W + C*, the least wall time of a run in the window, not the mean: a run's wall time
  also holds its waits for the GIL, which more threads only lengthen (a quick handler
  that makes one system call, a log line or a counter's write, lets the GIL go there,
  and each thread taking turns at it makes every run look blocked for longer); the
  quickest run of a window is the one that waited least for the GIL.

The first :data:`SAMPLE` runs of a kind give its first figure (one run alone can be
far off: the first call of a thread, a moment without the processor); each window's
figure replaces the last.

Everything here is guarded by one lock, taken once per run.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from time import perf_counter

__all__ = ["SAMPLE", "STALL", "WINDOW", "Demand", "Slots"]

#: Runs of a kind per measure.
WINDOW = 64
#: One run in this many has its CPU time read.
SAMPLE = 8

#: Seconds with no sync run finished after which the slot threads count as stuck: a
#: thread is added for runs that wait whatever the kinds' demands say. So they only
#: hold back threads while runs end every few milliseconds; runs that take longer get
#: a thread each, as many as wait, within this time. Longer than the GIL's switch
#: interval (5 ms), for which every thread may wait behind the worker's own work.
STALL = 0.01


class Demand:
    """The runs of one kind: how many threads they can use (:attr:`want`).

    Fed from the slot threads under the lock of their :class:`Slots`."""

    __slots__ = ("_cpu", "_least", "_read", "_runs", "want")

    def __init__(self) -> None:
        self._least = math.inf  # the least wall time in this window
        self._cpu = 0.0  # CPU time of the runs read in this window
        self._read = 0  # runs whose CPU time was read in this window
        self._runs = 0  # runs in this window
        #: Threads the kind's runs can use, at least 1; 0 until its first figure.
        self.want = 0

    def reads(self) -> bool:
        """Whether the next run's CPU time is read (one in :data:`SAMPLE`, the first of
        a window among them)."""
        return self._runs % SAMPLE == 0

    def add(self, wall: float, cpu: float | None) -> bool:
        """Count a run of *wall* seconds (*cpu* of them on a processor, if read); True
        when it ended a window (:attr:`want` is then new)."""
        self._runs += 1
        if wall < self._least:
            self._least = wall
        if cpu is not None:
            self._cpu += cpu
            self._read += 1
        if self._runs < (WINDOW if self.want else SAMPLE) or not self._read:
            return False
        compute = max(self._cpu / self._read, 1e-7)
        self.want = max(1, round(2 * self._least / compute - 1))  # 1 + 2 W / C
        self._least, self._cpu, self._read, self._runs = math.inf, 0.0, 0, 0
        return True


class Slots:
    """The slot threads of one runner.

    Args:
        size: The most threads (the worker's concurrency).
        serve: What each thread runs: takes runs until told to end (see :meth:`taken`,
            :meth:`ended`).
        waiting: Whether sync runs wait in the threads' queue.
    """

    def __init__(self, size: int, serve: Callable[[], None], waiting: Callable[[], bool]) -> None:
        self._size = size
        self._serve = serve
        self._waiting = waiting
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._numbers = itertools.count()  # threads' names: sqlaq-slot-0, -1...
        self._blocking = 0  # sync runs handed in and not finished (nor withdrawn)
        self._idle = 0  # threads between runs (a new one counts until its first)
        self._demands: dict[str, Demand] = {}  # by kind: how many threads its runs can use
        self._wanted = size  # the most any kind's runs can use (size until one is known)
        self._finished_at = -STALL  # perf_counter() at the last run's end
        self._finisher = 0  # the thread that ended it (threading.get_ident())
        # perf_counter() when the threads were last seen not stuck: a run ended, or runs
        # came with a thread between runs (an idle pool is not a stuck one).
        self._moved_at = -STALL
        # A start refused by the demands: the watch looks again after STALL, in case every
        # thread is stuck by then (started at the first refusal; ends at close()).
        self._again = threading.Event()
        self._shut = threading.Event()
        self._watch: threading.Thread | None = None
        self._closed = False  # close() has counted the threads it ends

    @property
    def count(self) -> int:
        """The threads started and not ended."""
        return len(self._threads)

    @property
    def idle(self) -> int:
        """The threads between runs."""
        return self._idle

    @property
    def blocking(self) -> int:
        """Sync runs handed in and not finished: running or waiting for a thread."""
        return self._blocking

    def want(self, kind: str) -> int:
        """The threads the runs of *kind* can use; 0 until they are measured."""
        demand = self._demands.get(kind)
        return 0 if demand is None else demand.want

    def handed(self, runs: int) -> None:
        """*runs* sync runs were put in the threads' queue: a thread for them if one is
        needed (see :meth:`grow`)."""
        if not runs:
            return
        with self._lock:
            self._blocking += runs
            if self._idle:
                self._moved_at = perf_counter()
        self.grow()

    def withdrawn(self, runs: int) -> None:
        """*runs* sync runs were taken back before they started."""
        with self._lock:
            self._blocking -= runs

    def taken(self) -> None:
        """The calling thread took a run: if more wait, a sibling for them."""
        with self._lock:
            self._idle -= 1
        if self._waiting():
            self.grow()

    def skipped(self) -> None:
        """The calling thread's run was withdrawn before it started: it is between runs
        again."""
        with self._lock:
            self._idle += 1

    def reads(self, kind: str) -> bool:
        """Whether the CPU time of the next run of *kind* is measured."""
        demand = self._demands.get(kind)
        return demand is None or demand.reads()

    def ended(self, kind: str, started: float, now: float, cpu: float | None, *, ran: bool) -> bool:
        """The calling thread ended a run of *kind*, from *started* to *now*
        (``perf_counter()``), *cpu* seconds of it on a processor if read; *ran*: False
        when it never started (cancelled while it waited). Returns whether the thread
        goes on; False when it ends now (it is counted out already)."""
        with self._lock:
            self._blocking -= 1
            if ran:
                demand = self._demands.get(kind)
                if demand is None:
                    demand = self._demands[kind] = Demand()
                if demand.add(now - started, cpu):
                    self._wanted = max(each.want for each in self._demands.values())
            serving = not self._retire(started, now)
            self._finished_at, self._finisher = now, threading.get_ident()
            self._moved_at = now
            if serving:
                self._idle += 1
        return serving

    def _retire(self, started: float, now: float) -> bool:
        """Whether the calling thread, having just ended a run (from *started* to *now*),
        ends too (under the lock; it is then counted out): when there are a quarter more
        threads than the kinds' runs can use, its run was quicker than :data:`STALL`,
        and another thread ended one lately (the others are not all stuck in long
        runs). The last thread stays."""
        count = len(self._threads)
        wanted = self._wanted
        if (
            count <= 1
            or count <= wanted + wanted // 4
            or now - started >= STALL
            or self._finisher == threading.get_ident()
            or now - self._finished_at >= STALL
        ):
            return False
        self._threads.remove(threading.current_thread())
        return True

    def grow(self) -> None:
        """Start one more thread if sync runs wait and no thread is between runs (up to
        the runs in hand and *size*), and the kinds' runs can use it or every thread is
        stuck. (A thread also costs about 36 KiB of resident memory.)"""
        with self._lock:
            count = len(self._threads)
            if self._closed or self._idle or count >= min(self._size, self._blocking):
                return
            stuck = perf_counter() - self._moved_at >= STALL
            refused = count >= self._wanted and not stuck
            if not refused:
                name = f"sqlaq-slot-{next(self._numbers)}"  # never one a thread still has
                thread = threading.Thread(target=self._serve, name=name, daemon=True)
                self._threads.append(thread)
                self._idle += 1
        if refused:
            self._look_again()
            return
        thread.start()

    def _look_again(self) -> None:
        """Have the watch call :meth:`grow` again after :data:`STALL` (the watch is
        started here the first time): runs that wait get a thread if every thread is
        stuck by then."""
        if self._again.is_set():
            return
        with self._lock:
            if self._watch is None:
                self._watch = threading.Thread(
                    target=self._watching, name="sqlaq-slots-watch", daemon=True
                )
                self._watch.start()
        self._again.set()

    def _watching(self) -> None:
        # Cleared before the wait, so a close() at any point ends the loop: its _shut
        # is seen by the wait or by the loop's test, and its _again is never lost.
        while not self._shut.is_set():
            self._again.wait()
            self._again.clear()
            if self._shut.wait(STALL):
                return
            if self._waiting():
                self.grow()

    def close(self) -> int:
        """Start no thread from now on (the watch ends); returns how many threads are
        running, each to be told to end."""
        self._shut.set()
        self._again.set()
        with self._lock:  # no thread is started after this count (see grow)
            self._closed = True
            return len(self._threads)
