"""Options: what a setting may hold, read from text (a flag, a variable) or checked as a value.

This module owns the *domains* of sqlaq's settings (:class:`Duration`, :class:`Integer`,
:class:`AutoInteger`, :class:`Boolean`, :class:`Names`, :class:`Choice`, :class:`Text`,
:class:`Condition`, :class:`DatabaseUrl`, :class:`PrepareThreshold`) and :class:`Option`,
one declared setting: its name, domain, default and help. A domain both parses text
(``"5m"`` -> 5 minutes) and checks a Python value, with the same bounds, so the worker's
Python API (:class:`~sqlaq.WorkerConfig`) and the commands refuse the same values. Every
refusal is a :class:`~sqlaq.errors.ConfigError` whose one-line message names the setting
as the caller spelled it (``lease``, ``--lease`` or ``SQLAQ_LEASE``) and the limit.

Pure: no environment, no database, no clock. The commands (``cli.py``, ``admin.py``)
build on it; nothing here knows about them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy import ClauseElement, FromClause
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from sqlaq.bounds import BIGINT_MAX, INT4_MAX, MAX_DURATION, SMALLINT_MAX, SMALLINT_MIN
from sqlaq.encoding import check_name
from sqlaq.errors import ConfigError, InvalidJobError

__all__ = [
    "COUNT",
    "JOB_ID",
    "PRIORITY",
    "AutoInteger",
    "Boolean",
    "Choice",
    "Condition",
    "DatabaseUrl",
    "Domain",
    "Duration",
    "Integer",
    "Names",
    "Option",
    "PrepareThreshold",
    "Text",
    "check_text",
    "parse_bool",
    "parse_duration",
]

T = TypeVar("T")

_MAX_DURATION_SHOWN = f"100 years ({MAX_DURATION.days}d)"
_DURATION_TEXT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*", re.ASCII)
_UNITS = {"ms": "milliseconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_INTEGER_TEXT = re.compile(r"\s*([+-]?)([0-9]+)\s*", re.ASCII)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _shown(text: object) -> str:
    """*text*'s repr, cut to 80 characters: an error line stays a line."""
    shown = repr(text)
    return shown if len(shown) <= 80 else shown[:76] + "...'"


def _named(label: str | None, message: str) -> str:
    """``"--lease: message"``; the bare message when there is no label."""
    return f"{label}: {message}" if label else message


