"""The one-line form of an error's text, shared by the commands, the logs and the wait."""

from __future__ import annotations

import psycopg

from sqlaq.errors import one_line
from sqlaq.transient import describe


def test_an_error_spanning_lines_reads_as_one_line_everywhere() -> None:
    error = psycopg.OperationalError("connection failed:\n  server closed\tthe connection\n")
    assert one_line(error) == "connection failed: server closed the connection"
    assert describe(error) == "OperationalError: connection failed: server closed the connection"
