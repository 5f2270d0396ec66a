"""The backend contract's hooks for scale: unapplied optimizer steps, local tensors, evaluation context."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Callback, Event
from cadence.backends.local import LocalBackend
from cadence.callbacks import EMA, NonFiniteSkip
from tests.conftest import tiny_batches, tiny_model

pytestmark = pytest.mark.timeout(60)


class RefusingBackend(LocalBackend):
    """Applies every optimizer step except those in `refuse` (as DeepSpeed's overflow or TorchFT's commit do)."""

    def __init__(self, refuse=(), **kwargs):
        super().__init__(**{"device": "cpu", **kwargs})
        self.refuse = set(refuse)
        self.calls = 0

    def optimizer_step(self, engine):
        self.calls += 1
        if engine.state.step + 1 in self.refuse:
            return False
        return super().optimizer_step(engine)


class StepLog(Callback):
    def __init__(self):
        self.optimizer_steps, self.params = [], []

    def on_optimizer_step(self, engine):
        self.optimizer_steps.append(engine.state.step + 1)

    def on_step_end(self, engine):
        self.params.append([p.detach().clone() for p in engine.model.parameters()])


def _engine(backend, callbacks=(), scheduler=None):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if scheduler:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return cadence.Engine(
        model,
        optimizer,
        tiny_batches(8),
        loss_fn=F.cross_entropy,
        backend=backend,
        callbacks=list(callbacks),
        scheduler=scheduler,
        seed=0,
        device="cpu",
    )


def test_an_unapplied_optimizer_step_counts_as_an_agreed_skip():
    log, ema = StepLog(), EMA(decay=0.5)
    engine = _engine(RefusingBackend(refuse={3}), [log, ema], scheduler=True)
    engine.fit(steps=5)
    assert engine.backend.calls == 5
    assert engine.state.skipped_steps == 1 and engine.state.step == 5
    assert log.optimizer_steps == [1, 2, 4, 5]  # on_optimizer_step fires only for applied steps
    assert ema.updates == 4  # started at fit start: one average per applied step, none for step 3
    # The LR scheduler did not step on the refused step: 4 applied steps halve lr 4 times.
    assert engine.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    # The next step's agreement clears the skip: step 4 was applied.
    assert not torch.equal(log.params[2][0], log.params[3][0])


def test_an_agreed_skip_does_not_call_the_optimizer_step():
    class SkipThird(Callback):
        def on_before_optimizer_step(self, engine):
            if engine.state.step + 1 == 3:
                engine.request_skip("test")

    engine = _engine(RefusingBackend(), [SkipThird()])
    engine.fit(steps=4)
    assert engine.backend.calls == 3 and engine.state.skipped_steps == 1


def test_zero_grad_may_be_left_to_the_optimizer_step():
    class ZeroesInStep(LocalBackend):
        def build_step(self, engine):
            import attrs

            from cadence.engine.step import nothing

            return attrs.evolve(super().build_step(engine), zero_grad=nothing)

        def optimizer_step(self, engine):
            super().optimizer_step(engine)
            for optimizer in engine.optimizers:
                optimizer.zero_grad(set_to_none=True)

    engine = _engine(ZeroesInStep(device="cpu"))
    engine.fit(steps=2)
    assert engine.state.step == 2
    assert all(p.grad is None for p in engine.model.parameters())


def test_local_parameters_and_gradients_default_to_the_model_s_own():
    engine = _engine(LocalBackend(device="cpu"))
    local = engine.backend.local_parameters(engine)
    assert [lp.name for lp in local] == [n for n, _ in engine.model.named_parameters()]
    assert all(lp.local is lp.param for lp in local)
    assert engine.backend.local_gradients(engine) == []
    engine.fit(steps=1)
    loss = F.cross_entropy(engine.model(tiny_batches(1)[0][0]), tiny_batches(1)[0][1])
    loss.backward()
    grads = engine.backend.local_gradients(engine)
    assert len(grads) == len(local) and all(g is p.grad for g, p in zip(grads, engine.model.parameters()))
    assert not engine.backend.checks_gradients_itself


def test_non_finite_skip_checks_what_local_gradients_returns():
    """A NaN only in what the backend hands out is found: NonFiniteSkip reads the backend, not the model."""

    class PoisonedShard(LocalBackend):
        def local_gradients(self, engine):
            grads = super().local_gradients(engine)
            if engine.state.step + 1 == 2:
                return [*grads, torch.tensor([float("nan")])]
            return grads

    engine = _engine(PoisonedShard(device="cpu"), [NonFiniteSkip()])
    engine.fit(steps=3)
    assert engine.state.skipped_steps == 1


@pytest.mark.cuda
def test_non_finite_skip_checks_gradients_on_several_devices():
    """CUDA gradients with a host part (as CPU-offloaded shards are): checked together, the NaN found."""

    class HostShard(LocalBackend):
        def local_gradients(self, engine):
            host = torch.tensor([float("nan") if engine.state.step + 1 == 2 else 0.0])
            return [*super().local_gradients(engine), host]

    engine = _engine(HostShard(device="cuda"), [NonFiniteSkip()])
    engine.fit(steps=3)
    assert engine.state.skipped_steps == 1


def test_evaluate_and_predict_run_inside_the_backend_s_evaluation_context():
    class Holding(LocalBackend):
        def __init__(self):
            super().__init__(device="cpu")
            self.entered = []

        def evaluation(self, engine):
            @contextlib.contextmanager
            def held():
                self.entered.append("in")
                yield
                self.entered.append("out")

            return held()

    seen = []

    class Inside(Callback):
        def on_eval_batch(self, engine):
            seen.append(list(engine.backend.entered))

        def on_predict_batch(self, engine):
            seen.append(list(engine.backend.entered))

    model = tiny_model()
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(2),
        eval_data=tiny_batches(2),
        predict_data=tiny_batches(1),
        loss_fn=F.cross_entropy,
        backend=Holding(),
        callbacks=[Inside()],
        seed=0,
        device="cpu",
    )
    engine.evaluate()
    engine.predict()
    assert engine.backend.entered == ["in", "out", "in", "out"]
    assert seen == [["in"], ["in"], ["in", "out", "in"]]


def test_ema_averages_through_local_parameters():
    ema = EMA(decay=0.5)
    engine = _engine(LocalBackend(device="cpu"), [ema])
    engine.fit(steps=3)
    assert ema._shadow_locals[0] is ema.shadow[0]  # plain tensors: the shadow is its own local view
    with ema.swapped(engine):
        averaged = [p.detach().clone() for p in engine.model.parameters()]
    assert all(torch.equal(a, s) for a, s in zip(averaged, ema.shadow))


class HalfStages(LocalBackend):
    """Pretends to be a pipeline stage without the loss (as the first stage): `eval_forward` gives nothing back."""

    def __init__(self, last: bool, **kwargs):
        super().__init__(**{"device": "cpu", **kwargs})
        self.last = last
        self.forwards = 0

    def eval_forward(self, engine):
        def forward(batch):
            self.forwards += 1
            if not self.last:
                return None, None
            outputs = engine.model(batch[0] if isinstance(batch, (tuple, list)) else batch)
            loss = F.cross_entropy(outputs, batch[1]) if isinstance(batch, (tuple, list)) else None
            return outputs, loss

        return forward


def test_eval_forward_replaces_the_models_forward_in_evaluate_and_predict():
    data = tiny_batches(5)
    plain = cadence.Engine(
        tiny_model(), None, eval_data=data, predict_data=data, loss_fn=F.cross_entropy, seed=0, device="cpu"
    )
    last = HalfStages(last=True)
    staged = cadence.Engine(
        tiny_model(),
        None,
        eval_data=data,
        predict_data=data,
        loss_fn=F.cross_entropy,
        seed=0,
        backend=last,
        device="cpu",
    )
    assert staged.evaluate()["val.loss"] == plain.evaluate()["val.loss"]
    assert last.forwards == 5
    assert all(torch.equal(a, b) for a, b in zip(staged.predict(), plain.predict()))
    # A rank without the loss declares it (names match at the reduction) and predicts nothing.
    first = HalfStages(last=False)
    engine = cadence.Engine(
        tiny_model(),
        None,
        eval_data=data,
        predict_data=data,
        loss_fn=F.cross_entropy,
        seed=0,
        backend=first,
        device="cpu",
    )
    assert list(engine.evaluate()) == ["val.loss"]
    assert engine.predict() == []
    assert first.forwards == 10


class NoLoss(Callback):
    """What a pipeline stage before the last shows TrainMetrics: `engine.loss` is None (backward still runs)."""

    order = 1

    def on_fit_start(self, engine):
        engine.on(Event.ON_FORWARD, order=79)(self.hide)
        engine.on(Event.ON_FORWARD, order=81)(self.show)

    def hide(self, engine):
        self.loss, engine.loss = engine.loss, None

    def show(self, engine):
        engine.loss = self.loss

    def on_step_end(self, engine):
        engine.loss = None


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_train_metrics_tolerates_no_loss_and_declares_it(grad_accum):
    from cadence.callbacks import TrainMetrics

    model = tiny_model()
    engine = cadence.Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tiny_batches(8),
        loss_fn=F.cross_entropy,
        callbacks=[NoLoss(), TrainMetrics()],
        log_interval=2,
        grad_accum=grad_accum,
        seed=0,
        device="cpu",
    )
    engine.fit(steps=2)
    assert "loss" in engine.logged and engine.logged["loss"] != engine.logged["loss"]  # declared, no value: NaN


def test_metric_names_are_checked_against_this_ranks_own():
    from cadence.engine.metrics import MetricStore

    class OthersRows(LocalBackend):
        """Hands back another rank's row (as a pipeline stage gets the last stage's)."""

        world_size = 2

        def all_gather(self, tensor, domain="data"):
            other = tensor.clone()
            other[0] += 1  # another name checksum
            return other.unsqueeze(0)

    store = MetricStore()
    store.log("loss", 1.0)
    with pytest.raises(RuntimeError, match="ranks logged different metrics"):
        store.compute(OthersRows(device="cpu"))
