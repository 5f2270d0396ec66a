"""LRScheduler: step / epoch / eval intervals against hand-written loops, monitors, skips."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import LRScheduler, NonFiniteSkip
from cadence.callbacks.scheduler import LRSchedulerConfig
from cadence.run.config import ConfigError
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def make(lr=0.5):
    model = tiny_model()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def lr_trace(engine, event=Event.ON_STEP_END):
    trace = []
    engine.on(event, order=99)(lambda e: trace.append(e.optimizers[0].param_groups[0]["lr"]))
    return trace


def hand_train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def hand_eval(model, batches):
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x), y).double() * len(x) for x, y in batches)
    return float(total / sum(len(x) for x, _ in batches))


def test_step_interval_matches_hand_loop_and_engine_registers_it():
    batches = tiny_batches(10)
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    engine = cadence.Engine(model, opt, batches, loss_fn=F.cross_entropy, scheduler=sched, seed=0, device="cpu")
    assert [type(c).__name__ for c in engine.callbacks] == ["LRScheduler", "RunRecorder"]
    trace = lr_trace(engine)
    engine.fit(epochs=1)

    ref_model, ref_opt = make()
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    expected = []
    for x, y in batches:
        hand_train_step(ref_model, ref_opt, x, y)
        ref_sched.step()
        expected.append(ref_opt.param_groups[0]["lr"])
    assert trace == expected and len(set(trace)) == 4
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_epoch_interval_matches_hand_loop():
    batches = tiny_batches(4)
    model, opt = make()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    engine = cadence.Engine(
        model,
        opt,
        batches,
        loss_fn=F.cross_entropy,
        seed=0,
        callbacks=[LRScheduler(sched, interval="epoch")],
        device="cpu",
    )
    trace = lr_trace(engine)
    engine.fit(epochs=3)

    ref_model, ref_opt = make()
    ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref_opt, gamma=0.5)
    expected = []
    for _ in range(3):
        for x, y in batches:
            hand_train_step(ref_model, ref_opt, x, y)
            expected.append(ref_opt.param_groups[0]["lr"])
        ref_sched.step()
    assert trace == expected == [0.5] * 4 + [0.25] * 4 + [0.125] * 4
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_eval_interval_reduce_on_plateau_driven_by_monitored_metric():
    batches, val = tiny_batches(4), tiny_batches(3, seed=9)
    model, opt = make(lr=2.0)  # large enough that the validation loss goes up and down
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    callback = LRScheduler(sched, interval="eval", monitor="val.loss")
    engine = cadence.Engine(
        model, opt, batches, eval_data=val, loss_fn=F.cross_entropy, seed=0, callbacks=[callback], device="cpu"
    )
    trace = lr_trace(engine, Event.ON_EPOCH_END)
    engine.fit(epochs=6)

    ref_model, ref_opt = make(lr=2.0)
    ref_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, patience=0, factor=0.5)
    expected = []
    for _ in range(6):
        for x, y in batches:
            hand_train_step(ref_model, ref_opt, x, y)
        ref_sched.step(hand_eval(ref_model, val))
        expected.append(ref_opt.param_groups[0]["lr"])
    assert trace == expected
    assert len(set(trace)) > 1, "the plateau scheduler never reduced the LR: the test proves nothing"


def test_eval_interval_ignores_evaluate_outside_fit_and_other_splits():
    model, opt = make()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    callback = LRScheduler(sched, interval="eval", monitor="val.loss")
    engine = cadence.Engine(
        model, opt, tiny_batches(2), loss_fn=F.cross_entropy, seed=0, callbacks=[callback], device="cpu"
    )
    for _ in range(4):
        engine.evaluate(tiny_batches(2, seed=4))  # outside fit
    assert sched.num_bad_epochs == 0 and sched.best == float("inf")
    engine.on(Event.ON_STEP_END)(lambda e: e.evaluate(tiny_batches(2, seed=4), split="test"))
    engine.fit(steps=2)
    assert sched.best == float("inf"), "a test-split evaluation stepped a scheduler monitoring val.loss"


def test_skipped_step_does_not_advance_unless_step_on_skip():
    def run(step_on_skip):
        model, opt = make()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        engine = cadence.Engine(
            model, opt, tiny_batches(4), loss_fn=F.cross_entropy, seed=0,
            callbacks=[NonFiniteSkip(), LRScheduler(sched, step_on_skip=step_on_skip)],
            device="cpu",
        )  # fmt: skip
        engine.on(Event.ON_FORWARD, once=2)(lambda e: setattr(e, "loss", e.loss * float("nan")))
        trace = lr_trace(engine)
        engine.fit(steps=4)
        assert engine.state.skipped_steps == 1
        return trace

    assert run(False) == [0.25, 0.25, 0.125, 0.0625]
    assert run(True) == [0.25, 0.125, 0.0625, 0.03125]


def test_user_registered_lrscheduler_replaces_the_automatic_one():
    model, opt = make()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    engine = cadence.Engine(
        model, opt, tiny_batches(2), loss_fn=F.cross_entropy, scheduler=sched, seed=0,
        callbacks=[LRScheduler(interval="epoch")],
        device="cpu",
    )  # fmt: skip
    assert [type(c).__name__ for c in engine.callbacks] == ["LRScheduler", "RunRecorder"]
    engine.fit(epochs=2)
    assert opt.param_groups[0]["lr"] == 0.125


def test_metric_scheduler_without_monitor_is_an_error_at_fit_start():
    model, opt = make()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    engine = cadence.Engine(model, opt, tiny_batches(2), loss_fn=F.cross_entropy, scheduler=sched, seed=0, device="cpu")
    with pytest.raises(cadence.HookError, match=r"monitor='val\.loss'") as info:
        engine.fit(steps=1)
    assert info.value.event is Event.ON_FIT_START and engine.state.step == 0


def test_missing_monitor_strict_raises_and_lenient_warns(caplog):
    model, opt = make()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    engine = cadence.Engine(
        model, opt, tiny_batches(2), loss_fn=F.cross_entropy, seed=0,
        callbacks=[LRScheduler(sched, interval="epoch", monitor="val.acc")],
        device="cpu",
    )  # fmt: skip
    with pytest.raises(cadence.HookError, match=r"'val\.acc' is not available"):
        engine.fit(epochs=1)
    engine = cadence.Engine(
        model, opt, tiny_batches(2), loss_fn=F.cross_entropy, seed=0,
        callbacks=[LRScheduler(sched, interval="epoch", monitor="val.acc", strict=False)],
        device="cpu",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="cadence.scheduler"):
        engine.fit(epochs=1)
    assert "not stepping" in caplog.text


def test_every_and_config_forms():
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    callback = LRScheduler(sched, config={"interval": "step", "every": 2})
    assert callback.config == LRSchedulerConfig(every=2)
    engine = cadence.Engine(
        model, opt, tiny_batches(6), loss_fn=F.cross_entropy, seed=0, callbacks=[callback], device="cpu"
    )
    engine.fit(steps=6)
    assert opt.param_groups[0]["lr"] == 0.5 * 0.5**3
    with pytest.raises(ConfigError, match="interval"):
        LRScheduler(interval="batch")
    with pytest.raises(TypeError, match="not both"):
        LRScheduler(config=LRSchedulerConfig(), every=2)


def test_explicit_scheduler_state_round_trips_in_callback_state():
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    callback = LRScheduler(sched)
    engine = cadence.Engine(
        model, opt, tiny_batches(3), loss_fn=F.cross_entropy, seed=0, callbacks=[callback], device="cpu"
    )
    engine.fit(steps=3)
    state = callback.state_dict()
    _, opt2 = make()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    restored = LRScheduler(sched2)
    restored.load_state_dict(state)
    assert sched2.state_dict() == sched.state_dict() and sched2.last_epoch == 3
    with pytest.raises(ValueError, match="1 scheduler state"):
        LRScheduler().load_state_dict(state)
    assert LRScheduler().state_dict() == {"evals": 0, "schedulers": []}


@pytest.mark.parametrize("explicit", [False, True])
def test_scheduler_state_round_trips_through_a_checkpoint_and_resume(tmp_path, explicit):
    from cadence.callbacks import Checkpoint

    def run(steps=None, **checkpoint):
        model, opt = make()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        callbacks = [Checkpoint(dir=str(tmp_path), interval=0, **checkpoint)]
        if explicit:
            callbacks.append(LRScheduler(sched))
        engine = cadence.Engine(
            model, opt, tiny_batches(10), loss_fn=F.cross_entropy, seed=0, callbacks=callbacks,
            scheduler=None if explicit else sched, steps=9,
            device="cpu",
        )  # fmt: skip
        engine.fit(steps=steps)  # None: to the absolute target of 9 steps (a resumed run finishes there)
        return engine, opt, sched

    _, full_opt, full_sched = run(save_on_fit_end=False)
    run(5)
    engine, opt, sched = run(resume=str(tmp_path / "latest"))
    assert engine.state.step == 9 and sched.last_epoch == full_sched.last_epoch == 9
    assert opt.param_groups[0]["lr"] == full_opt.param_groups[0]["lr"] == 0.5 * 0.5**4
