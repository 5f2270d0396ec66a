"""Contract: Event values are exactly the Callback hook names."""

from __future__ import annotations

import inspect

import pytest

import cadence
from cadence import Callback, Event

pytestmark = pytest.mark.timeout(30)


def test_every_event_value_is_a_hook_name():
    for event in Event:
        assert event.value.startswith("on_")
        assert event.value == "on_" + event.name.lower()[len("ON_") :]
        assert callable(getattr(Callback, event.value))


def test_every_hook_method_is_an_event():
    hooks = {name for name, _ in inspect.getmembers(Callback, inspect.isfunction) if name.startswith("on_")}
    assert hooks == {event.value for event in Event}


def test_required_events_exist():
    for name in ("on_step_start", "on_backward", "on_optimizer_step"):
        assert Event(name).value == name


def test_event_is_a_str_enum():
    assert Event.ON_STEP_END == "on_step_end"
    assert str(Event.ON_STEP_END) == "on_step_end"


def test_event_docstring_places_every_event_in_the_loop():
    doc = Event.__doc__
    assert doc is not None
    for event in Event:
        assert event.value in doc, f"{event.value} is not drawn in Event's docstring"


def test_public_api_is_exported():
    for name in cadence.__all__:
        assert hasattr(cadence, name)
