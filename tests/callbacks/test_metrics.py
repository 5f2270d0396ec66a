"""TrainMetrics: the built-in metrics, and MetricStore's reduction."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.backends.local import LocalBackend
from cadence.callbacks.grad_clip import GradClip
from cadence.callbacks.metrics import TrainMetrics, TrainMetricsConfig, default_callbacks, learning_rates
from cadence.engine.metrics import MetricStore
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def make_engine(callbacks, *, data=None, log_interval=3, **kwargs):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return cadence.Engine(
        model,
        optimizer,
        data if data is not None else tiny_batches(12),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        log_interval=log_interval,
        seed=0,
        **{"device": "cpu", **kwargs},
    )


def record_logs(engine):
    logs = []
    engine.on(cadence.Event.ON_LOG)(lambda e: logs.append((e.state.step, dict(e.logged))))
    return logs


class KeepLossTensors(TrainMetrics):
    """TrainMetrics as on an accelerator: the losses stay tensors until the interval."""

    def on_fit_start(self, engine):
        super().on_fit_start(engine)
        self._read_losses = False


LOSS_PATHS = pytest.mark.parametrize("metrics", [TrainMetrics, KeepLossTensors], ids=["read-on-cpu", "kept-tensors"])


@LOSS_PATHS
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("loss_mean", [False, True])
def test_the_loss_is_the_logged_steps_and_loss_mean_the_intervals(metrics, accum, loss_mean):
    """By default the logged step's loss (its micro-batches' mean); loss_mean=True: every micro-batch of the interval."""
    engine = make_engine([metrics(loss_mean=loss_mean)], grad_accum=accum)
    losses = []
    engine.on(cadence.Event.ON_FORWARD, order=99)(lambda e: losses.append(e.loss.item()))
    logs = record_logs(engine)
    engine.fit(steps=6)
    assert [step for step, _ in logs] == [3, 6]
    assert len(losses) == 6 * accum
    for (step, logged), first in zip(logs, (0, 3)):
        kept = losses[first * accum : step * accum] if loss_mean else losses[(step - 1) * accum : step * accum]
        assert logged["loss"] == pytest.approx(sum(kept) / len(kept), rel=1e-12), step
    assert set(logs[0][1]) == {"loss", "lr", "time.step", "throughput.samples_per_sec"}


STEP_EVENTS = [
    cadence.Event.ON_STEP_START,
    cadence.Event.ON_BATCH,
    cadence.Event.ON_FORWARD,
    cadence.Event.ON_BACKWARD,
    cadence.Event.ON_BEFORE_OPTIMIZER_STEP,
    cadence.Event.ON_OPTIMIZER_STEP,
    cadence.Event.ON_STEP_END,
    cadence.Event.ON_SAVE_POINT,
]


@pytest.mark.parametrize(
    ("options", "accum", "hooked"),
    [
        ({}, 1, {}),
        ({"loss_mean": True}, 1, {"on_step_end": 1}),
        ({}, 2, {"on_forward": 1}),
        ({"loss_mean": True}, 2, {"on_forward": 1}),
        ({"data_wait": True}, 1, {"on_step_start": 1, "on_step_end": 1}),
        ({"data_wait": True, "timing": False}, 1, {}),
        ({"loss": False, "loss_mean": True}, 2, {}),
    ],
)
def test_by_default_nothing_runs_per_step(options, accum, hooked):
    """The default TrainMetrics has no hook inside the step; each opt-in adds its own, for the fit only."""
    engine = make_engine([TrainMetrics(**options)], grad_accum=accum)
    during = []
    engine.on(cadence.Event.ON_FIT_END)(
        lambda e: during.append({event.value: len(e.hooks(event)) for event in STEP_EVENTS if e.hooks(event)})
    )
    engine.fit(steps=2)
    assert during == [hooked]
    assert not any(engine.hooks(event) for event in STEP_EVENTS)  # removed when the fit ended


@pytest.mark.parametrize("data_wait", [False, True])
def test_throughput_is_samples_over_step_time(data_wait):
    engine = make_engine([TrainMetrics(data_wait=data_wait)], log_interval=4)
    logs = record_logs(engine)
    engine.fit(steps=8)
    for _, logged in logs:
        assert logged["throughput.samples_per_sec"] * 4 * logged["time.step"] == pytest.approx(4 * 8, rel=1e-9)
        assert ("time.data_wait" in logged) is data_wait


def test_a_restore_inside_a_fit_starts_the_timing_window_again():
    """After on_load the interval counts the steps and samples from the restored state, not from before it."""
    engine = make_engine([TrainMetrics()], log_interval=4)

    @engine.on(cadence.Event.ON_STEP_END, order=99)
    def restore_once(e):
        if e.state.step == 2 and not restored:
            restored.append(True)
            e.state.step, e.state.samples_seen = 1, 8  # as a checkpoint of step 1 would set them
            e.fire(cadence.Event.ON_LOAD)

    restored = []
    logs = record_logs(engine)
    engine.fit(steps=4)  # steps 1, 2 (restored to 1), then 2, 3 and 4: one interval, at step 4
    assert [step for step, _ in logs] == [4]
    logged = logs[0][1]
    assert logged["throughput.samples_per_sec"] * 3 * logged["time.step"] == pytest.approx(3 * 8, rel=1e-9)


class SlowData:
    """Batches that take `delay` seconds each to arrive."""

    def __init__(self, batches, delay):
        self.batches, self.delay = batches, delay

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.delay)
            yield batch


@pytest.mark.parametrize("data_wait", [False, True])
def test_step_time_counts_the_loader_and_not_evaluation_or_long_operations(data_wait):
    def slow_eval(model, batch):
        time.sleep(0.1)
        return {"loss": F.cross_entropy(model(batch[0]), batch[1])}

    engine = make_engine(
        [TrainMetrics(data_wait=data_wait)],
        data=SlowData(tiny_batches(6), 0.03),
        eval_data=tiny_batches(1),
        eval_fn=slow_eval,
        eval_every_steps=1,
        log_interval=3,
    )

    @engine.on(cadence.Event.ON_SAVE_POINT, order=1)
    def export(e):  # as a checkpoint save: a long operation between two steps, nested ones counted once
        with e.long_operation("export"), e.long_operation("inner"):
            time.sleep(0.1)

    logs = record_logs(engine)
    engine.fit(steps=6)
    assert engine.long_operation_time >= 0.6
    train = [logged for _, logged in logs if "loss" in logged]
    assert len(train) == 2
    for logged in train:
        assert 0.03 <= logged["time.step"] < 0.09  # the sleep, not the 0.1 s evaluations and exports
        if data_wait:
            assert 0.03 <= logged["time.data_wait"] <= logged["time.step"]
            assert logged["time.step"] - logged["time.data_wait"] < 0.05  # the step itself
        else:
            assert "time.data_wait" not in logged


def test_learning_rate_per_param_group_and_optimizer():
    model = tiny_model()
    body, _, head = model.children()
    first = torch.optim.SGD(
        [{"params": body.parameters(), "lr": 0.1, "name": "body"}, {"params": head.parameters(), "lr": 0.01}]
    )
    assert learning_rates([first]) == [("lr.body", 0.1), ("lr.1", 0.01)]
    second = torch.optim.SGD(model.parameters(), lr=0.5)
    assert learning_rates([first, second]) == [("lr.opt0.body", 0.1), ("lr.opt0.1", 0.01), ("lr.opt1", 0.5)]

    engine = cadence.Engine(
        model,
        [first, second],
        tiny_batches(4),
        loss_fn=F.cross_entropy,
        callbacks=[TrainMetrics()],
        log_interval=2,
        seed=0,
        device="cpu",
    )
    logs = record_logs(engine)
    engine.fit(steps=2)
    assert {k: v for k, v in logs[0][1].items() if k.startswith("lr")} == {
        "lr.opt0.body": 0.1,
        "lr.opt0.1": 0.01,
        "lr.opt1": 0.5,
    }


def test_learning_rate_follows_the_scheduler():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine = cadence.Engine(
        model, optimizer, tiny_batches(4), loss_fn=F.cross_entropy, scheduler=scheduler,
        callbacks=[TrainMetrics()], log_interval=2, seed=0,
        device="cpu",
    )  # fmt: skip
    logs = record_logs(engine)
    engine.fit(steps=4)
    # Read after the scheduler stepped at the logged step (Order.SCHEDULER < Order.METRICS).
    assert [logged["lr"] for _, logged in logs] == [0.25, 0.0625]


def test_tokens_tflops_and_mfu_when_the_user_counts_tokens():
    def count_tokens(engine):
        engine.state.tokens_seen += 100  # e.g. 8 sequences of 12.5 tokens

    # A peak of 4e12 FLOP/s, not 1e12: there MFU would equal TFLOP/s and an ignored peak would pass.
    metrics = TrainMetrics(flops_per_token=6e6, peak_flops=4e12)
    engine = make_engine([metrics], log_interval=3)
    engine.on(cadence.Event.ON_STEP_END, order=0)(count_tokens)
    logs = record_logs(engine)
    engine.fit(steps=3)
    logged = logs[0][1]
    tokens_per_sec = logged["throughput.tokens_per_sec"]
    assert tokens_per_sec == pytest.approx(logged["throughput.samples_per_sec"] * 100 / 8, rel=1e-9)
    assert logged["throughput.tflops"] == pytest.approx(6e6 * tokens_per_sec / 1e12, rel=1e-9)
    assert logged["mfu"] == pytest.approx(logged["throughput.tflops"] * 1e12 / 4e12, rel=1e-9)
    assert logged["mfu"] == pytest.approx(6e6 * tokens_per_sec / 4e12, rel=1e-9)


def test_mfu_when_the_user_supplies_flops_per_sample():
    metrics = TrainMetrics(flops_per_sample=3e6, peak_flops=2.5e11)
    engine = make_engine([metrics], log_interval=3)  # no token count: MFU comes from the samples alone
    logs = record_logs(engine)
    engine.fit(steps=6)
    assert [step for step, _ in logs] == [3, 6]
    for _, logged in logs:
        assert "throughput.tokens_per_sec" not in logged
        samples_per_sec = logged["throughput.samples_per_sec"]
        assert logged["throughput.tflops"] == pytest.approx(3e6 * samples_per_sec / 1e12, rel=1e-9)
        assert logged["mfu"] == pytest.approx(3e6 * samples_per_sec / 2.5e11, rel=1e-9)
        assert logged["mfu"] == pytest.approx(logged["throughput.tflops"] * 1e12 / 2.5e11, rel=1e-9)


def test_no_tokens_metric_without_a_token_count():
    engine = make_engine([TrainMetrics(flops_per_sample=1e6)], log_interval=3)
    logs = record_logs(engine)
    engine.fit(steps=3)
    assert "throughput.tokens_per_sec" not in logs[0][1]
    assert "mfu" not in logs[0][1]
    assert logs[0][1]["throughput.tflops"] == pytest.approx(1e6 * logs[0][1]["throughput.samples_per_sec"] / 1e12)


def test_grad_norm_from_engine_attribute_and_no_clash_with_grad_clip():
    class SetNorm(cadence.Callback):
        def on_before_optimizer_step(self, engine):
            engine.grad_norm = torch.tensor(float(engine.state.step))

    engine = make_engine([TrainMetrics(), SetNorm()], log_interval=3)
    logs = record_logs(engine)
    engine.fit(steps=6)
    assert [logged["grad_norm"] for _, logged in logs] == [2.0, 5.0]

    engine = make_engine([TrainMetrics(), GradClip(max_norm=1e9)], log_interval=3)
    norms = []
    engine.on(cadence.Event.ON_STEP_END)(lambda e: norms.append(float(e.grad_norm)))
    logs = record_logs(engine)
    engine.fit(steps=3)
    assert logs[0][1]["grad_norm"] == pytest.approx(norms[-1])


def test_switches_turn_metrics_off():
    engine = make_engine([TrainMetrics(loss=False, learning_rate=False, throughput=False)], log_interval=3)
    logs = record_logs(engine)
    engine.fit(steps=3)
    assert set(logs[0][1]) == {"time.step"}
    engine = make_engine([TrainMetrics(loss=False, learning_rate=False, throughput=False, data_wait=True)])
    logs = record_logs(engine)
    engine.fit(steps=3)
    assert set(logs[0][1]) == {"time.step", "time.data_wait"}
    engine = make_engine([TrainMetrics(loss=False, learning_rate=False, timing=False, data_wait=True)])
    logs = record_logs(engine)
    engine.fit(steps=3)
    assert set(logs[0][1]) == {"throughput.samples_per_sec"}  # data_wait is part of timing (its hooks: above)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"peak_flops=1000000000000\.0 needs flops_per_sample or flops_per_token"):
        TrainMetrics(peak_flops=1e12)
    with pytest.raises(ValueError, match="not both"):
        TrainMetricsConfig(flops_per_sample=1.0, flops_per_token=1.0)
    with pytest.raises(cadence.ConfigError, match="flops_per_sample"):
        TrainMetrics(flops_per_sample="many")
    with pytest.raises(TypeError, match="config= or keyword arguments"):
        TrainMetrics(TrainMetricsConfig(), loss=False)
    assert TrainMetrics({"loss": False}).config.loss is False


def test_survives_fit_twice_and_default_callbacks():
    engine = make_engine([TrainMetrics()], log_interval=3)
    logs = record_logs(engine)
    engine.fit(steps=3)
    engine.fit(steps=3)
    assert [step for step, _ in logs] == [3, 6]
    assert all(math.isfinite(logged["throughput.samples_per_sec"]) for _, logged in logs)
    assert [type(c).__name__ for c in default_callbacks()] == ["TrainMetrics", "ProgressBar", "JSONL", "TextLog"]


@LOSS_PATHS
@pytest.mark.parametrize("loss_mean", [False, True])
def test_the_steps_after_the_last_interval_are_logged_when_the_fit_ends(metrics, loss_mean):
    engine = make_engine([metrics(loss_mean=loss_mean), GradClip(max_norm=1e9)], log_interval=4)
    losses, norms = [], []
    engine.on(cadence.Event.ON_STEP_END, order=99)(lambda e: (losses.append(e.loss.item()), norms.append(e.grad_norm)))
    logs = record_logs(engine)
    engine.fit(steps=6)
    assert [step for step, _ in logs] == [4, 6]
    last = logs[1][1]
    # The two steps since step 4, or the last of them.
    assert last["loss"] == pytest.approx(sum(losses[4:]) / 2 if loss_mean else losses[5], rel=1e-12)
    assert last["grad_norm"] == pytest.approx(float(norms[-1]))
    assert last["throughput.samples_per_sec"] * 2 * last["time.step"] == pytest.approx(2 * 8, rel=1e-9)
    engine.fit(steps=2)  # 7, 8: the interval at 8, nothing more at the end
    assert [step for step, _ in logs] == [4, 6, 8]
    assert logs[2][1]["loss"] == pytest.approx(sum(losses[6:]) / 2 if loss_mean else losses[7], rel=1e-12)
    assert engine.metrics._collectors == []  # both collectors removed at teardown


def test_grad_clip_logs_nothing_without_log_and_leaves_no_collector():
    engine = make_engine([GradClip(max_norm=1.0, log=False)], log_interval=2)
    engine.on(cadence.Event.ON_STEP_END)(lambda e: e.log("x", 1.0))
    logs = record_logs(engine)
    engine.fit(steps=3)
    assert [sorted(logged) for _, logged in logs] == [["x"], ["x"]]
    assert engine.metrics._collectors == []


# -- MetricStore -----------------------------------------------------------------------------


def test_store_collectors_log_right_before_a_reduction_and_can_be_removed():
    store = MetricStore()
    calls = []
    first = store.add_collector(lambda: (calls.append("first"), store.log("n", 2.0, "sum")))
    store.add_collector(lambda: calls.append("second"))
    store.log("n", 1.0, "sum")
    store.collect()
    assert calls == ["first", "second"]
    assert store.compute(LocalBackend(device="cpu")) == {"n": 3.0}
    first.remove()
    first.remove()  # removing twice is not an error
    store.collect()
    assert calls == ["first", "second", "second"] and not store
    with pytest.raises(TypeError, match="add_collector needs a callable, got float"):
        store.add_collector(1.0)


def test_store_reductions_tensors_and_numbers_exact():
    store = MetricStore()
    store.log("a", torch.tensor(1.0), weight=1.0)
    store.log("a", 0.1, weight=3.0)  # a Python float keeps float64 precision
    store.log("a", torch.tensor([2.0], dtype=torch.bfloat16), weight=2.0)
    for value in (3, torch.tensor(5, dtype=torch.int64), 4.0):
        store.log("s", value, "sum")
        store.log("mx", value, "max")
        store.log("mn", value, "min")
        store.log("l", value, "last")
    store.declare("never")
    assert "a" in store and "never" not in store and "other" not in store
    result = store.compute(LocalBackend(device="cpu"))
    assert result["a"] == (1.0 + 0.1 * 3 + 2.0 * 2) / 6
    assert (result["s"], result["mx"], result["mn"], result["l"]) == (12.0, 5.0, 3.0, 4.0)
    assert math.isnan(result["never"])
    assert not store


def test_store_one_weighted_value_on_one_rank_is_logged_as_it_is():
    store = MetricStore()
    store.log("loss", 0.1, weight=3.0)  # 0.1 * 3 / 3 is 0.10000000000000002
    store.log("zero", 2.0, weight=0.0)
    store.log("two", 0.1, weight=3.0)
    store.log("two", 0.1, weight=3.0)
    result = store.compute(LocalBackend(device="cpu"))
    assert result["loss"] == 0.1 and math.isnan(result["zero"]) and result["two"] == pytest.approx(0.1, rel=1e-15)


def test_store_errors_name_the_metric():
    store = MetricStore()
    store.log("vec", torch.ones(3))
    with pytest.raises(ValueError, match=r"metric 'vec'.*shape \(3,\)"):
        store.compute(LocalBackend(device="cpu"))
    store = MetricStore()
    store.log("text", "high")
    with pytest.raises(TypeError, match=r"metric 'text'.*str"):
        store.compute(LocalBackend(device="cpu"))
