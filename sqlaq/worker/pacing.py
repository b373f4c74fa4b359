"""How far a worker claims ahead when ``prefetch`` is left to it ("auto"). No I/O.

This module owns the rule, a pure function of what the worker observed
(:func:`auto_prefetch`), and :class:`Pace`, which keeps those observations: how many
jobs finish a second, how long a claim takes, and whether the last claim came back full
(the queue is deeper than what was asked). The run thread feeds it; nothing here reads a
clock of its own, so a test drives it with figures.

The rule: hold about four claims' worth of jobs ahead of the free slots, that is
``4 x jobs/s x claim seconds`` (the worker tops its prefetch up once half of it is
used, so two claims' worth are left when a claim starts), so a slot that frees starts
its next job at once instead of waiting a claim's round trip; nothing while the queue is
shallow (the last claim came back short: claiming ahead would only take jobs another
worker could start now); at most twice the concurrency, and at most
:data:`MAX_AUTO_PREFETCH`. It follows the handlers by itself: fast handlers finish many
jobs a second (a no-op drain: 20,000, so the prefetch reaches its bound), slow ones few
(ten 1 s handlers finish ten a second, and a 3 ms claim asks for none ahead), so a
prefetched job waits a few claims' time, never a handler's length, while its lease
ticks. The pace counts from when work begins (an idle spell restarts its window), so a
burst is paced from its first jobs' end. Measured (bench/RESULTS.md): a 10 ms handler
at concurrency 100 settles near 100 ahead and drains as fast as a hand-set
``prefetch=200``.
"""

from __future__ import annotations

import math

__all__ = ["MAX_AUTO_PREFETCH", "Pace", "auto_prefetch"]

#: The most jobs an automatic prefetch holds ahead of the free slots.
MAX_AUTO_PREFETCH = 1000
#: Claims' worth of jobs held ahead: half is left when the worker tops it up, so two
#: claims' worth cover the claim in flight and the next.
CLAIMS_AHEAD = 4.0
#: The shortest window a jobs/s figure is measured over (seconds): short enough that a
#: burst of 10 ms jobs is paced from its first round (they end together, 10-15 ms
#: after its claim), long enough that a figure counts more than a handful of jobs.
RATE_WINDOW = 0.01
#: Weight of the newest figure in the running averages.
SMOOTHING = 0.5


def auto_prefetch(
    *, jobs_per_second: float, claim_seconds: float, deep: bool, concurrency: int
) -> int:
    """Jobs to claim ahead of the free slots.

    Args:
        jobs_per_second: Jobs finished a second lately (0 before any has).
        claim_seconds: How long a claim takes lately (its round trip and its wait for
            the GIL).
        deep: The last claim came back full: more jobs are due than were asked for.
        concurrency: The worker's concurrency; the prefetch is at most twice it.
    """
    if not deep or jobs_per_second <= 0 or claim_seconds <= 0:
        return 0
    wanted = math.ceil(CLAIMS_AHEAD * jobs_per_second * claim_seconds)
    return max(0, min(wanted, 2 * concurrency, MAX_AUTO_PREFETCH))


class Pace:
    """What a worker observed of its own pace, and the prefetch that follows from it.

    Args:
        concurrency: The worker's concurrency (the prefetch's bound).
        now: The clock's time at start (``time.monotonic``).
    """

    def __init__(self, concurrency: int, now: float) -> None:
        self._concurrency = concurrency
        self.jobs_per_second = 0.0
        self.claim_seconds = 0.0
        self.deep = False
        self._finished = 0
        self._since = now
        self.prefetch = 0

    def claimed(self, asked: int, got: int, *, started: float, ended: float, held: int) -> None:
        """A claim asked for *asked* jobs and got *got*, from *started* to *ended* (the
        clock's times), made while the worker held *held* jobs (running or claimed
        ahead).

        Holding none, the worker has been idle: a rate window with no job finished in
        it starts again at this claim. An idle spell is not the jobs' pace; measured
        over it, a burst after a quiet minute would get no prefetch before its first
        window had passed.
        """
        if not held and not self._finished:
            self._since = started
        if asked <= 0:
            return
        self.deep = got >= asked
        if got:  # an empty claim is quick and says nothing of a full one's cost
            seconds, previous = ended - started, self.claim_seconds
            self.claim_seconds = (
                seconds if not previous else previous + SMOOTHING * (seconds - previous)
            )
        self._update()

    def finished(self, count: int, now: float) -> None:
        """*count* jobs finished by *now*."""
        self._finished += count
        elapsed = now - self._since
        if elapsed < RATE_WINDOW:
            return
        rate = self._finished / elapsed
        previous = self.jobs_per_second
        self.jobs_per_second = rate if not previous else previous + SMOOTHING * (rate - previous)
        self._finished, self._since = 0, now
        self._update()

    def _update(self) -> None:
        self.prefetch = auto_prefetch(
            jobs_per_second=self.jobs_per_second,
            claim_seconds=self.claim_seconds,
            deep=self.deep,
            concurrency=self._concurrency,
        )
