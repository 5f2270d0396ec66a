"""The mesh backend on gloo: FSDP2, HSDP and tensor parallel train like one process.

Each launch groups several checks (a launch costs seconds): equal start from
differently seeded ranks, equality with the local backend after 20 steps
(AdamW, accumulation 2, GradClip, EMA, a NaN gradient on one rank's shard),
the same skip on every rank without an extra collective, and evaluation with
9 and 8 batches on two ranks giving the exact dataset mean.
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # imported once here, not in every forked worker
import torch.distributed.fsdp
import torch.distributed.tensor.parallel
from torch.nn import functional as F
from torch.utils._pytree import tree_map

import cadence
from cadence.backends.mesh import MeshBackend, MeshConfig
from cadence.callbacks import EMA, GradClip, NonFiniteSkip
from cadence.engine.step import nothing
from cadence.launch import launch
from cadence.testing.collectives import CollectiveLog, read_log
from tests.conftest import tiny_dataset

pytestmark = pytest.mark.timeout(120)

STEPS, NAN_STEP, LR = 20, 7, 1e-2
EVAL_SAMPLES = 65  # 33 and 32 samples on two ranks: 9 and 8 batches of 4


class Block(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    """Two residual blocks between an input layer and a head: blocks are the FSDP units, TP splits them."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def fsdp_units(self) -> list[torch.nn.Module]:
        return list(self.blocks)

    def parallelize(self, mesh) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.blocks:
            parallelize_module(block, mesh["tensor"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


class NaNOnRank(cadence.Callback):
    """Puts a NaN into this rank's part of the first gradient at one step (before NonFiniteSkip looks)."""

    order = 5

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.before: torch.Tensor | None = None
        self.after: torch.Tensor | None = None

    def on_before_optimizer_step(self, engine) -> None:
        if engine.state.step + 1 == self.step:
            self.before = local_flat(engine)  # no collective here: the step's collectives are counted
            if engine.backend.rank == self.rank:
                engine.backend.local_gradients(engine)[0].view(-1)[0] = float("nan")

    def on_step_end(self, engine) -> None:
        if engine.state.step == self.step:
            self.after = local_flat(engine)


def local_flat(engine) -> torch.Tensor:
    return torch.cat([lp.local.detach().reshape(-1).clone() for lp in engine.backend.local_parameters(engine)])


class Recorder(cadence.Callback):
    def __init__(self) -> None:
        self.start: torch.Tensor | None = None
        self.eval_batches = 0
        self.norms: list[float] = []

    def on_fit_start(self, engine) -> None:
        if self.start is None:  # the first fit's
            self.start = flat(engine.model)

    def on_eval_batch(self, engine) -> None:
        self.eval_batches += 1


def flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter in full (DTensors gathered), flattened in name order."""
    with torch.no_grad():
        return torch.cat([_full(p).reshape(-1).clone() for _, p in sorted(model.named_parameters())])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def make_engine(model, backend, *, batch_size, callbacks=(), steps=STEPS, precision="fp32"):
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        tiny_dataset(400),
        eval_data=tiny_dataset(EVAL_SAMPLES, seed=5),
        loss_fn=F.cross_entropy,
        callbacks=callbacks,
        backend=backend,
        seed=0,
        grad_accum=2,
        log_interval=5,
        precision=precision,
        train={"batch_size": batch_size, "shuffle": False},
        eval={"batch_size": 4},
        device="cpu",
    )


def reference(batch_size: int) -> dict:
    """One process, the same global batch, the same NaN step, EMA and clipping."""
    nan, ema = NaNOnRank(rank=0, step=NAN_STEP), EMA(decay=0.9)
    callbacks = [NonFiniteSkip(), nan, ema, GradClip(max_norm=0.5)]
    engine = make_engine(Net(seed=0), "local", batch_size=batch_size, callbacks=callbacks)
    start = flat(engine.model)
    engine.fit(steps=STEPS)
    results = engine.evaluate()
    x, y = tiny_dataset(EVAL_SAMPLES, seed=5).tensors
    with torch.no_grad(), ema.swapped(engine):  # the EMA model's loss over the whole eval set in one batch
        exact = float(F.cross_entropy(engine.model(x), y))
    return {
        "start": start,
        "params": flat(engine.model),
        "ema": torch.cat([s.reshape(-1) for _, s in sorted(zip(ema.names, ema.shadow))]),
        "val": results["val.loss"],
        "skipped": engine.state.skipped_steps,
        "exact": exact,
        "norm": float(engine.grad_norm),
    }


def train_on_mesh(options: dict, workdir: str) -> dict:
    rank = int(os.environ["RANK"])
    log = CollectiveLog(Path(workdir) / f"rank-{rank}.jsonl")
    nan, ema, recorder = NaNOnRank(rank=1, step=NAN_STEP), EMA(decay=0.9), Recorder()
    callbacks = [NonFiniteSkip(), nan, ema, GradClip(max_norm=0.5), recorder]
    with log.patch_torch_distributed():
        # Each rank builds its model from its own seed: the backend must start them equal.
        with make_engine(
            Net(seed=rank), MeshBackend(**options, timeout=30, device="cpu"), batch_size=2, callbacks=callbacks
        ) as engine:
            log.engine = engine
            engine.fit(steps=STEPS)
            results = engine.evaluate()
            backend = engine.backend
            params = flat(engine.model)
            shadow = [_full(s).clone() for s in ema.shadow]
            local = torch.cat([lp.local.reshape(-1) for lp in backend.local_parameters(engine)])
            norm = engine.grad_norm
            restored, keys = _state_round_trip(engine)
            return {
                "norm": (type(norm).__name__, float(norm)),
                "restored": restored,
                "keys": keys,
                "start": recorder.start,
                "params": backend.all_gather(params, domain="optimizer"),
                "locals": backend.all_gather_object(local.clone(), domain="optimizer"),
                "ema": torch.cat([s.reshape(-1) for _, s in sorted(zip(ema.names, shadow))]),
                "val": results["val.loss"],
                "eval_batches": backend.all_gather_object(recorder.eval_batches, domain="optimizer"),
                "skipped": backend.all_gather_object(engine.state.skipped_steps, domain="optimizer"),
                "unchanged": backend.all_gather_object(torch.equal(nan.before, nan.after), domain="optimizer"),
                "placements": str(next(engine.model.parameters()).placements),
                "data": (backend.data_rank, backend.data_size),
            }


def _state_round_trip(engine) -> tuple[bool, list[str]]:
    """Save the state through the backend, train a step, load it back: the parameters are back."""
    backend = engine.backend
    clone = partial(tree_map, lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x)
    model_state = clone(backend.model_state_dict(engine))
    optimizer_states = clone(backend.optimizer_state_dicts(engine))
    before = flat(engine.model)
    engine.fit(steps=1)
    changed = not torch.equal(flat(engine.model), before)
    backend.load_model_state_dict(engine, model_state)
    backend.load_optimizer_state_dicts(engine, optimizer_states)
    same_step = all(
        float(state["step"]) == float(optimizer_states[0]["state"][name]["step"])
        for name, state in backend.optimizer_state_dicts(engine)[0]["state"].items()
    )
    return changed and same_step and torch.equal(flat(engine.model), before), sorted(optimizer_states[0]["state"])


def per_step(path: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in read_log(path):
        if not line["op"].startswith("event:"):
            counts[line["step"]] = counts.get(line["step"], 0) + 1
    return counts


@pytest.mark.parametrize(
    ("options", "placement"),
    [
        ({"shard": 2}, "(Shard(dim=0),)"),
        # HSDP, with activation checkpointing of every block on the way (same gradients).
        ({"replicate": 2, "shard": 1, "activation_checkpointing": {"mode": "full"}}, "(Replicate(), Shard(dim=0))"),
    ],
    ids=["fsdp2", "hsdp"],
)
def test_mesh_trains_like_one_process(tmp_path, options, placement):
    got = launch(train_on_mesh, options, str(tmp_path), nprocs=2, start_method="fork", timeout=100)
    ref = reference(batch_size=4)
    assert got["placements"] == placement
    # State through torch.distributed.checkpoint.state_dict: plain names, loads back in place.
    assert got["restored"] and got["keys"] == sorted(n for n, _ in Net().named_parameters())
    # GradClip's norm is a plain tensor over every shard.
    assert got["norm"][0] == "Tensor" and got["norm"][1] == pytest.approx(ref["norm"], rel=1e-5)
    # Ranks seeded differently start from rank 0's parameters.
    torch.testing.assert_close(got["start"], ref["start"], rtol=0, atol=0)
    # Equal to one process, and equal to each other bit for bit.
    torch.testing.assert_close(got["params"][0], ref["params"], rtol=0, atol=1e-6)
    assert torch.equal(got["params"][0], got["params"][1])
    if options.get("replicate", 1) > 1:  # replicas hold the same local parameters
        assert torch.equal(got["locals"][0], got["locals"][1])
    torch.testing.assert_close(got["ema"], ref["ema"], rtol=0, atol=1e-6)
    # A NaN in rank 1's shard: every rank skipped the same step, nothing changed then.
    assert got["skipped"] == [1, 1] and ref["skipped"] == 1
    assert got["unchanged"] == [True, True]
    counts = [per_step(tmp_path / f"rank-{r}.jsonl") for r in (0, 1)]
    assert counts[0] == counts[1]
    # Collectives during the skipped step (recorded at step NAN_STEP - 1) = those of the steps around it.
    assert counts[0][NAN_STEP - 1] == counts[0][NAN_STEP - 3] == counts[0][NAN_STEP] > 0, counts[0]
    # Evaluation: 9 and 8 batches on the two ranks, the exact mean over the dataset (with the EMA swapped in).
    assert sorted(got["eval_batches"]) == [8, 9]
    assert got["val"] == pytest.approx(ref["exact"], abs=1e-6)
    assert got["val"] == pytest.approx(ref["val"], abs=1e-6)


def train_tensor_parallel(options: dict, batch_size: int) -> dict:
    rank = int(os.environ["RANK"])
    with make_engine(
        Net(seed=rank),
        MeshBackend(**options, timeout=30, device="cpu"),
        batch_size=batch_size,
        callbacks=[GradClip(max_norm=0.5)],
    ) as engine:
        engine.fit(steps=STEPS)
        results = engine.evaluate()
        params = flat(engine.model)
        return {
            "params": engine.backend.all_gather(params, domain="optimizer"),
            "val": results["val.loss"],
            "data": (engine.backend.data_rank, engine.backend.data_size),
            "sync": engine.backend.build_step(engine).gradient_sync is not nothing,
        }


def reference_plain(batch_size: int) -> dict:
    engine = make_engine(Net(seed=0), "local", batch_size=batch_size, callbacks=[GradClip(max_norm=0.5)])
    engine.fit(steps=STEPS)
    return {"params": flat(engine.model), "val": engine.evaluate()["val.loss"]}


def test_tensor_parallel_trains_like_one_process():
    got = launch(train_tensor_parallel, {"shard": 1, "tensor": 2}, 2, nprocs=2, start_method="fork", timeout=100)
    ref = reference_plain(batch_size=2)  # both tensor ranks read the same batches: the global batch is 2 x 2
    assert got["data"] == (0, 1) and not got["sync"]
    torch.testing.assert_close(got["params"][0], ref["params"], rtol=0, atol=1e-5)
    assert torch.equal(got["params"][0], got["params"][1])
    assert got["val"] == pytest.approx(ref["val"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shard_2_by_tensor_2_on_four_processes_trains_like_one_process():
    got = launch(train_tensor_parallel, {"shard": 2, "tensor": 2}, 2, nprocs=4, start_method="fork", timeout=170)
    ref = reference_plain(batch_size=4)
    assert got["data"] == (0, 2) and got["sync"]
    torch.testing.assert_close(got["params"][0], ref["params"], rtol=0, atol=1e-5)
    assert all(torch.equal(got["params"][0], p) for p in got["params"][1:])


def train_bf16() -> dict:
    rank = int(os.environ["RANK"])
    losses = []
    model = Net(seed=rank)
    with make_engine(model, MeshBackend(shard=2, precision="bf16", device="cpu"), batch_size=8) as engine:
        engine.on(cadence.Event.ON_FORWARD)(lambda e: losses.append(float(e.loss)))
        engine.fit(steps=30)
        param = next(engine.model.parameters())
        return {
            "losses": losses,
            "param_dtype": str(param.dtype),
            "val": engine.evaluate()["val.loss"],
            "policy": str(engine.model._get_fsdp_state()._mp_policy),
        }


def test_bf16_mixed_precision_trains():
    got = launch(train_bf16, nprocs=2, start_method="fork", timeout=100)
    assert got["param_dtype"] == "torch.float32"  # sharded master weights stay fp32
    assert "param_dtype=torch.bfloat16" in got["policy"] and "reduce_dtype=torch.float32" in got["policy"]
    first, last = sum(got["losses"][:6]) / 6, sum(got["losses"][-6:]) / 6
    assert all(math.isfinite(x) for x in got["losses"]) and last < first
    assert math.isfinite(got["val"])


# -- bad meshes: one clear error each, before any process group or collective -------------


def _setup_error(monkeypatch, world: int, model=None, **options) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    model = model or Net()
    with pytest.raises((ValueError, NotImplementedError)) as caught:
        cadence.Engine(
            model,
            torch.optim.AdamW(model.parameters()),
            tiny_dataset(16),
            loss_fn=F.cross_entropy,
            backend=MeshBackend(**options, timeout=30, device="cpu"),
            seed=0,
        )
    assert not dist.is_initialized()  # nothing was joined, so nothing can hang
    return str(caught.value)


def test_axes_whose_product_is_not_the_world_size_name_both(monkeypatch):
    message = _setup_error(monkeypatch, 2, shard=2, tensor=2)
    assert "shard=2 x tensor=2 multiply to 4" in message and "world size is 2" in message
    message = _setup_error(monkeypatch, 4, shard=-1, tensor=3)
    assert "tensor=3" in message and "does not divide the world size 4" in message


def test_tensor_axis_without_parallelize_is_an_error_naming_the_axis(monkeypatch):
    plain = torch.nn.Sequential(torch.nn.Linear(8, 4))
    message = _setup_error(monkeypatch, 2, model=plain, shard=1, tensor=2)
    assert "tensor=2 needs `model.parallelize(mesh)`" in message and "Sequential" in message


def test_expert_axes_without_experts_are_errors_not_ignored(monkeypatch):
    # More: tests/distributed/test_mesh_context_expert.py, test_mesh_expert_tensor.py.
    for axis in ("expert", "expert_tensor"):  # divide the data ranks: shard=2
        message = _setup_error(monkeypatch, 2, shard=2, **{axis: 2})
        assert f"{axis}=2 needs mixture-of-experts modules" in message and "Net has none" in message


def test_unknown_unit_classes_and_checkpointing_without_blocks_fail_before_any_group(monkeypatch):
    assert "no module of class ['Blok']" in _setup_error(monkeypatch, 2, shard=2, units=["Blok"])
    plain = torch.nn.Sequential(torch.nn.Linear(8, 4))
    message = _setup_error(monkeypatch, 2, model=plain, shard=2, activation_checkpointing={"mode": "full"})
    assert "needs the model's blocks" in message


def test_cpu_offload_policy_without_an_accelerator_is_a_clear_error(monkeypatch):
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator: CPUOffloadPolicy works here")
    message = _setup_error(monkeypatch, 1, shard=1, cpu_offload=True)
    assert "CPUOffloadPolicy" in message and "no" in message and "cpu_offload=False" in message


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"mesh\.shard must be a size >= 1"):
        MeshConfig(shard=0)
    with pytest.raises(ValueError, match=r"at most one axis may be -1"):
        MeshConfig(shard=-1, tensor=-1)
    with pytest.raises(cadence.ConfigError, match=r"mesh\.precision"):
        MeshBackend(precision="fp16", device="cpu")
    assert MeshConfig(replicate=2, shard=-1, tensor=2).sizes(8) == {
        "replicate": 2, "shard": 2, "context": 1, "pipeline": 1, "tensor": 2, "expert": 1, "expert_tensor": 1
    }  # fmt: skip


def test_one_process_runs_without_a_launcher():
    model = Net(seed=0)
    engine = make_engine(model, "mesh", batch_size=4, steps=3)
    try:
        assert engine.backend.name == "mesh" and engine.backend.data_size == 1 and not engine.backend.sharded
        engine.fit(steps=3)
        ref = make_engine(Net(seed=0), "local", batch_size=4)
        ref.fit(steps=3)
        assert torch.equal(flat(engine.model), flat(ref.model))
    finally:
        engine.close()
    assert not dist.is_initialized()
