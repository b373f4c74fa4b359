"""Properties of enqueue over arbitrary input (hypothesis), against the real database.

Whatever a caller hands to ``enqueue``, ``enqueue_many``, ``enqueue_copy`` or ``NewJob``
(payloads of any shape: lone surrogates, NUL, huge ints, NaN, deep nesting, cycles,
non-str keys, sets, any Mapping; names, durations and ints of any type and size), the
outcome is one of two: the job round-trips exactly (the row read back holds the payload,
names and numbers given, and ``run_at - now()`` is the delay), or ``InvalidJobError`` is
raised, nothing is written and the transaction is still usable. Never another exception.

Which of the two is decided by :func:`acceptable` below, an oracle written apart from
``sqlaq.encoding``, so that refusing good input fails as surely as storing bad input.

Every example runs in a transaction of one connection, rolled back after it.
"""

from __future__ import annotations

import math
import sys
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text

import sqlaq
from sqlaq import InvalidJobError, NewJob
from sqlaq.bounds import MAX_DURATION

pytestmark = pytest.mark.timeout(300)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- what may be stored: the oracle ---------------------------------------------------------

MAX_DEPTH = 500
INT_BOUND = 10**4300


def good_text(value: str) -> bool:
    return "\x00" not in value and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in value)


def acceptable(payload: Any) -> bool:
    """Whether *payload* is a JSON object PostgreSQL can store and Python read back.

    Acyclic values only (cycles come from one strategy that knows they are refused).
    """
    if not isinstance(payload, Mapping):
        return False
    stack = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping | list | tuple):
            if depth > MAX_DEPTH:
                return False
            if isinstance(value, Mapping):
                if not all(isinstance(k, str) and good_text(k) for k in value):
                    return False
                children = list(value.values())
            else:
                children = list(value)
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(value, str):
            if not good_text(value):
                return False
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not -INT_BOUND < value < INT_BOUND:
                return False
        elif isinstance(value, float):
            if not math.isfinite(value):
                return False
        else:
            return False
    return True


def good_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip()) and len(value) <= 255 and good_text(value)


def good_dedupe_key(value: Any) -> bool:
    if value is None:
        return True
    return (
        isinstance(value, str)
        and bool(value)
        and good_text(value)
        and len(value.encode()) <= sqlaq.schema.MAX_DEDUPE_KEY_BYTES
    )


def good_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def good_delay(value: Any) -> bool:
    return isinstance(value, timedelta) and timedelta(0) <= value <= MAX_DURATION


