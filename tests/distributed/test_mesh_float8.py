"""float8 on FSDP2 (2 gloo ranks, torchao's emulation on the CPU): weights all-gathered in float8, scales precomputed.

With `fsdp_all_gather` each rank casts its weight shard to float8 with the
scale of the whole weight and FSDP2 gathers the float8 bytes; the backend
precomputes those scales after every optimizer step (and at fit start and
around evaluation, where EMA swaps weights). Casting the whole gathered weight
with the same scale gives the same numbers: with fp32 parameters the run with
the float8 all-gather equals the one that gathers and casts after (0.0 apart),
and both, and the bf16 policy's run, train like one float8 process within
float8's error.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # imported once here, not in every forked worker
from torch.nn import functional as F

import cadence
from cadence.backends.local import LocalBackend
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import EMA
from cadence.launch import launch
from tests.backends.test_float8 import Net, dataset

pytest.importorskip("torchao.float8", reason="float8 needs torchao: pip install 'cadence[float8]'")
pytestmark = pytest.mark.timeout(120)

STEPS = 12


def make_engine(model, backend, batch_size: int, losses: list[float]) -> cadence.Engine:
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        dataset(),
        eval_data=dataset(),
        loss_fn=F.cross_entropy,
        backend=backend,
        callbacks=[EMA(decay=0.9)],
        seed=0,
        train={"batch_size": batch_size, "shuffle": False},
        eval={"batch_size": 50},
        device="cpu",
    )
    engine.on(cadence.Event.ON_FORWARD)(lambda e: losses.append(float(e.loss.detach())))
    return engine


def flat(model) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.full_tensor().reshape(-1) for _, p in sorted(model.named_parameters())])


def train_float8() -> dict:
    dist.init_process_group("gloo")
    try:
        results = {}
        for gather, precision in ((True, "fp32"), (False, "fp32"), (True, "bf16")):
            losses: list[float] = []
            float8 = {"enabled": True, "emulate": True, "fsdp_all_gather": gather}
            backend = MeshBackend(shard=2, float8=float8, precision=precision, timeout=30, device="cpu")
            model = Net(seed=int(os.environ["RANK"]))
            with make_engine(model, backend, 4, losses) as engine:
                engine.fit(steps=STEPS)
                val = engine.evaluate()["val.loss"]
                weight = model.blocks[0][0].weight
                results[gather, precision] = {
                    "losses": losses,
                    "val": val,
                    "params": engine.backend.all_gather(flat(model), "optimizer"),
                    "local": type(weight.to_local()).__name__,
                    "kinds": sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}),
                    "hooks": {
                        event: [
                            getattr(h, "__qualname__", "").rsplit(".", 1)[-1]
                            if "precompute" in getattr(h, "__qualname__", "")
                            else getattr(h, "__qualname__", "")
                            for h in engine.hooks(event)
                        ]
                        for event in ("on_optimizer_step", "on_fit_start", "on_eval_start", "on_eval_end")
                    },
                }
        return results
    finally:
        dist.destroy_process_group()


def test_fsdp2_float8_all_gather_with_precomputed_scales_equals_gathering_fp32():
    got = launch(train_float8, nprocs=2, start_method="fork", timeout=100)
    gathered, plain, bf16 = got[True, "fp32"], got[False, "fp32"], got[True, "bf16"]
    # The float8 weights' shards are torchao's cast-on-gather tensors, and the precompute is registered.
    assert gathered["local"] == "WeightWithDynamicFloat8CastTensor" and plain["local"] != gathered["local"]
    assert gathered["kinds"] == ["Float8Linear", "Linear"]
    for event, hooks in gathered["hooks"].items():
        assert "precompute" in hooks, (event, hooks)
        assert "precompute" not in plain["hooks"][event]
    # After EMA has swapped its weights in (evaluation start) and back (evaluation end).
    for event in ("on_eval_start", "on_eval_end"):
        hooks = gathered["hooks"][event]
        assert hooks.index("precompute") > hooks.index(f"EMA.{event}"), hooks
    # Same scales, same float8 weights: the same training.
    torch.testing.assert_close(gathered["params"][0], plain["params"][0], rtol=0, atol=1e-6)
    assert torch.equal(gathered["params"][0], gathered["params"][1])
    assert gathered["val"] == pytest.approx(plain["val"], abs=1e-6)
    # Against one process in float8 on the same global batch: within float8's error (activation scales are per rank).
    reference: list[float] = []
    backend = LocalBackend(device="cpu", float8={"enabled": True, "emulate": True})
    with make_engine(Net(seed=0), backend, 8, reference) as engine:
        engine.fit(steps=STEPS)
        val = engine.evaluate()["val.loss"]
    assert gathered["val"] == pytest.approx(val, abs=2e-2)
    assert bf16["val"] == pytest.approx(val, abs=5e-2)  # bf16 parameters in forward as well
