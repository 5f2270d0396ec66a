"""Evaluation sets, metric objects in the engine, gathered predictions (one process; two ranks: tests/distributed)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.jsonl import JSONL, read_jsonl
from cadence.callbacks.metrics import TrainMetrics
from cadence.engine.evaluation import MetricError
from cadence.metrics import Accuracy, Metric
from cadence.run.config_cli import parse_cli
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

torchmetrics = pytest.importorskip("torchmetrics", reason="needs torchmetrics: pip install 'cadence[metrics]'")
from torchmetrics.classification import MulticlassConfusionMatrix, MulticlassF1Score  # noqa: E402


def make_engine(callbacks=(), seed=0, **kwargs):
    model = tiny_model(seed=seed)
    if "step_fn" not in kwargs:
        kwargs["loss_fn"] = F.cross_entropy
    kwargs.setdefault("eval_data", {"val": tiny_dataset(24, seed=seed + 10), "test": tiny_dataset(24, seed=seed + 20)})
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        tiny_dataset(64, seed=seed),
        callbacks=callbacks,
        train={"batch_size": 8},
        seed=0,
        **{"device": "cpu", **kwargs},
    )


# -- several evaluation sets ----------------------------------------------------------------------


def test_two_sets_are_logged_under_their_splits_to_jsonl_and_tensorboard_and_save_best_follows_test_f1(tmp_path):
    pytest.importorskip("tensorboard", reason="needs tensorboard: pip install 'cadence[tensorboard]'")
    from cadence.callbacks.tensorboard import TensorBoard
    from tests.callbacks.test_tensorboard import read, scalars

    best = Checkpoint(save_best=True, monitor="test.f1", mode="max", interval=0, save_on_fit_end=False)
    engine = make_engine(
        [TrainMetrics(), JSONL(), TensorBoard(), best],
        metrics={"f1": MulticlassF1Score(4, average="macro")},
        eval_every_steps=2,
        eval_every_epochs=None,
        log_interval=2,
        workspace=str(tmp_path),
    )
    engine.fit(steps=16)
    records = read_jsonl(engine.run_dir / "metrics.jsonl")
    val = {r["step"]: r["val.f1"] for r in records if r.get("split") == "val"}
    test = {r["step"]: r["test.f1"] for r in records if r.get("split") == "test"}
    assert sorted(val) == sorted(test) == list(range(2, 17, 2))  # both sets, each at every evaluation
    assert all(set(r) >= {"test.f1", "test.loss"} and "val.f1" not in r for r in records if r.get("split") == "test")
    steps = [r["step"] for r in records if r.get("split") in ("val", "test")]
    assert steps == sorted(steps)  # val then test at each step, in eval_data's order
    best_test, best_val = max(test, key=test.get), max(val, key=val.get)
    assert best_test != best_val  # the data tells the monitored split from the other
    assert best.best_step == best_test and best.best_score == test[best_test]
    assert best.store.manifest("best")["step"] == best_test
    board = read(next((engine.run_dir / "tensorboard").iterdir()))
    assert scalars(board, "test/f1") == [(step, pytest.approx(value)) for step, value in sorted(test.items())]
    assert scalars(board, "val/f1") == [(step, pytest.approx(value)) for step, value in sorted(val.items())]


def test_each_set_runs_on_its_own_schedule_from_the_config():
    evaluated = []
    engine = make_engine(
        config={"eval_every_steps": 2, "eval_every_epochs": None, "eval_sets": {"test": {"every_steps": 3}}},
    )
    engine.on(cadence.Event.ON_EVAL_END)(lambda e: evaluated.append((e.state.step, next(iter(e.logged)))))
    engine.fit(steps=6)
    assert evaluated == [(2, "val.loss"), (3, "test.loss"), (4, "val.loss"), (6, "val.loss"), (6, "test.loss")]


def four_batch_epochs(callbacks=(), lr=0.5, **kwargs):
    """An engine whose epochs are 4 steps (64 samples in batches of 16), evaluating val and test."""
    model = tiny_model()
    kwargs.setdefault("eval_data", {"val": tiny_dataset(24, seed=10), "test": tiny_dataset(24, seed=20)})
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        tiny_dataset(64),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        train={"batch_size": 16},
        seed=0,
        device="cpu",
        **kwargs,
    )


def test_a_step_that_is_both_an_evaluation_step_and_an_epoch_end_is_evaluated_once():
    """eval_every_steps=2 with 4 steps an epoch: steps 4 and 8 end epochs; each is evaluated once, not twice."""
    evaluated = []
    engine = four_batch_epochs(eval_data=tiny_dataset(24, seed=10), eval_every_steps=2, eval_every_epochs=1)
    engine.on(cadence.Event.ON_EVAL_END)(lambda e: evaluated.append(e.state.step))
    engine.fit(steps=8)
    assert engine.state.epoch == 2
    assert evaluated == [2, 4, 6, 8]


def test_a_set_not_due_at_the_step_is_still_evaluated_at_the_epoch_end():
    evaluated = []
    engine = four_batch_epochs(
        config={"eval_every_steps": 2, "eval_every_epochs": 1, "eval_sets": {"test": {"every_steps": 0}}}
    )
    engine.on(cadence.Event.ON_EVAL_END)(lambda e: evaluated.append((e.state.step, next(iter(e.logged)))))
    engine.fit(steps=4)
    assert evaluated == [(2, "val.loss"), (4, "val.loss"), (4, "test.loss")]


def test_early_stopping_counts_an_epoch_end_evaluation_step_once():
    """Patience 3 without improvement (lr 0): evaluations at steps 2 (best), 4, 6, 8: the stop comes after step 8."""
    from cadence.callbacks import EarlyStopping

    stopper = EarlyStopping(monitor="val.loss", patience=3)
    engine = four_batch_epochs([stopper], lr=0.0, eval_data=tiny_dataset(24, seed=10), eval_every_steps=2)
    engine.fit(steps=20)
    assert stopper.evaluations == 4 and engine.state.step == 8


def test_a_set_can_run_at_epoch_ends_only_and_have_its_own_loader_settings():
    evaluated = []
    engine = make_engine(
        eval_every_epochs=1,
        eval_sets={"test": {"every_epochs": 2, "data": {"batch_size": 5}}, "val": {"every_epochs": 0}},
    )
    engine.on(cadence.Event.ON_EVAL_BATCH)(lambda e: evaluated.append((e.state.epoch, len(e.batch[0]))))
    engine.fit(epochs=4)
    assert evaluated == [(2, 5)] * 4 + [(2, 4)] + [(4, 5)] * 4 + [(4, 4)]  # 24 samples in fives, test set only


def test_the_sets_schedules_are_overridable_from_the_command_line():
    config = parse_cli(cadence.EngineConfig, ["eval_sets.test.every_steps=5", "eval_sets.test.data.batch_size=3"])
    assert config.eval_sets["test"].every_steps == 5 and config.eval_sets["test"].data.batch_size == 3
    assert config.eval_sets["test"].every_epochs is None  # as eval_every_epochs


def test_evaluate_runs_every_set_or_the_one_named():
    engine = make_engine()
    every = engine.evaluate()
    assert set(every) == {"val.loss", "test.loss"} and set(engine.eval_results) == {"val", "test"}
    assert engine.evaluate(split="test") == {"test.loss": every["test.loss"]}
    assert engine.evaluate(tiny_batches(2), split="holdout").keys() == {"holdout.loss"}
    with pytest.raises(ValueError, match=r"no evaluation set 'nope': the engine has \['val', 'test'\]"):
        engine.evaluate(split="nope")


def test_one_set_given_alone_is_val_and_named_by_split_as_before():
    engine = make_engine(eval_data=tiny_batches(2))
    assert engine.eval_splits == ("val",)
    assert engine.evaluate().keys() == {"val.loss"}
    assert engine.evaluate(split="test").keys() == {"test.loss"}  # the one set, under another name


def test_bad_set_names_and_sets_missing_from_the_data_are_errors_at_construction():
    with pytest.raises(
        ValueError, match=r"config eval_sets.tset: eval_data has no split 'tset' \(it has \['test', 'val'\]\)"
    ):
        make_engine(eval_sets={"tset": {"every_steps": 2}})
    with pytest.raises(ValueError, match=r"evaluation split 'val.x': a split is a non-empty name without dots"):
        make_engine(eval_data={"val.x": tiny_batches(2)})
    with pytest.raises(ValueError, match=r"evaluation split 'train'"):
        make_engine(eval_data={"train": tiny_batches(2)})


# -- metric objects -----------------------------------------------------------------------------


def test_metric_objects_join_the_results_and_are_reset_for_every_evaluation():
    confusion = MulticlassConfusionMatrix(4)
    engine = make_engine(metrics={"accuracy": Accuracy(), "confusion": confusion, "top2": Accuracy(top_k=2)})
    first = engine.evaluate(split="val")
    assert first == engine.evaluate(split="val")  # nothing carried over
    matrix = engine.metric_values["val"]["val.confusion"]
    assert matrix.shape == (4, 4) and int(matrix.sum()) == 24  # every sample once
    assert "val.confusion" not in first  # not a number: kept, not logged
    inputs, targets = tiny_dataset(24, seed=10).tensors
    with torch.no_grad():
        predicted = engine.model(inputs).argmax(1)
    assert first["val.accuracy"] == (predicted == targets).double().mean().item()
    assert torch.equal(matrix, torch.bincount(targets * 4 + predicted, minlength=16).reshape(4, 4))
    assert first["val.accuracy"] <= first["val.top2"]


def test_eval_fn_can_hand_outputs_to_the_metrics():
    def eval_fn(model, batch):
        logits = model(batch[0])
        return {"loss": F.cross_entropy(logits, batch[1])}, logits

    engine = make_engine(eval_fn=eval_fn, metrics={"accuracy": Accuracy()})
    with_eval_fn = engine.evaluate(split="val")
    assert with_eval_fn == make_engine(metrics={"accuracy": Accuracy()}).evaluate(split="val")

    engine = make_engine(eval_fn=lambda m, b: {"loss": F.cross_entropy(m(b[0]), b[1])}, metrics=Accuracy())
    with pytest.raises(MetricError, match=r"metrics need the model's outputs while evaluating split 'val' at step 0"):
        engine.evaluate(split="val")


def test_metric_inputs_choose_what_update_receives():
    def step_fn(model, batch):
        logits = model(batch["x"])
        return {"loss": F.cross_entropy(logits, batch["y"]), "logits": logits}

    data = [{"x": x, "y": y} for x, y in tiny_batches(3)]
    engine = make_engine(
        step_fn=step_fn,
        eval_data=data,
        metrics={"accuracy": Accuracy()},
        metric_inputs=lambda outputs, batch: {"preds": outputs["logits"], "target": batch["y"]},
    )
    assert 0 <= engine.evaluate()["val.accuracy"] <= 1
    engine = make_engine(step_fn=step_fn, eval_data=data, metrics={"accuracy": Accuracy()})
    with pytest.raises(MetricError, match=r"pass metric_inputs=fn\(outputs, batch\)"):
        engine.evaluate()


class Exploding(Metric):
    def __init__(self, where):
        super().__init__()
        self.where = where
        self.add_state("count", torch.tensor(0))

    def update(self, preds, target):
        if self.where == "update":
            raise ValueError("boom in update")
        self.count += 1

    def compute(self):
        raise ZeroDivisionError("boom in compute")


@pytest.mark.parametrize("where", ["update", "compute"])
def test_a_metric_that_raises_names_itself_the_split_and_the_step(where):
    engine = make_engine(metrics={"accuracy": Accuracy(), "bad": Exploding(where)}, eval_every_epochs=None)
    engine.fit(steps=3)
    with pytest.raises(MetricError) as caught:
        engine.evaluate(split="test")
    message = str(caught.value)
    assert f"metric 'bad' (Exploding) failed in {where}() while evaluating split 'test' at step 3" in message
    assert "boom in" in message and isinstance(caught.value.__cause__, (ValueError, ZeroDivisionError))


def test_a_torchmetrics_metric_that_raises_is_named_too():
    engine = make_engine(metrics={"f1": MulticlassF1Score(3)})  # the data has 4 classes
    with pytest.raises(MetricError, match=r"metric 'f1' \(MulticlassF1Score\) failed in update\(\) while evaluating"):
        engine.evaluate(split="val")


def test_objects_that_cannot_be_synchronized_are_refused():
    class Counter:
        def update(self, *args):
            pass

        def compute(self):
            return 0

        def reset(self):
            pass

    with pytest.raises(TypeError, match=r"metrics\['c'\]: Counter is not a metric the engine can synchronize"):
        make_engine(metrics={"c": Counter()})


def test_names_clashing_with_logged_means_are_an_error():
    engine = make_engine(metrics={"loss": Accuracy()})
    with pytest.raises(ValueError, match=r"\['val.loss'\] are both metric objects and values logged"):
        engine.evaluate(split="val")


def test_a_bare_collection_keeps_its_names():
    engine = make_engine(metrics=torchmetrics.MetricCollection({"f1": MulticlassF1Score(4)}, prefix="m_"))
    assert set(engine.evaluate(split="val")) == {"val.loss", "val.m_f1"}


# -- predictions ---------------------------------------------------------------------------------


class Index(torch.utils.data.Dataset):
    def __len__(self):
        return 11

    def __getitem__(self, i):
        return (torch.tensor([float(i)]),)


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return {"double": x * self.scale, "index": x.long().squeeze(1)}


@pytest.mark.parametrize("shuffle", [False, True])
def test_predict_gathers_in_dataset_order_on_one_process(shuffle):
    engine = cadence.Engine(Twice(), seed=0, predict={"batch_size": 3, "shuffle": shuffle}, device="cpu")
    per_batch = engine.predict(Index())
    assert len(per_batch) == 4
    gathered = engine.predict(Index(), gather=True)
    assert torch.equal(gathered["index"], torch.arange(11))
    assert torch.equal(gathered["double"][:, 0], 2 * torch.arange(11, dtype=torch.float32))


def test_predict_gather_needs_tensor_outputs():
    class Words(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return "words"

    engine = cadence.Engine(Words(), seed=0, device="cpu")
    with pytest.raises(TypeError, match=r"predict\(gather=True\) joins tensor outputs .* got str"):
        engine.predict(Index(), gather=True)
