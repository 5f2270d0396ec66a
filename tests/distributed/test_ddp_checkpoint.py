"""Checkpoints under DDP: one writer, agreed saves, resume across world sizes and mid-epoch."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import pytest
import torch
import torch._dynamo  # DDP imports it (~1.5 s): once here, not in every forked worker
import torch.distributed as dist
from torch.nn import functional as F

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.launch import launch
from tests.conftest import tiny_model
from tests.distributed.test_ddp_training import RequestOnOneRank, flat_parameters

pytestmark = pytest.mark.timeout(120)

SAMPLES = 64  # 2 ranks x 4 per rank: 8 steps per epoch


def run(fn, *args):
    return launch(fn, *args, nprocs=2, start_method="fork", timeout=90)


def indexed_dataset(n=SAMPLES):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g), torch.arange(n)
    )


class SeenSamples:
    """A step_fn that records which sample indices each step trained on."""

    def __init__(self):
        self.steps: list[list[int]] = []

    def __call__(self, model, batch):
        inputs, targets, index = batch
        self.steps.append(index.tolist())
        return F.cross_entropy(model(inputs), targets)


def make_engine(batch_size, *, callbacks=(), shuffle=False, step_fn=None, steps=None):
    model = tiny_model(seed=3)
    return cadence.Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), indexed_dataset(),
        step_fn=step_fn or SeenSamples(), callbacks=callbacks, seed=0, steps=steps,
        train={"batch_size": batch_size, "shuffle": shuffle},
        device="cpu",
    )  # fmt: skip


def process_group():
    # One group for the whole worker: engines built on it neither create nor destroy it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))


class SaveEvents(cadence.Callback):
    def __init__(self):
        self.saved_at: list[int] = []

    def on_save(self, engine):
        self.saved_at.append(engine.state.step)


def test_save_requested_on_rank_one_is_written_once_by_rank_zero(tmp_path):
    directory = tmp_path / "ckpt"

    def train():
        process_group()
        events = SaveEvents()
        checkpoint = Checkpoint(dir=str(directory), interval=0, save_on_fit_end=False)
        engine = make_engine(4, callbacks=[RequestOnOneRank("save", rank=1, step=4), checkpoint, events])
        engine.fit(steps=10)
        return engine.backend.all_gather_object((engine.state.step, events.saved_at))

    assert run(train) == [(10, [5]), (10, [])]  # on_save fires where the file was written: rank 0
    assert sorted(p.name for p in directory.iterdir()) == ["latest"]
    manifest = json.loads((directory / "latest" / "manifest.json").read_text())
    assert manifest["step"] == 5, manifest


def test_world_size_2_checkpoint_resumes_on_1_process_and_back(tmp_path):
    two_ranks, one_rank = str(tmp_path / "two"), str(tmp_path / "one")

    def two_rank_part(resume):
        process_group()
        callbacks = [Checkpoint(dir=two_ranks, interval=0, resume=resume, strict=resume is None)]
        engine = make_engine(4, callbacks=callbacks, steps=8 if resume is None else 16)
        engine.fit()  # absolute targets: a resumed run trains to step 16; 8 steps = one epoch
        return flat_parameters(engine.model), engine.state.step

    # Reference: one process, global batch 8, 16 steps.
    reference = make_engine(8)
    reference.fit(steps=16)

    # 2 ranks x 4 for 8 steps, saved; then 1 process x 8 resumes and trains 8 more.
    saved, _ = run(two_rank_part, None)
    loaded = []
    resume = Checkpoint(dir=one_rank, interval=0, resume=f"{two_ranks}/latest", strict=False)
    single = make_engine(8, callbacks=[resume], steps=16)
    single.on(cadence.Event.ON_LOAD)(lambda e: loaded.append(flat_parameters(e.model)))
    single.fit()
    assert single.state.step == 16 and torch.equal(loaded[0], saved)
    torch.testing.assert_close(flat_parameters(single.model), flat_parameters(reference.model), rtol=0, atol=1e-6)

    # 1 process x 8 for 8 steps, saved; then 2 ranks x 4 resume and train 8 more.
    first = make_engine(8, callbacks=[Checkpoint(dir=one_rank, interval=0)])
    first.fit(steps=8)
    resumed, step = run(two_rank_part, f"{one_rank}/latest")
    assert step == 16
    torch.testing.assert_close(resumed, flat_parameters(reference.model), rtol=0, atol=1e-6)


def test_mid_epoch_checkpoint_of_plain_loaders_on_2_ranks_loaded_on_1_says_what_restarts(tmp_path, caplog):
    directory = str(tmp_path / "ckpt")

    def loader():  # a DataLoader the engine did not build: its epoch cannot be re-split
        sampler = (
            torch.utils.data.DistributedSampler(indexed_dataset(), shuffle=True, seed=0)
            if dist.is_initialized()
            else None
        )
        return torch.utils.data.DataLoader(indexed_dataset(), batch_size=4, sampler=sampler)

    def two_ranks():
        process_group()
        model = tiny_model(seed=3)
        engine = cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.05), loader(), step_fn=SeenSamples(), seed=0,
            callbacks=[Checkpoint(dir=directory, interval=0)], device="cpu",
        )  # fmt: skip
        engine.fit(steps=3)

    run(two_ranks)
    with caplog.at_level(logging.WARNING, logger="cadence.checkpoint"):
        resume = Checkpoint(dir=str(tmp_path / "single"), resume=f"{directory}/latest")
        model = tiny_model(seed=3)
        single = cadence.Engine(
            model, torch.optim.SGD(model.parameters(), lr=0.05), loader(), step_fn=SeenSamples(), seed=0,
            callbacks=[resume], device="cpu", steps=4,
        )  # fmt: skip
        single.fit()
    assert "saved on 2 data rank(s), this run has 1" in caplog.text and "restarts from its first batch" in caplog.text
    assert "cannot be resharded (only a map-style Dataset's can)" in caplog.text
    assert single.state.step == 4 and single.state.batch_in_epoch == 1


def test_mid_epoch_resume_on_2_ranks_sees_exactly_the_uninterrupted_samples(tmp_path):
    directory = str(tmp_path / "ckpt")

    def train():
        process_group()
        uninterrupted = SeenSamples()
        engine = make_engine(4, shuffle=True, step_fn=uninterrupted)
        engine.fit(steps=20)  # 2.5 epochs of 8 steps, reshuffled every epoch
        reference = flat_parameters(engine.model)

        first = make_engine(4, shuffle=True, callbacks=[Checkpoint(dir=directory, interval=0)])
        first.fit(steps=11)  # stops 3 batches into epoch 1; latest is saved at fit end
        seen = SeenSamples()
        resume = Checkpoint(dir=directory, resume=f"{directory}/latest")
        second = make_engine(4, shuffle=True, step_fn=seen, callbacks=[resume], steps=20)
        second.fit()
        report = {
            "step": second.state.step,
            "same_samples": seen.steps == uninterrupted.steps[11:],
            "bitwise_equal": torch.equal(flat_parameters(second.model), reference),
            "epoch_indices": sorted(i for step in uninterrupted.steps[:8] for i in step),
        }
        return engine.backend.all_gather_object(report)

    rank0, rank1 = run(train)
    for report in (rank0, rank1):
        assert report["step"] == 20 and report["same_samples"] and report["bitwise_equal"], report
    # The two ranks' shards of an epoch are disjoint and cover the dataset.
    assert sorted(rank0["epoch_indices"] + rank1["epoch_indices"]) == list(range(SAMPLES))


def test_async_saves_of_the_file_store_end_a_ddp_fit_on_every_rank(tmp_path):
    """Only the main process has the writer thread: the other ranks must not wait for a status after a save
    (examples/lm.py on two processes hung at the end of fit: rank 1 in a barrier rank 0 never entered)."""
    directory = str(tmp_path / "ckpt")

    def train():
        process_group()
        checkpoint = Checkpoint(dir=directory, interval=2, async_mode="async")
        engine = make_engine(4, callbacks=[checkpoint], steps=5)
        engine.fit()
        return engine.backend.all_gather_object(engine.state.step)  # a collective after the fit: every rank is here

    assert run(train) == [5, 5]
    from cadence.checkpoint.file_store import FileStore

    assert FileStore(directory).read("latest")["meta"]["step"] == 5
