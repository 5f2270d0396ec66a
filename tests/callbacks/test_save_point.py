"""The save point: a checkpoint holds what the step's evaluation changed (best, plateau LR, early stopping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cadence
from cadence.callbacks import EarlyStopping, LRScheduler
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint.file_store import FileStore
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(90)

#: Evaluation scores by step (lower is better): step 4 is the best the run ever sees.
SCORES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5, 10: 2.2, 12: 2.4, 14: 0.5, 16: 0.4}


class Recorder(cadence.Callback):
    """Every micro-batch's loss, and the learning rate after each step."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.lrs: list[float] = []

    def on_forward(self, engine: cadence.Engine) -> None:
        self.losses.append(engine.loss.detach().clone())

    def on_step_end(self, engine: cadence.Engine) -> None:
        self.lrs.append(engine.optimizers[0].param_groups[0]["lr"])


class Saves(cadence.Callback):
    """The names and step of every committed save."""

    def __init__(self) -> None:
        self.saves: list[tuple[tuple[str, ...], int]] = []

    def on_save(self, engine: cadence.Engine) -> None:
        ckpt = next(c for c in engine.callbacks if isinstance(c, Checkpoint))
        self.saves.append((ckpt.last_saved.names, ckpt.last_saved.step))


def build(
    directory: Path, *, resume: str | None = None, plateau: bool = False, epochs: bool = False, **checkpoint: Any
):
    """A seeded run evaluated every 2 steps (`epochs`: every epoch of 3 steps), whose score is SCORES[step]."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    holder: dict[str, cadence.Engine] = {}

    def eval_fn(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        step = holder["engine"].state.step
        return {"loss": torch.tensor(SCORES[step])}

    recorder = Recorder()
    callbacks: list[Any] = [recorder]
    if plateau:
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        callbacks += [
            LRScheduler(scheduler, interval="eval", monitor="val.loss"),
            EarlyStopping(monitor="val.loss", patience=3),
        ]
    options = {"dir": str(directory), "interval": 1 if epochs else 2, "save_best": True, "keep_latest_k": 0}
    options.update(checkpoint)
    if resume is not None:
        options["resume"] = str(directory / resume)
    events = Saves()
    if epochs:  # 3 steps of 2 micro-batches per epoch; evaluated at steps 3, 6, ... (SCORES[2 * epoch])
        budget: dict[str, Any] = {"epochs": 8, "eval_every_epochs": 1, "grad_accum": 2}
        eval_fn = _by_epoch(holder)
        data = tiny_dataset(48)
    else:
        budget = {"steps": 16, "eval_every_steps": 2, "eval_every_epochs": None}
        data = tiny_dataset()
    engine = cadence.Engine(
        model, optimizer, data, eval_data=tiny_dataset(16, seed=5), eval_fn=eval_fn,
        loss_fn=torch.nn.functional.cross_entropy, callbacks=[*callbacks, events, Checkpoint(**options)],
        seed=0, log_interval=1000, train=cadence.DataConfig(batch_size=8), **{"device": "cpu", **budget},
    )  # fmt: skip
    holder["engine"] = engine
    return engine, recorder, events


def _by_epoch(holder: dict[str, cadence.Engine]) -> Any:
    def eval_fn(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        return {"loss": torch.tensor(SCORES[2 * holder["engine"].state.epoch])}

    return eval_fn


def params(engine: cadence.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_a_checkpoint_at_an_evaluation_step_holds_that_evaluation(tmp_path: Path) -> None:
    engine, _, _ = build(tmp_path)
    engine.fit(steps=4)
    ckpt = next(c for c in engine.callbacks if isinstance(c, Checkpoint))
    assert (ckpt.best_score, ckpt.best_step) == (1.0, 4)
    saved = FileStore(tmp_path).read("ckpt-s000000000004")["callbacks"]["Checkpoint"]
    assert saved == {"best_score": 1.0, "best_step": 4}, "the step-4 checkpoint missed the step-4 evaluation"


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_best_never_holds_a_worse_score_than_the_best_seen(tmp_path: Path, async_mode: str) -> None:
    engine, _, _ = build(tmp_path, async_mode=async_mode)
    engine.fit(steps=4)
    at_best = params(engine)
    engine.close()
    engine, _, events = build(tmp_path, resume="ckpt-s000000000004", async_mode=async_mode)
    engine.fit(steps=4)  # evaluations at steps 6 (2.0) and 8 (2.5): no improvement on 1.0
    store = FileStore(tmp_path)
    best = store.read("best")
    assert best["meta"]["step"] == 4 and best["callbacks"]["Checkpoint"]["best_score"] == 1.0
    for name, value in at_best.items():
        assert torch.equal(best["model"][name], value), name
    assert events.saves and not any("best" in names for names, _ in events.saves), "best saved with a worse score"


def test_resume_with_step_evaluation_plateau_scheduler_and_early_stopping_is_bitwise(tmp_path: Path) -> None:
    reference, ref_recorder, _ = build(tmp_path / "reference", plateau=True)
    reference.fit()
    stopper = next(c for c in reference.callbacks if isinstance(c, EarlyStopping))
    # Scores 3, 1, 2, 2.5, 2.2, ...: the LR halves at steps 6, 8, 10; patience 3 stops at step 10's
    # evaluation, agreed at step 11.
    assert stopper.stopped_at == 10 and reference.state.step == 11
    assert ref_recorder.lrs[-1] == pytest.approx(0.1 / 8)

    first, recorder, _ = build(tmp_path / "run", plateau=True)
    first.fit(steps=4)
    first.close()
    resumed, resumed_recorder, _ = build(tmp_path / "run", plateau=True, resume="ckpt-s000000000004")
    resumed.fit()
    assert resumed.state.step == reference.state.step
    assert recorder.lrs + resumed_recorder.lrs == ref_recorder.lrs
    losses = recorder.losses + resumed_recorder.losses
    assert len(losses) == len(ref_recorder.losses)
    for i, (a, b) in enumerate(zip(losses, ref_recorder.losses)):
        assert torch.equal(a, b), f"micro-batch {i}: {a.item()!r} != uninterrupted {b.item()!r}"
    for name, value in params(reference).items():
        assert torch.equal(params(resumed)[name], value), name
    assert FileStore(tmp_path / "run").read("best")["meta"]["step"] == 4


def test_epoch_mode_resume_with_plateau_scheduler_and_early_stopping_is_bitwise(tmp_path: Path) -> None:
    reference, ref_recorder, ref_saves = build(tmp_path / "reference", plateau=True, epochs=True)
    reference.fit()
    stopper = next(c for c in reference.callbacks if isinstance(c, EarlyStopping))
    # Epoch scores 3, 1, 2, 2.5, 2.2: patience 3 stops at epoch 5's evaluation, before another epoch starts.
    assert (stopper.stopped_at, reference.state.epoch, reference.state.step) == (15, 5, 15)
    assert reference.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / 8)
    assert [step for names, step in ref_saves.saves if "best" in names] == [3, 6]

    first, recorder, _ = build(tmp_path / "run", plateau=True, epochs=True)
    first.fit(epochs=2)
    first.close()
    resumed, resumed_recorder, _ = build(tmp_path / "run", plateau=True, epochs=True, resume="ckpt-e000002")
    resumed.fit()
    assert (resumed.state.epoch, resumed.state.step) == (5, 15)
    assert recorder.lrs + resumed_recorder.lrs == ref_recorder.lrs
    assert resumed.optimizers[0].param_groups[0]["lr"] == reference.optimizers[0].param_groups[0]["lr"]
    losses = recorder.losses + resumed_recorder.losses
    assert len(losses) == len(ref_recorder.losses)
    for i, (a, b) in enumerate(zip(losses, ref_recorder.losses)):
        assert torch.equal(a, b), f"micro-batch {i}: {a.item()!r} != uninterrupted {b.item()!r}"
    for name, value in params(reference).items():
        assert torch.equal(params(resumed)[name], value), name
    assert FileStore(tmp_path / "run").read("best")["meta"]["step"] == 6


def test_a_save_requested_at_epoch_end_is_taken_at_that_epochs_save_point(tmp_path: Path) -> None:
    engine, _, saves = build(tmp_path, epochs=True, interval=0, save_best=False, save_on_fit_end=False)
    engine.on(cadence.Event.ON_EPOCH_END, once=1)(lambda e: e.request_save("test"))
    engine.fit(epochs=2)
    assert saves.saves == [(("latest",), 3)]
    assert FileStore(tmp_path).read("latest")["engine"]["epoch"] == 1
