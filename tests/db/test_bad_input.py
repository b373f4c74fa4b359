"""Bad input raises InvalidJobError before any SQL runs, and nothing is written.

One test per kind of bad input, for enqueue, enqueue_many and the ORM Job.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

import sqlaq
from sqlaq import InvalidJobError, NewJob
from sqlaq.bounds import MAX_DURATION
from tests.helpers import count_jobs

US = timedelta(microseconds=1)


def nested(depth: int) -> dict[str, Any]:
    """A payload of *depth* nested objects, the outermost included."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


DEEP_3000: dict[str, Any] = nested(3000)
CYCLE: dict[str, Any] = {"a": {"b": []}}
CYCLE["a"]["b"].append(CYCLE["a"])
SELF: dict[str, Any] = {}
SELF["me"] = SELF

BAD_INPUT: list[tuple[str, dict[str, Any], str]] = [
    (
        "set-in-payload",
        {"payload": {"tags": {"a", "b"}}},
        r"payload\['tags'\] is a set.*use a list",
    ),
    ("object-in-payload", {"payload": {"when": object()}}, r"payload\['when'\] is a object"),
    ("payload-not-object", {"payload": [1, 2]}, r"payload must be a dict"),
    ("non-str-key", {"payload": {1: "x"}}, r"key 1 of type int"),
    ("nan", {"payload": {"x": float("nan")}}, r"payload\['x'\] is nan.*NaN"),
    ("infinity", {"payload": {"x": [1.0, float("inf")]}}, r"payload\['x'\]\[1\] is inf"),
    ("nul-in-payload", {"payload": {"x": "a\x00b"}}, r"payload\['x'\] contains a NUL"),
    ("nul-in-payload-key", {"payload": {"a\x00": 1}}, r"has a key that contains a NUL"),
    ("nul-in-kind", {"kind": "se\x00nd"}, r"kind contains a NUL"),
    ("empty-kind", {"kind": ""}, r"kind must be a non-empty name"),
    ("blank-kind", {"kind": "   "}, r"kind must be a non-empty name"),
    ("long-kind", {"kind": "k" * 256}, r"kind is 256 characters long; the limit is 255"),
    ("kind-not-str", {"kind": 5}, r"kind must be a str, got int"),
    ("empty-queue", {"queue": ""}, r"queue must be a non-empty name"),
    ("long-queue", {"queue": "q" * 300}, r"queue is 300 characters long"),
    ("nul-in-queue", {"queue": "q\x00"}, r"queue contains a NUL"),
    ("max-attempts-zero", {"max_attempts": 0}, r"max_attempts must be between 1 and"),
    ("max-attempts-negative", {"max_attempts": -3}, r"max_attempts must be between 1 and"),
    ("max-attempts-bool", {"max_attempts": True}, r"max_attempts must be an int, got bool"),
    ("negative-delay", {"delay": timedelta(seconds=-1)}, r"delay must be zero or more"),
    ("delay-not-timedelta", {"delay": 5}, r"delay must be a datetime.timedelta"),
    ("priority-out-of-range", {"priority": 40_000}, r"priority must be between -32768 and"),
    ("empty-dedupe-key", {"dedupe_key": ""}, r"dedupe_key must not be empty"),
    ("long-dedupe-key", {"dedupe_key": "é" * 600}, r"dedupe_key is 1200 bytes"),
    ("nul-in-dedupe-key", {"dedupe_key": "a\x00"}, r"dedupe_key contains a NUL"),
    (
        "surrogate-in-payload",
        {"payload": {"x": ["a\ud800b"]}},
        r"payload\['x'\]\[0\] contains a lone surrogate \('\\ud800' at index 1\).*decode",
    ),
    (
        "surrogate-in-payload-key",
        {"payload": {"a": {"\udc80": 1}}},
        r"payload\['a'\] has a key that contains a lone surrogate",
    ),
    ("surrogate-in-kind", {"kind": "se\udfffnd"}, r"kind contains a lone surrogate"),
    ("surrogate-in-queue", {"queue": "\ud800"}, r"queue contains a lone surrogate"),
    ("surrogate-in-dedupe-key", {"dedupe_key": "k\udc00"}, r"dedupe_key contains a lone"),
    ("nested-3000-deep", {"payload": DEEP_3000}, r"nests deeper than 500 levels; flatten"),
    ("nested-501-deep", {"payload": nested(501)}, r"\.\.\.\(500 levels\) nests deeper"),
    ("cycle", {"payload": CYCLE}, r"payload\['a'\]\['b'\]\[0\] is payload\['a'\] again"),
    ("self-containing", {"payload": SELF}, r"payload\['me'\] is payload again"),
    ("huge-int", {"payload": {"n": 10**5000}}, r"payload\['n'\] is an int of more than 4300"),
    ("int-4301-digits", {"payload": {"n": [-(10**4300)]}}, r"more than 4300 digits"),
    ("bytes-in-payload", {"payload": {"b": b"x"}}, r"payload\['b'\] is a bytes"),
    ("delay-past-100-years", {"delay": timedelta(days=10**8)}, r"delay must be at most 100"),
    ("delay-just-past-100-years", {"delay": MAX_DURATION + US}, r"delay must be at most 100"),
]


