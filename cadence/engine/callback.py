"""The callback base class: one no-op method per event."""

from __future__ import annotations

import difflib
import sys
import warnings
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


class Callback:
    """Base class for everything that reacts to the loop's events.

    Override the `on_<event>` methods you need; the bus calls only the ones a
    subclass overrides, so an unused hook costs nothing. Callbacks run in one
    total order: `order` (lower first), then registration order, adjusted by
    `after` / `before` constraints (tuples of `state_key`s).

    A callback that has state implements `state_dict()` / `load_state_dict()`;
    it is saved in every checkpoint under `state_key` (by default the class's
    qualified name; pass another to register two instances).

    Example:
        >>> import cadence
        >>> class CountSteps(cadence.Callback):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def on_step_end(self, engine):
        ...         self.steps += 1
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state):
        ...         self.steps = state["steps"]
    """

    #: Position in the total order; see `cadence.Order` for the built-ins'.
    order: ClassVar[int] = 50
    #: `state_key`s of callbacks this one must run after / before.
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    #: Whether this callback raises control requests (`request_skip`, ...) inside
    #: the step, in `on_batch`, `on_forward`, `on_backward` or
    #: `on_before_optimizer_step`. None (the default): it is taken to, if it
    #: overrides one of them. While no registered callback does, the step's
    #: requests are agreed overlapped with its forward and backward; one that does
    #: makes every step wait for the agreement before the optimizer step. Set False
    #: on a callback that only reads there (a gradient logger), True on one that
    #: requests there (`NonFiniteSkip`).
    requests_in_step: ClassVar[bool | None] = None
    #: Whether this callback raises control requests at all (in any hook). None
    #: (the default): it is taken to. While every registered callback declares
    #: False (and no request is pending when a fit starts), a fit on several
    #: ranks runs no agreement per step, so the step adds no collective; a
    #: request raised in such a fit is refused (`RequestTimingError`). The
    #: built-in callbacks that never request declare False; `NonFiniteSkip`,
    #: `EarlyStopping` and `Preemption` declare True.
    raises_requests: ClassVar[bool | None] = None
    # `state_key` once set; the class's None until then (a subclass need not call __init__).
    _state_key: str | None = None

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint (must be unique)."""
        key = self._state_key
        return key if key is not None else type(self).__qualname__

    @state_key.setter
    def state_key(self, value: str) -> None:
        # A plain attribute, never through `self.__dict__`: on CPython, reading an instance's
        # `__dict__` moves its attributes out of the object into a dict object for good, and
        # every attribute access in its hooks then takes the slow generic path (3x).
        self._state_key = value

    def has_state(self) -> bool:
        """Whether this callback defines its own `state_dict`."""
        return type(self).state_dict is not Callback.state_dict

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint. The default has none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(state_key={self.state_key!r}, order={self.order})"

    # One no-op per Event; their names are checked against Event in tests.
    def on_setup(self, engine: Engine) -> None: ...
    def on_load(self, engine: Engine) -> None: ...
    def on_fit_start(self, engine: Engine) -> None: ...
    def on_epoch_start(self, engine: Engine) -> None: ...
    def on_step_start(self, engine: Engine) -> None: ...
    def on_batch(self, engine: Engine) -> None: ...
    def on_forward(self, engine: Engine) -> None: ...
    def on_backward(self, engine: Engine) -> None: ...
    def on_before_optimizer_step(self, engine: Engine) -> None: ...
    def on_optimizer_step(self, engine: Engine) -> None: ...
    def on_step_end(self, engine: Engine) -> None: ...
    def on_log(self, engine: Engine) -> None: ...
    def on_save_point(self, engine: Engine) -> None: ...
    def on_epoch_end(self, engine: Engine) -> None: ...
    def on_fit_end(self, engine: Engine) -> None: ...
    def on_eval_start(self, engine: Engine) -> None: ...
    def on_eval_batch(self, engine: Engine) -> None: ...
    def on_eval_end(self, engine: Engine) -> None: ...
    def on_predict_start(self, engine: Engine) -> None: ...
    def on_predict_batch(self, engine: Engine) -> None: ...
    def on_predict_end(self, engine: Engine) -> None: ...
    def on_save(self, engine: Engine) -> None: ...
    def on_exception(self, engine: Engine) -> None: ...
    def on_teardown(self, engine: Engine) -> None: ...


def overridden_hooks(callback: object) -> list[Event]:
    """The events whose hook `callback` defines itself (not Callback's no-op)."""
    events = []
    for event in Event:
        method = getattr(type(callback), event.value, None)
        if method is None or method is getattr(Callback, event.value):
            continue
        events.append(event)
    return events


@runtime_checkable
class BestScore(Protocol):
    """The best-score protocol: a callback that tracks the best value of one metric (`Checkpoint`).

    The run record (`metadata/attempts.jsonl`, `cadence.run.rundir`) labels its
    `best` entry with these, from the first registered callback that has a
    score: any callback with the three attributes takes part.

    Attributes:
        best_score: the best value so far (None before any).
        best_metric: the metric's name as `engine.logged` holds it (`val.acc`).
        best_step: the step it was reached at (None before any).
    """

    best_score: float | None
    best_step: int | None

    @property
    def best_metric(self) -> str: ...


_EVENT_NAMES = tuple(e.value for e in Event)


def warn_misspelled_hooks(callback: object, key: str) -> None:
    """Warn about methods named like a hook (`on_...`) that no event calls: a misspelled hook is never called."""
    cls = type(callback)
    for name in dir(cls):
        if not name.startswith("on_") or name in _EVENT_NAMES or not callable(getattr(cls, name, None)):
            continue
        close = difflib.get_close_matches(name, _EVENT_NAMES, n=1)
        hint = f"did you mean {close[0]}?" if close else f"hooks are named {', '.join(_EVENT_NAMES)}"
        warnings.warn(
            f"callback {key!r} has a method {name}() that no event calls: {hint} "
            "(a hook is a method named after a cadence.Event value; rename this one if it is not meant as a hook)",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )


def _user_stacklevel() -> int:
    """The `stacklevel` of the first frame outside cadence, so a warning points at the user's line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("cadence."):
        frame, level = frame.f_back, level + 1
    return level
