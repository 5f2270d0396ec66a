"""Mesh checkpoints through the `Checkpoint` callback and the DCP store (gloo, forked workers).

Each launch groups several runs (a launch costs seconds): FSDP2 on shard 2
stopped mid-epoch at step 7 and resumed, with sync and with async saves,
equal bit for bit (losses and parameters) to the run that was never stopped;
its EMA shadow resharded 2 -> 1 (a 1-rank mesh, and the local backend in one
process through `cadence.checkpoint.from_checkpoint`); and (slow) shard 2 x tensor 2 on
4 processes, whose checkpoint also loads on shard 2 and on one process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import cadence
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import EMA, Checkpoint
from cadence.checkpoint import from_checkpoint
from cadence.launch import launch
from tests.conftest import tiny_dataset
from tests.distributed.test_mesh import Net, _full, flat, make_engine

pytestmark = pytest.mark.timeout(120)

STEPS, STOP = 20, 7  # 50 steps per epoch at 2 x 2 samples a step on each of 2 ranks: step 7 is mid-epoch


def shadow_of(ema: EMA) -> dict[str, torch.Tensor]:
    """The shadow in full (a loaded one may wait in EMA until the next fit starts: its state_dict has it)."""
    return {name: _full(s).clone() for name, s in ema.state_dict()["shadow"].items()}


def _run(options: dict, callbacks: list, steps: int, batch_size: int) -> tuple[list[float], dict, object]:
    losses: list[float] = []
    ema = next(c for c in callbacks if isinstance(c, EMA))
    rank = dist.get_rank() if dist.is_initialized() else 0
    with make_engine(
        Net(seed=rank + 3), MeshBackend(**options, timeout=60, device="cpu"), batch_size=batch_size, callbacks=callbacks
    ) as engine:
        engine.on(cadence.Event.ON_FORWARD)(lambda e: losses.append(float(e.loss.detach())))
        engine.fit(steps=steps)
        return losses, {"params": flat(engine.model), "ema": shadow_of(ema)}, engine.restored_from


def stop_and_resume(options: dict, directory: str, batch_size: int = 2) -> dict:
    """The uninterrupted run, then for sync and async saves: 7 steps, saved; a new engine resumes for 13."""
    dist.init_process_group("gloo")  # one group for every engine of this launch
    straight_losses, straight, _ = _run(options, [EMA(decay=0.9)], STEPS, batch_size)
    out: dict = {"straight_losses": straight_losses, "straight": straight}
    for mode in ("disabled", "async"):
        folder = str(Path(directory) / mode)
        saver = Checkpoint(dir=folder, interval=STOP, unit="step", async_mode=mode, save_on_fit_end=False)
        first, _, _ = _run(options, [EMA(decay=0.9), saver], STOP, batch_size)
        assert saver.wait(60)
        # A differently seeded model: everything comes from the checkpoint. The resumed run saves at its end.
        loader = Checkpoint(dir=folder, resume=str(Path(folder) / "latest"), async_mode=mode, interval=0)
        rest, final, source = _run(options, [EMA(decay=0.9), loader], STEPS - STOP, batch_size)
        assert loader.wait(60)
        out[mode] = {"losses": first + rest, "final": final, "source": source}
    return out


def load_on_mesh(options: dict, checkpoint: str) -> dict:
    """A fresh engine on this mesh resumes from `checkpoint`: its full parameters and EMA shadow."""
    rank = int(os.environ.get("RANK", "0"))
    ema = EMA(decay=0.9)
    with make_engine(
        Net(seed=rank + 11),
        MeshBackend(**options, timeout=60, device="cpu"),
        batch_size=2,
        callbacks=[ema, Checkpoint(resume=checkpoint)],
    ) as engine:
        engine.evaluate()  # the first run applies the launch mode (on_setup)
        return {"params": flat(engine.model), "ema": shadow_of(ema), "step": engine.state.step}


def load_on_one_process(checkpoint: str) -> dict:
    """`cadence.checkpoint.from_checkpoint` on the local backend (no process group): the store comes from the checkpoint."""
    ema = EMA(decay=0.9)
    engine = from_checkpoint(
        checkpoint,
        *_engine_args(Net(seed=23)),
        loss_fn=F.cross_entropy,
        callbacks=[ema, Checkpoint(dir=str(Path(checkpoint).parent / "one-process"), interval=0)],
        backend="local",
        seed=0,
        grad_accum=2,
        train={"batch_size": 2, "shuffle": False},  # as saved (per data rank)
        device="cpu",
    )
    # Pretrained weights alone, through the callback on the local backend: the same store choice.
    pretrained = Checkpoint(dir=str(Path(checkpoint).parent / "pretrained"), pretrained=checkpoint, interval=0)
    with cadence.Engine(
        *_engine_args(Net(seed=29)),
        loss_fn=F.cross_entropy,
        callbacks=[pretrained],
        backend="local",
        seed=0,
        device="cpu",
    ) as other:
        other.evaluate(tiny_dataset(8))  # the first run applies the launch mode (on_setup)
        weights = flat(other.model)
    with engine:
        return {
            "params": flat(engine.model),
            "pretrained": weights,
            "ema": shadow_of(ema),
            "step": engine.state.step,
            "dist": dist.is_initialized(),
        }


def _engine_args(model: torch.nn.Module) -> tuple:
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), tiny_dataset(400)


def _check_resumed(got: dict) -> None:
    straight = got["straight"]
    for mode in ("disabled", "async"):
        resumed = got[mode]
        assert resumed["source"], mode
        assert len(resumed["losses"]) == len(got["straight_losses"]) > 0
        assert resumed["losses"] == got["straight_losses"], mode  # bit for bit, every micro-batch
        assert torch.equal(resumed["final"]["params"], straight["params"]), mode
        assert all(torch.equal(resumed["final"]["ema"][n], s) for n, s in straight["ema"].items()), mode


def test_fsdp2_resumes_bitwise_and_its_ema_reshards_to_one_rank_and_one_process(tmp_path: Path) -> None:
    got = launch(stop_and_resume, {"shard": 2}, str(tmp_path), nprocs=2, start_method="fork", timeout=110)
    _check_resumed(got)
    final = str(tmp_path / "disabled" / "latest")  # the resumed run's save at step 20
    ema = got["straight"]["ema"]
    assert set(ema) == {n for n, _ in Net().named_parameters()}
    on_mesh = launch(load_on_mesh, {"shard": 1}, final, nprocs=1, start_method="fork", timeout=60)
    on_local = launch(load_on_one_process, final, nprocs=1, start_method="fork", timeout=60)
    assert not on_local["dist"]  # one process, no process group
    assert torch.equal(on_local["pretrained"], got["straight"]["params"])
    for loaded in (on_mesh, on_local):
        assert loaded["step"] == STEPS
        assert torch.equal(loaded["params"], got["straight"]["params"])
        assert loaded["ema"].keys() == ema.keys()
        assert all(torch.equal(loaded["ema"][n], s) for n, s in ema.items())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shard_2_by_tensor_2_resumes_bitwise_and_loads_on_shard_2_and_one_process(tmp_path: Path) -> None:
    options = {"shard": 2, "tensor": 2}
    got = launch(stop_and_resume, options, str(tmp_path), nprocs=4, start_method="fork", timeout=170)
    _check_resumed(got)
    final = str(tmp_path / "async" / "latest")
    on_shard = launch(load_on_mesh, {"shard": 2}, final, nprocs=2, start_method="fork", timeout=60)
    on_local = launch(load_on_one_process, final, nprocs=1, start_method="fork", timeout=60)
    for loaded in (on_shard, on_local):
        assert loaded["step"] == STEPS
        assert torch.equal(loaded["params"], got["straight"]["params"])
        assert all(torch.equal(loaded["ema"][n], s) for n, s in got["straight"]["ema"].items())
