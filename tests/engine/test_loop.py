"""The loop: exact event sequences, modes, accumulation, requests, evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Callback, Event
from cadence.engine.agreement import may_request as may_request_at_all
from cadence.engine.agreement import requests_in_step
from tests.conftest import tiny_batches, tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(60)


class Recorder(Callback):
    def __init__(self):
        self.events = []


for _event in Event:
    setattr(Recorder, _event.value, (lambda name: lambda self, engine: self.events.append(name))(_event.value))


def engine_with(recorder=None, batches=4, **kwargs):
    model = tiny_model()
    kwargs.setdefault("loss_fn", F.cross_entropy)
    return cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(batches),
        callbacks=[recorder] if recorder else [],
        seed=0,
        **{"device": "cpu", **kwargs},
    )


def step_events(micro_batches):
    return (
        ["on_step_start"]
        + ["on_batch", "on_forward", "on_backward"] * micro_batches
        + ["on_before_optimizer_step", "on_optimizer_step", "on_step_end", "on_save_point"]
    )


def test_exact_event_sequence_two_epochs_accumulation_and_evaluation():
    recorder = Recorder()
    engine = engine_with(recorder, batches=4, grad_accum=2, eval_data=tiny_batches(2, seed=5))
    engine.fit(epochs=2)
    evaluation = ["on_eval_start", "on_eval_batch", "on_eval_batch", "on_log", "on_eval_end"]
    epoch = ["on_epoch_start", *step_events(2), *step_events(2), *evaluation, "on_epoch_end", "on_save_point"]
    assert recorder.events == ["on_setup", "on_fit_start", *epoch, *epoch, "on_fit_end", "on_teardown"]
    assert engine.state.step == 4 and engine.state.epoch == 2 and engine.state.micro_step == 8


def test_partial_accumulation_group_at_epoch_end_uses_what_is_left():
    recorder = Recorder()
    engine = engine_with(recorder, batches=5, grad_accum=2)
    engine.fit(epochs=1)
    assert engine.state.step == 3 and engine.state.micro_step == 5
    assert recorder.events.count("on_batch") == 5


def test_step_mode_crosses_epochs_and_completes_an_epoch_on_its_last_batch():
    recorder = Recorder()
    engine = engine_with(recorder, batches=4)
    engine.fit(steps=6)
    assert engine.state.step == 6 and engine.state.epoch == 1 and engine.state.batch_in_epoch == 2
    engine.fit(steps=2)
    assert engine.state.epoch == 2 and engine.state.batch_in_epoch == 0
    assert recorder.events.count("on_epoch_end") == 2


def test_config_targets_are_absolute():
    engine = engine_with(steps=5)
    engine.fit()
    assert engine.state.step == 5
    engine.fit()  # already there
    assert engine.state.step == 5
    with pytest.raises(ValueError, match="nothing to fit"):
        engine_with().fit()


@pytest.mark.parametrize(
    ("config", "fit", "step", "epoch"),
    [
        ({"steps": 10, "epochs": 2}, {}, 8, 2),  # 4 steps an epoch: the epochs bound comes first
        ({"steps": 6, "epochs": 2}, {}, 6, 1),  # the steps bound comes first, mid-epoch
        ({}, {"steps": 10, "epochs": 1}, 4, 1),
        ({}, {"steps": 3, "epochs": 1}, 3, 0),
    ],
)
def test_steps_and_epochs_together_stop_at_whichever_bound_comes_first(config, fit, step, epoch):
    engine = engine_with(batches=4, device="cpu", **config)
    engine.fit(**fit)
    assert (engine.state.step, engine.state.epoch) == (step, epoch)


def test_step_fn_and_model_returning_loss():
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = tiny_model()

        def forward(self, batch):
            x, y = batch
            return {"loss": F.cross_entropy(self.net(x), y)}

    model = WithLoss()
    engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(), seed=0, device="cpu")
    engine.fit(steps=3)
    assert engine.state.step == 3 and isinstance(engine.outputs, dict)

    model = tiny_model()
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(),
        step_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        seed=0,
        device="cpu",
    )
    engine.fit(steps=3)
    assert engine.state.step == 3


def test_the_last_outputs_are_released_before_the_next_forward():
    """A forward never runs beside the previous one's outputs (a language model's logits).

    They stay readable through the step and after the fit, as `engine.loss` does.
    """
    import weakref

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = tiny_model()
            self.previous = None
            self.alive_at_forward = []

        def forward(self, x):
            if self.previous is not None:
                self.alive_at_forward.append(self.previous() is not None)
            out = self.net(x)
            self.previous = weakref.ref(out)
            return out

    model = Probe()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(), loss_fn=F.cross_entropy, device="cpu"
    )
    at_step_end = []
    engine.on(Event.ON_STEP_END)(lambda e: at_step_end.append(e.outputs is model.previous()))
    engine.fit(steps=3)
    engine.fit(steps=1)  # the next fit's first forward too
    assert model.alive_at_forward == [False] * 3
    assert at_step_end == [True] * 4
    assert engine.outputs is model.previous() and isinstance(engine.loss, torch.Tensor)


def test_bad_model_output_and_batches_are_named():
    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(4, 8)], seed=0, device="cpu"
    )
    with pytest.raises(TypeError, match=r"the model must return the loss as a scalar tensor.*shape \(4, 4\)"):
        engine.fit(steps=1)
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [torch.randn(4, 8)],
        loss_fn=F.cross_entropy,
        seed=0,
        device="cpu",
    )
    with pytest.raises(TypeError, match=r"loss_fn expects batches of \(inputs, targets\)"):
        engine.fit(steps=1)
    with pytest.raises(TypeError, match="train_data must be a torch Dataset, a DataLoader or an iterable"):
        cadence.Engine(model, None, 42, device="cpu")
    with pytest.raises(ValueError, match="train_data is empty"):
        cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), [], loss_fn=F.cross_entropy, device="cpu")


def test_skip_request_leaves_parameters_unchanged_and_is_counted():
    engine = engine_with()
    engine.on(Event.ON_BEFORE_OPTIMIZER_STEP, when=lambda e: e.state.step == 1)(lambda e: e.request_skip("test"))
    before = {}
    engine.on(Event.ON_STEP_START, once=2)(
        lambda e: before.update({k: v.clone() for k, v in e.model.state_dict().items()})
    )
    taken = []
    engine.on(Event.ON_OPTIMIZER_STEP)(lambda e: taken.append(e.state.step))
    after = {}
    engine.on(Event.ON_STEP_END, once=2)(
        lambda e: after.update({k: v.clone() for k, v in e.model.state_dict().items()})
    )
    engine.fit(steps=4)
    assert taken == [0, 2, 3]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.state.skipped_steps == 1 and engine.state.consecutive_skips == 0
    assert all(p.grad is None for p in engine.model.parameters())


def test_stop_request_ends_fit_after_that_step():
    engine = engine_with(batches=10)
    engine.on(Event.ON_STEP_START, once=3)(lambda e: e.request_stop("enough"))
    engine.fit(epochs=5)
    assert engine.state.step == 3
    # The stop was for that fit: the next one trains again.
    engine.fit(steps=2)
    assert engine.state.step == 5


def test_stop_requested_at_epoch_end_is_agreed_before_the_next_epoch():
    engine = engine_with(batches=3)
    engine.on(Event.ON_EPOCH_END, once=1)(lambda e: e.request_stop())
    engine.fit(epochs=4)
    assert engine.state.epoch == 1 and engine.state.step == 3


def test_custom_request_is_agreed_and_visible():
    engine = engine_with()
    engine.requests.register("flush")
    engine.on(Event.ON_STEP_START, once=2)(lambda e: e.request("flush", 7))
    agreed = []
    engine.on(Event.ON_STEP_END)(lambda e: agreed.append(e.agreed("flush")))
    engine.fit(steps=3)
    assert agreed == [0, 7, 0]
    with pytest.raises(KeyError, match="unknown control request 'nope'"):
        engine.request("nope")


class ReadsInStep(Callback):
    """Listens inside the step and declares it requests nothing there."""

    requests_in_step = False

    def __init__(self, request_at=None):
        self.in_step, self.request_at = [], request_at

    def on_forward(self, engine):
        self.in_step.append(engine.requests.in_step)
        if engine.state.step + 1 == self.request_at:
            engine.request_stop("in on_forward")


class MayRequestInStep(Callback):
    """Overrides a hook inside the step without saying whether it requests there."""

    def on_backward(self, engine):
        pass


def test_the_agreement_is_overlapped_unless_a_callback_may_request_inside_the_step():
    from cadence.callbacks import GradClip, Heartbeat, MetricUpdates, NonFiniteSkip, Preemption
    from cadence.metrics import Accuracy

    def listeners_request(*callbacks):
        model = tiny_model()
        engine = cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(4), loss_fn=F.cross_entropy,
            callbacks=list(callbacks),
            device="cpu",
        )  # fmt: skip
        return requests_in_step(engine)

    assert not listeners_request()
    assert not listeners_request(
        ReadsInStep(), GradClip(max_norm=1.0), Heartbeat(), MetricUpdates({"accuracy": Accuracy()}), Preemption()
    )
    assert listeners_request(MayRequestInStep()) and listeners_request(NonFiniteSkip())
    function_hook = engine_with()
    function_hook.on(Event.ON_BEFORE_OPTIMIZER_STEP)(lambda e: None)
    assert requests_in_step(function_hook)
    outside = engine_with()
    outside.on(Event.ON_STEP_START)(lambda e: None)
    outside.on(Event.ON_STEP_END)(lambda e: None)
    assert not requests_in_step(outside)

    # Overlapped: `in_step` is set between on_step_start and the agreement, and a
    # request raised there is refused, naming it, as itself (a CadenceError).
    reads = ReadsInStep(request_at=2)
    engine = engine_with(reads)
    with pytest.raises(cadence.RequestTimingError, match=r"control request 'stop' raised inside the step") as info:
        engine.fit(steps=4)
    assert reads.in_step == [True, True] and engine.state.step == 1
    assert "requests_in_step = True" in str(info.value)
    assert not engine.requests.in_step  # reset on the way out: fit again works
    reads.request_at = None
    engine.fit(steps=1)
    assert engine.state.step == 2

    # Declared (or unknown): agreed after on_before_optimizer_step, and the same request takes effect in its step.
    class RequestsInStep(ReadsInStep):
        requests_in_step = True

    declared = RequestsInStep(request_at=2)
    engine = engine_with(declared)
    engine.fit(steps=4)
    assert declared.in_step == [False, False] and engine.state.step == 2


def test_which_callbacks_may_raise_requests_at_all(tmp_path):
    """`raises_requests`: the built-ins that never request say False; unknown callbacks and plain functions may."""
    from cadence.callbacks import (
        EMA,
        JSONL,
        Checkpoint,
        EarlyStopping,
        GradClip,
        Heartbeat,
        NonFiniteSkip,
        Preemption,
        ProgressBar,
        TextLog,
        TrainMetrics,
    )

    def engine_of(*callbacks):
        model = tiny_model()
        return cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_batches(4), loss_fn=F.cross_entropy,
            callbacks=list(callbacks), seed=0,
            device="cpu",
        )  # fmt: skip

    def may_request(*callbacks):
        return may_request_at_all(engine_of(*callbacks))

    def quiet():
        return [TrainMetrics(), ProgressBar(), JSONL(), TextLog(), GradClip(max_norm=1.0), EMA(), Heartbeat()]

    assert not may_request() and not may_request(*quiet(), Checkpoint(dir=str(tmp_path)))
    for requesting in (EarlyStopping(monitor="val.loss"), NonFiniteSkip(), Preemption(), MayRequestInStep()):
        assert may_request(*quiet(), requesting), requesting
    assert may_request(ReadsInStep()), "a callback that leaves raises_requests None is taken to request"

    class InStepOnly(Callback):
        raises_requests = False
        requests_in_step = True  # requesting inside the step is requesting

    assert may_request(InStepOnly())
    # A handler of a callback's bound method speaks for the callback; a plain function may request.
    metrics = TrainMetrics()
    bound = engine_of(metrics)
    bound.on(Event.ON_FORWARD)(metrics.on_step_end)
    assert not may_request_at_all(bound) and not requests_in_step(bound)
    plain = engine_of(TrainMetrics())
    plain.on(Event.ON_STEP_END)(lambda e: None)
    assert may_request_at_all(plain)

    # On one process nothing is refused: a callback that requests though it declares it does not is obeyed.
    class StopsAnyway(Callback):
        raises_requests = False

        def on_step_end(self, engine):
            if engine.state.step == 2:
                engine.request_stop("undeclared")

    engine = engine_of(StopsAnyway())
    engine.fit(steps=5)
    assert engine.state.step == 3 and not engine.requests.closed


def test_evaluate_is_exact_over_unequal_batches():
    model = tiny_model()
    batches = [(torch.randn(n, 8), torch.randint(0, 4, (n,))) for n in (5, 3, 8)]
    engine = cadence.Engine(model, None, loss_fn=F.cross_entropy, seed=0, device="cpu")
    results = engine.evaluate(batches)
    with torch.no_grad():
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        expected = F.cross_entropy(model(x), y).item()
    assert math.isclose(results["val.loss"], expected, rel_tol=1e-6)
    assert engine.model.training


def test_eval_fn_and_logging_inside_evaluation_are_split_prefixed():
    model = tiny_model()

    def eval_fn(m, batch):
        logits = m(batch[0])
        return {"accuracy": (logits.argmax(-1) == batch[1]).float().mean()}

    engine = cadence.Engine(model, None, eval_fn=eval_fn, eval_data=tiny_batches(3), seed=0, device="cpu")
    engine.on(Event.ON_EVAL_BATCH)(lambda e: e.log("batches", 1, reduce="sum"))
    results = engine.evaluate(split="test")
    assert set(results) == {"test.accuracy", "test.batches"}
    assert results["test.batches"] == 3
    assert engine.eval_results["test"] == results


def test_metrics_are_reduced_at_log_intervals():
    engine = engine_with(log_interval=2)
    engine.on(Event.ON_STEP_END)(lambda e: e.log("loss", e.loss.detach()))
    engine.on(Event.ON_STEP_END)(lambda e: e.log("peak", float(e.state.step), reduce="max"))
    logged = []
    engine.on(Event.ON_LOG)(lambda e: logged.append((e.state.step, dict(e.logged))))
    engine.fit(steps=4)
    assert [s for s, _ in logged] == [2, 4]
    assert logged[1][1]["peak"] == 4.0
    assert "loss" in logged[0][1]


def test_a_fit_that_ends_between_intervals_is_logged_at_its_last_step():
    engine = engine_with(log_interval=4)
    engine.on(Event.ON_STEP_END)(lambda e: e.log("step", float(e.state.step)))
    logged = []
    engine.on(Event.ON_LOG)(lambda e: logged.append((e.state.step, dict(e.logged))))
    engine.fit(steps=6)  # 4, then the two steps after it at the end
    assert logged == [(4, {"step": 2.5}), (6, {"step": 5.5})]
    engine.fit(steps=2)  # ends on the interval: one reduction, not two
    assert logged[2:] == [(8, {"step": 7.5})]
    engine.fit(steps=1)
    assert logged[3:] == [(9, {"step": 9.0})]

    epochs = engine_with(batches=3, log_interval=4)  # epoch mode: 2 epochs of 3 steps
    epochs.on(Event.ON_STEP_END)(lambda e: e.log("step", float(e.state.step)))
    logged = []
    epochs.on(Event.ON_LOG)(lambda e: logged.append((e.state.step, e.state.epoch, dict(e.logged))))
    epochs.fit(epochs=2)
    assert logged == [(4, 1, {"step": 2.5}), (6, 2, {"step": 5.5})]


def test_an_interrupted_fit_is_not_logged_until_the_next_reduction():
    engine = engine_with(log_interval=4)
    engine.on(Event.ON_STEP_END)(lambda e: e.log("step", float(e.state.step)))
    logged = []
    engine.on(Event.ON_LOG)(lambda e: logged.append((e.state.step, dict(e.logged))))

    def interrupt(e):
        if e.state.step == 5:
            raise KeyboardInterrupt

    handle = engine.add_handler(Event.ON_STEP_END, interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.fit(steps=10)
    assert logged == [(4, {"step": 2.5})]  # no collective on the way out of an interrupt
    handle.remove()
    engine.fit(steps=3)  # 6, 7, 8: step 5's value joins the interval that ends at 8
    assert logged[1:] == [(8, {"step": 6.5})]


def test_predict_returns_outputs_per_batch():
    engine = engine_with(predict_data=tiny_batches(3))
    outputs = engine.predict()
    assert len(outputs) == 3 and outputs[0].shape == (8, 4)


def test_dataset_builds_a_seeded_stateful_loader():
    def epoch_order(seed):
        model = tiny_model()
        engine = cadence.Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            tiny_dataset(32),
            loss_fn=F.cross_entropy,
            seed=seed,
            train=cadence.DataConfig(batch_size=8),
            device="cpu",
        )
        seen = []
        engine.on(Event.ON_BATCH)(lambda e: seen.append(e.batch[1].clone()))
        engine.fit(epochs=2)
        return torch.cat(seen)

    from torchdata.stateful_dataloader import StatefulDataLoader

    model = tiny_model()
    engine = cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), tiny_dataset(32), loss_fn=F.cross_entropy, device="cpu"
    )
    assert isinstance(engine.data["train"].loader, StatefulDataLoader)
    a, b, c = epoch_order(3), epoch_order(3), epoch_order(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a[:32], a[32:])  # reshuffled per epoch


def test_config_errors_are_raised_before_anything_starts():
    model = tiny_model()
    with pytest.raises(cadence.ConfigError, match="grad_accum"):
        cadence.Engine(model, None, grad_accum=0, device="cpu")
    with pytest.raises(cadence.ConfigError, match="stepz"):
        cadence.Engine(model, None, config={"stepz": 3}, device="cpu")
    with pytest.raises(cadence.ConfigError, match="precision"):
        cadence.Engine(model, None, precision="fp8", device="cpu")


def test_bf16_autocast_on_cpu_and_fp16_needs_cuda():
    engine = engine_with(precision="bf16")
    dtypes = []
    engine.on(Event.ON_FORWARD)(lambda e: dtypes.append(e.outputs.dtype))
    engine.fit(steps=1)
    assert dtypes == [torch.bfloat16]
    with pytest.raises(ValueError, match="fp16' needs a CUDA device"):  # on the CPU, also where CUDA is present
        engine_with(precision="fp16")


def test_unknown_backend_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"config error at 'backend'.*unknown backend 'tpu'.*local"):
        engine_with(backend="tpu")
    with pytest.raises(ValueError, match=r"unknown backend 'dpp'; did you mean 'ddp'\? known backends: ddp, "):
        engine_with(backend="dpp")


def test_relative_fit_counts_from_the_restored_step(tmp_path):
    from cadence.callbacks.checkpoint import Checkpoint

    first = engine_with(batches=6)
    first.add_callback(Checkpoint(dir=str(tmp_path / "ckpt")))
    first.fit(steps=4)
    resumed = engine_with(batches=6)
    resumed.add_callback(Checkpoint(dir=str(tmp_path / "ckpt"), auto_resume=True))
    resumed.fit(steps=3)  # restored at step 4 in on_setup, then 3 more
    assert resumed.state.step == 7
