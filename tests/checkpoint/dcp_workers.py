"""Forked ranks for the DCP store tests: FSDP2 saves and resharded loads, DDP runs with checkpoint="dcp"."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # building an optimizer imports it (~2 s): once here, not in every fork
import torch.distributed as dist

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint.dcp_store import DCPStore
from cadence.checkpoint.store import FORMAT
from tests.callbacks import checkpoint_workers

# -- FSDP2 at the store level (until the mesh backend lands) --------------------------------------


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def shard(net: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def fsdp2(world: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh

    net = shard(model(seed), init_device_mesh("cpu", (world,)))
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def tensor_parallel_2d(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 2-D mesh (shard 1 x tensor 2) on 2 ranks: column/row-wise TP, then FSDP2 over the shard axis."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("shard", "tensor"))
    net = parallelize_module(model(seed), mesh["tensor"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(net, mesh=mesh["shard"])
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        net(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(value: Any) -> Any:
    if hasattr(value, "full_tensor"):
        return value.full_tensor().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_full(v) for v in value]
    return value


def full_state(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(net, optimizer)
    return {"model": _full(model_state), "optimizer": _full(optimizer_state["state"])}


def save(directory: str, net: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """Save through the store as the payload has it on a mesh (DCP-style state dicts); the full values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(net, optimizer)
    payload = {
        "format": FORMAT,
        "version": 1,
        "meta": {"step": step, "epoch": 0},
        "engine": {"step": step, "rank": dist.get_rank() if dist.is_initialized() else 0},
        "model": model_state,
        "optimizers": [optimizer_state],
        "callbacks": {},
    }
    DCPStore(directory).write("latest", payload)
    return full_state(net, optimizer)


