"""Per-module precision (`precision_overrides`) in bf16 runs: the overridden modules compute in fp32.

On the local backend, DDP and a mesh whose parameters are not sharded the
modules run with autocast off and fp32 inputs; on a sharded mesh they are
FSDP2 units of their own with an fp32 `MixedPrecisionPolicy`. Each run is
checked from inside the modules' forward (the dtypes they compute in) and
against a reference written by hand: autocast with the same modules excluded
(local, DDP), or FSDP2's mixed precision emulated on one process (bf16 copies
of the other parameters, fp32 gradient averaging of the two ranks' halves).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # imported once here, not in every forked worker
from torch import nn
from torch.nn import functional as F

import cadence
from cadence.backends.ddp import DDPBackend
from cadence.backends.local import LocalBackend
from cadence.backends.mesh import MeshBackend
from cadence.launch import launch
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(120)

STEPS, LR, BATCH = 6, 1e-2, 4  # BATCH: the global batch (2 per rank on two ranks)
OVERRIDES = {"Norm": "fp32", "head": "fp32"}  # a class and a module name


class Norm(nn.Module):
    """RMSNorm by hand (no autocast rule applies to its ops: it computes in its input's dtype)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight
        self.seen.append((x.dtype, self.weight.dtype, out.dtype))
        return out


class Head(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.seen.append((x.dtype, self.weight.dtype, out.dtype))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = Norm(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(self.norm(x))
        self.seen.append(hidden.dtype)  # a bf16 module's matmul
        return x + self.fc2(torch.relu(hidden))


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = Head(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def fp32_modules(self) -> list[nn.Module]:
        return [*(b.norm for b in self.blocks), self.head]


def flat(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [(p.full_tensor() if hasattr(p, "full_tensor") else p).reshape(-1) for p in model.parameters()]
        )


def dtypes_seen(model: Net) -> dict[str, set]:
    """The dtypes each kind of module computed in during the last fit."""
    return {
        "norm": {s for b in model.blocks for s in b.norm.seen},
        "head": set(model.head.seen),
        "block": {s for b in model.blocks for s in b.seen},
    }


def make_engine(backend, batch_size: int, model: Net | None = None) -> cadence.Engine:
    model = model or Net(seed=0)
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        tiny_dataset(200),
        loss_fn=F.cross_entropy,
        backend=backend,
        seed=0,
        train={"batch_size": batch_size, "shuffle": False},
        device="cpu",
    )


def batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = tiny_dataset(200).tensors
    return [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(steps)]


# -- the references, written by hand ------------------------------------------------------------------


def autocast_reference(ranks: int = 1) -> torch.Tensor:
    """bf16 autocast with the fp32 modules' forward outside it (hooks turn it off and cast inputs); with `ranks`,
    the gradients of each rank's part of the batch averaged, as DDP does."""
    model = Net(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for module in model.fp32_modules():
        off = torch.autocast("cpu", enabled=False)

        def enter(module, args, off=off):
            off.__enter__()
            return tuple(a.float() for a in args)

        def leave(module, args, out, off=off):
            off.__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
    for x, y in batches(STEPS, BATCH):
        for rank in range(ranks):  # the sampler's shards: every `ranks`-th sample
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x[rank::ranks]), y[rank::ranks])
            (loss / ranks).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def fsdp_reference(ranks: int = 2) -> torch.Tensor:
    """FSDP2's bf16 policy on one process: bf16 copies of the parameters but the fp32 modules' (whose inputs are
    cast to fp32 and outputs back to bf16), each rank's half of the batch, fp32 gradients averaged over the ranks."""
    model = Net(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    fp32 = {name for name, m in model.named_modules() if m in model.fp32_modules()}
    for module in model.fp32_modules():
        module.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
        module.register_forward_hook(lambda m, args, out: out.to(torch.bfloat16))
    names = [n for n, _ in model.named_parameters()]
    for x, y in batches(STEPS, BATCH):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(ranks):  # the sampler's shards: every `ranks`-th sample
            params = {
                n: p if n.rsplit(".", 1)[0] in fp32 else p.to(torch.bfloat16) for n, p in model.named_parameters()
            }
            out = torch.func.functional_call(model, params, (x[rank::ranks].to(torch.bfloat16),))
            loss = F.cross_entropy(out, y[rank::ranks])
            for total, grad in zip(grads, torch.autograd.grad(loss, [params[n] for n in names])):
                total += grad.float()
        for p, total in zip(model.parameters(), grads):
            p.grad = total / ranks
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


# -- one process ------------------------------------------------------------------------------------------


def test_local_bf16_overridden_modules_compute_in_fp32_and_train_as_written_by_hand():
    backend = LocalBackend(device="cpu", precision="bf16", precision_overrides=OVERRIDES)
    with make_engine(backend, BATCH) as engine:
        engine.fit(steps=STEPS)
        seen = dtypes_seen(engine.model)
        params = flat(engine.model)
        assert engine.outputs.dtype == torch.float32  # the head's
    fp32, bf16 = torch.float32, torch.bfloat16
    assert seen == {"norm": {(fp32, fp32, fp32)}, "head": {(fp32, fp32, fp32)}, "block": {bf16}}
    torch.testing.assert_close(params, autocast_reference(), rtol=0, atol=0)
    # Without overrides the same norms compute in bf16 (the check above can fail).
    with make_engine(LocalBackend(device="cpu", precision="bf16"), BATCH) as engine:
        engine.fit(steps=1)
        assert dtypes_seen(engine.model)["norm"] == {(bf16, fp32, fp32)}  # its statistics in bf16


def test_mesh_on_one_process_autocasts_and_excludes_the_same_modules():
    backend = MeshBackend(precision="bf16", precision_overrides=OVERRIDES, device="cpu")
    with make_engine(backend, BATCH) as engine:
        assert not engine.backend.sharded
        engine.fit(steps=STEPS)
        assert dtypes_seen(engine.model)["norm"] == {(torch.float32,) * 3}
        torch.testing.assert_close(flat(engine.model), autocast_reference(), rtol=0, atol=0)


def test_unknown_keys_and_values_are_errors_naming_them(monkeypatch):
    with pytest.raises(ValueError, match=r"local\.precision_overrides: \['Nrom'\] match no module of Net.*'Norm'"):
        make_engine(LocalBackend(device="cpu", precision="bf16", precision_overrides={"Nrom": "fp32"}), BATCH)
    with pytest.raises(ValueError, match=r"precision_overrides\['head'\] = 'fp8': expected one of \['fp32'\]"):
        make_engine(LocalBackend(device="cpu", precision="bf16", precision_overrides={"head": "fp8"}), BATCH)
    # Patterns on module names are keys too; the mesh refuses before any process group.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"mesh\.precision_overrides: \['blocks\.\*\.nrom'\] match no module"):
        make_engine(MeshBackend(shard=2, precision_overrides={"blocks.*.nrom": "fp32"}, device="cpu"), BATCH)
    assert not dist.is_initialized()


# -- two ranks: DDP and FSDP2 -----------------------------------------------------------------------------


def train_two_ranks() -> dict:
    dist.init_process_group("gloo")
    try:
        results = {}
        for name, backend in (
            ("ddp", DDPBackend(device="cpu", precision="bf16", precision_overrides=OVERRIDES)),
            ("fsdp2", MeshBackend(shard=2, precision="bf16", precision_overrides=OVERRIDES, device="cpu")),
            (
                "pattern",
                MeshBackend(shard=2, precision="bf16", precision_overrides={"blocks.*.norm": "fp32"}, device="cpu"),
            ),
        ):
            model = Net(seed=int(os.environ["RANK"]))  # apart: the backends start the ranks equal
            with make_engine(backend, BATCH // 2, model) as engine:
                engine.fit(steps=STEPS)
                results[name] = {"params": engine.backend.all_gather(flat(model), "optimizer"), **dtypes_seen(model)}
                if name == "fsdp2":
                    policies = {
                        n: m._get_fsdp_state()._mp_policy
                        for n, m in model.named_modules()
                        if n in ("head", "blocks.0.norm", "blocks.0", "")
                    }
                    results[name]["policies"] = {n: (p.param_dtype, p.output_dtype) for n, p in policies.items()}
        return results
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_two_ranks_compute_overridden_modules_in_fp32():
    got = launch(train_two_ranks, nprocs=2, start_method="fork", timeout=100)
    fp32, bf16 = torch.float32, torch.bfloat16
    ddp, fsdp2, pattern = got["ddp"], got["fsdp2"], got["pattern"]
    assert (ddp["norm"], ddp["head"], ddp["block"]) == ({(fp32,) * 3}, {(fp32,) * 3}, {bf16})
    torch.testing.assert_close(ddp["params"][0], autocast_reference(ranks=2), rtol=0, atol=1e-6)
    # FSDP2: fp32 parameters and inputs inside the fp32 units, bf16 everywhere else.
    assert (fsdp2["norm"], fsdp2["head"], fsdp2["block"]) == ({(fp32,) * 3}, {(fp32,) * 3}, {bf16})
    assert fsdp2["policies"] == {
        "": (bf16, None), "blocks.0": (bf16, None), "blocks.0.norm": (fp32, bf16), "head": (fp32, bf16)
    }  # fmt: skip
    torch.testing.assert_close(fsdp2["params"][0], fsdp_reference(), rtol=0, atol=1e-6)
    for result in got.values():
        assert torch.equal(result["params"][0], result["params"][1])
    # A pattern on names: the norms only; the head computes in bf16.
    assert pattern["norm"] == {(fp32,) * 3} and pattern["head"] == {(bf16, bf16, bf16)}
