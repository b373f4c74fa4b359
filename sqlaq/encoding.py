"""Validation and encoding of jobs to enqueue; pure, no SQL, no clock.

Everything a caller hands to ``enqueue`` is checked here before any statement is built,
so bad input raises :class:`~sqlaq.errors.InvalidJobError` with a message naming the
field (or the path inside the payload) and the fix, and nothing is written.

Decisions written down here:

* A payload is a JSON object (a ``Mapping`` with ``str`` keys): the handler receives it
  as its one argument, and an object can grow fields without breaking old jobs. Nested
  values may be any JSON: a ``Mapping`` (any, not only ``dict``: it is stored as a JSON
  object and comes back as a ``dict``), ``list``/``tuple`` (comes back as a ``list``),
  ``str``, ``int``, finite ``float``, ``bool``, ``None``.
* **Text PostgreSQL cannot store is refused** in every text field (payload strings and
  keys, ``kind``, ``queue``, ``dedupe_key``): the NUL character, and lone surrogates
  (``"\\ud800"``, what ``errors="surrogateescape"`` leaves of undecodable bytes), which
  are not Unicode text and cannot be encoded to UTF-8.
* NaN and Infinity are refused (JSON and jsonb have no such values). jsonb keeps
  numbers as decimals and prints them without exponents, so a float of 1e16 or more
  (which ``repr`` spells ``1e+16``) is sent spelt out with a fraction
  (``10000000000000000.0``): it comes back as the same float, not as an int. (Through
  the ORM :class:`~sqlaq.Job`, whose payload SQLAlchemy's serializer encodes, it comes
  back as an int.)
* **Ints are bounded to** :data:`MAX_INT_DIGITS` **(4,300) digits**: jsonb would hold far
  more (131,072 digits), but Python converts ints to and from text only up to 4,300
  digits by default (``sys.get_int_max_str_digits()``), so a longer one could be
  stored and then not read back. A process that lowered that limit gets its own limit.
* **Nesting is bounded to** :data:`MAX_DEPTH` **(500) levels**, and a payload that
  contains itself (a cycle) is refused, naming where: both would otherwise end in a
  ``RecursionError`` somewhere between here and the handler.
* The payload is encoded once, here, and sent as text cast to jsonb, so no driver or
  SQLAlchemy serializer runs over it again.
* Times are intervals (``delay``), never timestamps: the database clock is the only
  clock, and ``run_at`` is always ``now() + delay``. Every duration is at most
  :data:`~sqlaq.bounds.MAX_DURATION` (100 years; see :mod:`sqlaq.bounds`).
* A payload's JSON is at most this process's payload limit (1 MiB by default; see
  :func:`~sqlaq.bounds.set_max_payload_bytes`), checked once it is encoded.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any, overload

from sqlaq.bounds import INT4_MAX, MAX_DURATION, SMALLINT_MAX, SMALLINT_MIN, check_payload_size
from sqlaq.errors import InvalidJobError, shown
from sqlaq.schema import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    MAX_DEDUPE_KEY_BYTES,
    MAX_NAME_LENGTH,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "JobBatch",
    "NewJob",
    "check_dedupe_key",
    "check_duration",
    "check_int",
    "check_key",
    "check_name",
    "check_payload",
    "check_text",
    "encode_payload",
    "encode_value",
    "plain_payload",
    "slot_setters",
]

#: How deep a payload may nest: a value inside this many objects or arrays, not more.
MAX_DEPTH = 500
#: The most digits an int in a payload may have (Python's default int/str limit).
MAX_INT_DIGITS = 4300

_NO_DELAY = timedelta(0)


class _EmptyPayload:
    """NewJob's default payload: a new empty dict each time (default_factory=dict)."""

    def __repr__(self) -> str:
        return "{}"


