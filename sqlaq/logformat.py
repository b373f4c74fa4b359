"""Log lines for the commands: text or JSON, with the ``extra`` keys of each record.

This module owns how ``sqlaq-worker`` (and ``sqlaq``) print their logs. The library
never configures logging: only a command calls :func:`configure_logging`, once, at
start. Library loggers attach stable ``extra`` keys (``job_id``, ``kind``, ``attempt``,
``queue``, ``duration``...), which both formats print.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import datetime
from typing import Any

__all__ = ["JsonFormatter", "TextFormatter", "configure_logging"]

_RECORD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS}


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``, extras sorted by key."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """Format *record*, then append its ``extra`` keys."""
        line = super().format(record)
        extras = _extras(record)
        if not extras:
            return line
        pairs = " ".join(f"{k}={_text(v)}" for k, v in sorted(extras.items()))
        head, sep, tail = line.partition("\n")  # keep a traceback below the line
        return f"{head} {pairs}{sep}{tail}"


#: What makes a value need quotes: a space (or any whitespace) or an equals sign.
_NEEDS_QUOTES = re.compile(r"[\s=]").search


def _text(value: object) -> str:
    # Quote a value with spaces, so "error=OSError: disk full" stays one field. One
    # regex search in C, not a Python test per character (this runs for every key of
    # every line).
    if type(value) is int or type(value) is float:
        return str(value)
    text = str(value)
    return json.dumps(text) if _NEEDS_QUOTES(text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then ``extra`` keys."""

    def format(self, record: logging.LogRecord) -> str:
        """Format *record* as a JSON object."""
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created).astimezone().isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update(_extras(record))
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Send logs to stderr at *level* in *fmt* (the library itself never does this)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # SQLAlchemy logs every statement at INFO once its logger is enabled: keep it quiet.
    logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
