"""Batch placement: used as given on the CPU, copied one ahead with prefetch, exact resume either way.

On the CPU the prefetch path is switched on explicitly (`prefetch_to_device=True`)
with a backend that moves (copies) batches, so its order, the pending step of
an interrupted fit and a resumed run are checked without a GPU; the CUDA test
checks the side stream.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.backends.local import LocalBackend
from cadence.callbacks import Checkpoint, TrainMetrics
from cadence.engine.placement import Placement, Prefetch
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(60)


def _as_given(batch):
    return batch


def test_the_plain_placement_unless_prefetch_is_asked_for_or_batches_go_to_cuda():
    cpu = torch.device("cpu")
    plain = Placement.choose(None, cpu, None)
    assert type(plain) is Placement and plain.to_device is None
    groups = [[1], [2]]
    assert plain.steps(groups) is groups  # the feed's groups as they are: nothing per step
    assert type(Placement.choose(_as_given, cpu, None)) is Placement  # moved, but not to CUDA
    assert Placement.choose(_as_given, torch.device("cuda", 0), False).to_device is _as_given  # switched off
    assert Placement.choose(None, torch.device("cuda", 0), None).to_device is None  # nothing to move
    prefetch = Placement.choose(_as_given, cpu, True)
    assert isinstance(prefetch, Prefetch) and prefetch.to_device == prefetch.to_device_ahead
    assert prefetch.stream is None  # the CPU: no stream, the same order of copies


class Copying(LocalBackend):
    """A CPU backend that moves batches (copies them) and records when, to see the order prefetch issues."""

    def __init__(self, log: list):
        super().__init__(device="cpu")
        self.log = log

    @property
    def moves_batches(self) -> bool:
        return True

    def to_device(self, batch):
        self.log.append(("copy", int(batch[0][0, 0].item() * 1e6)))
        return tuple(t.clone() for t in batch)


class Log(cadence.Callback):
    def __init__(self, log: list):
        self.log = log

    def on_step_start(self, engine):
        self.log.append(("step",))

    def on_batch(self, engine):
        self.log.append(("batch", int(engine.batch[0][0, 0].item() * 1e6)))


def make(prefetch, backend=None, callbacks=(), **kwargs):
    model = tiny_model()
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        tiny_dataset(96),
        loss_fn=F.cross_entropy,
        backend=backend or Copying([]),
        callbacks=list(callbacks),
        seed=0,
        grad_accum=3,
        prefetch_to_device=prefetch,
        train={"batch_size": 8},
        **kwargs,
    )


@pytest.mark.parametrize("prefetch", [False, True])
def test_each_copy_is_issued_one_ahead_of_its_use(prefetch):
    log: list = []
    engine = make(prefetch, Copying(log), [Log(log)])
    engine.fit(steps=2)
    first = [entry for entry in log if entry[0] == "batch"][:6]
    b = [index for _, index in first]
    if prefetch:  # the step's first copy before on_step_start, the next one before the current batch is used
        expected = [("copy", b[0]), ("step",), ("copy", b[1]), ("batch", b[0]), ("copy", b[2]), ("batch", b[1])]
        expected += [("batch", b[2]), ("copy", b[3]), ("step",), ("copy", b[4]), ("batch", b[3])]
        expected += [("copy", b[5]), ("batch", b[4]), ("batch", b[5])]
    else:  # each batch placed as it is used
        expected = [("step",), *[entry for i in range(3) for entry in (("copy", b[i]), ("batch", b[i]))]]
        expected += [("step",), *[entry for i in range(3, 6) for entry in (("copy", b[i]), ("batch", b[i]))]]
    assert log == expected


def trained(engine) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in engine.model.state_dict().items()}


class Losses(cadence.Callback):
    def __init__(self):
        self.losses = []

    def on_forward(self, engine):
        self.losses.append(engine.loss.detach().clone())


def test_an_interrupted_step_is_placed_again_and_training_matches(tmp_path):
    reference = make(True)
    reference.fit(steps=4)

    class InterruptAtBatch(cadence.Callback):
        def __init__(self, at: int):
            self.at, self.seen = at, 0

        def on_batch(self, engine):
            self.seen += 1
            if self.seen == self.at:
                raise KeyboardInterrupt

    engine = make(True, callbacks=[InterruptAtBatch(5)])  # the second micro-batch of step 2
    with pytest.raises(KeyboardInterrupt):
        engine.fit(steps=4)
    assert engine.state.step == 1 and engine.feed.pending is not None and len(engine.feed.pending) == 3
    engine.fit(steps=3)
    assert engine.state.step == 4
    for name, value in trained(reference).items():
        assert torch.equal(trained(engine)[name], value), name


def test_resume_is_bitwise_with_prefetch(tmp_path: Path):
    directory = str(tmp_path / "ckpt")
    reference_losses = Losses()
    reference = make(True, callbacks=[reference_losses])
    reference.fit(steps=6)

    first_losses = Losses()
    first = make(True, callbacks=[first_losses, Checkpoint(dir=directory, interval=3)])
    first.fit(steps=3)  # mid-epoch (96 samples: 4 steps of 3 micro-batches an epoch)
    first.close()
    resumed_losses = Losses()
    resumed = make(True, callbacks=[resumed_losses, Checkpoint(dir=directory, resume=directory + "/latest")])
    resumed.fit(steps=3)
    assert resumed.restored_from is not None and resumed.state.step == 6
    losses = first_losses.losses + resumed_losses.losses
    assert len(losses) == len(reference_losses.losses) == 18
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses.losses))
    for name, value in trained(reference).items():
        assert torch.equal(trained(resumed)[name], value), name


def test_the_data_wait_is_measured_with_prefetch():
    engine = make(True, callbacks=[TrainMetrics(data_wait=True)], log_interval=2)
    engine.fit(steps=2)
    assert engine.logged["time.data_wait"] > 0
    assert not any(name.startswith("memory.") for name in engine.logged)  # CPU: no memory figures


@pytest.mark.cuda
def test_prefetch_on_cuda_copies_on_a_side_stream_and_trains_as_without():
    runs = {}
    for prefetch in (False, True):
        model = tiny_model()
        engine = cadence.Engine(
            model, torch.optim.AdamW(model.parameters(), lr=0.05), tiny_dataset(96), loss_fn=F.cross_entropy,
            device="cuda", seed=0, grad_accum=2, prefetch_to_device=prefetch, train={"batch_size": 8},
        )  # fmt: skip
        seen = []
        engine.on(Event.ON_BATCH)(lambda e, seen=seen: seen.append(e.batch[0]))
        assert engine.data["train"].loader.pin_memory  # pinned by default for CUDA
        engine.fit(steps=6)
        assert all(t.device.type == "cuda" for t in seen)
        runs[prefetch] = trained(engine)
    placement = Placement.choose(lambda b: b, torch.device("cuda", 0), None)
    assert isinstance(placement, Prefetch) and placement.stream is not None  # on by default for CUDA
    for name, value in runs[False].items():  # the same batches in the same order: the same training
        torch.testing.assert_close(runs[True][name], value, rtol=1e-5, atol=1e-7, msg=name)