_NO_PAYLOAD: Any = _EmptyPayload()
# kind and queue names that passed check_name (exact str only), so that a job of a
# known kind and queue skips the check; bounded, as names may come from input.
_GOOD_NAMES: set[str] = set()
_GOOD_NAMES_MAX = 4096


def _remember(name: str) -> None:
    if type(name) is str and len(_GOOD_NAMES) < _GOOD_NAMES_MAX:
        _GOOD_NAMES.add(name)


_INT_BOUNDS: dict[int, int] = {}


def check_text(field_name: str, value: str) -> str:
    """Return *value* if PostgreSQL can store it as text, else raise.

    Raises:
        InvalidJobError: it holds a NUL character or a lone surrogate.
    """
    if "\x00" in value:
        raise InvalidJobError(
            f"{field_name} contains a NUL character (at index {value.index(chr(0))}); "
            "PostgreSQL cannot store it: remove it"
        )
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            bad = value[exc.start]
            raise InvalidJobError(
                f"{field_name} contains a lone surrogate ({bad!r} at index {exc.start}), "
                "which is not Unicode text and which PostgreSQL cannot store: decode the "
                "bytes it came from properly (e.g. data.decode('utf-8', 'replace'))"
            ) from None
    return value


def check_name(field_name: str, value: object) -> str:
    """Return *value* if it is a usable ``kind`` or ``queue`` name, else raise.

    Raises:
        InvalidJobError: not a string, empty, longer than 255 characters, or holding NUL
            or a lone surrogate.
    """
    if not isinstance(value, str):
        raise InvalidJobError(f"{field_name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidJobError(f"{field_name} must be a non-empty name, got {shown(value)}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidJobError(
            f"{field_name} is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    return check_text(field_name, value)


def check_key(value: object) -> str:
    """Return *value* if it is a usable job ``key`` (a tenant, an account), else raise.

    Raises:
        InvalidJobError: not a str, empty or blank, longer than 255 characters, or
            holding NUL or a lone surrogate.
    """
    if not isinstance(value, str):
        raise InvalidJobError(f"key must be a str or None, got {type(value).__name__}")
    return check_name("key", value)


def check_int(field_name: str, value: object, low: int, high: int) -> int:
    """Return *value* if it is an int (not a bool) within ``[low, high]``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(f"{field_name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidJobError(f"{field_name} must be between {low} and {high}, got {shown(value)}")
    return value


def check_duration(field_name: str, value: object, *, allow_zero: bool = True) -> timedelta:
    """Return *value* if it is a ``timedelta`` from zero (or more, if not *allow_zero*)
    to :data:`~sqlaq.bounds.MAX_DURATION` (100 years).

    Raises:
        InvalidJobError: not a timedelta, negative, zero where zero is not allowed, or
            longer than 100 years.
    """
    if not isinstance(value, timedelta):
        raise InvalidJobError(
            f"{field_name} must be a datetime.timedelta, got {type(value).__name__}; "
            f"use timedelta(seconds=...)"
        )
    if value < timedelta(0) or (not allow_zero and value == timedelta(0)):
        bound = "zero or more" if allow_zero else "more than zero"
        raise InvalidJobError(f"{field_name} must be {bound}, got {value}")
    if value > MAX_DURATION:
        raise InvalidJobError(
            f"{field_name} must be at most 100 years ({MAX_DURATION.days} days), got "
            f"{value.days} days: a time that far off cannot be stored and read back"
        )
    return value


def check_payload(payload: object) -> None:
    """Validate *payload*.

    Raises:
        InvalidJobError: the payload is not a JSON object of JSON values: see the
            module's decisions. The message gives the path to the bad value.
    """
    _check(payload)


def encode_payload(payload: object) -> str:
    """Validate *payload* and return it as compact JSON text.

    Raises:
        InvalidJobError: as :func:`check_payload`.
    """
    found = _check(payload)
    try:
        text = _encode(payload)
    except RecursionError:
        # Within MAX_DEPTH, but the caller's own stack was already deep.
        raise InvalidJobError(
            "payload nests too deep to encode from this call stack; flatten it"
        ) from None
    if found & _BIG_FLOAT:
        text = _TOKEN.sub(_fixed_point, text)
    return text


def encode_value(value: object, path: str = "result") -> str:
    """Validate *value*, any JSON value (an object, array, string, number, bool or
    None), with the payload's rules, and return it as compact JSON text.

    Messages name the bad element from *path*: ``result['rows'][3] is a set``.

    Raises:
        InvalidJobError: *value* is not a JSON value PostgreSQL can store and Python
            read back (see the module's decisions).
    """
    root: _Link = (None, path, value, 1)
    if isinstance(value, Mapping | list | tuple):
        found = _walk(value, _int_bound(), root)
    else:
        found = _check_scalar(value, root, None, _int_bound())
    try:
        text = _encode(value)
    except RecursionError:
        raise InvalidJobError(
            f"{path} nests too deep to encode from this call stack; flatten it"
        ) from None
    if found & _BIG_FLOAT:
        text = _TOKEN.sub(_fixed_point, text)
    return text


def plain_payload(payload: object) -> dict[str, Any]:
    """*payload*, validated, as a ``dict`` of plain JSON values (itself if it is one).

    Raises:
        InvalidJobError: as :func:`check_payload`.
    """
    if _check(payload) & _OTHER_MAPPING:
        plain: dict[str, Any] = json.loads(encode_payload(payload))
        return plain
    return payload  # type: ignore[return-value]


def _check(payload: object) -> int:
    if type(payload) is dict and _flat(payload):
        return 0
    if not isinstance(payload, Mapping):
        raise InvalidJobError(
            f"payload must be a dict (a JSON object), got {type(payload).__name__}; "
            "wrap the value, e.g. {'items': [...]}"
        )
    return _walk(payload, _int_bound())


# The fast path's bound on ints: 18 digits, far within any int/str digits limit (at
# least 640 digits).
_SMALL_INT = 10**18


def _flat(payload: dict[Any, Any]) -> bool:
    """Whether *payload* is the common case, passed without the walk: a dict whose keys
    are ASCII ``str`` without NUL and whose values are ``None``, bools, ints of at most
    18 digits, floats under 1e16 and ASCII ``str`` without NUL. False sends it to the
    walk, which decides (and names what is wrong)."""
    for key, value in payload.items():
        if type(key) is not str or not key.isascii() or "\x00" in key:
            return False
        kind = type(value)
        if kind is str:
            if not value.isascii() or "\x00" in value:
                return False
        elif kind is int:
            if not -_SMALL_INT < value < _SMALL_INT:
                return False
        elif kind is float:
            if not -_BIG < value < _BIG:  # NaN compares false too
                return False
        elif value is not None and kind is not bool:
            return False
    return True


def _as_dict(value: object) -> dict[Any, Any]:
    # The encoder's hook for what it cannot encode: only a non-dict Mapping gets here,
    # since the payload was walked first.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")  # pragma: no cover


_ENCODER = json.JSONEncoder(
    allow_nan=False,
    ensure_ascii=False,
    separators=(",", ":"),
    default=_as_dict,
    check_circular=False,  # the walk refused cycles already
)

# The C encoder behind _ENCODER.encode, called without its two Python-level wrappers
# (a third of the cost of encoding a small payload); what ``encode`` itself calls for
# any object but a str, with the same settings. None where the C accelerator is
# missing (another interpreter): _ENCODER.encode then.
_C_ENCODER = (
    None
    if c_make_encoder is None
    else c_make_encoder(None, _as_dict, encode_basestring, None, ":", ",", False, False, False)
)


def _encode(value: Any) -> str:
    if _C_ENCODER is None or isinstance(value, str):  # pragma: no cover - CPython has it
        return _ENCODER.encode(value)
    return "".join(_C_ENCODER(value, 0))


# What the walk found that encoding must mind.
_OTHER_MAPPING = 1  # a Mapping that is not a dict: the encoder's hook copies it
_BIG_FLOAT = 2  # a float of 1e16 or more, which repr spells with an exponent
_BIG = 1e16
# Every JSON string and number token, each matched whole from its first character (so a
# long run of digits is read once, never retried from each of its digits).
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?')


def _fixed_point(match: re.Match[str]) -> str:
    """A big float's exponent form spelt out with a fraction: ``1e+16`` ->
    ``10000000000000000.0``. jsonb keeps the number as that decimal, fraction included,
    so it reads back as the same float, not as an int."""
    token = match.group(0)
    if "e+" not in token or token[0] == '"':  # a string, or a number kept as it is
        return token
    return format(Decimal(token), "f") + ".0"


# Where a container sits in the payload: (parent link, key, the container, its level).
# Paths are spelt out from these links only for an error message.
_Link = tuple[Any, Any, Any, int]


def _spell(link: _Link | None, key: Any = None, limit: int = 12) -> str:
    keys: list[Any] = [] if key is None else [key]
    while link is not None and link[0] is not None:
        keys.append(link[1])
        link = link[0]
    keys.reverse()
    shown = "".join(f"[{k!r}]" for k in keys[:limit])
    if len(keys) > limit:
        shown += f"...({len(keys)} levels)"
    # The root link's key is the root's name (encode_value), else it is the payload.
    return (link[1] if link is not None and link[1] is not None else "payload") + shown


def _int_bound() -> int:
    """10 ** (the most digits an int may have): the default limit, or this process's
    lower one."""
    limit = sys.get_int_max_str_digits()
    digits = MAX_INT_DIGITS if limit == 0 else min(limit, MAX_INT_DIGITS)
    bound = _INT_BOUNDS.get(digits)
    if bound is None:
        bound = _INT_BOUNDS[digits] = 10**digits
    return bound


def _digits(bound: int) -> int:
    return next(d for d, b in _INT_BOUNDS.items() if b == bound)


def _walk(payload: Any, int_bound: int, root: _Link | None = None) -> int:
    # One walk, without recursion, names the exact bad element; json.dumps alone would
    # say "Object of type set is not JSON serializable" with no path, or raise
    # RecursionError.
    found = 0
    stack: list[_Link] = [root or (None, None, payload, 1)]
    while stack:
        link = stack.pop()
        container, level = link[2], link[3]
        if level > MAX_DEPTH:
            raise InvalidJobError(_too_deep(link))
        if isinstance(container, Mapping):
            if not isinstance(container, dict):
                found |= _OTHER_MAPPING
            for key, item in container.items():
                if type(key) is not str or "\x00" in key or not key.isascii():
                    _check_key(link, key)
                if isinstance(item, Mapping | list | tuple):
                    stack.append((link, key, item, level + 1))
                else:
                    found |= _check_scalar(item, link, key, int_bound)
        else:
            for index, item in enumerate(container):
                if isinstance(item, Mapping | list | tuple):
                    stack.append((link, index, item, level + 1))
                else:
                    found |= _check_scalar(item, link, index, int_bound)
    return found


def _check_key(link: _Link, key: Any) -> None:
    if not isinstance(key, str):
        raise InvalidJobError(
            f"{_spell(link)} has a key {shown(key)} of type {type(key).__name__}; "
            "JSON object keys must be str"
        )
    if "\x00" in key or not key.isascii():
        check_text(f"{_spell(link)} has a key that", key)


def _check_scalar(value: Any, link: _Link, key: Any, int_bound: int) -> int:
    """Check a value that is not a container; return what encoding must mind (flags)."""
    if value is None or value is True or value is False:
        return 0
    if isinstance(value, str):
        if "\x00" in value or not value.isascii():
            check_text(_spell(link, key), value)
        return 0
    if isinstance(value, int):
        if not -int_bound < value < int_bound:
            digits = _digits(int_bound)
            raise InvalidJobError(
                f"{_spell(link, key)} is an int of more than {digits} digits, which "
                "Python cannot read back from text: store it as a string"
            )
        return 0
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJobError(
                f"{_spell(link, key)} is {value!r}; JSON has no NaN or Infinity, "
                "use null or a string"
            )
        return _BIG_FLOAT if abs(value) >= _BIG else 0
    hint = "use a list" if isinstance(value, set | frozenset) else "convert it to a JSON value"
    raise InvalidJobError(
        f"{_spell(link, key)} is a {type(value).__name__}, not JSON-serialisable; {hint}"
    )


def _too_deep(link: _Link) -> str:
    """The message for a container past MAX_DEPTH: a cycle, if one of its ancestors is
    met twice on the way down, else plain depth."""
    chain: list[_Link] = []
    node: _Link | None = link
    while node is not None:
        chain.append(node)
        node = node[0]
    chain.reverse()
    first: dict[int, _Link] = {}
    for node in chain:
        seen = first.setdefault(id(node[2]), node)
        if seen is not node:
            return (
                f"{_spell(node)} is {_spell(seen)} again: the payload contains itself, "
                "which JSON cannot hold; copy the data instead of nesting the object in "
                "itself"
            )
    return f"{_spell(link)} nests deeper than {MAX_DEPTH} levels; flatten the payload"


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to enqueue, validated on construction.

    Args:
        kind: Which handler runs it (1 to 255 characters).
        payload: The handler's argument: a JSON object (None or left out: ``{}``, as
            :func:`sqlaq.enqueue`). Put ids in it, not data.
        queue: Routing: a worker serves some queues.
        priority: Higher runs first among due jobs (-32768 to 32767).
        delay: Run no sooner than ``now() + delay`` (database clock).
        max_attempts: How many times the job may be claimed, at least 1.
        dedupe_key: At most one pending job per ``(kind, dedupe_key)``; a second enqueue
            while one is pending reports the existing job instead.
        run_at: Run no sooner than this time, instead of ``now() + delay``: an aware
            ``datetime`` (a naive one is refused: its time zone would be a guess); one
            in the past is due at once.
        timeout: This job's attempt timeout, over its handler's ``timeout=`` (a
            positive timedelta of at most 100 years); None: the handler's.
        key: What per-key limits and strict order count over: a tenant, an account,
            a resource (1 to 255 characters); None: no key. See ``docs/how-to/tenants.md``.

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
    run_at: datetime | None = None
    timeout: timedelta | None = None
    key: str | None = None
    payload_json: str = field(init=False, repr=False, compare=False)

    # Written out, not generated: a frozen dataclass's __init__ sets each field through
    # object.__setattr__, a fifth of a NewJob's cost; the slots' own setters take half
    # that. The same parameters as the generated one (tests/db/test_enqueue_fast.py checks
    # them against the fields); payload's default is a new empty dict.
    def __init__(
        self,
        kind: str,
        payload: Mapping[str, Any] | None = _NO_PAYLOAD,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        delay: timedelta = _NO_DELAY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        dedupe_key: str | None = None,
        run_at: datetime | None = None,
        timeout: timedelta | None = None,
        key: str | None = None,
    ) -> None:
        (kind_, payload_, queue_, priority_, delay_, attempts_, dedupe_, at_, timeout_, key_) = (
            _SETTERS
        )
        kind_(self, kind)
        payload_(self, {} if payload is _NO_PAYLOAD or payload is None else payload)
        queue_(self, queue)
        priority_(self, priority)
        delay_(self, delay)
        attempts_(self, max_attempts)
        dedupe_(self, dedupe_key)
        at_(self, run_at)
        timeout_(self, timeout)
        key_(self, key)
        self.__post_init__()

    def __post_init__(self) -> None:
        # Each check is skipped for a value known good (a name checked before, an int
        # in range, no delay): a bulk enqueue builds thousands of these.
        kind, queue, priority, attempts = self.kind, self.queue, self.priority, self.max_attempts
        if type(kind) is not str or kind not in _GOOD_NAMES:
            _remember(check_name("kind", kind))
        if type(queue) is not str or queue not in _GOOD_NAMES:
            _remember(check_name("queue", queue))
        if type(priority) is not int or not SMALLINT_MIN <= priority <= SMALLINT_MAX:
            check_int("priority", priority, SMALLINT_MIN, SMALLINT_MAX)
        if type(self.delay) is not timedelta or self.delay:
            check_duration("delay", self.delay)
        if type(attempts) is not int or not 1 <= attempts <= INT4_MAX:
            check_int("max_attempts", attempts, 1, INT4_MAX)
        if self.dedupe_key is not None:
            check_dedupe_key(self.dedupe_key)
        if self.run_at is not None:
            check_run_at(self.run_at)
            if self.delay:
                raise InvalidJobError("pass delay or run_at, not both")
        if self.timeout is not None:
            check_duration("timeout", self.timeout, allow_zero=False)
        if self.key is not None:
            check_key(self.key)
        object.__setattr__(self, "payload_json", check_payload_size(encode_payload(self.payload)))

    def with_payloads(self, payloads: Iterable[Mapping[str, Any]]) -> JobBatch:
        """This job once per payload, every other field shared: a :class:`JobBatch`.

        ``sqlaq.enqueue_many(conn, NewJob("resize", queue="images").with_payloads(rows))``
        enqueues one job per payload, in order, about twice as fast as a list of
        ``NewJob`` objects: the fields are checked once, and the payloads are checked
        and encoded as one JSON array (this job's own payload is not used).

        Raises:
            InvalidJobError: a payload is unusable (the message names its index), or
                this job has a ``dedupe_key`` (shared, it would make every job but the
                first a duplicate); nothing is built.
        """
        return JobBatch(self, payloads)


def slot_setters(
    cls: type[Any], *, init_only: bool = False
) -> tuple[Callable[[Any, Any], None], ...]:
    """The setters of the slotted dataclass *cls*'s fields (only those its ``__init__``
    takes, with *init_only*), in field order. What is built by the thousand (a bulk
    enqueue's NewJob objects, a claim's jobs and leases, a bulk insert's results) sets its
    slots through these instead of ``object.__setattr__`` (what a frozen dataclass's
    generated ``__init__`` does, at twice the cost)."""
    return tuple(cls.__dict__[f.name].__set__ for f in fields(cls) if f.init or not init_only)


#: NewJob.__init__'s setters of its fields, in its parameters' order (the fields'
#: order: tests/db/test_enqueue_fast.py checks that the parameters follow it).
_SETTERS = slot_setters(NewJob, init_only=True)


class JobBatch(Sequence[NewJob]):
    """One job per payload, all other fields those of one :class:`NewJob`: what
    :meth:`NewJob.with_payloads` returns, for :func:`sqlaq.enqueue_many`.

    The payloads are validated when the batch is made, with the same rules as a
    ``NewJob``'s, and encoded once, as one JSON array (:attr:`payloads_json`). The batch
    is a sequence of ``NewJob`` (built on access), so anything that takes jobs takes it;
    :func:`sqlaq.enqueue_many` sends it as one statement without building them.

    Attributes:
        template: The job whose fields every job of the batch has (its payload unused).
        payloads: The payloads, in order.
        payloads_json: The payloads as one JSON array text.
    """

    __slots__ = ("payloads", "payloads_json", "template")

    def __init__(self, template: NewJob, payloads: Iterable[Mapping[str, Any]]) -> None:
        if not isinstance(template, NewJob):
            raise InvalidJobError(f"template must be a sqlaq.NewJob, got {type(template).__name__}")
        if template.dedupe_key is not None:
            raise InvalidJobError(
                "a batch shares every field but the payload, so a dedupe_key would make "
                "every job but the first a duplicate: build NewJobs with their own keys"
            )
        if isinstance(payloads, str | bytes | Mapping):
            raise InvalidJobError(
                f"payloads must be an iterable of payloads (dicts), got one "
                f"{type(payloads).__name__}; wrap it in a list"
            )
        batch = list(payloads)
        found = 0
        check = _check
        for index, payload in enumerate(batch):
            try:
                found |= check(payload)
            except InvalidJobError as exc:
                raise InvalidJobError(f"payloads[{index}]: {exc}") from None
        if found & _BIG_FLOAT:
            text = f"[{','.join(map(encode_payload, batch))}]"
        else:
            try:
                text = _encode(batch)
            except RecursionError:
                raise InvalidJobError(
                    "a payload nests too deep to encode from this call stack; flatten it"
                ) from None
        try:
            check_payload_size(text)  # the whole array within the limit: so is each payload
        except InvalidJobError:
            for index, payload in enumerate(batch):
                check_payload_size(encode_payload(payload), f"payloads[{index}]")
        self.template = template
        self.payloads = batch
        self.payloads_json = text

    def __len__(self) -> int:
        return len(self.payloads)

    @overload
    def __getitem__(self, index: int) -> NewJob: ...
    @overload
    def __getitem__(self, index: slice) -> list[NewJob]: ...
    def __getitem__(self, index: int | slice) -> NewJob | list[NewJob]:
        if isinstance(index, slice):
            return [self._job(payload) for payload in self.payloads[index]]
        return self._job(self.payloads[index])

    def __iter__(self) -> Iterator[NewJob]:
        return map(self._job, self.payloads)

    def _job(self, payload: Mapping[str, Any]) -> NewJob:
        return replace(self.template, payload=payload)

    def __repr__(self) -> str:
        return f"JobBatch({self.template!r}, {len(self.payloads)} payloads)"


#: The latest ``run_at`` accepted: far enough from ``datetime.max`` that the row stays
#: readable by Python whatever is added to it later (a retry's backoff, a travel).
MAX_RUN_AT = datetime(9899, 12, 31, tzinfo=UTC)


def check_run_at(value: object) -> datetime:
    """Return *value* if it is an aware ``datetime`` no later than :data:`MAX_RUN_AT`.

    Raises:
        InvalidJobError: not a datetime, naive (no time zone), or too far ahead.
    """
    if not isinstance(value, datetime):
        raise InvalidJobError(f"run_at must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidJobError(
            f"run_at must be an aware datetime, got the naive {value.isoformat()}: "
            "say its time zone, e.g. datetime(..., tzinfo=UTC) or datetime.now(UTC)"
        )
    if value > MAX_RUN_AT:
        raise InvalidJobError(f"run_at must be no later than {MAX_RUN_AT.date()}, got {value}")
    return value


def check_dedupe_key(value: object, field_name: str = "dedupe_key") -> str:
    """Return *value* if it is a usable dedupe key (or debounce key: *field_name*),
    else raise.

    Raises:
        InvalidJobError: not a str, empty, holding NUL or a lone surrogate, or longer
            than :data:`~sqlaq.schema.MAX_DEDUPE_KEY_BYTES` bytes in UTF-8.
    """
    if not isinstance(value, str):
        raise InvalidJobError(f"{field_name} must be a str or None, got {type(value).__name__}")
    if not value:
        raise InvalidJobError(f"{field_name} must not be empty; pass None for no key")
    check_text(field_name, value)
    size = len(value.encode())
    if size > MAX_DEDUPE_KEY_BYTES:
        raise InvalidJobError(
            f"{field_name} is {size} bytes; the limit is {MAX_DEDUPE_KEY_BYTES}: "
            "hash long keys (e.g. hashlib.sha256)"
        )
    return value
