"""The process executor's dispatcher wake-up (``sqlaq.worker.processes``), without
children: a submit's poke must never be lost, or a job claimed while every child is
idle waits until some child answers, which may be never."""

from __future__ import annotations

from typing import Any

from sqlaq.worker.processes import ProcessPool


def test_a_poke_while_the_dispatcher_empties_its_pipe_is_not_lost() -> None:
    pool = ProcessPool(1, {})
    reader = pool._wake_reader

    class Interrupted:
        """The pipe, with a submit's poke landing while the dispatcher empties it."""

        def __init__(self) -> None:
            self.fired = False

        def poll(self, *args: Any) -> bool:
            return reader.poll(*args)

        def recv_bytes(self) -> bytes:
            if not self.fired:
                self.fired = True
                pool._poke()  # as the worker's run thread would, mid-drain
            return reader.recv_bytes()

    try:
        pool._poke()  # a submit: the flag raised, a byte in the pipe
        pool._wake_reader = Interrupted()  # type: ignore[assignment]
        pool._woken()  # the dispatcher woke on the pipe
        pool._wake_reader = reader
        pool._poke()  # the next submit
        # Its byte is there for the dispatcher's next wait (the flag was not left
        # raised over an empty pipe, which would swallow every poke from now on).
        assert reader.poll()
    finally:
        pool._wake_reader = reader
        pool.close()
