"""The mesh backend in one process (a mesh of one): bf16 autocast, and on a GPU compile and CPU offload."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cadence
from cadence import Event
from cadence.backends import MeshBackend
from cadence.callbacks import NonFiniteSkip
from tests.conftest import tiny_dataset, tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    # One process started as a plain script: the backend makes a group of one itself.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


class Losses(cadence.Callback):
    def __init__(self):
        self.losses, self.dtypes = [], []

    def on_forward(self, engine):
        self.losses.append(float(engine.loss))
        self.dtypes.append(engine.outputs.dtype)


def train(backend, steps=6, callbacks=()):
    losses = Losses()
    model = tiny_model()
    with cadence.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.02), tiny_dataset(96), loss_fn=F.cross_entropy,
        backend=backend, callbacks=[losses, *callbacks], seed=0, train={"batch_size": 16},
    ) as engine:  # fmt: skip
        engine.fit(steps=steps)
        params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in engine.model.state_dict().items()}
        return losses, {k: v.detach().float().cpu() for k, v in params.items()}, engine.backend


def test_bf16_autocasts_where_parameters_are_not_sharded():
    losses, _, backend = train(MeshBackend(device="cpu", precision="bf16"), steps=2)
    assert not backend.sharded
    assert losses.dtypes == [torch.bfloat16] * 2  # not silently fp32 on a mesh of one


@pytest.mark.cuda
def test_compile_on_a_one_process_nccl_mesh_trains_like_eager():
    eager, eager_params, _ = train(MeshBackend(device="cuda", precision="bf16", units=["Linear"]))
    compiled, compiled_params, backend = train(
        MeshBackend(device="cuda", precision="bf16", units=["Linear"], compile={"enabled": True})
    )
    assert torch.distributed.is_available() and backend.device == torch.device("cuda", 0)
    assert compiled.dtypes == [torch.bfloat16] * 6
    assert compiled.losses == pytest.approx(eager.losses, rel=2e-2)  # bf16, another kernel order
    assert compiled.losses[-1] < compiled.losses[0]
    assert set(compiled_params) == set(eager_params)  # the plain module's keys (compile is in place)


class NanGradientAt(cadence.Callback):
    """Puts a NaN into this rank's first gradient shard before the optimizer step of step `step`."""

    order = 5  # before NonFiniteSkip

    def __init__(self, step):
        self.step = step

    def on_before_optimizer_step(self, engine):
        if engine.state.step + 1 == self.step:
            engine.backend.local_gradients(engine)[0].view(-1)[0] = float("nan")


@pytest.mark.cuda
def test_cpu_offload_on_one_gpu_keeps_parameters_on_the_host_and_skips_a_non_finite_step():
    skip = NonFiniteSkip()
    losses, params, backend = train(
        MeshBackend(device="cuda", cpu_offload=True, units=["Linear"]), callbacks=[NanGradientAt(3), skip]
    )
    assert backend.sharded  # FSDP2 over a mesh of one: CPUOffloadPolicy is FSDP2's
    assert skip.total == 1  # CPU gradients and a CUDA loss checked together (NonFiniteSkip)
    assert all(torch.isfinite(v).all() for v in params.values())
    assert losses.losses[-1] < losses.losses[0]


@pytest.mark.cuda
def test_cpu_offload_parameters_live_on_the_host_and_compute_on_the_gpu():
    model = tiny_model()
    seen = []
    with cadence.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.02), tiny_dataset(32), loss_fn=F.cross_entropy,
        backend=MeshBackend(device="cuda", cpu_offload=True, units=["Linear"]), seed=0, train={"batch_size": 16},
    ) as engine:  # fmt: skip
        engine.on(Event.ON_FORWARD)(lambda e: seen.append(e.outputs.device.type))
        engine.fit(steps=2)
        assert {p.to_local().device.type for p in engine.model.parameters()} == {"cpu"}
        assert all(state.device.type == "cpu" for s in engine.optimizers[0].state.values() for state in s.values()
                   if isinstance(state, torch.Tensor) and state.dim())  # fmt: skip
    assert seen == ["cuda", "cuda"]