def load(directory: str, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Read into templates of this mesh, set the state, return the full values and the payload's engine entry."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(net, optimizer)
    payload = DCPStore(directory).read("latest", template={"model": model_state, "optimizers": [optimizer_state]})
    placements = {k: str(getattr(v, "placements", None)) for k, v in payload["model"].items()}
    set_state_dict(net, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizers"][0])
    return {**full_state(net, optimizer), "engine": payload["engine"], "placements": placements}


def _init() -> None:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def save_on_one(directory: str) -> dict[str, Any]:
    """One rank, a 1-rank FSDP2 mesh: saves `directory/one`."""
    _init()
    try:
        net, optimizer = fsdp2(1)
        train(net, optimizer)
        return save(os.path.join(directory, "one"), net, optimizer, 3)
    finally:
        dist.destroy_process_group()


def two_ranks(directory: str) -> dict[str, Any]:
    """Two ranks: save FSDP2 (`two`) and 2-D (`twod`); load `twod` and `one` into a 1-D FSDP2 mesh of 2."""
    _init()
    try:
        out: dict[str, Any] = {}
        net, optimizer = fsdp2(2)
        train(net, optimizer)
        out["two"] = save(os.path.join(directory, "two"), net, optimizer, 3)
        net, optimizer = tensor_parallel_2d()
        train(net, optimizer, steps=2)
        out["twod"] = save(os.path.join(directory, "twod"), net, optimizer, 2)
        for name in ("twod", "one"):
            net, optimizer = fsdp2(2, seed=9)  # other initial values: all must come from the checkpoint
            out[f"{name}->2"] = load(os.path.join(directory, name), net, optimizer)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, out["twod->2"]["engine"])
        out["engines"] = gathered
        out["errors"] = errors_on_every_rank(directory)
        return out
    finally:
        dist.destroy_process_group()


def errors_on_every_rank(directory: str) -> list[str]:
    """A problem on rank 1 alone (its payload, its template) raises the same error on both ranks, nothing written."""
    from cadence.checkpoint.store import CheckpointError

    rank, messages = dist.get_rank(), []
    bad = {"format": FORMAT, "version": 1, "meta": {"step": 4}, "model": {"w": torch.zeros(2)}}
    if rank == 1:
        bad["model"]["w"] = torch.zeros(2).to_sparse()
    try:
        DCPStore(os.path.join(directory, "bad")).write("latest", bad)
    except CheckpointError as exc:
        messages.append(str(exc))
    template = {"model": {"0.weight": torch.zeros(32, 8 if rank == 0 else 9)}}
    try:
        DCPStore(os.path.join(directory, "two"), template=template).read("latest")
    except CheckpointError as exc:
        messages.append(str(exc))
    return messages


def load_on_one(directory: str) -> dict[str, Any]:
    """One rank, a 1-rank FSDP2 mesh: loads `two`."""
    _init()
    try:
        net, optimizer = fsdp2(1, seed=9)
        return load(os.path.join(directory, "two"), net, optimizer)
    finally:
        dist.destroy_process_group()


# -- DDP with checkpoint="dcp" through the engine and the Checkpoint callback -------------------------


def ddp_run(
    directory: str, stop: int | None = None, resume: str = "none", async_mode: str = "disabled"
) -> dict[str, Any]:
    """The resume tests' seeded run (tests/callbacks/checkpoint_workers.py) on DDP with the DCP store."""
    backend = DDPBackend(checkpoint="dcp", timeout=60, device="cpu")
    engine, recorder = checkpoint_workers.build(
        directory, workers=0, mode="step", stop=stop, resume=resume, async_mode=async_mode, backend=backend
    )
    try:
        engine.fit()
        return checkpoint_workers.outcome(engine, recorder)
    finally:
        engine.close()


def auto_resume_each(directories: list[str]) -> list[tuple[int, str | None]]:
    """One engine per folder with auto_resume (one process group for all): the step and source restored."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = []
    try:
        for directory in directories:
            engine, _ = checkpoint_workers.build(
                directory,
                workers=0,
                mode="step",
                stop=None,
                resume="auto",
                backend=DDPBackend(checkpoint="dcp", device="cpu"),
            )
            try:
                engine.fit(steps=0)  # setup: the launch modes apply
                out.append((engine.state.step, engine.restored_from))
            finally:
                engine.close()
    finally:
        dist.destroy_process_group()
    return out


class RecordAtSaves(cadence.Callback):
    """The model's parameters at every step whose number is a multiple of `every` (what a save there holds)."""

    order = 99

    def __init__(self, every: int) -> None:
        self.every, self.params = every, {}

    def on_step_end(self, engine: cadence.Engine) -> None:
        if engine.state.step % self.every == 0:
            self.params[engine.state.step] = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def async_many(directory: str, steps: int = 100, every: int = 10) -> dict[int, dict[str, torch.Tensor]]:
    """Async DCP saves every `every` steps over `steps` steps, all kept; the parameters at each save."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    data = torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randn(256, 64))
    recorder = RecordAtSaves(every)
    checkpoint = Checkpoint(dir=directory, interval=every, keep_latest_k=0, async_mode="async")
    engine = cadence.Engine(
        net, torch.optim.AdamW(net.parameters()), data, loss_fn=torch.nn.functional.mse_loss,
        backend=DDPBackend(checkpoint="dcp", timeout=60, device="cpu"), callbacks=[recorder, checkpoint], seed=0,
        log_interval=10**6, train=cadence.DataConfig(batch_size=8), steps=steps,
    )  # fmt: skip
    saved = []
    engine.on(cadence.Event.ON_SAVE)(lambda e: saved.append(checkpoint.last_saved.step))
    try:
        engine.fit()
        assert checkpoint.wait(60)
    finally:
        engine.close()
    return {"params": recorder.params, "saved": saved}


# -- the save loop killed at random moments -------------------------------------------------------


def save_loop_rank(directory: str, async_mode: str) -> None:
    """One rank of a DDP run with the DCP store that saves at every step until killed."""
    torch.set_num_threads(1)
    net = checkpoint_workers.crash_model()
    data = [(torch.randn(4, 128), torch.randn(4, 64))] * 8
    checkpoint = Checkpoint(dir=directory, interval=3, keep_latest_k=2, async_mode=async_mode, auto_resume=True)
    engine = cadence.Engine(
        net, torch.optim.AdamW(net.parameters()), data, loss_fn=torch.nn.functional.mse_loss,
        backend=DDPBackend(checkpoint="dcp", timeout=30, device="cpu"), callbacks=[checkpoint_workers.SetParameters(), checkpoint],
        seed=0, log_interval=10**6,
    )  # fmt: skip
    engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP)(lambda e: e.request_save("every step"))
    if engine.backend.is_main:
        Path(directory, "started").touch()
    engine.fit(steps=10**9)


def save_loop(directory: str, async_mode: str) -> None:
    """A new session (so one signal kills the launcher and its ranks) running 2 ranks of `save_loop_rank`."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cadence.launch(save_loop_rank, directory, async_mode, nprocs=2, start_method="fork", timeout=600)
    time.sleep(600)
