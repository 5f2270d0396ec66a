"""FSDP2 gradient accumulation modes (`mesh.accumulation_sync`) on gloo: each trains like one process.

One launch runs several modes one after the other on the same process group:
"last" (unsharded gradients until the step's last micro-batch), "every"
(reduce-scatter each micro-batch) and, under HSDP, "replicate_last"
(reduce-scatter each, all-reduce across replicas at the last). Each equals the
local backend on the same global batch within 1e-6 after 8 AdamW steps of 4
micro-batches, and makes the collectives its mode says (counted per step).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # imported once here, not in every forked worker
from torch.nn import functional as F

import cadence
from cadence.backends.mesh import MeshBackend
from cadence.launch import launch
from tests.conftest import tiny_dataset
from tests.distributed.test_mesh import Net, flat

pytestmark = pytest.mark.timeout(120)

STEPS, ACCUM, MICRO = 8, 4, 2  # 4 micro-batches of 2 samples per rank and step
UNITS = 3  # FSDP2 modules with gradients: the two blocks and the root


class CountCollectives(cadence.Callback):
    """FSDP2's reduce-scatters and all-reduces in the third step of each fit (torch.distributed calls, counted and passed on)."""

    order = 0
    raises_requests = False  # no agreement all-reduce in the step: only FSDP2's collectives are counted

    def __init__(self) -> None:
        self.counts = {"reduce_scatter_single": 0, "all_reduce": 0}
        self.counting = False
        for name in self.counts:  # once per worker process
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += self.counting
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_fit_start(self, engine) -> None:
        self.counts = dict.fromkeys(self.counts, 0)

    def on_step_start(self, engine) -> None:
        self.counting = engine.state.step == 2

    def on_step_end(self, engine) -> None:
        self.counting = False


def make_engine(backend, batch_size: int, callbacks=()) -> cadence.Engine:
    model = Net(seed=int(os.environ.get("RANK", "0")))  # ranks seeded apart: the backend starts them equal
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        tiny_dataset(400),
        loss_fn=F.cross_entropy,
        backend=backend,
        callbacks=callbacks,
        seed=0,
        grad_accum=ACCUM,
        train={"batch_size": batch_size, "shuffle": False},
        device="cpu",
    )


def train_modes(options: dict, modes: list[str]) -> dict:
    """Each mode in turn on one process group: parameters after STEPS steps and the third step's collectives."""
    dist.init_process_group("gloo")
    try:
        results, counter = {}, CountCollectives()
        for mode in modes:
            backend = MeshBackend(**options, accumulation_sync=mode, timeout=30, device="cpu")
            with make_engine(backend, MICRO, [counter]) as engine:
                engine.fit(steps=STEPS)
                params = engine.backend.all_gather(flat(engine.model), domain="optimizer")
                results[mode] = {"params": params, "counts": dict(counter.counts)}
        return results
    finally:
        dist.destroy_process_group()


def reference(data_size: int) -> torch.Tensor:
    """One process on the same global batch (the data ranks' micro-batches side by side)."""
    with make_engine("local", MICRO * data_size) as engine:
        engine.fit(steps=STEPS)
        return flat(engine.model)


def check(got: dict, data_size: int, replicas: int) -> None:
    shards = data_size // replicas
    ref = reference(data_size)
    for mode, result in got.items():
        params = result["params"]
        torch.testing.assert_close(params[0], ref, rtol=0, atol=1e-6, msg=lambda m, mode=mode: f"{mode}: {m}")
        assert all(torch.equal(params[0], p) for p in params[1:]), mode
        counts = result["counts"]
        # Reduce-scatters (none over a shard group of one): one per FSDP2 module and micro-batch, or one per
        # module at the step's last micro-batch.
        scatters = UNITS * (1 if mode == "last" else ACCUM) if shards > 1 else 0
        assert counts["reduce_scatter_single"] == scatters, (mode, counts)
        # HSDP all-reduces across replicas: each micro-batch ("every"), or once per step.
        reduces = UNITS * (ACCUM if mode == "every" else 1) if replicas > 1 else 0
        assert counts["all_reduce"] == reduces, (mode, counts)


def test_fsdp2_last_and_every_train_like_one_process():
    got = launch(train_modes, {"shard": 2}, ["last", "every"], nprocs=2, start_method="fork", timeout=100)
    check(got, data_size=2, replicas=1)


def test_hsdp_modes_on_two_replicas_train_like_one_process():
    modes = ["last", "every", "replicate_last"]
    got = launch(train_modes, {"replicate": 2, "shard": 1}, modes, nprocs=2, start_method="fork", timeout=100)
    check(got, data_size=2, replicas=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hsdp_2x2_modes_on_four_processes_train_like_one_process():
    modes = ["last", "every", "replicate_last"]
    got = launch(train_modes, {"replicate": 2, "shard": 2}, modes, nprocs=4, start_method="fork", timeout=230)
    check(got, data_size=4, replicas=2)


def test_replicate_last_without_replicas_fails_before_any_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    backend = MeshBackend(shard=2, accumulation_sync="replicate_last", timeout=30, device="cpu")
    with pytest.raises(ValueError, match=r"replicate_last.*replicate=1.*use 'every'"):
        make_engine(backend, MICRO)
    assert not dist.is_initialized()
    with pytest.raises(cadence.ConfigError, match=r"mesh\.accumulation_sync"):
        MeshBackend(accumulation_sync="sometimes", device="cpu")
