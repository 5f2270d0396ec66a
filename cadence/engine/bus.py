"""The event bus: ordered callbacks, one tuple of hooks per event."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from cadence.engine.callback import Callback, overridden_hooks, warn_misspelled_hooks
from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


class CadenceError(Exception):
    """Base of Cadence's documented errors (`CheckpointError`, `NonFiniteError`, ...).

    Raised in a hook, one propagates as itself, so `except CheckpointError:`
    catches it; the callback, event and step are added as a note (shown in the
    traceback) and as `hook_callback` / `hook_event` / `hook_step`. Derive your
    own callback's errors from it to get the same.
    """

    hook_callback: str | None = None
    hook_event: Event | None = None
    hook_step: int | None = None


class HookError(RuntimeError):
    """Any other exception raised inside a callback hook, naming the callback and event.

    The original exception is `__cause__` and `.original`.
    """

    def __init__(self, callback: Any, event: Event, original: BaseException, step: int) -> None:
        self.callback = callback
        self.event = event
        self.original = original
        self.step = step
        super().__init__(
            f"callback {callback_key(callback)!r} raised {type(original).__name__} "
            f"in {event.value} at step {step}: {original}"
        )


def hook_failure(callback: Any, event: Event, error: Exception, step: int) -> Exception:
    """What an error raised in `callback`'s hook for `event` propagates as.

    A `CadenceError` as itself, with the hook added as a note (once: an error
    crossing nested events keeps the innermost hook); any other exception
    wrapped in a `HookError`.
    """
    if not isinstance(error, CadenceError):
        return HookError(callback, event, error, step)
    if error.hook_event is None:
        error.hook_callback, error.hook_event, error.hook_step = callback_key(callback), event, step
        # What BaseException.add_note (Python 3.11+) does; on 3.10 the note is kept but not printed.
        error.__notes__ = [  # type: ignore[attr-defined]
            *getattr(error, "__notes__", ()),
            f"raised by callback {callback_key(callback)!r} in {event.value} at step {step}",
        ]
    return error


class OrderError(ValueError):
    """The `after=` / `before=` constraints of the callbacks form a cycle."""


def callback_key(callback: Any) -> str:
    key = getattr(callback, "state_key", None)
    return key if isinstance(key, str) else type(callback).__qualname__


def callback_order(callback: Any) -> int:
    order = getattr(callback, "order", 50)
    if not isinstance(order, int) or isinstance(order, bool):
        raise TypeError(f"callback {callback_key(callback)!r}: order must be an int, got {order!r}")
    return order


# The engine counter that `every=` / `once=` read for each event (1-based):
# step events count steps, epoch events count epochs, the rest count calls.
_STEP_IN_PROGRESS = {
    Event.ON_STEP_START,
    Event.ON_BATCH,
    Event.ON_FORWARD,
    Event.ON_BACKWARD,
    Event.ON_BEFORE_OPTIMIZER_STEP,
    Event.ON_OPTIMIZER_STEP,
}
_STEP_DONE = {Event.ON_STEP_END, Event.ON_LOG, Event.ON_SAVE_POINT}


def _counter(event: Event) -> Callable[[Engine, FunctionHandler], int]:
    if event in _STEP_IN_PROGRESS:
        return lambda engine, handler: engine.state.step + 1
    if event in _STEP_DONE:
        return lambda engine, handler: engine.state.step
    if event is Event.ON_EPOCH_START:
        return lambda engine, handler: engine.state.epoch + 1
    if event is Event.ON_EPOCH_END:
        return lambda engine, handler: engine.state.epoch
    return lambda engine, handler: handler.calls


class FunctionHandler:
    """A plain function registered on one event with `every` / `once` / `when` filters.

    `every=N` fires when the event's counter is a multiple of N, `once=N` fires
    only when it equals N; the counter is the number of steps for step events
    (completed steps for `on_step_end` / `on_log` / `on_save_point`), the number of epochs for
    epoch events, and the number of calls otherwise. `when(engine)` must also
    be true. Without a filter the function itself is the event's hook: it
    costs one call per event, like a callback's method (`calls` then stays 0).
    """

    def __init__(
        self,
        fn: Callable[[Engine], Any],
        event: Event,
        *,
        every: int | None,
        once: int | None,
        when: Callable[[Engine], bool] | None,
        order: int,
        key: str,
    ) -> None:
        for name, value in (("every", every), ("once", once)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"engine.on({event.value}): {name} must be an int >= 1, got {value!r}")
        self.fn, self.event, self.every, self.once, self.when = fn, event, every, once, when
        self.order = order
        self.state_key = key
        # A callback's bound method speaks for that callback: its declarations
        # hold for the handler (a plain function is taken to request anywhere).
        owner = getattr(fn, "__self__", None)
        self.requests_in_step: bool | None = getattr(owner, "requests_in_step", None)
        self.raises_requests: bool | None = getattr(owner, "raises_requests", None)
        self.calls = 0
        self._count = _counter(event)
        filtered = every is not None or once is not None or when is not None
        setattr(self, event.value, self._call if filtered else fn)

    def _call(self, engine: Engine) -> None:
        self.calls += 1
        if self.every is not None or self.once is not None:
            n = self._count(engine, self)
            if self.every is not None and n % self.every:
                return
            if self.once is not None and n != self.once:
                return
        if self.when is not None and not self.when(engine):
            return
        self.fn(engine)

    def __repr__(self) -> str:
        return f"FunctionHandler({self.state_key!r}, event={self.event.value}, order={self.order})"


CallbackType = TypeVar("CallbackType")


class Callbacks(tuple):  # type: ignore[type-arg]
    """The registered callbacks in their resolved order (`engine.callbacks`): a tuple, plus `find`."""

    def find(self, kind: type[CallbackType]) -> CallbackType | None:
        """The first registered callback that is an instance of `kind` (a class or a runtime-checkable
        protocol), or None: `engine.callbacks.find(Checkpoint)`."""
        return next((callback for callback in self if isinstance(callback, kind)), None)


class Handle:
    """Returned by `engine.add_callback` and `engine.add_handler`; `remove()` unregisters.

    (`@engine.on(...)` returns the decorated function itself; `engine.remove_handler(fn)` unregisters it.)
    """

    def __init__(self, bus: EventBus, callback: Any) -> None:
        self._bus, self.callback = bus, callback

    def remove(self) -> None:
        self._bus.remove(self.callback)


class EventBus:
    """Holds callbacks in their resolved order and dispatches events.

    At each registration it rebuilds, per event, one tuple of the bound hooks
    of the callbacks that override it (`registered`); `fire(event)` calls the
    tuple of `table`, the dispatch table: the registered hooks, or while an
    instrument is set (`instrument`), one hook running them inside its context.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._entries: list[tuple[Any, int]] = []  # (callback, registration index)
        self._index = itertools.count()
        self.ordered = Callbacks()
        #: Event -> the hooks `fire(event)` calls, in order: the dispatch table.
        self.table: dict[Event, tuple[Callable[[Engine], None], ...]] = {e: () for e in Event}
        #: Event -> the registered callbacks' hooks, in order (`table` without an instrument).
        self.registered: dict[Event, tuple[Callable[[Engine], None], ...]] = dict(self.table)
        self._instrument: Callable[[Event], Any] | None = None

    # -- registration -----------------------------------------------------

    def add(self, callback: Any) -> Handle:
        if isinstance(callback, type):
            raise TypeError(
                f"register an instance, not the class {callback.__qualname__}; did you mean {callback.__qualname__}()?"
            )
        key = callback_key(callback)
        callback_order(callback)
        for existing, _ in self._entries:
            if existing is callback:
                raise ValueError(f"callback {key!r} is already registered")
            if callback_key(existing) == key:
                raise ValueError(
                    f"two callbacks with state_key {key!r}: {existing!r} and {callback!r}; "
                    f"give one another key (callback.state_key = '...') so their checkpoint states do not collide"
                )
        self._entries.append((callback, next(self._index)))
        try:
            self._rebuild()
        except Exception:
            self._entries.pop()
            self._rebuild()
            raise
        if not isinstance(callback, FunctionHandler):
            warn_misspelled_hooks(callback, key)
        return Handle(self, callback)

    def remove(self, callback: Any) -> None:
        before = len(self._entries)
        self._entries = [(c, i) for c, i in self._entries if c is not callback]
        if len(self._entries) == before:
            raise ValueError(f"callback {callback_key(callback)!r} is not registered")
        self._rebuild()

    def add_function(
        self,
        event: Event | str,
        fn: Callable[[Engine], Any],
        *,
        every: int | None = None,
        once: int | None = None,
        when: Callable[[Engine], bool] | None = None,
        order: int = 50,
    ) -> Handle:
        """Register `fn(engine)` on `event` with filters; returns its handle."""
        event = as_event(event)
        if not callable(fn):
            raise TypeError(f"engine.on({event.value}) registers a function fn(engine), got {fn!r}")
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        key = f"fn:{name}@{event.value}#{next(self._index)}"
        handler = FunctionHandler(fn, event, every=every, once=once, when=when, order=order, key=key)
        return self.add(handler)

    def remove_function(self, fn: Callable[[Engine], Any], event: Event | str | None = None) -> int:
        """Unregister every registration of `fn` (on `event` only, when given); returns how many."""
        wanted = None if event is None else as_event(event)
        handlers = [
            c
            for c in self.ordered
            if isinstance(c, FunctionHandler) and c.fn == fn and (wanted is None or c.event is wanted)
        ]
        if not handlers:
            on = "" if wanted is None else f" on {wanted.value}"
            raise ValueError(f"function {getattr(fn, '__qualname__', fn)!r} is not registered{on}")
        for handler in handlers:
            self.remove(handler)
        return len(handlers)

    def listeners(self, events: Iterable[Event]) -> list[Any]:
        """The registered callbacks (and function handlers) with a hook on any of `events`, in order."""
        wanted = set(events)
        return [
            callback
            for callback in self.ordered
            if (
                callback.event in wanted
                if isinstance(callback, FunctionHandler)
                else wanted & set(overridden_hooks(callback))
            )
        ]

    # -- order ------------------------------------------------------------

    def _rebuild(self) -> None:
        self.ordered = Callbacks(_resolve_order(self._entries))
        table: dict[Event, list[Callable[[Engine], None]]] = {e: [] for e in Event}
        for callback in self.ordered:
            if isinstance(callback, FunctionHandler):
                table[callback.event].append(getattr(callback, callback.event.value))
                continue
            for event in overridden_hooks(callback):
                table[event].append(getattr(callback, event.value))
        self.registered = {e: tuple(hooks) for e, hooks in table.items()}
        self._apply_instrument()

    def instrument(self, make_context: Callable[[Event], Any] | None) -> None:
        """Wrap every event's dispatch in `make_context(event)` (None: unwrap).

        Swapping the table costs nothing per step; the profiler uses it to put
        each event in a named `record_function` range only while it records.
        """
        self._instrument = make_context
        self._apply_instrument()

    def _apply_instrument(self) -> None:
        make = self._instrument
        if make is None:
            self.table = dict(self.registered)
        else:
            self.table = {e: (_Instrumented(self, e, hooks, make),) for e, hooks in self.registered.items()}

    # -- dispatch ---------------------------------------------------------

    def fire(self, event: Event) -> None:
        """Call `event`'s hooks in order; an error names the callback and event (`hook_failure`)."""
        hook = None
        try:
            for hook in self.table[event]:
                hook(self._engine)
        except HookError:
            raise
        except Exception as exc:
            _raise_hook_failure(self._engine, self, hook, event, exc)

    def fire_all(self, event: Event) -> list[BaseException]:
        """Call every hook even if some raise (for on_exception / on_teardown)."""
        errors: list[BaseException] = []
        for hook in self.registered[event]:
            try:
                hook(self._engine)
            except Exception as exc:
                errors.append(hook_failure(self.owner(hook, event), event, exc, self._engine.state.step))
        return errors

    def owner(self, hook: Any, event: Event) -> Any:
        """The callback `hook` belongs to: its handler for a function registered with `on`.

        Only errors ask (never the step), so a search is fine.
        """
        for callback in self.ordered:
            if isinstance(callback, FunctionHandler) and callback.event is event and callback.fn is hook:
                return callback
        return getattr(hook, "__self__", hook)


