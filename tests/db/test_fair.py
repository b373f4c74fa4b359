"""Weighted fair claiming across keys (:func:`sqlaq.claim_fair`), against a real
PostgreSQL: a flooding key gets its share of each claim, weights change the shares,
racing claimers take each job once, and the plain claim keeps its order."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import Engine, text

import sqlaq
from sqlaq import ConfigError

pytestmark = pytest.mark.timeout(120)


def _flood(engine: Engine, *, big: int = 2000, small: int = 20, per_small: int = 5) -> None:
    """*big* jobs of key 'big' enqueued first, then *per_small* jobs of each of *small*
    keys, then a few jobs without a key: in plain claim order the flood comes first."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (kind, key, created_at) "
                "SELECT 'work', 'big', now() FROM generate_series(1, :n)"
            ),
            {"n": big},
        )
        conn.execute(
            text(
                "INSERT INTO sqlaq_jobs (kind, key) SELECT 'work', 'small' || (g % :s) "
                "FROM generate_series(1, :n) AS g ORDER BY g % :s"
            ),
            {"s": small, "n": small * per_small},
        )
        conn.execute(text("INSERT INTO sqlaq_jobs (kind) SELECT 'work' FROM generate_series(1, 3)"))


def _claim_keys(engine: Engine, limit: int, fair: bool = True, **options: Any) -> Counter[str]:
    claim = sqlaq.claim_fair if fair else sqlaq.claim
    with engine.begin() as conn:
        jobs = claim(conn, worker_id=uuid.uuid4(), limit=limit, **options)
        ids = [job.id for job in jobs]
        keys = conn.execute(
            text("SELECT coalesce(key, '-') FROM sqlaq_jobs WHERE id = ANY(:ids)"), {"ids": ids}
        ).scalars()
        return Counter(keys)


def test_every_key_starts_while_the_flood_is_queued(committed: Engine) -> None:
    _flood(committed)
    # 21 keys: one claim of 21 takes one job of each key (the jobs without a key are no
    # share: they take the slots the keys leave, none here).
    first = _claim_keys(committed, 21)
    assert first == Counter({f"small{n}": 1 for n in range(20)} | {"big": 1})
    # Claim after claim, the small keys keep their share until they run dry (5 jobs
    # each: five or six claims of 22), the flood a share like any other (more once the
    # small keys have fewer left than their slots).
    claims = 1
    while _queued_of_small_keys(committed):
        claims += 1
        assert _claim_keys(committed, 22)["big"] <= 5
        assert claims <= 6
    # Only the flood is keyed now: a claim still fills up (no claim comes back short).
    assert _claim_keys(committed, 50) == Counter({"big": 50})


def test_jobs_without_a_key_take_the_slots_the_keys_leave(committed: Engine) -> None:
    _flood(committed, big=5, small=2, per_small=2)
    # 9 keyed jobs and 3 without a key: a claim of 12 takes every keyed job (the shares)
    # and fills up with the 3 others (plain order).
    assert _claim_keys(committed, 12) == Counter({"big": 5, "small0": 2, "small1": 2, "-": 3})


def _queued_of_small_keys(engine: Engine) -> int:
    with engine.connect() as conn:
        sql = "SELECT count(*) FROM sqlaq_jobs WHERE status = 'queued' AND key LIKE 'small%'"
        return int(conn.execute(text(sql)).scalar_one())


def test_the_plain_claim_keeps_its_order(committed: Engine) -> None:
    _flood(committed)
    assert _claim_keys(committed, 22, fair=False) == Counter({"big": 22})


def test_small_claims_take_turns(committed: Engine) -> None:
    _flood(committed, big=1000, small=4, per_small=250)
    served: Counter[str] = Counter()
    for _ in range(500):
        served += _claim_keys(committed, 1)
    # Five keys of equal weight and one slot a claim: the slot goes to one of the five
    # at random (the shares tie), so each gets about a fifth of the 500 (mean 100,
    # standard deviation 9), the flood never the whole worker (in plain claim order it
    # would get all 500). The bounds are 5.6 deviations out: a fair claim misses them
    # about once in ten million runs, an unfair one every time.
    assert served["big"] <= 150
    assert all(served[f"small{n}"] >= 50 for n in range(4))


def test_weights_change_the_shares(committed: Engine) -> None:
    _flood(committed, big=500, small=2, per_small=200)
    # Weights 6 (big), 3 (small0), 1 (small1): of 10 jobs, 6, 3 and 1.
    got = _claim_keys(committed, 10, weights={"big": 6, "small0": 3})
    assert got == Counter({"big": 6, "small0": 3, "small1": 1})


def test_a_paused_queue_gives_nothing(committed: Engine) -> None:
    _flood(committed, big=10, small=2, per_small=2)
    with committed.begin() as conn:
        sqlaq.pause(conn, "default")
    try:
        assert _claim_keys(committed, 10) == Counter()
    finally:
        with committed.begin() as conn:
            sqlaq.resume(conn, "default")


def test_racing_claimers_claim_each_job_once(committed: Engine) -> None:
    _flood(committed, big=600, small=10, per_small=40)
    claimed: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            while True:
                with committed.begin() as conn:
                    jobs = sqlaq.claim_fair(conn, worker_id=uuid.uuid4(), limit=7)
                if not jobs:
                    return
                with lock:
                    claimed.extend(job.id for job in jobs)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(claimed) == len(set(claimed)) == 600 + 400 + 3


def test_bad_weights_are_one_line(committed: Engine) -> None:
    with committed.begin() as conn:
        with pytest.raises(ConfigError, match="the weight of 'a' must be between 1 and"):
            sqlaq.claim_fair(conn, worker_id=uuid.uuid4(), weights={"a": 0})
        with pytest.raises(ConfigError, match="key"):
            sqlaq.claim_fair(conn, worker_id=uuid.uuid4(), weights={" ": 1})


def test_claimed_jobs_and_their_context_carry_the_key(committed: Engine) -> None:
    from datetime import timedelta

    from sqlaq.context import JobContext

    with committed.begin() as conn:
        sqlaq.enqueue(conn, "work", key="tenant-7")
        sqlaq.enqueue(conn, "work")
    for claim in (sqlaq.claim, sqlaq.claim_fair):
        with committed.begin() as conn:
            jobs = claim(conn, worker_id=uuid.uuid4(), limit=2)
            assert sorted((job.key or "") for job in jobs) == ["", "tenant-7"]
            lease = jobs[0].lease
            context = JobContext.for_job(
                jobs[0], timedelta(seconds=30), lambda *a, lease=lease: lease
            )
            assert context.key == jobs[0].key
            conn.rollback()


def test_a_fair_claim_leaves_out_excluded_kinds_and_honours_where(committed: Engine) -> None:
    _flood(committed, big=50, small=3, per_small=5)
    with committed.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("limited", key="small0") for _ in range(5)])
    got = _claim_keys(committed, 100, exclude_kinds=["limited"], where=sqlaq.jobs.c.key != "big")
    assert got == Counter({"small0": 5, "small1": 5, "small2": 5})
    with committed.connect() as conn:
        left = conn.execute(
            text("SELECT kind, count(*) FROM sqlaq_jobs WHERE status = 'queued' GROUP BY kind")
        ).all()
    assert sorted(left) == [("limited", 5), ("work", 53)]  # the flood and the keyless 3
