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
        pace.claimed(asked=100, got=100, seconds=0.004)
        now += 0.01
        pace.finished(200, now)  # 20,000 jobs/s
    assert pace.prefetch == 200
    pace.claimed(asked=300, got=12, seconds=0.001)  # the queue ran dry: none ahead
    assert pace.prefetch == 0

    slow = Pace(concurrency=100, now=0.0)
    now = 0.0
    for _ in range(20):  # 1 s handlers, 100 at once: 100 jobs/s
        slow.claimed(asked=100, got=100, seconds=0.003)
        now += 1.0
        slow.finished(100, now)
    assert slow.prefetch <= 2
    empty = Pace(concurrency=100, now=0.0)
    empty.claimed(asked=0, got=0, seconds=0.001)  # asked for nothing: says nothing
    assert (empty.deep, empty.prefetch) == (False, 0)


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
