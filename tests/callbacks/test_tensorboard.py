"""TensorBoard: event files read back with EventAccumulator; hparams once; resume without duplicates."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.nn import functional as F

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.metrics import TrainMetrics
from cadence.callbacks.tensorboard import TensorBoard, tag
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(90)


@attrs.define
class RunConfig:
    lr: float = 0.1
    layers: list[int] = attrs.field(factory=lambda: [16, 4])
    engine: cadence.EngineConfig = attrs.field(factory=cadence.EngineConfig)


def make_engine(callbacks, **kwargs):
    model = tiny_model()
    kwargs.setdefault("log_interval", 2)
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_dataset(96),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        train={"batch_size": 8},
        **{"device": "cpu", **kwargs},
    )


def read(log_dir):
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator, name):
    return [(event.step, event.value) for event in accumulator.Scalars(name)]


def test_scalars_hold_exactly_the_logged_values_at_the_logged_steps(tmp_path):
    board = TensorBoard()
    engine = make_engine(
        [TrainMetrics(), board], eval_data=tiny_batches(2), eval_every_steps=3, workspace=str(tmp_path),
        run_config=RunConfig(),
    )  # fmt: skip
    logged = []
    engine.on(cadence.Event.ON_LOG)(lambda e: logged.append((e.state.step, dict(e.logged))))
    engine.fit(steps=6)
    assert board.writer is None  # closed (and flushed) at teardown
    assert board.log_dir is not None and board.log_dir.parent == engine.run_dir / "tensorboard"

    accumulator = read(board.log_dir)
    names = {name for _, values in logged for name in values}
    assert set(accumulator.Tags()["scalars"]) == {tag(name) for name in names}
    assert "val/loss" in accumulator.Tags()["scalars"] and "time/step" in accumulator.Tags()["scalars"]
    for name in names:
        expected = [(step, np.float32(values[name])) for step, values in logged if name in values]
        assert scalars(accumulator, tag(name)) == expected
    assert [step for step, _ in scalars(accumulator, "loss")] == [2, 4, 6]
    assert [step for step, _ in scalars(accumulator, "val/loss")] == [3, 6]


def hparams_on_disk(log_dir):
    """Every hparams summary in the folder's event files, as (kind, step, data), in write order.

    Read event by event: `EventAccumulator.PluginTagToContent` keeps one entry
    per tag, so it cannot tell one record from two.
    """
    records = []
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):  # named by creation time
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    records.append((data.WhichOneof("data"), event.step, data))
    return records


ONE_SESSION = ["experiment", "session_start_info", "session_end_info"]


def test_hyperparameters_recorded_once_from_the_run_config(tmp_path):
    board = TensorBoard(log_dir=str(tmp_path / "tb"))
    engine = make_engine([TrainMetrics(), board], run_config=RunConfig(lr=0.3))
    engine.fit(steps=2)
    engine.fit(steps=2)  # a second fit reopens the writer: no second record
    records = hparams_on_disk(tmp_path / "tb")
    assert [kind for kind, _, _ in records] == ONE_SESSION
    assert {step for _, step, _ in records} == {2}  # at the first log
    hparams = records[1][2].session_start_info.hparams
    assert hparams["lr"].number_value == 0.3
    assert hparams["layers"].string_value == "[16, 4]"
    assert hparams["engine.log_interval"].number_value == 50
    accumulator = read(tmp_path / "tb")
    assert "config" in {t.partition("/")[0] for t in accumulator.Tags()["tensors"]}
    assert [step for step, _ in scalars(accumulator, "loss")] == [2, 4]


@pytest.mark.parametrize(
    ("checkpoint_every", "log_interval"),
    [(4, 2), (3, 4)],
    ids=["checkpoint-after-the-first-log", "checkpoint-before-the-first-log"],
)
def test_hyperparameters_recorded_once_across_a_stop_and_resume(tmp_path, checkpoint_every, log_interval):
    ckpt = str(tmp_path / "ckpt")

    def run(callbacks, **kwargs):
        return make_engine(
            [TrainMetrics(), *callbacks], workspace=str(tmp_path), run_id="r", run_config=RunConfig(lr=0.3),
            log_interval=log_interval, **kwargs,
        )  # fmt: skip

    first_board = TensorBoard()
    first = run([first_board, Checkpoint(dir=ckpt, interval=checkpoint_every, unit="step", save_on_fit_end=False)])
    first.fit(steps=5)  # stopped after its checkpoint, having written the hparams at its first log
    assert first_board._hparams_written

    second_board = TensorBoard()
    second = run([second_board, Checkpoint(dir=ckpt, auto_resume=True)], steps=8)
    second.fit()
    assert second_board.log_dir == first_board.log_dir
    assert second_board._hparams_written  # and stays so in its checkpoints

    records = hparams_on_disk(first_board.log_dir)
    assert [kind for kind, _, _ in records] == ONE_SESSION  # the resumed writer added no session
    assert records[1][2].session_start_info.hparams["lr"].number_value == 0.3
    # The stopped run's logs after the checkpoint are purged; the resumed run's continue the same folder.
    steps = [2, 4, 6, 8] if log_interval == 2 else [4, 8]
    assert [step for step, _ in scalars(read(first_board.log_dir), "loss")] == steps


def test_after_stop_and_resume_steps_strictly_increase_without_duplicates(tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def run(attempt, callbacks, **kwargs):
        engine = make_engine([TrainMetrics(), *callbacks], workspace=str(tmp_path), run_id="r", **kwargs)
        engine.on(cadence.Event.ON_STEP_END)(lambda e: e.log("attempt", attempt, "last"))
        return engine

    first_board = TensorBoard()
    first = run(1, [first_board, Checkpoint(dir=ckpt, interval=4, unit="step", save_on_fit_end=False)])
    first.fit(steps=10)  # saved at 8, logged up to 10: steps 9-10 never happened for the resumed run

    second_board = TensorBoard()
    second = run(2, [second_board, Checkpoint(dir=ckpt, auto_resume=True)], steps=14)
    second.fit()
    assert second_board.log_dir == first_board.log_dir  # the same TensorBoard run continues

    accumulator = read(first_board.log_dir)
    for name in accumulator.Tags()["scalars"]:
        steps = [step for step, _ in scalars(accumulator, name)]
        assert steps == sorted(set(steps)), f"{name}: {steps}"
    assert scalars(accumulator, "attempt") == [(2, 1), (4, 1), (6, 1), (8, 1), (10, 2), (12, 2), (14, 2)]
