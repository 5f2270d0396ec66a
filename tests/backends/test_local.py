"""The local backend and the step contract: who runs a step's micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.backends.local import LocalBackend
from cadence.callbacks import NonFiniteSkip
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


def make(backend=None, grad_accum=2, lr=0.1, engine_class=cadence.Engine, **kwargs):
    model = tiny_model()
    return engine_class(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        tiny_batches(12),
        loss_fn=F.cross_entropy,
        backend=backend or LocalBackend(device="cpu"),
        grad_accum=grad_accum,
        seed=0,
        **kwargs,
        device="cpu",
    )


def train(backend=None, steps=3, grad_accum=2, lr=0.1, **kwargs):
    engine = make(backend, grad_accum, lr, **kwargs)
    events = []
    for event in (Event.ON_BATCH, Event.ON_FORWARD, Event.ON_BACKWARD):
        engine.on(event)(lambda e, name=event.value: events.append(name))
    engine.fit(steps=steps)
    return engine, events


class ConcatSchedule(LocalBackend):
    """Runs a step's micro-batches as one forward over their concatenation, the way
    a pipeline schedule takes all of a step's micro-batches at once."""

    def __init__(self):
        super().__init__(device="cpu")
        self.calls = []

    def forward_backward(self, engine, micro_batches):
        self.calls.append(len(micro_batches))
        inputs = torch.cat([x for x, _ in micro_batches])
        targets = torch.cat([y for _, y in micro_batches])
        engine.batch = (inputs, targets)
        engine.fire(Event.ON_BATCH)
        engine.outputs, engine.loss = engine.compute_loss(engine.batch)
        engine.fire(Event.ON_FORWARD)
        engine.loss.backward()
        engine.fire(Event.ON_BACKWARD)


def test_a_backend_that_overrides_forward_backward_runs_each_step_itself():
    plain, plain_events = train()
    assert plain_events == ["on_batch", "on_forward", "on_backward"] * 6
    backend = ConcatSchedule()
    scheduled, events = train(backend)
    assert backend.calls == [2, 2, 2]  # once per step, with all of its micro-batches
    assert events == ["on_batch", "on_forward", "on_backward"] * 3
    assert scheduled.state.step == 3 and scheduled.state.micro_step == 6 and scheduled.state.samples_seen == 48
    # The mean loss over the concatenation is the mean of the micro-batch means: the same step.
    for a, b in zip(plain.model.parameters(), scheduled.model.parameters()):
        torch.testing.assert_close(a, b)


def test_bf16_autocast_is_entered_for_every_micro_batch_and_left_for_backward():
    model_dtypes, grad_enabled_autocast = [], []
    engine, _ = train(LocalBackend(device="cpu", precision="bf16"), steps=2)
    engine.on(Event.ON_FORWARD)(lambda e: model_dtypes.append(e.outputs.dtype))
    engine.on(Event.ON_BACKWARD)(lambda e: grad_enabled_autocast.append(torch.is_autocast_enabled("cpu")))
    engine.fit(steps=2)
    assert model_dtypes == [torch.bfloat16] * 4
    assert grad_enabled_autocast == [False] * 4
    assert all(p.grad is None and p.dtype == torch.float32 for p in engine.model.parameters())


def test_cpu_batches_are_used_as_given_and_other_devices_are_moved():
    assert LocalBackend(device="cpu").moves_batches is False
    batch = tiny_batches(1)[0]
    engine, _ = train(steps=1, grad_accum=1)
    seen = []
    engine.on(Event.ON_BATCH)(lambda e: seen.append(e.batch))
    engine.fit(steps=1)
    assert seen[0] is engine.data["train"].loader[1]
    assert LocalBackend(device="cpu").to_device(batch)[0] is batch[0]  # already there: not copied


def test_fp32_has_no_autocast_context_so_the_step_enters_none():
    from cadence.engine.backend import NULL_CONTEXT

    assert LocalBackend(device="cpu").autocast() is NULL_CONTEXT
    assert LocalBackend(device="cpu", precision="bf16").autocast() is not NULL_CONTEXT


def test_the_step_is_the_backends_own_methods_and_a_schedule_only_when_overridden():
    from cadence.backends.ddp import DDPBackend
    from cadence.engine.step import NULL_CONTEXT

    engine, _ = train(steps=1)
    step = LocalBackend(device="cpu").build_step(engine)
    assert step.schedule is None and step.to_device is None and step.autocast is NULL_CONTEXT
    assert ConcatSchedule().build_step(engine).schedule is not None
    ddp = DDPBackend(device="cpu")
    assert ddp.build_step(engine).gradient_sync == ddp.set_gradient_sync
    assert LocalBackend(device="cpu").agreement_mode(engine) == "inline"


class ZeroGradients(LocalBackend):
    """Finishes gradients by zeroing them: a step that changes nothing."""

    def finish_gradients(self, engine):
        for p in engine.model.parameters():
            p.grad.zero_()


class SkipEveryOtherStep(LocalBackend):
    """Steps the optimizer on odd calls only: its own optimizer_step must be what the loop calls."""

    def __init__(self):
        super().__init__(device="cpu")
        self.calls = 0

    def optimizer_step(self, engine):
        self.calls += 1
        if self.calls % 2:
            super().optimizer_step(engine)


