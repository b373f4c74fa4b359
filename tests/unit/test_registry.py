"""sqlaq.registry: the handler options are declared once (HandlerOptions) and checked at
registration, unknown ones refused with one line."""

from __future__ import annotations

import dataclasses
import inspect
import re
from datetime import timedelta
from pathlib import Path

import pytest

from sqlaq import ConfigError, InvalidJobError, NewJob, Registry, WorkerConfig
from sqlaq.bounds import INT4_MAX, MAX_DURATION, MIN_LEASE
from sqlaq.registry import _OPTIONS, Handler, HandlerOptions


def test_the_options_are_declared_once_and_each_becomes_a_handler_field() -> None:
    declared = list(HandlerOptions.__annotations__)
    assert declared == list(_OPTIONS)
    assert set(declared) <= {field.name for field in dataclasses.fields(Handler)}
    # handler() and add() take them as **options: no second list of keywords.
    for method in (Registry.handler, Registry.add):
        kinds = [p.kind for p in inspect.signature(method).parameters.values()]
        assert inspect.Parameter.KEYWORD_ONLY not in kinds
        assert kinds[-1] is inspect.Parameter.VAR_KEYWORD


def test_every_option_reaches_the_handler_through_both_spellings() -> None:
    registry = Registry()
    options: HandlerOptions = {
        "max_attempts": 7,
        "lease": timedelta(seconds=9),
        "concurrency": 2,
        "rate": "5/s",
        "timeout": timedelta(seconds=3),
    }

    @registry.handler("decorated", **options)
    def decorated(payload: dict[str, object]) -> None: ...

    added = registry.add("added", decorated, **options)
    for entry in (registry.get("decorated"), added):
        assert entry is not None
        assert (entry.max_attempts, entry.lease, entry.concurrency) == (7, timedelta(seconds=9), 2)
        assert entry.rate is not None
        assert entry.rate.count == 5
        assert entry.timeout == timedelta(seconds=3)
    plain = registry.add("plain", decorated)
    assert (plain.max_attempts, plain.lease, plain.rate, plain.timeout) == (5, None, None, None)


def test_an_unknown_option_is_refused_with_one_line_naming_the_close_one() -> None:
    registry = Registry()
    with pytest.raises(ConfigError) as refused:
        registry.add("k", lambda payload: None, timout=timedelta(seconds=1))  # type: ignore[call-arg]
    message = str(refused.value)
    assert "\n" not in message
    assert "'timout'" in message
    assert "did you mean 'timeout'?" in message
    assert all(name in message for name in _OPTIONS)
    assert "k" not in registry
    with pytest.raises(ConfigError, match="no option 'colour'"):
        registry.handler("k", colour="red")  # type: ignore[call-arg]


_DAY = timedelta(days=1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lease": timedelta(milliseconds=99)}, "lease of 'k' must be at least 0.1s"),
        ({"lease": MAX_DURATION + _DAY}, "lease of 'k' must be at most 100 years"),
        ({"lease": 30}, "lease of 'k' must be a datetime.timedelta"),
        ({"max_attempts": 0}, "max_attempts of 'k' must be between 1 and 2147483647"),
        ({"max_attempts": INT4_MAX + 1}, "max_attempts of 'k' must be between 1 and 2147483647"),
        ({"max_attempts": None}, "max_attempts of 'k' must be an int"),
        ({"max_attempts": True}, "max_attempts of 'k' must be an int"),
        ({"concurrency": 0}, "concurrency of 'k' must be between 1 and 2147483647"),
        ({"concurrency": INT4_MAX + 1}, "concurrency of 'k' must be between 1 and 2147483647"),
        ({"key_concurrency": 2**70}, "key_concurrency of 'k' must be between 1 and 2147483647"),
        ({"key_concurrency": "3"}, "key_concurrency of 'k' must be an int"),
        ({"ordered": 1}, "ordered of 'k' must be a bool"),
    ],
)
def test_an_option_out_of_what_postgresql_stores_is_refused_at_registration(
    options: dict[str, object], message: str
) -> None:
    # Not later, when a worker renews a lease 100 years out or writes a limit above
    # PostgreSQL's integer: one line, where the handler is declared, nothing registered.
    registry = Registry()
    with pytest.raises(ConfigError, match=message):
        registry.add("k", print, **options)  # type: ignore[arg-type]
    assert "k" not in registry


def test_the_bounds_are_the_workers_and_the_enqueues() -> None:
    registry = Registry()
    handler = registry.add(
        "k",
        print,
        lease=MIN_LEASE,
        max_attempts=INT4_MAX,
        concurrency=INT4_MAX,
        key_concurrency=INT4_MAX,
    )
    assert (handler.lease, handler.max_attempts) == (MIN_LEASE, INT4_MAX)
    assert registry.add("far", print, lease=MAX_DURATION).lease == MAX_DURATION
    # A worker's lease has the same floor and ceiling as a handler's.
    assert WorkerConfig(lease=MIN_LEASE).lease == MIN_LEASE
    for lease in (MIN_LEASE - timedelta(milliseconds=1), MAX_DURATION + _DAY):
        with pytest.raises(ConfigError, match="lease"):
            WorkerConfig(lease=lease)
        with pytest.raises(ConfigError, match="lease of 'x'"):
            registry.add("x", print, lease=lease)
    # A job's max_attempts has the same ceiling at enqueue.
    assert NewJob("k", max_attempts=INT4_MAX).max_attempts == INT4_MAX
    with pytest.raises(InvalidJobError, match="max_attempts"):
        NewJob("k", max_attempts=INT4_MAX + 1)


def test_the_handlers_page_has_a_row_for_every_option() -> None:
    page = (Path(__file__).parents[2] / "docs" / "how-to" / "handlers.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|", page.split("## Handler options", 1)[1], re.MULTILINE)
    assert rows == list(_OPTIONS)
