"""The outcome function: its table of cases, and properties over arbitrary input. Pure."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
import tenacity
from hypothesis import given, settings
from hypothesis import strategies as st

import sqlaq
from sqlaq.bounds import MAX_DURATION
from sqlaq.outcome import (
    DONE,
    MAX_MESSAGE_LENGTH,
    Outcome,
    Verdict,
    decide,
    describe_error,
    unwritable,
)

_NIL = UUID(int=0)


def claimed(attempt: int = 1, max_attempts: int = 3) -> sqlaq.ClaimedJob:
    now = datetime.now(UTC)
    lease = sqlaq.Lease(1, _NIL, _NIL, attempt, now)
    return sqlaq.ClaimedJob(1, "default", "k", {}, 0, attempt, max_attempts, now, lease, now)


def handler(**options: Any) -> sqlaq.Handler:
    registry = sqlaq.Registry()
    registry.handler("k", **options)(lambda payload: None)
    found = registry.get("k")
    assert found is not None
    return found


FAST = sqlaq.Backoff(base=timedelta(seconds=1), cap=timedelta(seconds=1), jitter=0.0)

CASES: list[tuple[str, dict[str, Any], int, BaseException | None, Verdict, timedelta | None]] = [
    ("returned", {}, 1, None, Verdict.DONE, None),
    ("returned on the last attempt", {}, 3, None, Verdict.DONE, None),
    ("raised, attempts left", {"wait": FAST}, 1, OSError("x"), Verdict.RETRY, timedelta(1 / 86400)),
    ("raised on the last attempt", {"wait": FAST}, 3, OSError("x"), Verdict.FAILED, None),
    ("PermanentError", {}, 1, sqlaq.PermanentError("no"), Verdict.FAILED, None),
    (
        "not retryable by the predicate",
        {"retry": OSError},
        1,
        ValueError("v"),
        Verdict.FAILED,
        None,
    ),
    (
        "retryable by the predicate",
        {"retry": OSError, "wait": FAST},
        1,
        OSError("o"),
        Verdict.RETRY,
        timedelta(seconds=1),
    ),
    ("snooze", {}, 3, sqlaq.Snooze(timedelta(seconds=5)), Verdict.SNOOZED, timedelta(seconds=5)),
    ("snooze for ever", {}, 1, sqlaq.Snooze(timedelta.max), Verdict.SNOOZED, MAX_DURATION),
    (
        "wait past the ceiling",
        {"wait": tenacity.wait_fixed(1e30)},
        1,
        OSError("x"),
        Verdict.RETRY,
        MAX_DURATION,
    ),
    ("negative wait", {"wait": lambda state: -5}, 1, OSError("x"), Verdict.RETRY, timedelta(0)),
    (
        "sub-task cancelled",
        {"wait": FAST},
        1,
        asyncio.CancelledError(),
        Verdict.RETRY,
        timedelta(seconds=1),
    ),
    (
        "KeyboardInterrupt in a handler",
        {"wait": FAST},
        3,
        KeyboardInterrupt(),
        Verdict.FAILED,
        None,
    ),
]


@pytest.mark.parametrize(
    ("options", "attempt", "error", "verdict", "delay"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_table_of_cases(
    options: dict[str, Any],
    attempt: int,
    error: BaseException | None,
    verdict: Verdict,
    delay: timedelta | None,
) -> None:
    outcome = decide(handler(**options), claimed(attempt), error)
    assert outcome.verdict is verdict
    assert outcome.delay == delay
    assert (outcome.error is not None) == (verdict in (Verdict.RETRY, Verdict.FAILED))
    if error is not None and verdict is not Verdict.SNOOZED:
        assert outcome.exception is error


def test_no_handler_fails_the_job() -> None:
    outcome = decide(None, claimed(), None)
    assert outcome.verdict is Verdict.FAILED
    assert outcome.error == "no handler for kind 'k'"


def test_a_policy_that_raises_falls_back_to_the_default_backoff() -> None:
    def broken(state: tenacity.RetryCallState) -> float:
        raise RuntimeError("broken policy")

    outcome = decide(handler(wait=broken), claimed(), OSError("x"))
    assert outcome.verdict is Verdict.RETRY
    assert outcome.delay is not None
    assert timedelta(0) <= outcome.delay <= sqlaq.DEFAULT_BACKOFF.cap


def test_statuses_and_what_is_written() -> None:
    assert DONE.status is sqlaq.JobStatus.DONE
    assert Outcome(Verdict.RETRY).status is sqlaq.JobStatus.QUEUED
    assert Outcome(Verdict.SNOOZED).status is sqlaq.JobStatus.QUEUED
    assert Outcome(Verdict.LOST).status is None
    assert not Outcome(Verdict.LOST).writes
    assert not Outcome(Verdict.CANCELLED).writes
    replaced = unwritable(DONE, "CheckViolation: no")
    assert replaced.verdict is Verdict.FAILED
    assert (
        replaced.error
        == "the done outcome of this attempt could not be written: CheckViolation: no"
    )


def test_a_ten_megabyte_message_is_cut() -> None:
    try:
        raise ValueError("x" * 10_000_000)
    except ValueError as exc:
        text = describe_error(exc)
    assert len(text) < MAX_MESSAGE_LENGTH + 3000
    assert text.startswith("ValueError: xxx")
    assert "more characters)" in text


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def test_an_exception_whose_str_raises_is_described() -> None:
    assert "_Unprintable" in describe_error(_Unprintable()).partition(":")[0]


_errors = st.one_of(
    st.none(),
    st.builds(OSError, st.text(max_size=50)),
    st.builds(ValueError, st.text(max_size=50)),
    st.builds(sqlaq.PermanentError, st.text(max_size=20)),
    st.builds(
        sqlaq.Snooze,
        st.timedeltas(min_value=timedelta(0), max_value=timedelta.max),
    ),
    st.just(asyncio.CancelledError()),
    st.just(_Unprintable()),
)
_waits = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
)


@settings(max_examples=300, deadline=None)
@given(
    error=_errors,
    wait=_waits,
    attempt=st.integers(min_value=1, max_value=2**31 - 1),
    max_attempts=st.integers(min_value=1, max_value=2**31 - 1),
)
def test_every_outcome_is_storable(
    error: BaseException | None, wait: float, attempt: int, max_attempts: int
) -> None:
    """Whatever the handler raised and its policy returned: an outcome, never an
    exception, with a delay in [0, 100 years] and an error only when it failed."""
    outcome = decide(handler(wait=lambda state: wait), claimed(attempt, max_attempts), error)
    assert isinstance(outcome, Outcome)
    if outcome.delay is not None:
        assert timedelta(0) <= outcome.delay <= MAX_DURATION
    assert (outcome.verdict in (Verdict.RETRY, Verdict.SNOOZED)) == (outcome.delay is not None)
    if error is None:
        assert outcome is DONE
    elif isinstance(error, sqlaq.Snooze):
        assert outcome.verdict is Verdict.SNOOZED
    else:
        assert outcome.verdict in (Verdict.RETRY, Verdict.FAILED)
        assert outcome.error
        if attempt >= max_attempts:
            assert outcome.verdict is Verdict.FAILED
