"""EMA: equals a hand-computed average; swapped in for evaluation and always swapped back."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import EMA
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def engine_with(ema, steps_data=8, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.3), tiny_batches(steps_data), loss_fn=F.cross_entropy,
        callbacks=[ema], seed=0, **{"device": "cpu", **kwargs},
    )  # fmt: skip


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("every", "start_step"), [(1, 0), (2, 3)])
def test_ema_equals_hand_computed_average(every, start_step):
    ema = EMA(decay=0.9, every=every, start_step=start_step, eval_with_ema=False)
    engine = engine_with(ema)
    initial = params(engine.model)
    after_step = {}
    engine.on(Event.ON_OPTIMIZER_STEP)(lambda e: after_step.__setitem__(e.state.step + 1, params(e.model)))
    engine.fit(steps=8)

    shadow = initial if start_step == 0 else None
    for step in range(1, 9):
        if step < start_step or step % every:
            continue
        if shadow is None:
            shadow = after_step[step]
            continue
        shadow = [0.9 * s + 0.1 * w for s, w in zip(shadow, after_step[step])]
    for mine, expected in zip(ema.shadow, shadow):
        torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(ema.shadow, engine.model.parameters()))


def test_evaluation_uses_the_average_and_puts_the_weights_back():
    ema = EMA(decay=0.8)
    val = tiny_batches(2, seed=7)
    engine = engine_with(ema, eval_data=val)
    engine.fit(steps=6)
    trained = params(engine.model)
    results = engine.evaluate()
    assert all(torch.equal(a, b) for a, b in zip(trained, engine.model.parameters()))

    averaged = tiny_model()
    with torch.no_grad():
        for p, s in zip(averaged.parameters(), ema.shadow):
            p.copy_(s)
    with torch.no_grad():
        expected = sum(F.cross_entropy(averaged(x), y).double() * len(x) for x, y in val) / sum(len(x) for x, _ in val)
    assert results["val.loss"] == pytest.approx(float(expected), rel=1e-6)
    raw = EMA(decay=0.8, eval_with_ema=False)
    raw_engine = engine_with(raw, eval_data=val)
    raw_engine.fit(steps=6)
    assert raw_engine.evaluate()["val.loss"] != pytest.approx(results["val.loss"], rel=1e-6)


def test_failed_evaluation_still_restores_the_trained_weights():
    ema = EMA(decay=0.8)
    engine = engine_with(ema, eval_data=tiny_batches(2, seed=7))
    engine.fit(steps=4)
    trained = params(engine.model)

    def boom(engine):
        raise RuntimeError("boom")

    engine.on(Event.ON_EVAL_BATCH)(boom)
    with pytest.raises(cadence.HookError):
        engine.evaluate()
    assert all(torch.equal(a, b) for a, b in zip(trained, engine.model.parameters()))


def test_swapped_context_and_state_round_trip_before_and_after_binding():
    ema = EMA(decay=0.5)
    engine = engine_with(ema)
    engine.fit(steps=3)
    state = ema.state_dict()
    assert set(state["shadow"]) == {n for n, _ in engine.model.named_parameters()}
    with ema.swapped(engine) as swapped:
        assert swapped and all(torch.equal(p, s) for p, s in zip(engine.model.parameters(), ema.shadow))

    unbound = EMA(decay=0.5)
    unbound.load_state_dict(state)  # before any fit: kept until the model is known
    assert unbound.state_dict()["shadow"].keys() == state["shadow"].keys()
    engine2 = engine_with(unbound)
    engine2.fit(steps=0)
    assert all(torch.equal(a, b) for a, b in zip(unbound.shadow, ema.shadow)) and unbound.updates == 3

    bound = EMA(decay=0.5)
    engine3 = engine_with(bound)
    engine3.fit(steps=1)
    bound.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(bound.shadow, ema.shadow))
    with pytest.raises(KeyError, match="missing"):
        bound.load_state_dict({**state, "shadow": {"nope": torch.zeros(1)}})


def test_fit_twice_keeps_averaging_and_config_errors():
    ema = EMA(decay=0.9, eval_with_ema=False)
    engine = engine_with(ema)
    engine.fit(steps=2)
    engine.fit(steps=2)
    assert ema.updates == 4
    assert EMA.restore_with_model is True
    with pytest.raises(cadence.ConfigError, match="decay"):
        EMA(decay=1.0)


def test_ema_round_trips_through_a_checkpoint_and_resume(tmp_path):
    from cadence.callbacks import Checkpoint

    def run(steps=None, **checkpoint):
        ema = EMA(decay=0.9, start_step=2)
        engine = engine_with(ema, steps_data=10, steps=8)
        engine.add_callback(Checkpoint(dir=str(tmp_path / "ckpt"), interval=0, **checkpoint))
        engine.fit(steps=steps)  # None: to the absolute target of 8 steps (a resumed run finishes there)
        return engine, ema

    full_engine, full = run(save_on_fit_end=False)
    run(4)
    resumed_engine, resumed = run(resume=str(tmp_path / "ckpt" / "latest"))
    assert resumed_engine.state.step == 8 and resumed.updates == full.updates == 6  # started at step 2, updated at 3..8
    for a, b in zip(resumed.shadow, full.shadow):
        assert torch.equal(a, b)
    for a, b in zip(resumed_engine.model.parameters(), full_engine.model.parameters()):
        assert torch.equal(a, b)