def _call(fields: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "ok", "payload": {}} | fields


@pytest.mark.parametrize(
    ("fields", "message"), [(f, m) for _, f, m in BAD_INPUT], ids=[i for i, _, _ in BAD_INPUT]
)
def test_enqueue_rejects_bad_input_and_writes_nothing(
    conn: Connection, fields: dict[str, Any], message: str
) -> None:
    args = _call(fields)
    with pytest.raises(InvalidJobError, match=message):
        sqlaq.enqueue(conn, args.pop("kind"), args.pop("payload"), **args)
    assert count_jobs(conn) == 0


@pytest.mark.parametrize(
    ("fields", "message"), [(f, m) for _, f, m in BAD_INPUT], ids=[i for i, _, _ in BAD_INPUT]
)
def test_enqueue_many_rejects_the_whole_batch(
    conn: Connection, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message):
        sqlaq.enqueue_many(conn, [NewJob("fine"), NewJob(**_call(fields))])
    assert count_jobs(conn) == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [(f, m) for i, f, m in BAD_INPUT if "delay" not in i],
    ids=[i for i, _, _ in BAD_INPUT if "delay" not in i],
)
def test_orm_job_rejects_bad_input_at_construction(
    engine: Any, fields: dict[str, Any], message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(InvalidJobError, match=message):
            session.add(sqlaq.Job(**_call(fields)))
        assert count_jobs(session.connection()) == 0
        session.rollback()


def test_enqueue_many_rejects_items_that_are_not_new_jobs(conn: Connection) -> None:
    with pytest.raises(InvalidJobError, match=r"jobs\[1\] must be a sqlaq.NewJob, got dict"):
        sqlaq.enqueue_many(conn, [NewJob("a"), {"kind": "b"}])  # type: ignore[list-item]
    assert count_jobs(conn) == 0


def test_orm_job_needs_a_kind_and_refuses_naive_timestamps() -> None:
    from datetime import UTC, datetime

    with pytest.raises(InvalidJobError, match="Job needs a kind"):
        sqlaq.Job(payload={})
    with pytest.raises(InvalidJobError, match="run_at must be an aware datetime"):
        sqlaq.Job(kind="k", run_at=datetime(2030, 1, 1))
    aware = datetime(2030, 1, 1, tzinfo=UTC)
    assert sqlaq.Job(kind="k", run_at=aware).run_at == aware


@pytest.mark.parametrize(
    "lease", [timedelta(seconds=-1), timedelta(0), 30], ids=["negative", "zero", "not-timedelta"]
)
def test_claim_and_extend_reject_a_bad_lease(conn: Connection, lease: Any) -> None:
    sqlaq.enqueue(conn, "k")
    with pytest.raises(InvalidJobError, match="lease must be"):
        sqlaq.claim(conn, worker_id=uuid.uuid4(), lease=lease)
    assert count_jobs(conn, "status = 'queued'") == 1
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    with pytest.raises(InvalidJobError, match="length must be"):
        sqlaq.extend_lease(conn, job.lease, length=lease)


def test_fail_rejects_a_negative_retry_delay(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    with pytest.raises(InvalidJobError, match="retry_in must be zero or more"):
        sqlaq.fail(conn, job.lease, "x", retry_in=timedelta(seconds=-5))
    assert count_jobs(conn, "status = 'running'") == 1


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
def test_claim_rejects_a_bad_limit(conn: Connection, limit: Any) -> None:
    with pytest.raises(sqlaq.ConfigError, match="limit must be a positive int"):
        sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=limit)


# -- the edges that are accepted, and come back as they went ------------------------------


def read_payload(conn: Connection, job_id: int) -> Any:
    return conn.execute(
        text("SELECT payload FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
    ).scalar_one()


def test_the_deepest_nesting_and_the_longest_int_round_trip(conn: Connection) -> None:
    for payload in (nested(500), {"n": 10**4300 - 1, "m": -(10**4300 - 1)}):
        job_id = sqlaq.enqueue(conn, "k", payload).job_id
        assert read_payload(conn, job_id) == payload


def test_a_lower_int_digit_limit_of_the_process_is_the_limit(conn: Connection) -> None:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        with pytest.raises(InvalidJobError, match=r"payload\['n'\] is an int of more than 640"):
            sqlaq.enqueue(conn, "k", {"n": 10**700})
        assert sqlaq.enqueue(conn, "k", {"n": 10**639}).job_id
    finally:
        sys.set_int_max_str_digits(before)
    assert count_jobs(conn) == 1


def test_any_mapping_is_stored_as_an_object(conn: Connection, engine: Any) -> None:
    class Settings(Mapping[str, Any]):
        def __init__(self, **values: Any) -> None:
            self._values = values

        def __getitem__(self, key: str) -> Any:
            return self._values[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self._values)

        def __len__(self) -> int:
            return len(self._values)

    payload = MappingProxyType({"user": Settings(id=7, tags=("a", "b")), "n": None})
    expected = {"user": {"id": 7, "tags": ["a", "b"]}, "n": None}
    job = NewJob("k", payload)
    assert job.payload is payload
    assert read_payload(conn, sqlaq.enqueue(conn, "k", payload).job_id) == expected
    (result,) = sqlaq.enqueue_many(conn, [job])
    assert read_payload(conn, result.job_id) == expected
    with Session(engine) as session:
        orm_job = sqlaq.Job(kind="k", payload=payload)
        session.add(orm_job)
        session.flush()
        assert read_payload(session.connection(), orm_job.id) == expected
        session.rollback()


def test_big_floats_come_back_as_the_same_floats(conn: Connection) -> None:
    payload = {
        "huge": 1e308,
        "least": -1.7976931348623157e308,
        "at-the-edge": 1e16,
        "below": 9999999999999998.0,
        "tiny": 5e-324,
        "text": 'a "1e+20" \\" 2e+30',
        "list": [1.5e20, "x\\", 3e17],
    }
    back = read_payload(conn, sqlaq.enqueue(conn, "k", payload).job_id)
    assert back == payload
    assert all(type(back[k]) is float for k in ("huge", "least", "at-the-edge", "below"))
    assert [type(v) for v in back["list"]] == [float, str, float]


def test_a_delay_of_exactly_100_years_is_stored_and_read_back(conn: Connection) -> None:
    job_id = sqlaq.enqueue(conn, "k", delay=MAX_DURATION).job_id
    late = conn.execute(
        text("SELECT run_at, run_at - now() FROM sqlaq_jobs WHERE id = :id"), {"id": job_id}
    ).one()
    assert late[1] == MAX_DURATION
    assert late[0].year > 2100  # psycopg reads it back


# -- durations and numbers of the other operations ---------------------------------------

TOO_LONG = MAX_DURATION + US


def test_every_duration_argument_is_bounded_to_100_years(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k")
    worker = uuid.uuid4()
    with pytest.raises(InvalidJobError, match="lease must be at most 100 years"):
        sqlaq.claim(conn, worker_id=worker, lease=TOO_LONG)
    with pytest.raises(InvalidJobError, match="lease must be at most 100 years"):
        sqlaq.claim_limited(conn, worker_id=worker, kind="k", lease=TOO_LONG)
    with pytest.raises(InvalidJobError, match="older_than must be at most 100 years"):
        sqlaq.prune(conn, older_than=timedelta(days=10**8))
    with pytest.raises(InvalidJobError, match="delay must be at most 100 years"):
        NewJob("k", delay=TOO_LONG)
    (job,) = sqlaq.claim(conn, worker_id=worker, lease=MAX_DURATION)
    with pytest.raises(InvalidJobError, match="length must be at most 100 years"):
        sqlaq.extend_lease(conn, job.lease, length=TOO_LONG)
    with pytest.raises(InvalidJobError, match="retry_in must be at most 100 years"):
        sqlaq.fail(conn, job.lease, "boom", retry_in=timedelta.max)
    assert count_jobs(conn, "status = 'running'") == 1
    assert sqlaq.fail(conn, job.lease, "boom", retry_in=MAX_DURATION) == sqlaq.JobStatus.QUEUED


def test_a_snooze_for_ever_is_brought_down_to_100_years(conn: Connection) -> None:
    forever = sqlaq.Snooze(timedelta.max)
    assert forever.delay == timedelta.max
    sqlaq.enqueue(conn, "k")
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    assert sqlaq.snooze(conn, job.lease, forever.delay) == [job.id]
    late = conn.execute(text("SELECT run_at - now() FROM sqlaq_jobs")).scalar_one()
    assert late == MAX_DURATION
    with pytest.raises(InvalidJobError, match="delay must be zero or more"):
        sqlaq.snooze(conn, job.lease, timedelta(seconds=-1))
    with pytest.raises(InvalidJobError, match="Snooze needs a non-negative"):
        sqlaq.Snooze(timedelta(seconds=-1))


@pytest.mark.parametrize(
    ("text_", "message"),
    [
        ("1/99999999999d", r"period must be at most 100 years"),
        ("9" * 5000 + "/s", r"count must be 1 to 10000"),
    ],
    ids=["period", "count"],
)
def test_a_rate_out_of_range_is_a_config_error(text_: str, message: str) -> None:
    with pytest.raises(sqlaq.ConfigError, match=message):
        sqlaq.Rate.parse(text_)


def test_a_rate_period_past_100_years_is_refused() -> None:
    with pytest.raises(sqlaq.ConfigError, match="period must be at most 100 years"):
        sqlaq.Rate(1, TOO_LONG)


def test_numbers_postgresql_cannot_hold_are_refused_before_any_sql(conn: Connection) -> None:
    with pytest.raises(sqlaq.ConfigError, match="limit must be a positive int"):
        sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=2**31)
    with pytest.raises(sqlaq.ConfigError, match=r"worker_id must be a uuid\.UUID"):
        sqlaq.claim(conn, worker_id="w-1")  # type: ignore[arg-type]
    with pytest.raises(sqlaq.ConfigError, match="job ids are bigints"):
        sqlaq.cancel(conn, [1, 2**63])
    # One check of a job id, whichever operation takes it.
    for by_id in (lambda: sqlaq.retry(conn, [1, True]), lambda: sqlaq.result(conn, "1")):
        with pytest.raises(sqlaq.ConfigError, match="a job id must be an int, got"):
            by_id()
    with pytest.raises(sqlaq.ConfigError, match="job ids are bigints"):
        sqlaq.result(conn, -(2**63) - 1)
    with pytest.raises(sqlaq.ConfigError, match="limit must be a positive int"):
        sqlaq.prune(conn, older_than=timedelta(0), limit=2**40)
    assert conn.execute(text("SELECT 1")).scalar_one() == 1


def test_an_error_text_with_lone_surrogates_is_stored_spelt_out(conn: Connection) -> None:
    sqlaq.enqueue(conn, "k", max_attempts=1)
    (job,) = sqlaq.claim(conn, worker_id=uuid.uuid4())
    sqlaq.fail(conn, job.lease, "bad byte \udcff and NUL \x00")
    error = conn.execute(text("SELECT last_error FROM sqlaq_jobs")).scalar_one()
    assert error == "bad byte \\udcff and NUL \\x00"


def test_a_payload_of_none_is_the_empty_object_on_every_path(conn: Connection) -> None:
    """``payload=None`` means ``{}`` whether the job goes through enqueue, NewJob and
    enqueue_many, or the ORM Job: one rule, not one per path."""
    one = sqlaq.enqueue(conn, "none-payload", payload=None).job_id
    [many] = sqlaq.enqueue_many(conn, [NewJob("none-payload", payload=None)])
    payloads = conn.execute(
        text("SELECT payload FROM sqlaq_jobs WHERE id = ANY(:ids)"), {"ids": [one, many.job_id]}
    ).scalars()
    assert list(payloads) == [{}, {}]
    assert NewJob("none-payload", payload=None) == NewJob("none-payload")
    with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
        session.add(job := sqlaq.Job(kind="none-payload", payload=None))
        session.flush()
        assert (
            conn.execute(
                text("SELECT payload FROM sqlaq_jobs WHERE id = :id"), {"id": job.id}
            ).scalar_one()
            == {}
        )