def _raise_hook_failure(engine: Engine, bus: EventBus, hook: Any, event: Any, exc: Exception) -> NoReturn:
    """Raise what `exc`, raised by `hook` on `event`, becomes (`hook_failure`): itself, or a `HookError`."""
    error = hook_failure(bus.owner(hook, event), event, exc, engine.state.step)
    if error is exc:
        raise exc
    raise error from exc


class _Instrumented:
    """One hook standing for an event's hooks, run inside a context."""

    def __init__(self, bus: EventBus, event: Event, hooks: tuple[Any, ...], make: Callable[[Event], Any]) -> None:
        self.bus, self.event, self.hooks, self.make = bus, event, hooks, make

    def __call__(self, engine: Engine) -> None:
        hook = None
        with self.make(self.event):
            try:
                for hook in self.hooks:
                    hook(engine)
            except HookError:
                raise
            except Exception as exc:
                _raise_hook_failure(engine, self.bus, hook, self.event, exc)


def as_event(event: Event | str) -> Event:
    """`event` as an `Event`; an unknown name is a ValueError listing the events."""
    try:
        return Event(event)
    except ValueError:
        names = ", ".join(e.value for e in Event)
        raise ValueError(f"unknown event {event!r}; events are: {names}") from None


def order_constraints(callback: Any, attribute: str) -> tuple[str, ...]:
    """The `state_key`s in a callback's `after` or `before` (`Callback.after`/`.before`).

    Only a string or a tuple/list/set of strings counts: a plain callback
    object may use the same attribute name for its own data (a tensor kept
    from before a step), which says nothing about order.
    """
    value = getattr(callback, attribute, ())
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list, set, frozenset)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return ()


