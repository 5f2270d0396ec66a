"""GradClip: equals torch.nn.utils.clip_grad_norm_, records and logs the pre-clip norm."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.callbacks import GradClip
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


class GradCopy(cadence.Callback):
    def __init__(self, order):
        self.order = order
        self.state_key = f"GradCopy@{order}"
        self.grads = []

    def on_before_optimizer_step(self, engine):
        self.grads.append([p.grad.detach().clone() for p in engine.model.parameters()])


def engine_with(clip, *extra, **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.5), tiny_batches(6), loss_fn=F.cross_entropy,
        callbacks=[clip, *extra], seed=0, **{"device": "cpu", **kwargs},
    )  # fmt: skip


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_equals_torch_clip_grad_norm(norm_type):
    before, after = GradCopy(order=15), GradCopy(order=25)
    clip = GradClip(max_norm=0.05, norm_type=norm_type)
    engine = engine_with(clip, before, after)
    norms = []
    engine.on(Event.ON_BEFORE_OPTIMIZER_STEP, order=30)(lambda e: norms.append(e.grad_norm.clone()))
    engine.fit(steps=6)
    reference_model = tiny_model()
    for raw, clipped, norm in zip(before.grads, after.grads, norms):
        for p, g in zip(reference_model.parameters(), raw):
            p.grad = g.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.05, norm_type=norm_type)
        assert torch.equal(norm, expected_norm) and norm > 0.05  # clipping was active
        for p, g in zip(reference_model.parameters(), clipped):
            assert torch.equal(p.grad, g)
        assert not all(torch.equal(a, b) for a, b in zip(raw, clipped))


def test_pre_clip_norm_is_logged_once_per_log_interval():
    engine = engine_with(GradClip(max_norm=0.05), log_interval=3)
    norms, logged = {}, {}
    engine.on(Event.ON_BEFORE_OPTIMIZER_STEP, order=30)(
        lambda e: norms.__setitem__(e.state.step + 1, float(e.grad_norm))
    )
    engine.on(Event.ON_LOG)(lambda e: logged.__setitem__(e.state.step, e.logged.get("grad_norm")))
    engine.fit(steps=6)
    assert set(logged) == {3, 6}
    assert logged[3] == pytest.approx(norms[3], rel=1e-6) and logged[6] == pytest.approx(norms[6], rel=1e-6)
    assert norms[3] != norms[2]  # the logged value is that step's norm, not an average


def test_config_validation_and_no_log():
    with pytest.raises(cadence.ConfigError, match="max_norm"):
        GradClip(max_norm=0.0)
    with pytest.raises(cadence.ConfigError, match="max_norm"):
        GradClip()
    assert GradClip(max_norm=1.0, norm_type="inf").config.norm_type == math.inf
    engine = engine_with(GradClip(max_norm=1.0, log=False), log_interval=1)
    engine.on(Event.ON_FORWARD)(lambda e: e.log("loss", e.loss.detach()))
    engine.fit(steps=2)
    assert "grad_norm" not in engine.logged and "loss" in engine.logged
