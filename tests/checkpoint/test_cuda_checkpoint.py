"""Checkpoints of GPU state through the `Checkpoint` callback (CUDA only: each test skips without a CUDA device).

- The file store's async save (`LocalBackend`): CUDA tensors are copied into the
  pinned staging on a side stream; the loop goes on at once and its stream waits
  for the copies (buffers at once, parameters and optimizer state before the next
  optimizer step). Each checkpoint must hold the values at its step while training
  goes on, and restore bit for bit.
- The DCP store on a one-process NCCL mesh (`MeshBackend(device=None)` and
  `"cuda"`), sync and async: the same.

Times are printed (`-s`), not asserted: benchmarks/gpu_checkpoint.py measures them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence.callbacks import Checkpoint
from cadence.checkpoint import from_checkpoint
from cadence.checkpoint.file_store import FileStore
from cadence.engine.callback import Callback
from cadence.engine.order import Order
from tests.conftest import tiny_dataset

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU state, pinned staging)"),
]


class Net(torch.nn.Module):
    """A batch norm between two layers: its running statistics are written in place by every forward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.head = (
            torch.nn.Linear(8, width),
            torch.nn.BatchNorm1d(width),
            torch.nn.Linear(width, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.inp(x))))


class Heavy(Net):
    """`Net` and 0.8 GB more: a 256 MB buffer (an early copy) and a 256 MB layer (late copies, with 512 MB of AdamW state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(64 << 20))
        self.wide = torch.nn.Linear(4096, 16384, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0 * self.wide.weight[:1, :4].sum()  # trained (zero gradients): AdamW keeps state


def full(t: Any) -> torch.Tensor:
    """A tensor's whole value on the CPU (a DTensor gathered)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
    return t.cpu().clone()


def cpu_state(engine: cadence.Engine) -> dict[str, Any]:
    """Model and optimizer state as the backend saves them, copied to the CPU."""
    backend = engine.backend
    model = {k: full(v) for k, v in backend.model_state_dict(engine).items()}
    optimizers = [
        {i: {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in o["state"].items()}
        for o in backend.optimizer_state_dicts(engine)
    ]
    return {"model": model, "optimizers": optimizers}


class Snapshot(Callback):
    """At each save point, just before the checkpoint's: the state a save there must hold, and how long the save held the loop."""

    order = Order.CHECKPOINT - 1
    raises_requests = False

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, Any]] = {}
        self.started = 0.0

    def on_save_point(self, engine: cadence.Engine) -> None:
        torch.cuda.synchronize()
        self.saved[engine.state.step] = cpu_state(engine)
        self.started = time.perf_counter()


class Held(Callback):
    """Right after the checkpoint's save point: the time the save held the loop (host time)."""

    order = Order.CHECKPOINT + 1
    raises_requests = False

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot, self.held = snapshot, {}

    def on_save_point(self, engine: cadence.Engine) -> None:
        self.held[engine.state.step] = time.perf_counter() - self.snapshot.started


def assert_equal(expected: dict[str, Any], actual: dict[str, Any], where: str) -> None:
    for name, value in expected["model"].items():
        assert torch.equal(full(actual["model"][name]), value), f"{where}: model.{name}"
    for n, states in enumerate(expected["optimizers"]):
        got = actual["optimizers"][n]
        got = got.get("state", got)
        for index, state in states.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(full(got[index][key]), value), f"{where}: optimizers.{n}.{index}.{key}"


def make_engine(model: torch.nn.Module, callbacks: list[Any], **options: Any) -> cadence.Engine:
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        tiny_dataset(1024),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        seed=0,
        log_interval=1000,
        train={"batch_size": 32, "shuffle": False},
        **options,
    )