def _resolve_order(entries: list[tuple[Any, int]]) -> list[Any]:
    """Topological order of the after/before constraints, ties by (order, registration)."""
    by_key = {callback_key(c): (c, i) for c, i in entries}
    edges: dict[str, set[str]] = {k: set() for k in by_key}  # key -> keys that must come later
    for key, (callback, _) in by_key.items():
        for other in order_constraints(callback, "after"):
            if other in by_key:
                edges[other].add(key)
        for other in order_constraints(callback, "before"):
            if other in by_key:
                edges[key].add(other)
    indegree = {k: 0 for k in by_key}
    for targets in edges.values():
        for t in targets:
            indegree[t] += 1

    def rank(key: str) -> tuple[int, int, str]:
        callback, index = by_key[key]
        return (callback_order(callback), index, key)

    ready = [rank(k) for k, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    result: list[Any] = []
    while ready:
        _, _, key = heapq.heappop(ready)
        result.append(by_key[key][0])
        for t in edges[key]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, rank(t))
    if len(result) < len(by_key):
        remaining = {k for k, d in indegree.items() if d > 0}
        raise OrderError(f"callback order constraints form a cycle: {' -> '.join(_find_cycle(edges, remaining))}")
    return result


def _find_cycle(edges: dict[str, set[str]], nodes: set[str]) -> list[str]:
    # Every node left over by Kahn's algorithm has a predecessor that is left
    # over too, so walking predecessors must come back to a node seen before.
    preds = {n: sorted(k for k in nodes if n in edges[k]) for n in nodes}
    node = min(nodes)
    seen: dict[str, int] = {}
    path: list[str] = []
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = preds[node][0]
    cycle = path[seen[node] :]
    cycle.reverse()
    return [*cycle, cycle[0]]


__all__ = ["CadenceError", "Callback", "Callbacks", "EventBus", "FunctionHandler", "Handle", "HookError", "OrderError"]
