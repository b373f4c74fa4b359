"""Job keys: set at every enqueue path, checked, and claimed within per-key limits and
strict order per key (``key_concurrency``, ``ordered``), against a real PostgreSQL."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import sqlaq
from sqlaq import InvalidJobError, NewJob, admin
from sqlaq.explain import ReasonCode

pytestmark = pytest.mark.timeout(60)


def _keys(engine: Engine) -> list[tuple[str, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT kind, key FROM sqlaq_jobs ORDER BY id")).all()
    return [(row.kind, row.key) for row in rows]


def _enqueue(engine: Engine, kind: str, *keys: str | None, **options: Any) -> list[int]:
    with engine.begin() as conn:
        results = sqlaq.enqueue_many(conn, [NewJob(kind, key=key, **options) for key in keys])
    return [r.job_id for r in results]


def _claim(engine: Engine, kind: str, limit: int = 10, **limits: Any) -> sqlaq.LimitedClaim:
    with engine.begin() as conn:
        return sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind=kind, limit=limit, **limits)


def _running_keys(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        sql = "SELECT key FROM sqlaq_jobs WHERE status = 'running' ORDER BY key"
        return list(conn.execute(text(sql)).scalars())


def _ids(claim: sqlaq.LimitedClaim) -> list[int]:
    return sorted(job.id for job in claim.jobs)


# -- enqueue ------------------------------------------------------------------------------


def test_every_enqueue_path_writes_the_key(committed: Engine) -> None:
    registry = sqlaq.Registry()
    registry.add("reg", print)
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "one", key="t1")
        registry.enqueue(conn, "reg", key="t2")
        # Not uniform (a dedupe key): enqueue_many_stmt's arrays.
        sqlaq.enqueue_many(conn, [NewJob("many", key="t3", dedupe_key="d"), NewJob("many")])
        # Uniform: one statement with the key as one value.
        sqlaq.enqueue_many(conn, [NewJob("uniform", {"n": n}, key="t4") for n in range(2)])
        sqlaq.enqueue_many(conn, NewJob("batch", key="t5").with_payloads([{}, {}]))
        # Jobs of one shape but two keys are not one uniform batch.
        sqlaq.enqueue_many(conn, [NewJob("mixed", key="a"), NewJob("mixed", key="b")])
        assert sqlaq.enqueue_copy(conn, [NewJob("copy", key="t6"), NewJob("copy")]) == 2
        sqlaq.enqueue(conn, "debounced", key="t7", debounce_key="d", debounce=timedelta(hours=1))
        sqlaq.enqueue(conn, "debounced", key="t8", debounce_key="d", debounce=timedelta(hours=1))
    with Session(committed) as session, session.begin():
        session.add(sqlaq.Job(kind="orm", key="t9"))
    assert _keys(committed) == [
        ("one", "t1"),
        ("reg", "t2"),
        ("many", "t3"),
        ("many", None),
        ("uniform", "t4"),
        ("uniform", "t4"),
        ("batch", "t5"),
        ("batch", "t5"),
        ("mixed", "a"),
        ("mixed", "b"),
        ("copy", "t6"),
        ("copy", None),
        ("debounced", "t7"),  # a debounced job keeps its first key
        ("orm", "t9"),
    ]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "key must be a non-empty name"),
        ("   ", "key must be a non-empty name"),
        (7, "key must be a str or None, got int"),
        ("k" * 256, "key is 256 characters long; the limit is 255"),
        ("a\x00b", "key contains a NUL character"),
    ],
)
def test_a_bad_key_is_one_line_and_writes_nothing(
    committed: Engine, key: Any, message: str
) -> None:
    with committed.begin() as conn:
        with pytest.raises(InvalidJobError, match=message) as raised:
            sqlaq.enqueue(conn, "k", key=key)
        assert "\n" not in str(raised.value)
        with pytest.raises(InvalidJobError, match=message):
            NewJob("k", key=key)
        with pytest.raises(InvalidJobError, match=message):
            sqlaq.Job(kind="k", key=key)
    assert _keys(committed) == []


def test_registry_checks_the_key_options() -> None:
    registry = sqlaq.Registry()
    with pytest.raises(sqlaq.ConfigError, match="key_concurrency of 'a' must be between 1 and"):
        registry.add("a", print, key_concurrency=0)
    with pytest.raises(sqlaq.ConfigError, match="ordered of 'a' must be a bool"):
        registry.add("a", print, ordered=1)  # type: ignore[arg-type]
    with pytest.raises(sqlaq.ConfigError, match="'a' is ordered: one job of a key runs"):
        registry.add("a", print, ordered=True, key_concurrency=2)
    keyed = registry.add("keyed", print, key_concurrency=3)
    ordered = registry.add("ordered", print, ordered=True)
    plain = registry.add("plain", print)
    assert (keyed.key_concurrency, keyed.ordered, keyed.keyed, keyed.limited) == (
        3,
        False,
        True,
        True,
    )
    assert (ordered.key_concurrency, ordered.ordered, ordered.limited) == (1, True, True)
    assert (plain.key_concurrency, plain.ordered, plain.keyed, plain.limited) == (
        None,
        False,
        False,
        False,
    )


# -- per-key concurrency --------------------------------------------------------------------


def test_key_concurrency_counts_live_leases_per_key(committed: Engine) -> None:
    a = _enqueue(committed, "tenant", *["a"] * 4)
    b = _enqueue(committed, "tenant", *["b"] * 4)
    free = _enqueue(committed, "tenant", None, None)
    first = _claim(committed, "tenant", key_concurrency=2)
    # Two of each key, and the jobs without a key: keys limit only their own jobs.
    assert _ids(first) == sorted(a[:2] + b[:2] + free)
    assert first.full  # held back by its keys: worth a look when a job ends
    assert _claim(committed, "tenant", key_concurrency=2).jobs == []
    done = next(job for job in first.jobs if job.id == a[0])
    with committed.begin() as conn:
        sqlaq.complete(conn, done.lease)
    assert _ids(_claim(committed, "tenant", key_concurrency=2)) == [a[2]]
    # A lease that expired holds no slot of its key: its job is claimed back.
    with committed.begin() as conn:
        conn.execute(
            text("UPDATE sqlaq_jobs SET run_at = now() - interval '1s' WHERE id = :id"),
            {"id": b[0]},
        )
    assert _ids(_claim(committed, "tenant", key_concurrency=2)) == [b[0]]


def test_one_claim_takes_no_more_than_a_keys_room(committed: Engine) -> None:
    """A claim reads a few candidates at a time: a flood of one key at the front of the
    queue does not keep it from the other keys' jobs, nor make it take more of that key."""
    flood = _enqueue(committed, "tenant", *["big"] * 30, priority=5)
    small = _enqueue(committed, "tenant", "x", "y", "z")
    got = _claim(committed, "tenant", limit=10, key_concurrency=3)
    assert _ids(got) == sorted(flood[:3] + small)


