"""Processes for the checkpoint tests: training runs that stop and resume, and a save loop to kill.

Used through `multiprocessing` fork (fast: torch is already imported) and, for
one case, as a script in a brand-new interpreter::

    python tests/callbacks/checkpoint_workers.py run DIR OUT --workers 2 --stop 13 --resume auto
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # building an optimizer imports it (~2 s): once here, not in every forked child
import torchdata.stateful_dataloader  # noqa: F401 - likewise

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint import from_checkpoint

STEPS = 40
EPOCHS = 3


class RecordLosses(cadence.Callback):
    """Every micro-batch's loss, as a tensor (compared with torch.equal)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_forward(self, engine: cadence.Engine) -> None:
        self.losses.append(engine.loss.detach().clone())


def build(
    directory: str,
    *,
    workers: int,
    mode: str,
    stop: int | None,
    resume: str,
    async_mode: str = "disabled",
    backend="local",
):
    """The seeded run: dropout (global RNG), AdamW, StepLR, shuffled Dataset, grad accumulation 2."""
    generator = torch.Generator().manual_seed(1234)
    samples = 64 if mode == "step" else 72  # epoch mode: 9 micro-batches, so each epoch ends on a 1-batch step
    dataset = torch.utils.data.TensorDataset(
        torch.randn(samples, 6, generator=generator), torch.randn(samples, 1, generator=generator)
    )
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    options: dict[str, Any] = {"dir": directory, "async_mode": async_mode, "keep_latest_k": 2}
    options["interval"] = 10 if mode == "step" else 1
    if resume == "auto":
        options["auto_resume"] = True
    elif resume == "path":
        options["resume"] = str(Path(directory) / "latest")
    recorder = RecordLosses()
    budget = {"steps": STEPS} if mode == "step" else {"epochs": EPOCHS}
    kwargs = dict(
        loss_fn=torch.nn.functional.mse_loss,
        scheduler=scheduler,
        callbacks=[recorder, Checkpoint(**options)],
        seed=11,
        grad_accum=2,
        backend=backend,
        device="cpu",
        log_interval=1000,
        train=cadence.DataConfig(batch_size=8, num_workers=workers),
        **budget,
    )
    args = (model, optimizer, dataset)
    if resume == "from_checkpoint":
        engine = from_checkpoint(directory, *args, **kwargs)
    else:
        engine = cadence.Engine(*args, **kwargs)
    if stop is not None:  # stop after step `stop`: requested before its optimizer step, agreed in that step
        engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP, once=stop)(lambda e: e.request_stop("test"))
    return engine, recorder


def outcome(engine: cadence.Engine, recorder: Any) -> dict[str, Any]:
    """What a resume test compares: losses, parameters, optimizer state, engine state, where it restored from."""
    return {
        "losses": recorder.losses,
        "params": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "optimizer": engine.optimizers[0].state_dict(),
        "state": engine.state.state_dict(),
        "restored_from": engine.restored_from,
    }


def run(
    directory: str, out: str, *, workers: int, mode: str = "step", stop: int | None = None, resume: str = "none"
) -> None:
    """Train (to `stop`, or to the end) and write losses, parameters and optimizer state to `out`."""
    torch.set_num_threads(1)
    try:
        engine, recorder = build(directory, workers=workers, mode=mode, stop=stop, resume=resume)
        engine.fit()
        result = outcome(engine, recorder)
        torch.save(result, out)
    except BaseException:
        Path(out + ".error").write_text(traceback.format_exc())
        raise


def ddp_run(directory: str, stop: int | None = None, resume: str = "none") -> dict[str, Any]:
    """One rank of a 2-process DDP run (started by cadence.launch); rank 0's result is returned."""
    engine, recorder = build(directory, workers=0, mode="step", stop=stop, resume=resume, backend="auto")
    try:
        engine.fit()
        return {
            "losses": recorder.losses,
            "params": {k: v.clone() for k, v in engine.model.state_dict().items()},
            "optimizer": engine.optimizers[0].state_dict(),
            "state": engine.state.state_dict(),
            "world_size": engine.backend.world_size,
        }
    finally:
        engine.close()


# -- plain DataLoaders: the user's own loader, resumed mid-epoch ------------------------------

