"""Two gloo ranks train like one process, and take every control decision together."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo  # DDP imports it (~1.5 s): once here, not in every forked worker
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.launch import WorkerError, launch
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH, STEPS = 8, 20


def run(fn, *args, timeout=90):
    return launch(fn, *args, nprocs=2, start_method="fork", timeout=timeout)


def make_engine(batch_size, *, grad_accum=1, callbacks=(), backend="auto", steps=STEPS):
    model = tiny_model(seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return cadence.Engine(
        model,
        optimizer,
        tiny_dataset(400),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        backend=backend,
        seed=0,
        grad_accum=grad_accum,
        log_interval=5,
        train={"batch_size": batch_size, "shuffle": False},
        device="cpu",
    )


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def log_loss(engine):
    engine.log("loss", engine.loss.detach())


def train_two_ranks(grad_accum):
    with make_engine(GLOBAL_BATCH // 2 // grad_accum, grad_accum=grad_accum) as engine:
        engine.on(cadence.Event.ON_FORWARD)(log_loss)
        engine.fit(steps=STEPS)
        replicas = engine.backend.all_gather(flat_parameters(engine.model))
        return replicas, engine.state.step, engine.logged


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_two_ranks_equal_one_process_with_the_same_global_batch(grad_accum):
    replicas, steps, logged = run(train_two_ranks, grad_accum)
    assert steps == STEPS and torch.equal(replicas[0], replicas[1])  # bitwise equal across ranks

    single = make_engine(GLOBAL_BATCH // grad_accum, grad_accum=grad_accum)
    single.on(cadence.Event.ON_FORWARD)(log_loss)
    single.fit(steps=STEPS)
    assert single.backend.name == "local"
    torch.testing.assert_close(replicas[0], flat_parameters(single.model), rtol=0, atol=1e-6)
    # The logged loss is reduced over both ranks: it matches the single-process mean.
    assert logged["loss"] == pytest.approx(single.logged["loss"], abs=1e-6)


def gradients_after_each_backward():
    with make_engine(2, grad_accum=2, steps=2) as engine:
        seen = []

        def record(engine):  # every rank's first-parameter gradient after this micro-batch's backward
            grad = next(engine.model.parameters()).grad.detach().reshape(-1).clone()
            seen.append(engine.backend.all_gather(grad))

        engine.on(cadence.Event.ON_BACKWARD)(record)
        engine.fit(steps=2)
        return seen


def test_accumulating_micro_batches_do_not_synchronize_gradients_and_the_last_does():
    seen = run(gradients_after_each_backward)  # rank 0's record of every rank's gradients
    assert len(seen) == 4  # 2 steps x 2 micro-batches
    for step in (0, 1):
        local, synced = seen[2 * step], seen[2 * step + 1]
        assert not torch.equal(local[0], local[1])  # each rank still holds its own gradient
        assert torch.equal(synced[0], synced[1])  # all-reduced on the step's last micro-batch


class RequestOnOneRank(cadence.Callback):
    """Raises `kind` at one step on one rank only, and records what the loop did."""

    def __init__(self, kind, rank, step):
        self.kind, self.rank, self.step = kind, rank, step
        self.before = self.after = None

    def on_before_optimizer_step(self, engine):
        if engine.state.step == self.step:
            self.before = flat_parameters(engine.model).clone()
            if engine.backend.rank == self.rank:
                getattr(engine, f"request_{self.kind}")(f"{self.kind} on rank {self.rank} only")

    def on_step_end(self, engine):
        if engine.state.step == self.step + 1:
            self.after = flat_parameters(engine.model).clone()


def test_skip_requested_on_rank_one_skips_on_both():
    def train():
        recorder = RequestOnOneRank("skip", rank=1, step=5)
        with make_engine(4, callbacks=[recorder]) as engine:
            engine.fit(steps=10)
            report = (engine.state.step, engine.state.skipped_steps, torch.equal(recorder.before, recorder.after))
            return engine.backend.all_gather_object(report)

    assert run(train) == [(10, 1, True), (10, 1, True)]


def test_stop_requested_on_rank_zero_stops_both_after_the_same_step():
    def train():
        with make_engine(4, callbacks=[RequestOnOneRank("stop", rank=0, step=6)]) as engine:
            engine.fit(steps=STEPS)
            report = (engine.state.step, engine.agreed("stop"))
            return engine.backend.all_gather_object(report)

    assert run(train) == [(7, 1), (7, 1)]


class RaiseAt(cadence.Callback):
    def __init__(self, rank, step):
        self.rank, self.step = rank, step

    def on_step_start(self, engine):
        if engine.state.step == self.step and engine.backend.rank == self.rank:
            raise ValueError(f"injected failure on rank {self.rank} at step {self.step}")


def test_a_rank_raising_at_step_3_is_reported_with_its_traceback():
    def train():
        with make_engine(
            4, callbacks=[RaiseAt(rank=1, step=3)], backend=DDPBackend(timeout=20, device="cpu")
        ) as engine:
            engine.fit(steps=STEPS)

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run(train)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1
    assert "injected failure on rank 1 at step 3" in info.value.traceback
    assert "in on_step_start" in info.value.traceback


def test_the_other_rank_fails_within_the_collective_timeout(tmp_path):
    # Rank 1 raises at step 3 and then stays alive without joining any collective
    # (a wedged rank keeps its sockets open): rank 0 must fail on its own, within
    # the collective timeout, instead of waiting forever.
    collective_timeout = 3.0

    def train():
        rank = int(os.environ["RANK"])
        engine = make_engine(
            4, callbacks=[RaiseAt(rank=1, step=3)], backend=DDPBackend(timeout=collective_timeout, device="cpu")
        )
        start = time.monotonic()
        try:
            engine.fit(steps=STEPS)
        except Exception as error:
            report = {"rank": rank, "step": engine.state.step, "after": time.monotonic() - start, "error": repr(error)}
            Path(tmp_path, f"rank{rank}.json").write_text(json.dumps(report))
            if rank == 1:
                time.sleep(30)  # wedged; launch kills it once rank 0 has failed
            raise
        return "finished"

    with pytest.raises(WorkerError) as info:
        run(train, timeout=60)
    assert info.value.rank == 0  # the first failure launch saw: rank 1 is still asleep
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["step"] == 3
    assert report["after"] < collective_timeout + 5, report
    assert "timed out" in report["error"].lower() or "timeout" in report["error"].lower(), report