def test_key_concurrency_goes_with_the_kinds_concurrency(committed: Engine) -> None:
    _enqueue(committed, "tenant", "a", "a", "b", "b", "c")
    got = _claim(committed, "tenant", concurrency=3, key_concurrency=1)
    assert (len(got.jobs), got.full) == (3, True)
    assert _running_keys(committed) == ["a", "b", "c"]


def test_where_narrows_a_keyed_claim(committed: Engine) -> None:
    _enqueue(committed, "tenant", "eu-1", "eu-1", "us-1")
    eu = sqlaq.jobs.c.key.startswith("eu-")
    assert len(_claim(committed, "tenant", key_concurrency=5, where=eu).jobs) == 2
    assert _running_keys(committed) == ["eu-1", "eu-1"]


# -- strict order per key -------------------------------------------------------------------


def test_ordered_runs_a_keys_jobs_one_at_a_time_in_enqueue_order(committed: Engine) -> None:
    # Priorities against enqueue order: within a key, enqueue order wins.
    a1, a2, a3 = _enqueue(committed, "ledger", "a", "a", "a", priority=0)
    (b1,) = _enqueue(committed, "ledger", "b", priority=0)
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "ledger", key="a", priority=9)  # a4: last of a, whatever its priority
    first = _claim(committed, "ledger", ordered=True)
    assert _ids(first) == [a1, b1]
    assert _claim(committed, "ledger", ordered=True).jobs == []
    with committed.begin() as conn:
        sqlaq.complete(conn, next(j.lease for j in first.jobs if j.id == a1))
    assert _ids(_claim(committed, "ledger", ordered=True)) == [a2]
    assert a3 > a2


