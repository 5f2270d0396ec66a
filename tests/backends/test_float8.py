"""float8 training through torchao (`cadence.backends.float8`): the requirement, the module filter, the transform.

Without a GPU of compute capability >= 8.9 float8 is one clear error, raised
before any process group on every backend. On the CPU the conversion runs with
torchao's emulation (`emulate=True`: float8 casts, high-precision matmuls):
which layers are swapped, in the transforms' order, and that the run trains
like fp32 within float8's error. The float8 matmuls themselves are the CUDA
tests' (tests/examples/test_lm_float8.py) and the GPU benchmark's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.backends.float8 import Float8Config, select
from cadence.backends.local import LocalBackend
from cadence.backends.mesh import MeshBackend

pytest.importorskip("torchao.float8", reason="float8 needs torchao: pip install 'cadence[float8]'")

EMULATED = {"enabled": True, "emulate": True}


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64)) for _ in range(2)
        )
        self.odd = nn.Linear(64, 24)  # 24 is not a multiple of 16: float8 matmuls cannot take it
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.odd(x))

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(400, 16, generator=g), torch.randint(0, 4, (400,), generator=g))


def make_engine(backend, steps_seen: list[float] | None = None) -> cadence.Engine:
    model = Net()
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        dataset(),
        loss_fn=F.cross_entropy,
        backend=backend,
        seed=0,
        train={"batch_size": 8, "shuffle": False},
        device="cpu",
    )
    if steps_seen is not None:
        engine.on(cadence.Event.ON_FORWARD)(lambda e: steps_seen.append(float(e.loss.detach())))
    return engine


def capable_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


def test_without_a_capable_gpu_float8_is_one_error_before_any_group(monkeypatch):
    if capable_gpu():
        pytest.skip("this machine has a GPU of capability >= 8.9: float8 runs here")
    wanted = r"float8 training \((local|ddp|mesh)\) needs a CUDA GPU of compute capability 8\.9 or newer"
    with pytest.raises(ValueError, match=wanted + r".*trains on cpu"):
        make_engine(LocalBackend(device="cpu", float8={"enabled": True}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: joining a group would fail differently
    for backend in (
        DDPBackend(device="cpu", float8={"enabled": True}),
        MeshBackend(shard=2, float8={"enabled": True}, device="cpu"),
    ):
        with pytest.raises(ValueError, match=wanted):
            make_engine(backend)
        assert not dist.is_initialized()


def test_the_filter_skips_the_head_odd_sizes_small_layers_patterns_and_fp32_modules():
    model = Net()
    assert select(model, Float8Config(enabled=True)) == ["inp", "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert "head" not in select(model, Float8Config(enabled=True, skip_head=False))  # 24 x 4: odd sizes
    assert select(model, Float8Config(enabled=True, min_features=64)) == [
        "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"
    ]  # fmt: skip
    assert select(model, Float8Config(enabled=True, exclude=["blocks.1.*", "inp"])) == ["blocks.0.0", "blocks.0.2"]
    assert select(model, Float8Config(enabled=True), skip=["blocks.0"]) == ["inp", "blocks.1.0", "blocks.1.2"]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"fsdp_all_gather needs recipe='tensorwise'"):
        Float8Config(enabled=True, recipe="rowwise", fsdp_all_gather=True)
    with pytest.raises(ValueError, match=r"fsdp_all_gather .* needs the mesh backend"):
        LocalBackend(device="cpu", float8={"enabled": True, "fsdp_all_gather": True})
    with pytest.raises(cadence.ConfigError, match=r"float8\.recipe"):
        MeshBackend(float8={"enabled": True, "recipe": "columnwise"}, device="cpu")


def test_float8_with_a_tensor_axis_is_refused_before_any_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    class Parallel(Net):
        def parallelize(self, mesh) -> None: ...

    model = Parallel()
    with pytest.raises(NotImplementedError, match=r"float8 with tensor=2 is not supported yet"):
        cadence.Engine(
            model, torch.optim.SGD(model.parameters()), dataset(), loss_fn=F.cross_entropy, device="cpu",
            backend=MeshBackend(shard=1, tensor=2, float8=EMULATED, device="cpu"),
        )  # fmt: skip
    assert not dist.is_initialized()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_swaps_the_chosen_layers_and_trains_like_fp32(recipe):
    float8, plain = [], []
    backend = LocalBackend(
        device="cpu",
        float8={**EMULATED, "recipe": recipe},
        precision_overrides={"blocks.1": "fp32"},  # kept out of float8 with what is inside it
        activation_checkpointing={"mode": "full"},  # after float8: the swapped layers are recomputed
    )
    with make_engine(backend, float8) as engine:
        kinds = {name: type(m).__name__ for name, m in engine.model.named_modules() if isinstance(m, nn.Linear)}
        keys = sorted(engine.model.state_dict())
        engine.fit(steps=20)
    assert kinds == {
        "inp": "Float8Linear", "blocks.0.0": "Float8Linear", "blocks.0.2": "Float8Linear",
        "blocks.1.0": "Linear", "blocks.1.2": "Linear", "odd": "Linear", "head": "Linear",
    }  # fmt: skip
    assert keys == sorted(Net().state_dict())  # checkpoints keep the plain model's keys
    with make_engine(LocalBackend(device="cpu"), plain) as engine:
        engine.fit(steps=20)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(float8, plain)), list(zip(float8, plain))
    assert float8 != plain  # float8 casts changed something