def test_a_backend_that_overrides_the_optimizer_step_keeps_it():
    backend = SkipEveryOtherStep()
    engine, _ = train(backend, steps=4, grad_accum=1)
    assert backend.calls == 4 and engine.state.step == 4
    several = tiny_model()
    optimizers = [torch.optim.SGD([p], lr=0.1) for p in several.parameters()]
    engine = cadence.Engine(
        several, optimizers, tiny_batches(4), loss_fn=F.cross_entropy, seed=0, backend="local", device="cpu"
    )
    before = [p.detach().clone() for p in several.parameters()]
    engine.fit(steps=1)  # several optimizers: the backend's loop steps each
    assert all(not torch.equal(a, b) for a, b in zip(before, several.parameters()))


def test_a_backend_that_finishes_gradients_is_called_every_step():
    before = [p.detach().clone() for p in tiny_model().parameters()]
    engine, _ = train(ZeroGradients(device="cpu"), grad_accum=1)
    assert engine.state.step == 3
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))  # SGD without momentum


class HalfBackward(LocalBackend):
    """Backpropagates half of each loss: its own backward must be what the loop calls."""

    def __init__(self):
        super().__init__(device="cpu")
        self.calls = []

    def backward(self, loss, micro_batches):
        self.calls.append(micro_batches)
        super().backward(loss * 0.5, micro_batches)


class CountingAgreement(LocalBackend):
    """Agrees like one process, counting calls: a backend's own agree runs every step."""

    def __init__(self):
        super().__init__(device="cpu")
        self.calls = 0

    def agree(self, requests):
        self.calls += 1
        super().agree(requests)


def test_a_backend_that_overrides_backward_or_agree_keeps_it():
    backend = HalfBackward()
    train(backend, steps=3, grad_accum=2)
    assert backend.calls == [2] * 6  # every micro-batch, told how many the step has
    # Half the gradient at lr 0.1 is the plain gradient at lr 0.05 (SGD without momentum).
    halved, _ = train(HalfBackward(), steps=2, grad_accum=1)
    plain, _ = train(steps=2, grad_accum=1, lr=0.05)
    for a, b in zip(halved.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b)
    agreeing = CountingAgreement()
    engine, _ = train(agreeing, steps=3, grad_accum=1)
    assert agreeing.calls >= 3 and engine.state.step == 3


def test_a_batch_replaced_in_on_batch_and_a_loss_replaced_in_on_forward_are_used():
    engine = make(grad_accum=1)
    model = engine.model
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))

    @engine.on(Event.ON_BATCH)
    def halve(engine):
        inputs, targets = engine.batch
        engine.batch = (inputs[:2], targets[:2])

    @engine.on(Event.ON_FORWARD)
    def no_loss(engine):
        engine.loss = engine.loss * 0.0

    before = [p.detach().clone() for p in model.parameters()]
    engine.fit(steps=2)
    assert seen == [2, 2]  # the forward ran on the replaced batch
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # backward ran on the replaced loss


class ZeroLossEngine(cadence.Engine):
    """Computes the loss its own way: the loop must call this, not its inlined usual case."""

    def compute_loss(self, batch):
        outputs, loss = super().compute_loss(batch)
        return outputs, loss * 0.0


def test_an_engine_subclass_that_overrides_compute_loss_keeps_it():
    engine = make(grad_accum=1, engine_class=ZeroLossEngine)
    model = engine.model
    before = [p.detach().clone() for p in model.parameters()]
    engine.fit(steps=2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class CPUScaler(LocalBackend):
    """The fp16 step's bookkeeping on CPU: a real GradScaler (torch's CPU one) around
    fp32 compute, since fp16 autocast is CUDA-only here."""

    def __init__(self):
        super().__init__(device="cpu")
        self.scaler = self.precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)


def train_through_a_nan(backend):
    """Four steps whose second has a non-finite input (a NaN loss), under `NonFiniteSkip`."""
    model = tiny_model()
    batches = tiny_batches(6)
    batches[1] = (torch.full_like(batches[1][0], float("inf")), batches[1][1])
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batches,
        loss_fn=F.cross_entropy,
        backend=backend,
        callbacks=[NonFiniteSkip()],  # under a scaler it checks the loss only
        seed=0,
        device="cpu",
    )
    engine.fit(steps=4)
    assert engine.state.step == 4 and engine.state.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return engine


def test_scaler_survives_a_requested_skip():
    # The skipped step's gradients were unscaled: without closing the scaler's
    # step, the next unscale_ raises "unscale_() has already been called".
    engine = make(CPUScaler(), grad_accum=1)
    engine.on(Event.ON_BEFORE_OPTIMIZER_STEP, once=2)(lambda e: e.request_skip("test"))
    engine.fit(steps=4)
    assert engine.state.step == 4 and engine.state.skipped_steps == 1
    assert engine.backend.scaler.get_scale() == 1024.0  # finite gradients: no back-off


def test_non_finite_skip_under_a_scaler_backs_the_scale_off_and_keeps_training():
    engine = train_through_a_nan(CPUScaler())
    assert engine.backend.scaler.get_scale() == 512.0  # one back-off, as a GradScaler's own skip


@pytest.mark.cuda  # fp16 autocast with a GradScaler needs a CUDA device
def test_fp16_on_cuda_trains_through_a_non_finite_step():
    engine = train_through_a_nan(LocalBackend(device="cuda", precision="fp16"))
    assert engine.backend.scaler.get_scale() < 2.0**16  # the scaler's default start, backed off
