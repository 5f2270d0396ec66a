"""State: counters and pending control requests, through state_dict and a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks import Checkpoint
from cadence.engine.state import State
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def test_pending_requests_round_trip_and_agreed_ones_are_not_pending():
    state = State(step=7)
    state.requests.register("custom")
    state.requests.request("custom", 3, reason="three")
    state.requests.request("stop", reason="enough")
    saved = state.state_dict()
    assert saved["requests"] == {"pending": {"stop": 1, "custom": 3}, "reasons": {"stop": "enough", "custom": "three"}}

    restored = State()
    restored.load_state_dict(saved)
    assert restored == state and restored.requests.any_pending
    assert restored.requests.state_dict() == saved["requests"]

    state.requests.accept(list(state.requests.pending))  # agreed: no longer pending
    assert state.state_dict()["requests"]["pending"] == {}
    restored.load_state_dict(state.state_dict())
    assert not restored.requests.any_pending and restored.requests.pending == [0, 0, 0, 0]


def test_a_state_without_requests_leaves_none_pending():
    state = State()
    state.requests.request("skip")
    state.load_state_dict({"step": 3})  # a checkpoint from before requests were saved
    assert state.step == 3 and not state.requests.any_pending


class StopAfter(cadence.Callback):
    """Raises a stop in on_step_end of `step`: it is agreed at the next step's agreement."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, engine):
        if engine.state.step == self.step:
            engine.request_stop("planned")


def run(tmp_path: Path, callbacks, **checkpoint):
    model = tiny_model()
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(12),
        loss_fn=F.cross_entropy,
        callbacks=[*callbacks, Checkpoint(dir=str(tmp_path / "ckpt"), interval=1, **checkpoint)],
        seed=0,
        workspace=str(tmp_path),
        device="cpu",
    )
    engine.fit(steps=8)
    return engine


def test_a_request_pending_at_a_save_is_agreed_after_resume_at_the_same_step(tmp_path: Path):
    uninterrupted = run(tmp_path / "a", [StopAfter(3)])
    assert uninterrupted.state.step == 4  # raised at step 3's end, agreed during step 4

    # Its checkpoint of step 3 was saved with the stop pending: a run resumed
    # from it (without the callback that raised it) stops where it would have.
    saved = tmp_path / "a" / "ckpt" / "ckpt-s000000000003"
    assert saved.is_dir()
    resumed = run(tmp_path / "b", [], resume=str(saved), save_on_fit_end=False)
    assert resumed.state.step == 4
    assert resumed.requests.reasons.get("stop") == "planned"
