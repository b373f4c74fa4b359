"""The LISTEN connection read by its owner, and the waker it sleeps on (a real server).

The worker's run thread sleeps on a :class:`~sqlaq.worker.listener.Waker` and on the
LISTEN connection's socket at once and reads notifications itself; the listener's own
thread only connects (and reconnects). These tests drive both as the worker does, with
no worker around them; ``tests/process/test_worker.py`` covers the same through a worker process.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from workerkit import backends, terminate, wait_until

from sqlaq import queries
from sqlaq.worker.listener import Listener, Waker, connection_params

CHANNEL = "sqlaq_test_listener"
NAME = "sqlaq-test-listener"


@pytest.fixture
def waker() -> Iterator[Waker]:
    waker = Waker()
    waker.open()
    yield waker
    waker.close()


def notify(engine: Engine, payload: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": payload}
        )


@pytest.mark.timeout(20)
def test_a_set_from_another_thread_wakes_the_sleeper_whenever_it_comes(waker: Waker) -> None:
    # Set before the wait (the flag) or during it (the socket pair): the wait returns
    # either way; were a set lost, it would block until the test's timeout.
    for _ in range(200):
        setter = threading.Thread(target=waker.set)
        setter.start()
        waker.wait(None)
        setter.join()
        assert waker.is_set()
        waker.clear()
        assert not waker.is_set()


@pytest.mark.timeout(20)
def test_a_set_made_while_the_sleeper_clears_is_not_lost(waker: Waker) -> None:
    # A set() from another thread lands while clear() drains the pair (the reader's
    # recv stands in for that moment): the flag must stay raised, or the next wait
    # sleeps with nothing to wake it (a worker asked to stop that never stops).
    waker.set()
    reader = waker._reader
    assert reader is not None

    class Interrupted:
        def __init__(self) -> None:
            self.fired = False

        def recv(self, size: int) -> bytes:
            if not self.fired:
                self.fired = True
                waker.set()  # as another thread would, mid-drain
            return reader.recv(size)

    waker._reader = Interrupted()  # type: ignore[assignment]
    try:
        waker.clear()
    finally:
        waker._reader = reader
    assert waker.is_set()


@pytest.mark.timeout(20)
def test_a_byte_a_set_left_past_a_clear_is_drained_by_the_next_wait(waker: Waker) -> None:
    # A set() between clear()'s look at the flag and its lowering: the flag ends lowered
    # with the set()'s byte in the pair. The next wait returns at once (the set is not
    # lost) and takes the byte, so the wait after it sleeps instead of spinning.
    waker.set()
    waker._set = False  # lowered by the racing clear(), which then drains nothing
    waker.wait(None)  # returns: the byte (were it not there, the test's timeout)
    reader = waker._reader
    assert reader is not None
    with pytest.raises(BlockingIOError):
        reader.recv(1)  # drained by the wait


def test_a_waker_set_before_it_opens_or_after_it_closes_only_raises_its_flag() -> None:
    waker = Waker()
    waker.set()  # nobody waits yet: no socket to write to
    waker.open()
    try:
        waker.wait(None)  # the flag is up: returns at once
        waker.clear()
    finally:
        waker.close()
    waker.set()  # closed: no error
    assert waker.is_set()


@pytest.mark.timeout(20)
def test_a_socket_numbered_past_select_s_limit_wakes_the_sleeper(waker: Waker) -> None:
    """A worker with many connections has descriptors past FD_SETSIZE (1024)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 1500:
        pytest.skip(f"the soft limit of open files is {soft}")
    reader, writer = socket.socketpair()
    high = os.dup2(reader.fileno(), 1500)
    try:
        writer.send(b"x")
        waker.wait(None, high)  # returns: the socket is readable (select would refuse it)
    finally:
        os.close(high)
        reader.close()
        writer.close()


@pytest.mark.timeout(60)
def test_the_owner_reads_notifications_and_a_lost_connection_is_replaced(
    committed: Engine, waker: Waker, caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[tuple[str | None, str | None]] = []
    params = connection_params(committed, NAME)
    listener = Listener(
        params, queries.listen_stmt(channel=CHANNEL), lambda c, p: heard.append((c, p)), waker.set
    )

    def sleep_and_read() -> None:
        """What the worker's run thread does: sleep on both, clear, read."""
        waker.wait(None, listener.fileno())
        waker.clear()
        listener.read()

    listener.start()
    try:
        while not heard:  # the thread connects, LISTENs, publishes, then wakes us
            sleep_and_read()
        assert heard == [(None, None)]
        assert listener.listening.is_set()
        assert listener.fileno() is not None

        notify(committed, "first")
        while len(heard) < 2:
            sleep_and_read()
        assert heard[1] == (CHANNEL, "first")

        (pid,) = backends(committed, NAME)
        with caplog.at_level(logging.WARNING, logger="sqlaq.worker.listener"):
            terminate(committed, [pid])
            # The socket turns readable; the owner's read finds the connection broken and
            # drops it; the thread reconnects and reports (None, None) again.
            while len(heard) < 3:
                sleep_and_read()
        assert heard[2] == (None, None)
        assert "listener connection lost, reconnecting" in caplog.text
        assert backends(committed, NAME) not in ([], [pid])

        notify(committed, "second")
        while len(heard) < 4:
            sleep_and_read()
        assert heard[3] == (CHANNEL, "second")
    finally:
        listener.stop()
    assert not listener.listening.is_set()
    assert listener.fileno() is None
    wait_until(lambda: not backends(committed, NAME), 10, "the backend to end")
