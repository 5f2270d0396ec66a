"""Metric objects during training: every micro-batch updates them, every log interval computes and resets them."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks.metric_updates import MetricUpdates
from cadence.launch import launch
from cadence.metrics import Accuracy, Metric
from tests.conftest import tiny_dataset, tiny_model


def count_correct(engine):
    # The reference: the interval's counts, summed exactly over the ranks by the engine's own reduction.
    logits, targets = engine.outputs, engine.batch[1]
    engine.log("correct", int((logits.argmax(1) == targets).sum()), reduce="sum")
    engine.log("seen", len(targets), reduce="sum")


def make_engine(backend="local", grad_accum=1, **kwargs):
    model = tiny_model(seed=2)
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        tiny_dataset(96),
        loss_fn=F.cross_entropy,
        train_metrics={"accuracy": Accuracy()},
        backend=backend,
        seed=0,
        log_interval=3,
        grad_accum=grad_accum,
        train={"batch_size": 4},
        **kwargs,
        device="cpu",
    )
    engine.on(cadence.Event.ON_FORWARD)(count_correct)
    return engine


def logged_values(engine, steps):
    seen = []
    engine.on(cadence.Event.ON_LOG)(lambda e: seen.append((e.state.step, dict(e.logged))))
    engine.fit(steps=steps)
    return seen


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_each_interval_logs_the_accuracy_of_its_own_samples(grad_accum):
    engine = make_engine(grad_accum=grad_accum)
    assert isinstance(engine.callbacks.find(MetricUpdates), MetricUpdates)  # registered by the engine, visible
    seen = logged_values(engine, 7)
    assert [step for step, _ in seen] == [3, 6, 7]  # the fit's last, partial interval too
    for _, logged in seen:
        assert logged["accuracy"] == logged["correct"] / logged["seen"]  # reset per interval
        assert logged["seen"] == 3 * 4 * grad_accum or logged["seen"] == 4 * grad_accum
    assert engine.metric_values["train"]["accuracy"] == pytest.approx(seen[-1][1]["accuracy"])


def test_a_second_fit_starts_a_fresh_interval():
    engine = make_engine()
    logged_values(engine, 2)
    seen = logged_values(engine, 3)
    assert seen[0][0] == 3 and seen[0][1]["seen"] == 4  # step 3 only: the first fit's 2 steps were logged at its end
    assert seen[0][1]["accuracy"] == seen[0][1]["correct"] / 4


def test_a_training_metric_that_raises_names_itself_and_the_step():
    class Bad(Metric):
        def update(self, preds, target):
            raise RuntimeError("nope")

    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(32), loss_fn=F.cross_entropy,
        train_metrics={"bad": Bad()}, seed=0,
        device="cpu",
    )  # fmt: skip
    with pytest.raises(
        cadence.HookError, match=r"metric .bad. \(Bad\) failed in update\(\) while training at step 0: "
    ):
        engine.fit(steps=1)


def train_on_two_ranks():
    with make_engine("ddp") as engine:
        seen = logged_values(engine, 6)
        return int(os.environ["RANK"]), seen


@pytest.mark.timeout(120)
def test_on_two_ranks_each_interval_covers_every_ranks_samples():
    rank, seen = launch(train_on_two_ranks, nprocs=2, start_method="fork", timeout=90)
    assert rank == 0 and [step for step, _ in seen] == [3, 6]
    for _, logged in seen:
        assert logged["seen"] == 2 * 3 * 4  # both ranks' samples
        assert logged["accuracy"] == logged["correct"] / logged["seen"]
