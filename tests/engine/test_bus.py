"""The event bus: order, constraints, filters, handles, errors."""

from __future__ import annotations

import pytest
import torch

import cadence
from cadence import Callback, Event, HookError, OrderError
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def names_of(engine):
    """The test's own callbacks in their resolved order (the engine's RunRecorder left out)."""
    return [c.name for c in engine.callbacks if isinstance(c, Recorder)]


def make_engine(**kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(),
        loss_fn=torch.nn.functional.cross_entropy,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


class Recorder(Callback):
    def __init__(self, log, name, order=50, after=(), before=()):
        self.log, self.name = log, name
        self.order, self.after, self.before = order, tuple(after), tuple(before)
        self.state_key = name

    def on_step_end(self, engine):
        self.log.append(self.name)


def test_order_then_registration_order():
    log = []
    engine = make_engine(
        callbacks=[Recorder(log, "b", 60), Recorder(log, "a", 40), Recorder(log, "c", 60), Recorder(log, "z", 40)]
    )
    assert names_of(engine) == ["a", "z", "b", "c"]
    engine.fit(steps=1)
    assert log == ["a", "z", "b", "c"]


def test_after_and_before_constraints():
    log = []
    first = Recorder(log, "first", 10, after=("last",))
    last = Recorder(log, "last", 90)
    mid = Recorder(log, "mid", 50, before=("early",))
    early = Recorder(log, "early", 20)
    engine = make_engine(callbacks=[first, last, mid, early])
    names = names_of(engine)
    assert names.index("last") < names.index("first")
    assert names.index("mid") < names.index("early")
    engine.fit(steps=1)
    assert log == names


def test_constraint_cycle_is_an_error_naming_the_cycle():
    log = []
    engine = make_engine(callbacks=[Recorder(log, "a", after=("b",)), Recorder(log, "x")])
    with pytest.raises(OrderError, match=r"cycle: (a -> b -> a|b -> a -> b)"):
        engine.add_callback(Recorder(log, "b", after=("a",)))
    # The failed registration left the bus as it was.
    assert names_of(engine) == ["a", "x"]


def test_longer_cycle_names_every_member():
    log = []
    engine = make_engine(callbacks=[Recorder(log, "a", after=("c",)), Recorder(log, "b", after=("a",))])
    with pytest.raises(OrderError) as info:
        engine.add_callback(Recorder(log, "c", after=("b",)))
    assert all(name in str(info.value) for name in "abc")


def test_only_overridden_hooks_are_in_the_table():
    class OnlyStepEnd(Callback):
        def on_step_end(self, engine):
            pass

    only = OnlyStepEnd()
    engine = make_engine(callbacks=[only])
    assert [hook.__self__ for hook in engine.hooks(Event.ON_STEP_END)] == [only]
    for event in Event:
        if event is not Event.ON_STEP_END:
            assert all(getattr(hook, "__self__", None) is not only for hook in engine.hooks(event))


def test_duplicate_state_key_is_an_error_at_registration():
    class Stateful(Callback):
        def state_dict(self):
            return {}

    engine = make_engine(callbacks=[Stateful()])
    with pytest.raises(
        ValueError,
        match=r"two callbacks with state_key 'test_duplicate_state_key_is_an_error_at_registration.<locals>.Stateful'",
    ):
        engine.add_callback(Stateful())
    second = Stateful()
    second.state_key = "other"
    engine.add_callback(second)
    assert sum(isinstance(c, Stateful) for c in engine.callbacks) == 2


def test_state_key_keeps_a_callbacks_attributes_in_the_object():
    """Registering, naming and fitting never read a callback's `__dict__`.

    On CPython an instance keeps its attributes inside the object until its `__dict__` is
    read; from then on they live in a dict object and every attribute access in its hooks
    takes the slow generic path (about 3x: TrainMetrics' per-step hooks paid that).
    """
    import gc

    class Counting(Callback):
        def __init__(self):
            self.count = 0

        def on_step_end(self, engine):
            self.count += 1

    def in_a_dict(obj):
        return any(type(r) is dict for r in gc.get_referents(obj))

    untouched, control = Counting(), Counting()
    control.__dict__  # noqa: B018 - what the old state_key did
    if in_a_dict(untouched) or not in_a_dict(control):
        pytest.skip("this Python's instances do not show where their attributes live")
    default, named = Counting(), Counting()
    named.state_key = "named"
    engine = make_engine(callbacks=[default, named])
    engine.fit(steps=2)
    assert (default.state_key, named.state_key) == (
        "test_state_key_keeps_a_callbacks_attributes_in_the_object.<locals>.Counting",
        "named",
    )
    assert default.count == named.count == 2
    assert not in_a_dict(default) and not in_a_dict(named)


def test_registering_a_class_instead_of_an_instance():
    with pytest.raises(TypeError, match="an instance"):
        make_engine(callbacks=[Callback])


def test_every_once_when_filters():
    engine = make_engine()
    seen = {"every": [], "once": [], "when": [], "epoch": []}
    engine.on(Event.ON_STEP_END, every=3)(lambda e: seen["every"].append(e.state.step))
    engine.on(Event.ON_STEP_END, once=5)(lambda e: seen["once"].append(e.state.step))
    engine.on("on_step_end", when=lambda e: e.state.step in (2, 7))(lambda e: seen["when"].append(e.state.step))
    engine.on(Event.ON_EPOCH_END, every=2)(lambda e: seen["epoch"].append(e.state.epoch))
    engine.fit(steps=24)  # 12 batches per epoch: 2 epochs
    assert seen["every"] == [3, 6, 9, 12, 15, 18, 21, 24]
    assert seen["once"] == [5]
    assert seen["when"] == [2, 7]
    assert seen["epoch"] == [2]


def test_step_start_counts_the_step_in_progress():
    engine = make_engine()
    seen = []
    engine.on(Event.ON_STEP_START, every=2)(lambda e: seen.append(e.state.step))
    engine.fit(steps=5)
    assert seen == [1, 3]  # steps 2 and 4 (1-based) start when 1 and 3 are done


def test_handle_remove_unregisters():
    engine = make_engine()
    calls = []
    handle = engine.add_handler(Event.ON_STEP_END, lambda e: calls.append(e.state.step))
    engine.fit(steps=2)
    handle.remove()
    engine.fit(steps=2)
    assert calls == [1, 2]
    assert engine.hooks(Event.ON_STEP_END) == ()
    with pytest.raises(ValueError, match="not registered"):
        handle.remove()


def test_an_event_dispatches_the_same_with_one_hook_and_with_several():
    """One hook is called without the loop; registering and removing switch between the two ways."""
    engine = make_engine()
    calls = []
    first = engine.add_handler(Event.ON_STEP_END, lambda e: calls.append(("a", e.state.step)))
    engine.fit(steps=1)
    second = engine.add_handler(Event.ON_STEP_END, lambda e: calls.append(("b", e.state.step)), order=10)
    engine.fit(steps=1)
    first.remove()
    engine.fit(steps=1)
    second.remove()
    engine.fit(steps=1)
    assert calls == [("a", 1), ("b", 2), ("a", 2), ("b", 3)]


def test_the_decorator_returns_the_function_itself_so_it_can_be_called_and_registered_again():
    first, second = make_engine(device="cpu"), make_engine(device="cpu")
    seen = []

    @first.on(Event.ON_STEP_END, every=2)
    def record(engine):
        seen.append((engine is first, engine.state.step))

    assert callable(record) and record.__name__ == "record"
    second.on(Event.ON_STEP_END, once=1)(record)  # the same function on a second engine
    record(second)  # and called directly
    first.fit(steps=4)
    second.fit(steps=2)
    assert seen == [(False, 0), (True, 2), (True, 4), (False, 1)]


def test_a_decorated_function_is_removed_by_remove_handler():
    engine = make_engine(device="cpu")
    calls = []

    @engine.on(Event.ON_STEP_END)
    def count(engine):
        calls.append(engine.state.step)

    engine.on(Event.ON_EPOCH_END)(count)
    engine.fit(steps=1)
    engine.remove_handler(count, Event.ON_STEP_END)  # the step registration only
    assert engine.hooks(Event.ON_STEP_END) == () and engine.hooks(Event.ON_EPOCH_END) == (count,)
    engine.remove_handler(count)
    assert engine.hooks(Event.ON_EPOCH_END) == ()
    engine.fit(steps=1)
    assert calls == [1]
    with pytest.raises(ValueError, match=r"\.<locals>\.count' is not registered"):
        engine.remove_handler(count)


def test_a_misspelled_hook_warns_at_registration_naming_the_closest_event():
    class Typo(Callback):
        def on_stepend(self, engine):
            pass

        def on_train_start(self, engine):
            pass

    with pytest.warns(UserWarning) as caught:
        make_engine(device="cpu", callbacks=[Typo()])
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2, messages
    assert "method on_stepend() that no event calls: did you mean on_step_end?" in messages[0]
    assert "Typo' has a method on_stepend()" in messages[0]
    assert "method on_train_start() that no event calls: did you mean on_fit_start?" in messages[1]
    assert all(w.filename == __file__ for w in caught)  # points at the line that registered it


def test_hooks_spelled_right_and_non_hook_methods_do_not_warn(recwarn):
    class Fine(Callback):
        def on_step_end(self, engine):
            pass

        def helper(self):
            pass

    engine = make_engine(device="cpu", callbacks=[Fine()])
    engine.on(Event.ON_STEP_END)(lambda e: None)
    assert not [w for w in recwarn if "no event calls" in str(w.message)]


def test_bad_filter_values():
    engine = make_engine()
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        engine.on(Event.ON_STEP_END, every=0)(print)
    with pytest.raises(ValueError, match="unknown event 'on_stp_end'"):
        engine.on("on_stp_end")


def test_hook_exception_names_callback_and_event_then_exception_and_teardown_run():
    order = []

    class Boom(Callback):
        def on_backward(self, engine):
            if engine.state.step == 2:
                raise ValueError("bad gradient")

    class Watcher(Callback):
        def __init__(self, name):
            self.state_key = name

        def on_exception(self, engine):
            order.append((self.state_key, "exception", type(engine.exception).__name__))

        def on_teardown(self, engine):
            order.append((self.state_key, "teardown"))

    engine = make_engine(callbacks=[Watcher("w1"), Boom(), Watcher("w2")])
    with pytest.raises(HookError) as info:
        engine.fit(steps=5)
    message = str(info.value)
    assert "Boom" in message and "on_backward" in message and "step 2" in message and "bad gradient" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.event is Event.ON_BACKWARD
    assert order == [
        ("w1", "exception", "HookError"),
        ("w2", "exception", "HookError"),
        ("w1", "teardown"),
        ("w2", "teardown"),
    ]
    assert engine.state.step == 2
    # Gradients of the failed step were dropped: the engine can fit again.
    assert all(p.grad is None for p in engine.model.parameters())


@pytest.mark.parametrize("failing", [0, 3, 6])
def test_the_hook_that_raised_is_named_among_the_hooks_of_its_event(failing):
    calls = []

    class Step(Callback):
        def __init__(self, i):
            self.i, self.state_key = i, f"step{i}"

        def on_step_end(self, engine):
            calls.append(self.i)
            if self.i == failing:
                raise KeyError(f"hook {self.i}")

    engine = make_engine(callbacks=[Step(i) for i in range(7)])
    with pytest.raises(HookError) as info:
        engine.fit(steps=1)
    assert info.value.callback.state_key == f"step{failing}" and info.value.event is Event.ON_STEP_END
    assert f"'step{failing}'" in str(info.value) and isinstance(info.value.original, KeyError)
    assert calls == list(range(failing + 1))  # the hooks after it did not run


@pytest.mark.parametrize("when", [None, lambda engine: True])
def test_a_function_hook_that_raises_is_named_by_its_handler(when):
    def report(engine):
        raise RuntimeError("no sink")

    engine = make_engine()
    handle = engine.add_handler(Event.ON_STEP_END, report, when=when)
    # Without a filter the function itself is the hook: one call per event.
    assert engine.hooks(Event.ON_STEP_END) == ((report,) if when is None else (handle.callback.on_step_end,))
    with pytest.raises(HookError) as info:
        engine.fit(steps=1)
    assert info.value.callback is handle.callback
    assert f"'{handle.callback.state_key}'" in str(info.value) and "report" in str(info.value)
    for error in engine.bus.fire_all(Event.ON_STEP_END):  # the teardown / exception path names it too
        assert error.callback is handle.callback


def test_teardown_error_surfaces_when_nothing_else_failed():
    class BadTeardown(Callback):
        def on_teardown(self, engine):
            raise RuntimeError("cannot close")

    engine = make_engine(callbacks=[BadTeardown()])
    with pytest.raises(HookError, match="on_teardown"):
        engine.fit(steps=1)


class StaleData(cadence.CadenceError):
    """A callback's own documented error."""


@pytest.mark.parametrize("event", [Event.ON_STEP_END, Event.ON_TEARDOWN])
def test_a_documented_error_is_caught_as_itself_with_the_hook_named(event):
    class Guard(Callback):
        state_key = "guard"

    def fail(engine):
        raise StaleData("the data changed under the run")

    setattr(Guard, event.value, lambda self, engine: fail(engine))
    engine = make_engine(callbacks=[Guard()])
    with pytest.raises(StaleData) as info:  # not wrapped in HookError
        engine.fit(steps=1)
    error = info.value
    assert (error.hook_callback, error.hook_event, error.hook_step) == ("guard", event, 1)
    assert error.__notes__ == [f"raised by callback 'guard' in {event.value} at step 1"]


def test_a_checkpoint_error_from_resume_is_caught_as_checkpoint_error(tmp_path):
    from cadence.callbacks import Checkpoint
    from cadence.checkpoint.store import CheckpointError

    engine = make_engine(callbacks=[Checkpoint(resume=str(tmp_path / "nowhere"))])
    try:
        engine.fit(steps=1)
    except CheckpointError as error:  # what docs/checkpoints.md promises
        assert str(tmp_path / "nowhere") in str(error) and error.hook_callback == "Checkpoint"
    else:
        raise AssertionError("a missing resume checkpoint did not raise")
    assert engine.state.step == 0


def test_duck_typed_callbacks_work():
    class Plain:
        order = 5
        state_key = "plain"

        def __init__(self):
            self.steps = 0

        def on_step_end(self, engine):
            self.steps += 1

    plain = Plain()
    engine = make_engine(callbacks=[plain])
    engine.fit(steps=3)
    assert plain.steps == 3


def test_instrument_wraps_dispatch_and_unwraps():
    import contextlib

    entered = []

    @contextlib.contextmanager
    def trace(event):
        entered.append(event.value)
        yield

    engine = make_engine()
    calls = []
    engine.on(Event.ON_STEP_END)(lambda e: calls.append(1))
    engine.bus.instrument(trace)
    engine.fit(steps=1)
    assert "on_step_end" in entered and "on_step_start" in entered
    count = len(entered)
    engine.bus.instrument(None)
    engine.fit(steps=1)
    assert len(entered) == count
    assert calls == [1, 1]


def test_after_and_before_that_are_not_state_keys_say_nothing_about_order():
    """A callback may keep its own data under the names `before`/`after` (a tensor from before a step)."""

    class KeepsTensors(cadence.Callback):
        def on_step_start(self, engine):
            self.before = torch.ones(3)

        def on_step_end(self, engine):
            self.after = torch.zeros(3)

    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1))] * 2
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=torch.nn.functional.mse_loss,
        eval_data=data,
        callbacks=[KeepsTensors()],
        seed=0,
        device="cpu",
    )
    engine.fit(steps=2)
    engine.evaluate()  # a new run: its order checks meet the tensors
    engine.fit(steps=1)
    assert engine.state.step == 3
