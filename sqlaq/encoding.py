"""Validation and encoding of jobs to enqueue; pure, no SQL, no clock.

Everything a caller hands to ``enqueue`` is checked here before any statement is built,
so bad input raises :class:`~sqlaq.errors.InvalidJobError` with a message naming the
field and the fix, and nothing is written.

Decisions written down here:

* A payload is a JSON object (a ``dict`` with ``str`` keys): the handler receives it as
  its one argument, and an object can grow fields without breaking old jobs. Nested
  values may be any JSON: ``dict``, ``list``/``tuple``, ``str``, ``int``, finite
  ``float``, ``bool``, ``None``.
* NaN and Infinity are rejected (PostgreSQL's jsonb has no such values), and so is the
  NUL character anywhere (jsonb and text cannot store it).
* The payload is encoded once, here, and sent as text cast to jsonb, so no driver or
  SQLAlchemy serializer runs over it again.
* Times are intervals (``delay``), never timestamps: the database clock is the only
  clock, and ``run_at`` is always ``now() + delay``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlaq.errors import InvalidJobError
from sqlaq.schema import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    MAX_DEDUPE_KEY_BYTES,
    MAX_NAME_LENGTH,
)

_SMALLINT = (-32768, 32767)
_INT4_MAX = 2_147_483_647
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def check_name(field_name: str, value: object) -> str:
    """Return *value* if it is a usable ``kind`` or ``queue`` name, else raise.

    Raises:
        InvalidJobError: not a string, empty, longer than 255 characters, or holding NUL.
    """
    if not isinstance(value, str):
        raise InvalidJobError(f"{field_name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidJobError(f"{field_name} must be a non-empty name, got {value!r}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidJobError(
            f"{field_name} is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    if "\x00" in value:
        raise InvalidJobError(f"{field_name} contains a NUL character; remove it")
    return value


def check_int(field_name: str, value: object, low: int, high: int) -> int:
    """Return *value* if it is an int (not a bool) within ``[low, high]``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(f"{field_name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidJobError(f"{field_name} must be between {low} and {high}, got {value}")
    return value


def check_duration(field_name: str, value: object, *, allow_zero: bool = True) -> timedelta:
    """Return *value* if it is a non-negative ``timedelta`` (positive if not *allow_zero*).

    Raises:
        InvalidJobError: not a timedelta, negative, or zero where zero is not allowed.
    """
    if not isinstance(value, timedelta):
        raise InvalidJobError(
            f"{field_name} must be a datetime.timedelta, got {type(value).__name__}; "
            f"use timedelta(seconds=...)"
        )
    if value < timedelta(0) or (not allow_zero and value == timedelta(0)):
        bound = "zero or more" if allow_zero else "more than zero"
        raise InvalidJobError(f"{field_name} must be {bound}, got {value}")
    return value


def encode_payload(payload: object) -> str:
    """Validate *payload* and return it as compact JSON text.

    Raises:
        InvalidJobError: the payload is not a JSON object of JSON values, or holds NaN,
            Infinity or a NUL character. The message gives the path to the bad value.
    """
    if not isinstance(payload, Mapping):
        raise InvalidJobError(
            f"payload must be a dict (a JSON object), got {type(payload).__name__}; "
            "wrap the value, e.g. {'items': [...]}"
        )
    _check_value(payload, "payload")
    return _ENCODER.encode(payload)


def _check_value(value: Any, path: str) -> None:
    # Walk the value once to name the exact bad element; json.dumps alone would only say
    # "Object of type set is not JSON serializable" with no path.
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidJobError(f"{path} contains a NUL character; PostgreSQL cannot store it")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJobError(
                f"{path} is {value!r}; JSON has no NaN or Infinity, use null or a string"
            )
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidJobError(
                    f"{path} has a key {key!r} of type {type(key).__name__}; "
                    "JSON object keys must be str"
                )
            if "\x00" in key:
                raise InvalidJobError(f"{path} has a key containing a NUL character")
            _check_value(item, f"{path}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_value(item, f"{path}[{index}]")
        return
    hint = "use a list" if isinstance(value, set | frozenset) else "convert it to a JSON value"
    raise InvalidJobError(f"{path} is a {type(value).__name__}, not JSON-serialisable; {hint}")


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to enqueue, validated on construction.

    Args:
        kind: Which handler runs it (1 to 255 characters).
        payload: The handler's argument: a JSON object. Put ids in it, not data.
        queue: Routing: a worker serves some queues.
        priority: Higher runs first among due jobs (-32768 to 32767).
        delay: Run no sooner than ``now() + delay`` (database clock).
        max_attempts: How many times the job may be claimed, at least 1.
        dedupe_key: At most one pending job per ``(kind, dedupe_key)``; a second enqueue
            while one is pending reports the existing job instead.

    Raises:
        InvalidJobError: any field is unusable; the message names it and the fix.
    """

    kind: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    delay: timedelta = timedelta(0)
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    dedupe_key: str | None = None
    payload_json: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_name("kind", self.kind)
        check_name("queue", self.queue)
        check_int("priority", self.priority, *_SMALLINT)
        check_duration("delay", self.delay)
        check_int("max_attempts", self.max_attempts, 1, _INT4_MAX)
        if self.dedupe_key is not None:
            check_dedupe_key(self.dedupe_key)
        object.__setattr__(self, "payload_json", encode_payload(self.payload))


def check_dedupe_key(value: object) -> str:
    """Return *value* if it is a usable dedupe key, else raise InvalidJobError."""
    if not isinstance(value, str):
        raise InvalidJobError(f"dedupe_key must be a str or None, got {type(value).__name__}")
    if not value:
        raise InvalidJobError("dedupe_key must not be empty; pass None for no dedupe")
    if "\x00" in value:
        raise InvalidJobError("dedupe_key contains a NUL character; remove it")
    size = len(value.encode())
    if size > MAX_DEDUPE_KEY_BYTES:
        raise InvalidJobError(
            f"dedupe_key is {size} bytes; the limit is {MAX_DEDUPE_KEY_BYTES}: "
            "hash long keys (e.g. hashlib.sha256)"
        )
    return value