def test_async_file_saves_of_gpu_state_hold_their_step_s_values_while_training_goes_on_and_restore_bitwise(
    tmp_path: Path,
) -> None:
    snapshot = Snapshot()
    held = Held(snapshot)
    saver = Checkpoint(dir=str(tmp_path), interval=3, unit="step", async_mode="async", keep_latest_k=0)
    with make_engine(Net(), [snapshot, saver, held], device="cuda") as engine:
        engine.fit(steps=10)  # saves at 3, 6, 9 (each written while the next steps run) and at 10 (fit's end)
        assert saver.wait(120)
    print("\nloop held by each async save (s):", {k: round(v, 4) for k, v in held.held.items()})
    store = FileStore(tmp_path)
    assert store.names() == ["ckpt-s000000000003", "ckpt-s000000000006", "ckpt-s000000000009", "latest"]
    for step in (3, 6, 9):
        assert_equal(snapshot.saved[step], store.read(f"ckpt-s{step:012d}"), f"step {step}")
    restored = from_checkpoint(
        tmp_path / "ckpt-s000000000006",
        (model := Net()),
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        tiny_dataset(1024),
        loss_fn=F.cross_entropy,
        seed=0,
        device="cuda",
        train={"batch_size": 32, "shuffle": False},
        callbacks=[Checkpoint(dir=str(tmp_path / "after"), interval=0)],  # the saved state has one
    )
    with restored:
        assert next(restored.model.parameters()).is_cuda and restored.state.step == 6
        assert_equal(snapshot.saved[6], cpu_state(restored), "restored")


def test_an_async_save_of_gpu_state_returns_before_it_is_written(tmp_path: Path) -> None:
    """About 0.8 GB of GPU state, written at a twentieth of the disk's time: the steps after the save run meanwhile."""
    snapshot = Snapshot()
    held = Held(snapshot)
    saver = Checkpoint(dir=str(tmp_path), interval=2, unit="step", async_mode="async", async_write_share=0.05)
    pending_after: list[bool] = []
    big = Heavy()
    with make_engine(big, [snapshot, saver, held], device="cuda") as engine:
        engine.on(cadence.Event.ON_STEP_END, once=3)(lambda e: pending_after.append(not saver.wait(0)))
        started = time.perf_counter()
        engine.fit(steps=3)
        loop = time.perf_counter() - started
        assert pending_after == [True]  # step 3 ran while step 2's checkpoint was being written
        assert saver.wait(300)
    print(f"\nsave held the loop {held.held[2]:.4f} s; 3 steps {loop:.2f} s")
    assert_equal(snapshot.saved[2], FileStore(tmp_path).read("ckpt-s000000000002"), "step 2")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("device", [None, "cuda"])
def test_dcp_saves_on_a_one_process_nccl_mesh_hold_their_step_s_values_and_restore_bitwise(
    tmp_path: Path, device: str | None, async_mode: str
) -> None:
    from cadence.backends.mesh import MeshBackend
    from cadence.checkpoint.dcp_store import DCPStore

    snapshot = Snapshot()
    saver = Checkpoint(dir=str(tmp_path), interval=3, unit="step", async_mode=async_mode, keep_latest_k=0)
    with make_engine(Net(), [snapshot, saver], backend=MeshBackend(device=device)) as engine:
        engine.fit(steps=7)
        assert engine.backend.device.type == "cuda" and isinstance(saver.store, DCPStore)
        assert saver.wait(120)
    for step in (3, 6):
        assert_equal(snapshot.saved[step], DCPStore(tmp_path).read(f"ckpt-s{step:012d}"), f"step {step}")
    model = Net()
    with from_checkpoint(
        tmp_path / "ckpt-s000000000006",
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        tiny_dataset(1024),
        loss_fn=F.cross_entropy,
        seed=0,
        backend=MeshBackend(device=device),
        train={"batch_size": 32, "shuffle": False},
        callbacks=[Checkpoint(dir=str(tmp_path / "after"), interval=0)],  # the saved state has one
    ) as restored:
        assert restored.state.step == 6
        assert_equal(snapshot.saved[6], cpu_state(restored), "restored")
