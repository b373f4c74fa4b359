"""The lease a running handler's context holds, renewed from two threads."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from sqlaq.context import JobContext
from sqlaq.lease import Lease

START = datetime(2026, 1, 1, tzinfo=UTC)


def lease_ending(seconds: float) -> Lease:
    token = uuid.UUID(int=7)
    return Lease(1, uuid.UUID(int=1), token, 1, START + timedelta(seconds=seconds), "default")


def test_the_context_keeps_the_later_of_two_renewals_whatever_their_order() -> None:
    """The heartbeat's renewal (the worker's 3 s lease) may report after the handler's
    own (five minutes): the context keeps the five minutes."""
    handler_renewal = lease_ending(300)
    context = JobContext(
        1, "k", "default", 1, 3, lease_ending(3), timedelta(seconds=3),
        lambda ctx, length: handler_renewal,
    )  # fmt: skip
    assert context.extend_lease(timedelta(minutes=5)) is handler_renewal
    context._set_lease(lease_ending(3.5))  # the heartbeat's, computed before
    assert context.lease is handler_renewal
    later = lease_ending(301)
    context._set_lease(later)
    assert context.lease is later