def check_text(text: str, label: str | None = None) -> str:
    """Return *text* if PostgreSQL can store it as text, else raise.

    A command line or variable may carry bytes that are not UTF-8: Python hands them
    over as lone surrogates (``'\\udcff'``), which no driver can encode, and PostgreSQL's
    text has no NUL character. (:func:`sqlaq.encoding.check_text` is the same rule for
    the Python API, worded for a program's values rather than a command line's bytes.)

    Raises:
        ConfigError: *text* holds NUL or a lone surrogate; the message names *label*.
    """
    if "\x00" in text:
        raise ConfigError(_named(label, f"{_shown(text)} contains a NUL character; remove it"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            _named(
                label,
                f"{_shown(text)} is not valid UTF-8 text (character {exc.start} is "
                f"{text[exc.start]!r}: a byte that is not UTF-8, or a lone surrogate)",
            )
        ) from None
    return text


class Domain(Generic[T]):
    """The values a setting may hold: parsed from text, or checked as given."""

    @property
    def metavar(self) -> str:
        """How ``--help`` names the value."""
        return "VALUE"

    def parse(self, text: str, label: str | None = None) -> T:
        """The value *text* spells, within bounds.

        Raises:
            ConfigError: not a value of this domain; the message names *label*.
        """
        raise NotImplementedError

    def check(self, value: object, label: str) -> T:
        """*value* (normalised) if it belongs to this domain.

        Raises:
            ConfigError: it does not; the message names *label*.
        """
        raise NotImplementedError

    def show(self, value: T) -> str:
        """*value* as ``--help`` prints a default."""
        return str(value).lower()


@dataclass(frozen=True)
class Duration(Domain[timedelta | None]):
    """A :class:`~datetime.timedelta` from *minimum* to :data:`~sqlaq.bounds.MAX_DURATION`.

    Text: seconds (``30``, ``2.5``) or a number with a unit (``500ms``, ``30s``, ``5m``,
    ``1h``, ``7d``). With *forever*, ``forever`` (text) or None (value) means no limit.
    """

    minimum: timedelta = timedelta(0)
    forever: bool = False

    @property
    def metavar(self) -> str:
        """``DURATION``."""
        return "DURATION"

    def parse(self, text: str, label: str | None = None) -> timedelta | None:
        """See :meth:`Domain.parse`."""
        if self.forever and text.strip().lower() == "forever":
            return None
        match = _DURATION_TEXT.fullmatch(text)
        if match is None:
            also = " or 'forever'" if self.forever else ""
            raise ConfigError(
                _named(
                    label,
                    f"invalid duration {_shown(text)}: use seconds (30, 2.5) or a unit "
                    f"(500ms, 30s, 5m, 1h, 7d){also}",
                )
            )
        number, unit = float(match.group(1)), match.group(2) or "s"
        # Compared before a timedelta is built: timedelta(days=1e10) raises OverflowError.
        if number * _UNIT_SECONDS[unit] > MAX_DURATION.total_seconds():
            raise ConfigError(
                f"{label or 'a duration'} must be at most {_MAX_DURATION_SHOWN}, "
                f"got {_shown(text.strip())}"
            )
        return self.check(timedelta(**{_UNITS[unit]: number}), label or "a duration")

    def check(self, value: object, label: str) -> timedelta | None:
        """See :meth:`Domain.check`."""
        if value is None and self.forever:
            return None
        if not isinstance(value, timedelta):
            also = " (or None: for ever)" if self.forever else ""
            raise ConfigError(
                f"{label} must be a datetime.timedelta{also}, got {_shown(value)}; "
                "use timedelta(seconds=...)"
            )
        if value < self.minimum:
            raise ConfigError(
                f"{label} must be at least {self.minimum.total_seconds():g}s, got {value}"
            )
        if value > MAX_DURATION:
            raise ConfigError(f"{label} must be at most {_MAX_DURATION_SHOWN}, got {value}")
        return value

    def show(self, value: timedelta | None) -> str:
        """``30s``; ``forever`` for None."""
        return "forever" if value is None else f"{value.total_seconds():g}s"


@dataclass(frozen=True)
class Integer(Domain[int]):
    """An int from *low* to *high*, both included (never a bool)."""

    low: int
    high: int

    @property
    def metavar(self) -> str:
        """``N``."""
        return "N"

    def parse(self, text: str, label: str | None = None) -> int:
        """See :meth:`Domain.parse`."""
        match = _INTEGER_TEXT.fullmatch(text)
        if match is None:
            raise ConfigError(_named(label, f"invalid integer {_shown(text)}"))
        sign, digits = match.groups()
        if len(digits.lstrip("0")) > len(str(max(abs(self.low), abs(self.high)))):
            # Out of range whatever the digits: skip int() of a 5,000-digit number
            # (which Python refuses beyond 4,300 digits).
            raise ConfigError(
                f"{label or 'the value'} must be between {self.low} and {self.high}, "
                f"got {_shown(text.strip())}"
            )
        return self.check(int(sign + digits), label or "the value")

    def check(self, value: object, label: str) -> int:
        """See :meth:`Domain.check`."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} must be an int, got {_shown(value)}")
        if not self.low <= value <= self.high:
            raise ConfigError(f"{label} must be between {self.low} and {self.high}, got {value}")
        return value


#: A job id (PostgreSQL's ``bigint``, from 1); also a row limit of the commands.
JOB_ID = Integer(1, BIGINT_MAX)
#: A count stored as PostgreSQL's ``integer``, from 1: a job's ``max_attempts``, a
#: kind's ``concurrency`` and ``key_concurrency``.
COUNT = Integer(1, INT4_MAX)
#: A job's priority (PostgreSQL's ``smallint``).
PRIORITY = Integer(SMALLINT_MIN, SMALLINT_MAX)


@dataclass(frozen=True)
class AutoInteger(Domain[int | None]):
    """An :class:`Integer` from *low* to *high*, or ``auto`` (text) / None (value): the
    number is left to the program (the worker's prefetch follows its pace)."""

    low: int
    high: int

    @property
    def metavar(self) -> str:
        """``N|auto``."""
        return "N|auto"

    def parse(self, text: str, label: str | None = None) -> int | None:
        """See :meth:`Domain.parse`."""
        if text.strip().lower() == "auto":
            return None
        if _INTEGER_TEXT.fullmatch(text) is None:
            raise ConfigError(_named(label, f"invalid integer {_shown(text)} (or 'auto')"))
        return Integer(self.low, self.high).parse(text, label)

    def check(self, value: object, label: str) -> int | None:
        """See :meth:`Domain.check`."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} must be an int or None (auto), got {_shown(value)}")
        return Integer(self.low, self.high).check(value, label)

    def show(self, value: int | None) -> str:
        """``10``; ``auto`` for None."""
        return "auto" if value is None else str(value)


@dataclass(frozen=True)
class Boolean(Domain[bool]):
    """A bool; as text, ``1/true/yes/on`` or ``0/false/no/off`` in any case."""

    def parse(self, text: str, label: str | None = None) -> bool:
        """See :meth:`Domain.parse`."""
        value = text.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ConfigError(_named(label, f"invalid boolean {_shown(text)}: use true or false"))

    def check(self, value: object, label: str) -> bool:
        """See :meth:`Domain.check`."""
        if not isinstance(value, bool):
            raise ConfigError(f"{label} must be a bool, got {_shown(value)}")
        return value


@dataclass(frozen=True)
class Names(Domain[tuple[str, ...]]):
    """One or more queue names, in order, without repeats; as text, comma-separated.

    A single ``str`` value is one name.
    """

    what: str = "queue"
    #: Whether no name at all is a value (else at least one is needed).
    empty: bool = False

    @property
    def metavar(self) -> str:
        """``NAME``."""
        return "NAME"

    def parse(self, text: str, label: str | None = None) -> tuple[str, ...]:
        """See :meth:`Domain.parse`."""
        check_text(text, label)
        names = tuple(name.strip() for name in text.split(",") if name.strip())
        return self.check(names, label or f"{self.what}s")

    def check(self, value: object, label: str) -> tuple[str, ...]:
        """See :meth:`Domain.check`."""
        names: Iterable[object]
        if isinstance(value, str):
            names = (value,)
        elif isinstance(value, Mapping):
            # A mapping would give its keys and drop the rest without a word (fair=
            # {"q": {"vip": 3}}: the weights are key_weights=).
            raise ConfigError(
                f"{label} must be a {self.what} name or names, not a mapping: got {_shown(value)}"
            )
        elif isinstance(value, Iterable):
            names = tuple(value)
        else:
            raise ConfigError(f"{label} must be a {self.what} name or names, got {_shown(value)}")
        checked: list[str] = []
        for name in names:
            try:
                checked_name = check_name(self.what, name)  # NUL, lone surrogates too
            except InvalidJobError as exc:
                raise ConfigError(_named(label, str(exc))) from exc
            if checked_name not in checked:
                checked.append(checked_name)
        if not checked and not self.empty:
            raise ConfigError(f"{label} must name at least one {self.what}")
        return tuple(checked)

    def show(self, value: tuple[str, ...]) -> str:
        """``a,b`` (``none`` for no name)."""
        return ",".join(value) or "none"


@dataclass(frozen=True)
class Weights(Domain[tuple[tuple[str, int], ...]]):
    """Weights of job keys: a mapping of keys to ints from 1 to :data:`MAX_WEIGHT`, or
    (key, weight) pairs, held as pairs in key order; as text, ``key=N`` pairs,
    comma-separated (``vip=3,free=1``)."""

    @property
    def metavar(self) -> str:
        """``KEY=N``."""
        return "KEY=N"

    def parse(self, text: str, label: str | None = None) -> tuple[tuple[str, int], ...]:
        """See :meth:`Domain.parse`."""
        check_text(text, label)
        label = label or "the weights"
        pairs: list[tuple[str, int]] = []
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, number = item.rpartition("=")
            if not sep or not number.strip().isdigit():
                raise ConfigError(f"{label}: {_shown(item)} is not KEY=N (N a positive int)")
            pairs.append((key.strip(), int(number)))
        return self.check(pairs, label)

    def check(self, value: object, label: str) -> tuple[tuple[str, int], ...]:
        """See :meth:`Domain.check`: a mapping, or (key, weight) pairs (a key given
        twice: its last weight)."""
        if isinstance(value, Mapping):
            pairs = list(value.items())
        elif isinstance(value, Iterable) and not isinstance(value, str):
            pairs = list(value)
        else:
            raise ConfigError(f"{label} must map keys to positive ints, got {_shown(value)}")
        checked: dict[str, int] = {}
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ConfigError(f"{label} must map keys to positive ints, got {_shown(pair)}")
            key, weight = pair
            try:
                check_name("key", key)
            except InvalidJobError as exc:
                raise ConfigError(_named(label, str(exc))) from exc
            if isinstance(weight, bool) or not isinstance(weight, int):
                raise ConfigError(
                    f"{label}: the weight of {key!r} must be an int, got {_shown(weight)}"
                )
            if not 1 <= weight <= MAX_WEIGHT:
                raise ConfigError(
                    f"{label}: the weight of {key!r} must be between 1 and {MAX_WEIGHT}, "
                    f"got {weight}"
                )
            checked[key] = weight
        held = tuple(sorted(checked.items()))
        return value if value == held and isinstance(value, tuple) else held

    def show(self, value: tuple[tuple[str, int], ...]) -> str:
        """``free=1,vip=3`` (``none`` for no weight)."""
        return ",".join(f"{key}={weight}" for key, weight in value) or "none"


#: The largest weight of a key (fair claiming).
MAX_WEIGHT = 1_000_000


@dataclass(frozen=True)
class Choice(Domain[str]):
    """One of *choices* (lower case; text in any case)."""

    choices: Sequence[str]

    @property
    def metavar(self) -> str:
        """``debug|info|...``."""
        return "|".join(self.choices)

    def parse(self, text: str, label: str | None = None) -> str:
        """See :meth:`Domain.parse`."""
        return self.check(text.strip().lower(), label or "the value", shown=text)

    def check(self, value: object, label: str, *, shown: object = None) -> str:
        """See :meth:`Domain.check`."""
        if value not in self.choices:
            given = value if shown is None else shown
            raise ConfigError(
                f"{label}: invalid choice {_shown(given)}: use one of {', '.join(self.choices)}"
            )
        return str(value)


@dataclass(frozen=True)
class Text(Domain[str]):
    """Text PostgreSQL can store: no NUL, no lone surrogate (see :func:`check_text`)."""

    @property
    def metavar(self) -> str:
        """``TEXT``."""
        return "TEXT"

    def parse(self, text: str, label: str | None = None) -> str:
        """See :meth:`Domain.parse`."""
        return check_text(text, label)

    def check(self, value: object, label: str) -> str:
        """See :meth:`Domain.check`."""
        if not isinstance(value, str):
            raise ConfigError(f"{label} must be a str, got {_shown(value)}")
        return check_text(value, label)

    def show(self, value: str) -> str:
        """The text as given."""
        return str(value)


@dataclass(frozen=True)
class Condition(Domain[str | tuple[Any, ...] | None]):
    """A condition on rows: SQLAlchemy boolean clauses (one, or a sequence of them,
    AND-ed; kept as a tuple), or SQL text (what a flag or variable gives, kept as
    text); None for none. Only the types are checked here: what the clauses or the
    text mean is the statement builders' and the database's to judge."""

    @property
    def metavar(self) -> str:
        """``SQL``."""
        return "SQL"

    def parse(self, text: str, label: str | None = None) -> str | tuple[Any, ...] | None:
        """See :meth:`Domain.parse`; empty text is none."""
        return self.check(text, label or "the condition")

    def check(self, value: object, label: str) -> str | tuple[Any, ...] | None:
        """See :meth:`Domain.check`."""
        if value is None:
            return None
        if isinstance(value, str):
            text = check_text(value, label).strip()
            return text or None
        clauses = tuple(value) if isinstance(value, Sequence) else (value,)
        for clause in clauses:
            if not isinstance(clause, ClauseElement) or isinstance(clause, FromClause):
                raise ConfigError(
                    f"{label} must be a SQLAlchemy boolean clause, a sequence of them, or "
                    f"SQL text, got {_shown(clause)}: e.g. "
                    "sqlaq.jobs.c.payload['region'].astext == 'eu'"
                )
        return clauses or None

    def show(self, value: str | tuple[Any, ...] | None) -> str:
        """``none``, the text, or ``<N clauses>``."""
        if value is None:
            return "none"
        if isinstance(value, str):
            return value
        return f"<{len(value)} clause{'s' if len(value) != 1 else ''}>"


#: The largest ``prepare_threshold``: psycopg's is a C int.
_MAX_PREPARE_THRESHOLD = 2**31 - 1
_MAX_PORT = 65535


@dataclass(frozen=True)
class PrepareThreshold(Domain[int | None]):
    """psycopg's ``prepare_threshold``: how many executions of a statement before the
    connection prepares it server-side; None never prepares (what PgBouncer in
    *transaction* pooling needs). Text: ``none`` (any case), or 0 to 2**31 - 1."""

    @property
    def metavar(self) -> str:
        """``none|N``."""
        return "none|N"

    def parse(self, text: str, label: str | None = None) -> int | None:
        """See :meth:`Domain.parse`."""
        if text.strip().lower() == "none":
            return None
        try:
            return Integer(0, _MAX_PREPARE_THRESHOLD).parse(text, label)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc}; use none (no prepared statements, for PgBouncer in transaction "
                "mode) or a number of executions"
            ) from None

    def check(self, value: object, label: str) -> int | None:
        """See :meth:`Domain.check`."""
        if value is None:
            return None
        return Integer(0, _MAX_PREPARE_THRESHOLD).check(value, label)


def _redacted(url: str) -> str:
    """*url* with its password replaced by ``***``."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


@dataclass(frozen=True)
class DatabaseUrl(Domain[str | None]):
    """A PostgreSQL URL (``postgresql://user@host:5432/db``, any ``+driver``); None when
    not set. Checked as SQLAlchemy reads it: a ``postgres`` scheme, a port from 0 to
    65535, and a ``prepare_threshold`` query parameter, if any, that
    :class:`PrepareThreshold` reads. A :class:`sqlalchemy.engine.URL` is taken as its
    text, password included."""

    @property
    def metavar(self) -> str:
        """``URL``."""
        return "URL"

    def parse(self, text: str, label: str | None = None) -> str | None:
        """See :meth:`Domain.parse`."""
        return self.check(text, label or "the URL")

    def check(self, value: object, label: str) -> str | None:
        """See :meth:`Domain.check`."""
        if value is None:
            return None
        if isinstance(value, URL):
            value = value.render_as_string(hide_password=False)
        if not isinstance(value, str):
            raise ConfigError(f"{label} must be a database URL (str), got {type(value).__name__}")
        text = check_text(value, label).strip()
        if not text:
            raise ConfigError(f"{label}: empty; leave it unset to use the database URL")
        shown = _shown(_redacted(text))
        try:
            url = make_url(text)
            port = url.port  # int() of the port: a ValueError for "abc"
        except (ArgumentError, ValueError):
            raise ConfigError(
                f"{label}: invalid URL {shown}: use postgresql://user:password@host:port/database"
            ) from None
        if url.drivername.split("+")[0] not in {"postgresql", "postgres"}:
            raise ConfigError(f"{label}: {shown} is not a PostgreSQL URL (postgresql://...)")
        if port is not None and not 0 <= port <= _MAX_PORT:
            raise ConfigError(f"{label}: invalid URL {shown}: the port must be 0 to {_MAX_PORT}")
        threshold = url.query.get("prepare_threshold")
        if threshold is not None:
            if not isinstance(threshold, str):  # given twice: SQLAlchemy makes a tuple
                raise ConfigError(f"{label}: prepare_threshold is given more than once")
            PrepareThreshold().parse(threshold, f"{label}: prepare_threshold")
        return text

    def show(self, value: str | None) -> str:
        """``none``, or the URL without its password."""
        return "none" if value is None else _redacted(value)


@dataclass(frozen=True, slots=True)
class Option:
    """One setting, declared once: its name, domain, default and help.

    The commands derive the rest: the flag (``--`` and the name with dashes, unless
    *flag* says otherwise) and the variable (``SQLAQ_`` and the name in capitals).

    Args:
        name: The setting (a :class:`~sqlaq.WorkerConfig` field, or the command's own).
        domain: Its values (and so its parser and bounds).
        default: Used when neither flag nor variable is given.
        help: One line for ``--help``.
        flag: The flag, when not derived from *name*.
        shown: The default as ``--help`` prints it, when not derived from *default*.
        repeatable: The flag may be given several times; the values add up.
        positional: An argument without a flag (its variable still applies).
        metavar: How ``--help`` names the value, when not the domain's.
    """

    name: str
    domain: Domain[Any]
    default: Any
    help: str
    flag: str = ""
    shown: str | None = None
    repeatable: bool = False
    positional: bool = False
    metavar: str | None = None

    @property
    def flag_name(self) -> str:
        """``--lease``; for a positional argument, its name."""
        if self.positional:
            return self.name
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """``SQLAQ_LEASE``."""
        return "SQLAQ_" + self.name.upper()

    def help_text(self) -> str:
        """The help, the variable and the default, as ``--help`` prints them."""
        shown = self.domain.show(self.default) if self.shown is None else self.shown
        return f"{self.help} (env: {self.env}; default: {shown})"


def parse_duration(text: str) -> timedelta:
    """``"30"``, ``"2.5"``, ``"500ms"``, ``"30s"``, ``"5m"``, ``"1h"``, ``"7d"`` -> timedelta.

    At most :data:`~sqlaq.bounds.MAX_DURATION` (100 years).

    Raises:
        ConfigError: not a duration, or longer than 100 years (a ValueError).
    """
    value = Duration().parse(text)
    if value is None:  # pragma: no cover - Duration() without forever never returns None
        raise ConfigError(f"invalid duration {text!r}")
    return value


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` and ``0/false/no/off`` (any case) -> bool.

    Raises:
        ConfigError: anything else (a ValueError).
    """
    return Boolean().parse(text)