def plain(value: Any) -> Any:
    """What reading a stored payload back gives: dicts and lists."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


# -- strategies --------------------------------------------------------------------------------

# Any code point, surrogates included (hypothesis leaves them out unless asked).
any_char = st.characters(exclude_categories=())
texts = st.text(any_char, max_size=12) | st.sampled_from(
    ["", " ", "a\x00b", "a\ud800b", "\udfff", "é" * 3, "😀", "\\", '"', "1e+20"]
)
ints = (
    st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from(
        [10**4300 - 1, -(10**4300) + 1, 10**4300, -(10**4300), 10**5000, 2**63, -(2**63) - 1]
    )
)
floats = st.floats() | st.sampled_from(
    [1e308, -1e308, 1e16, 9999999999999998.0, 5e-324, -0.0, 1.5e20, math.nan, math.inf]
)
scalars = st.none() | st.booleans() | ints | floats | texts
keys = texts | st.integers(-3, 3) | st.none() | st.just(("tuple", "key"))
odd = st.sets(st.integers(0, 3), max_size=2) | st.just(b"bytes") | st.just(object())


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        st.lists(children, max_size=4)
        | st.dictionaries(texts, children, max_size=4)
        | st.dictionaries(keys, children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(texts, children, max_size=3).map(MappingProxyType)
    )


json_ish = st.recursive(scalars | odd, containers, max_leaves=25)


@st.composite
def deep(draw: st.DrawFn) -> Any:
    depth = draw(st.sampled_from([2, 499, 500, 501, 3000]) | st.integers(1, 700))
    leaf = draw(scalars)
    pattern = draw(st.lists(st.booleans(), min_size=1, max_size=3))  # lists or objects
    value: Any = leaf
    for level in range(depth - 1):
        value = [value] if pattern[level % len(pattern)] else {"a": value}
    return {"root": value}


payloads = (
    st.dictionaries(texts, json_ish, max_size=5)
    | st.dictionaries(keys, json_ish, max_size=3)
    | deep()
    | json_ish
    | st.dictionaries(texts, json_ish, max_size=3).map(MappingProxyType)
)
names = texts | st.text(min_size=250, max_size=260) | st.integers(0, 3) | st.none()
delays = (
    st.timedeltas()
    | st.timedeltas(min_value=timedelta(0), max_value=MAX_DURATION + timedelta(days=1))
    | st.sampled_from([MAX_DURATION, MAX_DURATION + timedelta(microseconds=1), timedelta(0)])
    | st.integers(0, 10)
)
dedupe_keys = st.none() | texts | st.text(min_size=500, max_size=520)
priorities = ints | st.integers(-32769, 32768)
attempts = ints | st.integers(-1, 3) | st.just(2**31)


# Values that are always fine, so that one field at a time can be the odd one out.
good_chars = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
good_texts = st.text(good_chars, max_size=12)
good_names = st.text(good_chars, min_size=1, max_size=20).filter(str.strip)
good_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**4300 - 1, -(10**4300) + 1, 2**63, 1e308, 5e-324, 1e16, -0.0])
    | st.floats(allow_nan=False, allow_infinity=False)
    | good_texts
)
good_json = st.recursive(
    good_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(good_texts, children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(good_texts, children, max_size=3).map(MappingProxyType)
    ),
    max_leaves=25,
)
GOOD = {
    "kind": good_names,
    "payload": st.dictionaries(good_texts, good_json, max_size=5),
    "queue": good_names,
    "priority": st.integers(-32768, 32767),
    "delay": st.timedeltas(min_value=timedelta(0), max_value=MAX_DURATION),
    "max_attempts": st.integers(1, 2**31 - 1),
    "dedupe_key": st.none() | good_names,
}
ANY = {
    "kind": names,
    "payload": payloads,
    "queue": names,
    "priority": priorities,
    "delay": delays,
    "max_attempts": attempts,
    "dedupe_key": dedupe_keys,
}


@st.composite
def job_args(draw: st.DrawFn, dedupe: bool = True, delay: bool = True) -> dict[str, Any]:
    """A job's fields: all good, or one (sometimes two) drawn from anything at all."""
    odd = draw(st.sets(st.sampled_from(sorted(ANY)), max_size=2) | st.just(set()))
    args = {name: draw(ANY[name] if name in odd else GOOD[name]) for name in sorted(GOOD)}
    if not dedupe:
        args["dedupe_key"] = None
    if not delay:
        args["delay"] = timedelta(0)
    return args


def acceptable_job(args: dict[str, Any]) -> bool:
    return (
        good_name(args["kind"])
        and good_name(args["queue"])
        and good_int(args["priority"], -32768, 32767)
        and good_delay(args["delay"])
        and good_int(args["max_attempts"], 1, 2**31 - 1)
        and good_dedupe_key(args["dedupe_key"])
        and acceptable(given_payload(args))
    )


def given_payload(args: dict[str, Any]) -> Any:
    """The payload the job is meant to store: None is enqueue's documented default, {}."""
    return {} if args["payload"] is None else args["payload"]


# -- the database side ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def unlimited_int_text() -> Iterator[None]:
    """Lets hypothesis print the huge ints it draws (sqlaq's own bound stays 4,300
    digits whatever the process allows above it)."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


@pytest.fixture(scope="module")
def db(engine: Engine) -> Iterator[Connection]:
    """One connection for every example; each example's transaction is rolled back."""
    with engine.connect() as conn:
        yield conn


def assert_nothing_written_and_usable(conn: Connection) -> None:
    assert conn.execute(text("SELECT count(*) FROM sqlaq_jobs")).scalar_one() == 0


def assert_stored(conn: Connection, job_id: int, args: dict[str, Any]) -> None:
    row = conn.execute(
        text(
            "SELECT kind, queue, payload, priority, max_attempts, dedupe_key, status,"
            " run_at - now() AS late FROM sqlaq_jobs WHERE id = :id"
        ),
        {"id": job_id},
    ).one()
    assert row.payload == plain(given_payload(args))
    assert _types(row.payload) == _types(plain(given_payload(args)))  # floats stay floats
    assert (row.kind, row.queue, row.priority, row.max_attempts, row.dedupe_key) == (
        args["kind"],
        args["queue"],
        args["priority"],
        args["max_attempts"],
        args["dedupe_key"],
    )
    assert row.status == "queued"
    assert row.late == args["delay"]