PLAIN_STEPS = 14  # 64 samples, batches of 8, 2 micro-batches per step: 4 steps per epoch


class NoisyDataset(torch.utils.data.Dataset):
    """Samples with random noise added when read (an augmentation drawing from torch's RNG)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(99)
        self.x, self.y = torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.1 * torch.randn(6), self.y[index]


def plain_loader(kind: str, workers: int, *, rank: int = 0, world: int = 1) -> torch.utils.data.DataLoader:
    """The loaders users pass: shuffle=True with or without a generator, a replacement sampler, a distributed one."""
    dataset = NoisyDataset()
    options: dict[str, Any] = {"batch_size": 8, "num_workers": workers}
    if kind == "shuffle":
        options["shuffle"] = True
    elif kind == "generator":
        options.update(shuffle=True, generator=torch.Generator().manual_seed(5))
    elif kind == "replacement":
        options["sampler"] = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=64)
    elif kind == "distributed":
        options["sampler"] = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=3)
    else:
        raise ValueError(kind)
    return torch.utils.data.DataLoader(dataset, **options)


def plain_run(
    directory: str, out: str | None, *, kind: str, workers: int, stop: int | None = None, backend: str = "local"
) -> dict[str, Any]:
    """Train on a plain DataLoader to `stop` (or the end), resuming from `directory` when it holds a checkpoint."""
    torch.set_num_threads(1)
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        torch.manual_seed(7)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        recorder = RecordLosses()
        checkpoint = Checkpoint(dir=directory, interval=5, keep_latest_k=2, auto_resume=True)
        engine = cadence.Engine(
            model, optimizer, plain_loader(kind, workers, rank=rank, world=world),
            loss_fn=torch.nn.functional.mse_loss, callbacks=[recorder, checkpoint], seed=11, grad_accum=2,
            steps=PLAIN_STEPS, log_interval=1000, backend=backend,
            device="cpu",
        )  # fmt: skip
        if stop is not None:
            engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP, once=stop)(lambda e: e.request_stop("test"))
        try:
            engine.fit()
        finally:
            engine.close()
        result = outcome(engine, recorder)
        if out is not None:
            torch.save(result, out)
        return result
    except BaseException:
        if out is not None:
            Path(out + ".error").write_text(traceback.format_exc())
        raise


# -- the save loop killed at random moments -------------------------------------------------


def expected_params(step: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """What the save loop puts in the model at `step` (so any checkpoint's content is predictable)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        n = int(torch.Size(shape).numel())
        out[name] = (torch.arange(n, dtype=torch.float32).reshape(shape) * 1e-3 + step + i).contiguous()
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def crash_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 64))


class SetParameters(cadence.Callback):
    """Overwrites the parameters with `expected_params(step)` at every step end, before the checkpoint."""

    order = 90

    def on_step_end(self, engine: cadence.Engine) -> None:
        shapes = {k: tuple(v.shape) for k, v in engine.model.named_parameters()}
        values = expected_params(engine.state.step, shapes)
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                p.copy_(values[name])


def save_loop(directory: str, async_mode: str) -> None:
    """Train forever, saving at every step (history every 3rd, `latest` only otherwise) until killed."""
    torch.set_num_threads(1)
    model = crash_model()
    data = [(torch.randn(4, 128), torch.randn(4, 64))] * 8
    checkpoint = Checkpoint(dir=directory, interval=3, keep_latest_k=2, async_mode=async_mode, auto_resume=True)
    engine = cadence.Engine(
        model, torch.optim.AdamW(model.parameters()), data, loss_fn=torch.nn.functional.mse_loss,
        callbacks=[SetParameters(), checkpoint], seed=0, log_interval=10**6, device="cpu",
    )  # fmt: skip
    engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP)(lambda e: e.request_save("every step"))
    Path(directory, "started").touch()
    engine.fit(steps=10**9)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["run"])
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--mode", default="step")
    parser.add_argument("--stop", type=int, default=None)
    parser.add_argument("--resume", default="none")
    args = parser.parse_args(argv)
    run(args.directory, args.out, workers=args.workers, mode=args.mode, stop=args.stop, resume=args.resume)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
