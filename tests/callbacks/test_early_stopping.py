"""EarlyStopping: stops at the right epoch, agreed across ranks, and survives a resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch.nn import functional as F

import cadence
from cadence.callbacks import EarlyStopping
from cadence.launch import launch
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


def scripted_engine(scores, callbacks, **kwargs):
    """An engine whose evaluation reports `scores[epoch]` as val.score."""
    model = tiny_model()
    holder = {}

    def eval_fn(model, batch):
        return {"score": torch.tensor(scores[holder["engine"].state.epoch - 1])}  # evaluated after epoch += 1

    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(2), eval_data=tiny_batches(1),
        loss_fn=F.cross_entropy, eval_fn=eval_fn, callbacks=callbacks, seed=0, **{"device": "cpu", **kwargs},
    )  # fmt: skip
    holder["engine"] = engine
    return engine


SCORES = [5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 1.0, 0.5, 0.2, 0.1]


def test_stops_after_patience_evaluations_without_improvement():
    stopper = EarlyStopping(monitor="val.score", patience=3)
    engine = scripted_engine(SCORES, [stopper])
    engine.fit(epochs=10)
    assert engine.state.epoch == 6 and engine.state.step == 12
    assert stopper.best == 3.0 and stopper.wait == 3 and stopper.stopped_at == 12


def test_min_delta_and_mode_max():
    # In max mode the scores fall after epoch 1: patience 2 stops after epoch 3.
    stopper = EarlyStopping(monitor="val.score", mode="max", patience=2)
    assert scripted_engine(SCORES, [stopper]).fit(epochs=10) is None
    assert stopper.best == 5.0 and stopper.evaluations == 3
    # 3.0 -> 3.5 -> 3.2 -> 3.1 -> 1.0: with min_delta 2.5 only 5.0 -> 1.0 would count... after 4 waits.
    stopper = EarlyStopping(monitor="val.score", patience=4, min_delta=2.5)
    engine = scripted_engine(SCORES, [stopper])
    engine.fit(epochs=10)
    assert engine.state.epoch == 5 and stopper.best == 5.0


def test_non_finite_metric_stops_at_once_and_missing_metric_is_an_error():
    stopper = EarlyStopping(monitor="val.score", patience=5)
    engine = scripted_engine([3.0, math.nan, 1.0, 1.0], [stopper])
    engine.fit(epochs=4)
    assert engine.state.epoch == 2
    engine = scripted_engine(SCORES, [EarlyStopping(monitor="val.accuracy")])
    with pytest.raises(cadence.HookError, match=r"'val\.accuracy' is not in this evaluation's results"):
        engine.fit(epochs=1)
    lenient = EarlyStopping(monitor="val.accuracy", strict=False)
    scripted_engine(SCORES, [lenient]).fit(epochs=2)
    assert lenient.evaluations == 0


def test_evaluations_outside_fit_and_of_other_splits_do_not_count():
    stopper = EarlyStopping(monitor="val.score", patience=1)
    engine = scripted_engine([1.0] * 10, [stopper])
    for _ in range(3):
        engine.evaluate()
    assert stopper.evaluations == 0
    engine.on(cadence.Event.ON_STEP_END)(lambda e: e.evaluate(split="test"))
    engine.fit(epochs=1)
    assert stopper.evaluations == 1 and stopper.wait == 0


def test_fit_twice_continues_counting_and_state_round_trips():
    stopper = EarlyStopping(monitor="val.score", patience=3)
    engine = scripted_engine(SCORES, [stopper])
    engine.fit(epochs=4)
    state = stopper.state_dict()
    assert state == {"best": 3.0, "wait": 1, "evaluations": 4, "stopped_at": None}
    engine.fit(epochs=6)
    assert engine.state.epoch == 6
    restored = EarlyStopping(monitor="val.score", patience=3)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state


# -- two gloo ranks ---------------------------------------------------------------


def two_ranks_one_stopper(out):
    import os

    rank = int(os.environ["RANK"])
    callbacks = [EarlyStopping(monitor="val.loss", patience=1, min_delta=10.0)] if rank == 1 else []
    model = tiny_model(seed=3)
    with cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), tiny_dataset(64), eval_data=tiny_dataset(16, seed=4),
        loss_fn=F.cross_entropy, callbacks=callbacks, backend="ddp", seed=0, train={"batch_size": 8},
        device="cpu",
    ) as engine:  # fmt: skip
        engine.fit(epochs=8)
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"epoch": engine.state.epoch, "step": engine.state.step}))


def test_a_stop_from_one_ranks_callback_is_agreed_on_both(tmp_path):
    launch(two_ranks_one_stopper, str(tmp_path), nprocs=2, start_method="fork", timeout=90)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # min_delta 10: the first evaluation sets the best, the second cannot beat it: stop after epoch 2.
    assert ranks[0] == ranks[1] == {"epoch": 2, "step": 8}


def test_counters_survive_a_resume_and_stop_at_the_same_epoch(tmp_path):
    from cadence.callbacks import Checkpoint

    uninterrupted = scripted_engine(SCORES, [EarlyStopping(monitor="val.score", patience=3)], epochs=10)
    uninterrupted.fit()
    assert uninterrupted.state.epoch == 6

    first = scripted_engine(
        SCORES, [EarlyStopping(monitor="val.score", patience=3), Checkpoint(dir=str(tmp_path))], epochs=10
    )
    first.fit(epochs=4)  # best 3.0 at epoch 3, one evaluation without improvement
    stopper = EarlyStopping(monitor="val.score", patience=3)
    resumed = scripted_engine(
        SCORES, [stopper, Checkpoint(dir=str(tmp_path), resume=str(tmp_path / "latest"))], epochs=10
    )
    restored = []
    resumed.on(cadence.Event.ON_FIT_START)(lambda e: restored.append((stopper.best, stopper.wait, stopper.evaluations)))
    resumed.fit()
    assert restored == [(3.0, 1, 4)]
    assert resumed.state.epoch == 6 and resumed.state.step == uninterrupted.state.step
