"""The automatic prefetch (sqlaq.worker.pacing): a pure rule, driven with figures."""

from __future__ import annotations

import pytest

from sqlaq import ConfigError, WorkerConfig
from sqlaq.config import WORKER_OPTIONS
from sqlaq.worker.pacing import MAX_AUTO_PREFETCH, Pace, auto_prefetch


def test_a_deep_queue_of_fast_jobs_gets_a_deep_prefetch() -> None:
    # A no-op drain: 20,000 jobs/s, claims of 5 ms, each claim full.
    assert (
        auto_prefetch(jobs_per_second=20_000, claim_seconds=0.005, deep=True, concurrency=100)
        == 200
    )  # bounded by twice the concurrency
    assert (
        auto_prefetch(jobs_per_second=20_000, claim_seconds=0.02, deep=True, concurrency=10_000)
        == MAX_AUTO_PREFETCH
    )
    # 10 ms handlers at concurrency 100: 9,000 jobs/s, 2 ms claims: four claims' worth.
    assert (
        auto_prefetch(jobs_per_second=9_000, claim_seconds=0.002, deep=True, concurrency=100) == 72
    )


def test_slow_jobs_and_shallow_queues_get_none() -> None:
    # Ten 1 s handlers: ten jobs a second; a 3 ms claim covers them without prefetch.
    assert auto_prefetch(jobs_per_second=10, claim_seconds=0.003, deep=True, concurrency=10) == 1
    assert auto_prefetch(jobs_per_second=1, claim_seconds=0.003, deep=True, concurrency=10) == 1
    # The last claim came back short: nothing is claimed ahead, however fast the jobs.
    assert (
        auto_prefetch(jobs_per_second=20_000, claim_seconds=0.005, deep=False, concurrency=100) == 0
    )
    # Nothing observed yet: no prefetch.
    assert auto_prefetch(jobs_per_second=0, claim_seconds=0.005, deep=True, concurrency=100) == 0


def test_the_pace_follows_what_the_worker_observes() -> None:
    pace = Pace(concurrency=100, now=0.0)
    assert pace.prefetch == 0
    now = 0.0
    for _ in range(20):  # fast jobs, full claims: the prefetch grows to its bound
        pace.claimed(asked=100, got=100, started=now, ended=now + 0.004, held=100)
        now += 0.01
        pace.finished(200, now)  # 20,000 jobs/s
    assert pace.prefetch == 200
    pace.claimed(asked=300, got=12, started=now, ended=now + 0.001, held=100)  # ran dry: none
    assert pace.prefetch == 0

    slow = Pace(concurrency=100, now=0.0)
    now = 0.0
    for _ in range(20):  # 1 s handlers, 100 at once: 100 jobs/s
        slow.claimed(asked=100, got=100, started=now, ended=now + 0.003, held=100)
        now += 1.0
        slow.finished(100, now)
    assert slow.prefetch <= 2
    empty = Pace(concurrency=100, now=0.0)
    empty.claimed(asked=0, got=0, started=0.0, ended=0.001, held=100)  # asked nothing
    assert (empty.deep, empty.prefetch) == (False, 0)


def test_a_burst_after_an_idle_spell_is_paced_from_its_start() -> None:
    # A worker idle for a minute, then 500 jobs of 10 ms: a claim of 100 at 60.000 s,
    # which end together 12 ms later. Paced from the claim: 8,333 jobs/s and 4 ms claims,
    # four claims' worth ahead (134) from the second claim on. Measured over the idle
    # minute instead (1.7 jobs/s), the burst would get one job ahead while it lasts.
    pace = Pace(concurrency=100, now=0.0)
    pace.claimed(asked=100, got=100, started=60.0, ended=60.004, held=0)
    assert pace.prefetch == 0  # nothing has finished yet: no pace to go by
    pace.finished(100, 60.012)
    assert pace.prefetch == 134

    busy = Pace(concurrency=100, now=0.0)  # the same claim by a worker holding a job
    busy.claimed(asked=100, got=100, started=60.0, ended=60.004, held=1)
    busy.finished(100, 60.012)
    assert busy.prefetch == 1


def test_a_window_with_jobs_counted_in_it_is_not_restarted() -> None:
    # Jobs finished since the window began: a claim made holding none is a pause in
    # the pace, not a new start (their count keeps its elapsed time).
    pace = Pace(concurrency=100, now=0.0)
    pace.finished(50, 0.004)  # too soon for a figure (under RATE_WINDOW)
    pace.claimed(asked=100, got=100, started=0.006, ended=0.010, held=0)
    pace.finished(50, 0.010)  # 100 jobs over 10 ms, not over 4 ms
    assert pace.jobs_per_second == pytest.approx(10_000)
    assert pace.prefetch == 160


def test_prefetch_defaults_to_auto_and_a_number_still_wins() -> None:
    assert WorkerConfig().prefetch is None
    assert WorkerConfig(prefetch=0).prefetch == 0
    assert WorkerConfig(prefetch=200).prefetch == 200
    option = next(o for o in WORKER_OPTIONS if o.name == "prefetch")
    assert option.domain.parse("auto", "--prefetch") is None
    assert option.domain.parse(" 50 ", "--prefetch") == 50
    assert option.domain.show(None) == "auto"
    with pytest.raises(ConfigError, match="--prefetch: invalid integer 'lots' \\(or 'auto'\\)"):
        option.domain.parse("lots", "--prefetch")
    with pytest.raises(ConfigError, match="prefetch must be between 0 and 10000, got -1"):
        WorkerConfig(prefetch=-1)
    with pytest.raises(ConfigError, match="prefetch must be an int or None"):
        WorkerConfig(prefetch="auto")  # type: ignore[arg-type]
