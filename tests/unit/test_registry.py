"""sqlaq.registry: the handler options are declared once (HandlerOptions) and checked at
registration, unknown ones refused with one line."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest

from sqlaq import ConfigError, Registry
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
