"""The LISTEN connection and the wake-up signal; knows nothing of jobs.

This module owns one raw psycopg connection in autocommit, outside any SQLAlchemy pool
(a pooled connection would be reset, and a LISTEN lost, on return), and one daemon
thread that waits on it with ``conn.notifies(timeout=...)``. Each notification's payload
is handed to a callback with its channel; what it means is the caller's business.

When the connection dies (the server restarted, the backend was terminated) the thread
reconnects with exponential backoff (tenacity), LISTENs again, and then calls the
callback with ``None``: notifications sent while it was down are lost, so the caller
should look for work once. It must not run any statement but the LISTEN it is given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.sql
import tenacity

from sqlaq.dsn import connection_params

__all__ = ["Listener", "connection_params"]

_log = logging.getLogger(__name__)

#: Called with a notification's channel and payload, or with (None, None) right after
#: (re)connecting.
OnNotify = Callable[[str | None, str | None], None]

DEFAULT_APPLICATION_NAME = "sqlaq-listener"
# How long one wait for notifications lasts: the bound on how late stop() is noticed.
_WAIT_SECONDS = 0.25
_RECONNECT_INITIAL_SECONDS = 0.1


class Listener:
    """LISTENs on a dedicated connection in a daemon thread and reports notifications.

    Args:
        params: psycopg ``connect()`` keyword arguments (see :func:`connection_params`).
        statement: The LISTEN statement to run on each (re)connection.
        on_notify: Called (in the listener's thread) with each notification's channel
            and payload, and with (None, None) after each successful (re)connection.
            Keep it quick.
        max_backoff: The longest wait between reconnection attempts.
    """

    def __init__(
        self,
        params: Mapping[str, Any],
        statement: psycopg.sql.Composed,
        on_notify: OnNotify,
        *,
        max_backoff: timedelta = timedelta(seconds=5),
    ) -> None:
        self._params = dict(params)
        self._statement = statement
        self._on_notify = on_notify
        self._max_backoff = max_backoff.total_seconds()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqlaq-listener", daemon=True)
        #: Set while LISTEN is in effect; cleared while the connection is down.
        self.listening = threading.Event()

    def start(self) -> None:
        """Start the listener's thread; it connects in the background."""
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop listening and close the connection (waits up to *timeout* seconds)."""
        self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:
            # Not a connection problem (those are retried): say so; the caller keeps
            # working without notifications, by polling.
            _log.exception("listener stopped by an unexpected error; relying on polling")
        finally:
            self.listening.clear()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._connect()
            except psycopg.Error:
                return  # only raised once stop() was called: the retry loop never gives up
            try:
                self._listen(conn)
            except psycopg.Error as exc:
                _log.warning("listener connection lost, reconnecting: %s", _one_line(exc))
            finally:
                self.listening.clear()
                conn.close()

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
        self.listening.set()
        _log.info("listening for notifications")
        # Whatever was notified while we were not listening is lost: look once.
        self._on_notify(None, None)
        return conn

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        while not self._stopping.is_set():
            for notification in conn.notifies(timeout=_WAIT_SECONDS):
                self._on_notify(notification.channel, notification.payload)

    def _sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        _log.warning(
            "listener cannot connect (attempt %d), retrying in %.1fs: %s",
            state.attempt_number,
            state.upcoming_sleep,
            _one_line(error),
        )


def _one_line(error: object) -> str:
    return " ".join(str(error).split())
