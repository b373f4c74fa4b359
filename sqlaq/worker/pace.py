"""How many slot threads the runs of a ``def`` handler can use; no SQL, no threads.

The rule starts from the sizing rule of a pool of threads (Goetz et al., *Java
Concurrency in Practice*, 8.2): on *N* processors, a task that computes for *C* and
waits for *W* (I/O, a sleep, a lock) keeps ``N * (1 + W / C)`` threads busy; more only
take turns. Python code runs on one processor at a time, whatever the machine (the
GIL), so *N* is 1. The wait counts twice, ``1 + 2 W / C``: a worker's runs come a claim
at a time, and its own threads take the GIL too, so threads that block queue for it
between their waits; at ``1 + W / C`` a drain of ``def`` handlers sleeping 10 ms ran on
about 190 threads and a seventh slower than with as many as waited (about 310), at
twice the wait as fast. A handler that only computes gets one thread, one that sleeps
10 ms (computing 50 us) about four hundred.

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
"""

from __future__ import annotations

import math

__all__ = ["SAMPLE", "WINDOW", "Pace"]

#: Runs of a kind per measure.
WINDOW = 64
#: One run in this many has its CPU time read.
SAMPLE = 8


class Pace:
    """The runs of one kind: how many threads they can use (:attr:`want`).

    Fed from the slot threads under the runner's lock."""

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