def _types(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return type(value).__name__ if not isinstance(value, int | float) or value == value else ""


@pytest.fixture(scope="module")
def example(db: Connection) -> Any:
    """Runs each example in a transaction of *db*, rolled back after it."""

    @contextmanager
    def transaction() -> Iterator[Connection]:
        with db.begin() as outer:
            try:
                yield db
            finally:
                outer.rollback()

    return transaction


# -- the properties ----------------------------------------------------------------------------


@SETTINGS
@given(args=job_args())
def test_enqueue_round_trips_or_refuses_cleanly(example: Any, args: dict[str, Any]) -> None:
    with example() as conn:
        try:
            result = sqlaq.enqueue(conn, **args)
        except InvalidJobError:
            event("refused")
            assert not acceptable_job(args)
            assert_nothing_written_and_usable(conn)
            return
        event("stored")
        assert acceptable_job(args), args
        assert_stored(conn, result.job_id, args)


@SETTINGS
@given(batch=st.lists(job_args(), min_size=1, max_size=4))
def test_enqueue_many_writes_all_or_nothing(example: Any, batch: list[dict[str, Any]]) -> None:
    def new_jobs() -> Iterator[NewJob]:  # built lazily: a bad one comes mid-iteration
        for args in batch:
            yield NewJob(**args)

    with example() as conn:
        try:
            results = sqlaq.enqueue_many(conn, new_jobs())
        except InvalidJobError:
            assert not all(acceptable_job(a) for a in batch)
            assert_nothing_written_and_usable(conn)
            return
        assert all(acceptable_job(a) for a in batch), batch
        firsts: dict[tuple[str, str], int] = {}
        for args, result in zip(batch, results, strict=True):
            twin = (args["kind"], args["dedupe_key"])
            if args["dedupe_key"] is not None and twin in firsts:
                assert result == sqlaq.EnqueueResult(firsts[twin], duplicate=True)
                continue
            firsts[twin] = result.job_id
            assert not result.duplicate
            assert_stored(conn, result.job_id, args)


@SETTINGS
@given(batch=st.lists(job_args(dedupe=False, delay=False), min_size=1, max_size=3))
def test_enqueue_copy_writes_all_or_nothing(example: Any, batch: list[dict[str, Any]]) -> None:
    with example() as conn:
        try:
            jobs = [NewJob(**args) for args in batch]
        except InvalidJobError:
            assert not all(acceptable_job(a) for a in batch)
            return
        assert all(acceptable_job(a) for a in batch), batch
        assert sqlaq.enqueue_copy(conn, jobs) == len(batch)
        ids = conn.execute(text("SELECT id FROM sqlaq_jobs ORDER BY id")).scalars().all()
        for job_id, args in zip(ids, batch, strict=True):
            assert_stored(conn, job_id, args)


@SETTINGS
@given(
    lease=delays,
    limit=ints | st.integers(-1, 5) | st.just(2**31 - 1),
    queue=names | st.just("default"),
)
def test_claim_takes_what_it_may_or_refuses_cleanly(
    example: Any, lease: Any, limit: Any, queue: Any
) -> None:
    with example() as conn:
        sqlaq.enqueue(conn, "k", queue=queue if good_name(queue) else "default")
        try:
            claimed = sqlaq.claim(
                conn, worker_id=uuid.uuid4(), queue=queue, limit=limit, lease=lease
            )
        except (InvalidJobError, sqlaq.ConfigError):
            ok = good_delay(lease) and lease > timedelta(0)
            assert not (ok and good_name(queue) and good_int(limit, 1, 2**31 - 1))
            assert (
                conn.execute(
                    text("SELECT count(*) FROM sqlaq_jobs WHERE status = 'queued'")
                ).scalar_one()
                == 1
            )
            return
        assert len(claimed) == 1
        late = conn.execute(text("SELECT run_at - now() FROM sqlaq_jobs")).scalar_one()
        assert late == lease


def test_a_payload_containing_itself_is_refused(example: Any) -> None:
    cycle: dict[str, Any] = {"list": []}
    cycle["list"].append({"back": cycle})
    with example() as conn:
        with pytest.raises(InvalidJobError, match="the payload contains itself"):
            sqlaq.enqueue(conn, "k", cycle)
        assert_nothing_written_and_usable(conn)