def test_a_job_waiting_for_its_retry_holds_the_line(committed: Engine) -> None:
    a1, a2 = _enqueue(committed, "ledger", "a", "a")
    (job,) = _claim(committed, "ledger", ordered=True).jobs
    with committed.begin() as conn:
        sqlaq.fail(conn, job.lease, "boom", retry_in=timedelta(hours=1))
    assert _claim(committed, "ledger", ordered=True).jobs == []  # a2 waits for a1's retry
    with committed.begin() as conn:
        reasons = sqlaq.explain(conn, a2, registry=_ledger_registry())
    assert reasons[0].code is ReasonCode.KEY_ORDER
    assert reasons[0].message == f"behind an earlier job of its key 'a' (id {a1}, queued)"
    with committed.begin() as conn:
        conn.execute(text("UPDATE sqlaq_jobs SET run_at = now() WHERE id = :id"), {"id": a1})
    assert _ids(_claim(committed, "ledger", ordered=True)) == [a1]


def test_a_job_failed_for_good_holds_its_key_until_retried(committed: Engine) -> None:
    a1, a2 = _enqueue(committed, "ledger", "a", "a", max_attempts=1)
    (b1,) = _enqueue(committed, "ledger", "b")
    first = _claim(committed, "ledger", ordered=True)
    assert _ids(first) == [a1, b1]
    with committed.begin() as conn:
        failed = next(j for j in first.jobs if j.id == a1)
        assert sqlaq.fail(conn, failed.lease, "boom") == sqlaq.JobStatus.FAILED
    assert _claim(committed, "ledger", ordered=True).jobs == []
    with committed.begin() as conn:
        reasons = sqlaq.explain(conn, a2, registry=_ledger_registry())
    assert [r.code for r in reasons] == [ReasonCode.KEY_ORDER, ReasonCode.NO_WORKER]
    assert reasons[0].message == (
        f"behind an earlier job of its key 'a' (id {a1}, failed): it failed for good and "
        f"holds the key until it is retried ('sqlaq retry {a1}') or deleted"
    )
    # The operator's choices: retry it (it runs again, first), or give it up: retry and
    # cancel it in one transaction (no worker sees it queued), and the line moves on.
    with committed.begin() as conn:
        sqlaq.retry(conn, [a1])
        assert sqlaq.cancel(conn, [a1]) == [a1]
    assert _ids(_claim(committed, "ledger", ordered=True)) == [a2]


def test_explain_says_a_key_is_at_its_limit(committed: Engine) -> None:
    registry = sqlaq.Registry()
    registry.add("tenant", print, key_concurrency=1)
    first, second = _enqueue(committed, "tenant", "acme", "acme")
    assert _ids(_claim(committed, "tenant", key_concurrency=1)) == [first]
    with committed.begin() as conn:
        reasons = sqlaq.explain(conn, second, registry=registry)
    assert reasons[0] == sqlaq.Reason(
        ReasonCode.KEY_LIMIT, "waiting: key 'acme' at its limit (1 running, key_concurrency 1)"
    )


def test_claim_limited_checks_the_key_options(committed: Engine) -> None:
    with committed.begin() as conn:
        with pytest.raises(sqlaq.ConfigError, match="key_concurrency must be a positive int"):
            sqlaq.claim_limited(conn, worker_id=uuid.uuid4(), kind="k", key_concurrency=0)
        with pytest.raises(sqlaq.ConfigError, match="key_concurrency must be 1 or None"):
            sqlaq.claim_limited(
                conn, worker_id=uuid.uuid4(), kind="k", key_concurrency=2, ordered=True
            )


def _ledger_registry() -> sqlaq.Registry:
    registry = sqlaq.Registry()
    registry.add("ledger", print, ordered=True)
    return registry


def test_sqlaq_explain_names_the_key_that_holds_a_job(committed: Engine, database_url: str) -> None:
    """``sqlaq explain ID --app ...`` with worker_app's ordered kind ``account_op``."""
    first, second = _enqueue(committed, "account_op", "acct-9", "acct-9")
    assert _ids(_claim(committed, "account_op", ordered=True)) == [first]
    out = io.StringIO()
    argv = ["explain", str(second), "--app", "worker_app:registry", "--database-url", database_url]
    assert admin.run(argv, {}, out=out) == 0
    lines = [line for line in out.getvalue().splitlines() if line.startswith("key_")]
    assert lines == [
        f"key_order: behind an earlier job of its key 'acct-9' (id {first}, running)",
        "key_limit: waiting: key 'acct-9' at its limit (1 running, key_concurrency 1)",
    ]
