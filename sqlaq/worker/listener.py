"""The LISTEN connection and the wake-up signal; knows nothing of jobs.

This module owns one raw psycopg connection in autocommit, outside any SQLAlchemy pool
(a pooled connection would be reset, and a LISTEN lost, on return), and the
:class:`Waker` the worker's run thread sleeps on.

The connection is *read by its owner*, the thread that sleeps on the waker (the
worker's run thread): it waits on the connection's socket and the waker's at once, and
:meth:`Listener.read` hands each notification's channel and payload to a callback on that
thread. A notification therefore wakes the thread that claims, with no other thread in
between (a thread hand-off costs 0.05-0.09 ms on this kind of box: ``bench/RESULTS.md``,
"The wake-up").

Connecting is the job of a daemon thread of the listener's own, since a connection
attempt can block for its timeout: it connects, LISTENs, publishes the connection, and
waits until the owner reports it lost (or :meth:`Listener.stop`). Then it reconnects
with exponential backoff (tenacity), LISTENs again, and calls the callback with
``(None, None)``: notifications sent while it was down are lost, so the caller should
look for work once. No statement but the LISTEN it is given ever runs on it.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.sql
import tenacity
from psycopg.pq import ConnStatus

from sqlaq.dsn import connection_params
from sqlaq.errors import one_line

__all__ = ["Listener", "Waker", "connection_params"]

_log = logging.getLogger(__name__)

#: Called with a notification's channel and payload, or with (None, None) right after
#: (re)connecting.
OnNotify = Callable[[str | None, str | None], None]

DEFAULT_APPLICATION_NAME = "sqlaq-listener"
_RECONNECT_INITIAL_SECONDS = 0.1


class Waker:
    """A flag any thread sets and one thread sleeps on, with a socket beside it.

    Like :class:`threading.Event` (``set``, ``is_set``, ``clear``, ``wait``), except
    that :meth:`wait` also returns when another socket (the LISTEN connection's) is
    readable: a socket pair carries the flag to ``poll``. :meth:`set` writes to it only
    when the flag was clear, so a busy sleeper costs its setters one check, not a system
    call each. Only one thread waits and clears; :meth:`open` and :meth:`close` are that
    thread's; :meth:`set` is safe from any thread at any time (before :meth:`open` and
    after :meth:`close` it only raises the flag, which :meth:`wait` checks first).
    """

    def __init__(self) -> None:
        self._set = False
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None

    def open(self) -> None:
        """Create the socket pair (the waiting thread, before it first waits)."""
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._reader, self._writer = reader, writer

    def close(self) -> None:
        """Close the socket pair (the waiting thread, after it last waits)."""
        reader, writer = self._reader, self._writer
        self._reader = self._writer = None
        for sock in (reader, writer):
            if sock is not None:
                sock.close()

    def set(self) -> None:
        """Raise the flag and wake the sleeper; safe from any thread."""
        if self._set:
            return
        self._set = True
        writer = self._writer
        if writer is not None:
            # Full (a wake is pending anyway) or closed (nobody waits any more): no matter.
            with contextlib.suppress(OSError):
                writer.send(b"\0")

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        """Lower the flag, then drain the pair if the flag was raised. A :meth:`set`
        writes a byte only when it raises the flag, so a lowered flag leaves no byte to
        drain (a wake-up by the other socket, a notification, costs no system call
        here) but one written by a :meth:`set` racing this clear: the next :meth:`wait`
        then finds it, returns at once and drains it. A :meth:`set` after the flag is
        lowered raises it again (and writes a byte, which the drain may take: the
        raised flag then ends the next :meth:`wait` at once). Draining first would lose
        a :meth:`set` made between the two: it would find the flag still raised, write
        nothing, and the flag would then be lowered with nothing to wake the sleeper."""
        raised = self._set
        self._set = False
        if raised:
            self._drain()

    def _drain(self) -> None:
        reader = self._reader
        if reader is not None:
            try:
                while reader.recv(4096):
                    pass
            except OSError:  # empty (BlockingIOError)
                pass

    def wait(self, timeout: float | None, fileno: int | None = None) -> None:
        """Sleep until :meth:`set`, until *fileno* is readable, or *timeout* seconds."""
        reader = self._reader
        if self._set or reader is None:
            return
        # poll, not select: a process with a thousand connections has descriptors past
        # select's limit (FD_SETSIZE, 1024). A poller per wait: the socket it waits on
        # changes with each reconnection, and building one costs a microsecond or two.
        poller = select.poll()
        poller.register(reader, select.POLLIN)
        if fileno is not None:
            poller.register(fileno, select.POLLIN)
        for fd, _ in poller.poll(None if timeout is None else timeout * 1000):
            if fd == reader.fileno():  # a set() that raced the last clear(): drain it
                self._drain()


class Listener:
    """LISTENs on a dedicated connection that its owner reads (see the module's text).

    Args:
        params: psycopg ``connect()`` keyword arguments (see :func:`connection_params`).
        statement: The LISTEN statement to run on each (re)connection.
        on_notify: Called with each notification's channel and payload (by
            :meth:`read`, on the owner's thread), and with (None, None) after each
            successful (re)connection (on the listener's thread). Keep it quick.
        wake: Wakes the owner (its :meth:`Waker.set`): called once a new connection is
            published, so the owner waits on its socket.
        max_backoff: The longest wait between reconnection attempts.
    """

    def __init__(
        self,
        params: Mapping[str, Any],
        statement: psycopg.sql.Composed,
        on_notify: OnNotify,
        wake: Callable[[], None],
        *,
        max_backoff: timedelta = timedelta(seconds=5),
    ) -> None:
        self._params = dict(params)
        self._statement = statement
        self._on_notify = on_notify
        self._wake = wake
        self._max_backoff = max_backoff.total_seconds()
        self._stopping = threading.Event()
        self._lost = threading.Event()  # the owner dropped the connection, or stop()
        self._lock = threading.Lock()  # publishing, dropping and closing the connection
        self._conn: psycopg.Connection[Any] | None = None  # published: the owner reads it
        self._encoding = "utf-8"  # the published connection's client encoding
        self._thread = threading.Thread(target=self._run, name="sqlaq-listener", daemon=True)
        #: Set while LISTEN is in effect; cleared while the connection is down.
        self.listening = threading.Event()

    def start(self) -> None:
        """Start the listener's thread; it connects in the background."""
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop listening and close the connection (waits up to *timeout* seconds for
        the thread). The owner's: it must not be waiting on the socket meanwhile."""
        self._stopping.set()
        self._lost.set()
        self._drop()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def fileno(self) -> int | None:
        """The published connection's socket, for the owner to wait on; None while
        there is none."""
        conn = self._conn
        return None if conn is None else conn.pgconn.socket

    def read(self) -> None:
        """Take in what the server sent and report each notification (the owner's;
        returns at once when nothing came). A connection found broken is dropped and
        the thread reconnects."""
        conn = self._conn
        if conn is None:
            return
        pgconn = conn.pgconn
        try:
            pgconn.consume_input()
            if pgconn.status != ConnStatus.OK:
                raise psycopg.OperationalError("the listener's connection is closed")
            notify = pgconn.notifies()
            encoding = self._encoding
            while notify is not None:
                self._on_notify(notify.relname.decode(encoding), notify.extra.decode(encoding))
                notify = pgconn.notifies()
        except psycopg.Error as exc:
            _log.warning("listener connection lost, reconnecting: %s", one_line(exc))
            self._drop()
            self._lost.set()

    def _drop(self) -> None:
        """Unpublish and close the connection (the owner's: from read and stop; the
        thread closes only a connection it has not published)."""
        with self._lock:
            conn, self._conn = self._conn, None
            self.listening.clear()
        if conn is not None:
            conn.close()

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:
            # Not a connection problem (those are retried): say so; the caller keeps
            # working without notifications, by polling.
            _log.exception("listener stopped by an unexpected error; relying on polling")

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._connect()
            except psycopg.Error:
                return  # only raised once stop() was called: the retry loop never gives up
            with self._lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                self._lost.clear()
                # Looked up once: no statement but the LISTEN runs on it to change it.
                self._encoding = conn.info.encoding
                self._conn = conn
                self.listening.set()
            _log.info("listening for notifications")
            # Whatever was notified while we were not listening is lost: look once.
            self._on_notify(None, None)
            self._wake()  # the owner waits on the new socket from now on
            self._lost.wait()

    def _connect(self) -> psycopg.Connection[Any]:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(psycopg.Error),
            # Jittered, so workers that lost the server together do not come back in step.
            wait=tenacity.wait_exponential(
                multiplier=_RECONNECT_INITIAL_SECONDS, max=self._max_backoff
            )
            + tenacity.wait_random(0, _RECONNECT_INITIAL_SECONDS),
            stop=lambda _state: self._stopping.is_set(),
            # Sleeping on the stop event lets stop() cut a backoff short.
            sleep=self._sleep,
            before_sleep=self._log_retry,
            reraise=True,
        )
        return retrying(self._open)

    def _open(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(**self._params, autocommit=True)
        try:
            conn.execute(self._statement)
        except BaseException:
            conn.close()
            raise
        return conn

    def _sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        _log.warning(
            "listener cannot connect (attempt %d), retrying in %.1fs: %s",
            state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
            one_line(error),
        )
