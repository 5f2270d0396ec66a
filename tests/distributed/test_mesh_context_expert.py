"""Context parallel and expert parallel on the mesh backend (gloo, forked ranks).

examples/lm.py's Transformer, small: context parallel (MATH attention, non-causal)
on 2 ranks trains like one process; the mixture-of-experts model on 2 ranks with
expert=2 has the one-process loss and gradients, one clipping norm over the data
and expert meshes, the same skip everywhere for a NaN in one expert's gradient,
and logs its load-balancing loss and tokens per expert. Bad configurations fail
before any process group.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # imported once here, not in every forked worker
import torch.distributed.fsdp
import torch.distributed.tensor.experimental

import cadence
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import Checkpoint, GradClip, NonFiniteSkip
from cadence.launch import launch

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
try:
    import lm
finally:
    sys.path.remove(str(ROOT / "examples"))

SEQ, VOCAB, STEPS, LR, NAN_STEP = 16, 32, 6, 1e-2, 4


@pytest.fixture(autouse=True)
def _collect_before_forking():
    """Collect the pytest process's garbage before a launch forks it.

    Earlier tests (one-process meshes in this process) leave cyclic garbage
    holding process-group objects; collected inside a forked rank, its
    finalizers hung both ranks in a garbage collection (seen once in three
    runs of this file after tests/distributed/test_mesh.py, load 9).
    """
    gc.collect()


def model_config(**overrides) -> lm.ModelConfig:
    options = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab=VOCAB, seq_len=SEQ)
    return lm.ModelConfig(**{**options, **overrides})


def token_data(samples: int = 64) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class Grads(cadence.Callback):
    """Keeps the loss and every full gradient of the first step (before clipping), and the clip norms."""

    order = 1  # before GradClip

    def __init__(self) -> None:
        self.loss: float | None = None
        self.grads: dict[str, torch.Tensor] = {}
        self.norms: list[float] = []

    def on_before_optimizer_step(self, engine) -> None:
        if engine.state.step == 0:
            self.loss = float(engine.loss.detach())
            for name, p in sorted(engine.model.named_parameters()):
                g = p.grad
                self.grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    def on_step_end(self, engine) -> None:
        if getattr(engine, "grad_norm", None) is not None:
            self.norms.append(float(engine.grad_norm))


class NaNInExpert(cadence.Callback):
    """Puts a NaN into this rank's part of the first expert weight's gradient at one step."""

    order = 5  # after Grads, before NonFiniteSkip

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_before_optimizer_step(self, engine) -> None:
        if engine.state.step + 1 == self.step and engine.backend.rank == self.rank:
            grads = {lp.name: lp.param.grad for lp in engine.backend.local_parameters(engine)}
            g = grads["layers.0.feed_forward.w1"]
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")


def flat(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [
                (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).reshape(-1).clone()
                for _, p in sorted(model.named_parameters())
            ]
        )


def make_engine(config, backend, batch_size, callbacks=(), seed=0, shuffle=False, **options):
    torch.manual_seed(seed)
    model = lm.Transformer(config)
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        token_data(),
        loss_fn=lm.training_loss(model),
        callbacks=list(callbacks),
        backend=backend,
        seed=0,
        log_interval=STEPS,
        train={"batch_size": batch_size, "shuffle": shuffle},
        **options,
        device="cpu",
    )
    if config.n_experts:
        engine.on(cadence.Event.ON_FORWARD)(lm.log_experts)
    return engine


def one_process(config, batch_size: int, nan_step: int | None = None, **options) -> dict:
    grads = Grads()
    callbacks = [grads, NonFiniteSkip(), GradClip(max_norm=0.5)]
    if nan_step is not None:
        callbacks.append(NaNInExpert(rank=0, step=nan_step))
    logged: dict = {}
    engine = make_engine(config, "local", batch_size, callbacks, **options)
    engine.on(cadence.Event.ON_LOG)(lambda e: logged.update(e.logged))
    engine.fit(steps=STEPS)
    return {
        "loss": grads.loss,
        "grads": grads.grads,
        "norms": grads.norms,
        "params": flat(engine.model),
        "skipped": engine.state.skipped_steps,
        "logged": logged,
    }


# -- expert parallel -------------------------------------------------------------------------


def train_experts(options: dict) -> dict:
    rank = int(os.environ["RANK"])
    grads = Grads()
    logged: dict = {}
    callbacks = [grads, NonFiniteSkip(), GradClip(max_norm=0.5), NaNInExpert(rank=1, step=NAN_STEP)]
    # Each rank builds its model from its own seed: the backend starts them equal.
    with make_engine(
        model_config(n_experts=4), MeshBackend(**options, timeout=30, device="cpu"), 2, callbacks, seed=rank
    ) as engine:
        engine.on(cadence.Event.ON_LOG)(lambda e: logged.update(e.logged))
        engine.fit(steps=STEPS)
        backend = engine.backend
        expert = engine.model.layers[0].feed_forward.w1
        return {
            "loss": float(backend.reduce(torch.tensor(grads.loss), "mean")),
            "grads": grads.grads,
            "norms": grads.norms,
            "params": flat(engine.model),
            "skipped": backend.all_gather_object(engine.state.skipped_steps, domain="optimizer"),
            "logged": logged,
            "expert_local": tuple(expert.to_local().shape),
            "expert_placements": str(expert.placements),
        }


def test_mixture_of_experts_on_expert_2_equals_one_process():
    got = launch(train_experts, {"shard": 2, "expert": 2}, nprocs=2, start_method="fork", timeout=100)
    ref = one_process(model_config(n_experts=4), batch_size=4, nan_step=NAN_STEP)
    # Each rank holds 2 of the 4 experts of every layer, whole (the expert_tensor axis has one rank).
    assert got["expert_local"] == (2, 48, 32) and got["expert_placements"] == "(Shard(dim=0), Shard(dim=1))"
    # The first step: the loss (with the load-balancing loss) and every gradient as on one process.
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-6, msg=name)
    # One clipping norm over the data mesh and the expert mesh, the one-process norm at every step.
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5, nan_ok=True)
    # A NaN in rank 1's expert gradient: every rank skipped that step, as one process did.
    assert got["skipped"] == [1, 1] and ref["skipped"] == 1
    # After 6 AdamW steps (which normalise tiny gradients) 1.8e-6 was measured.
    torch.testing.assert_close(got["params"], ref["params"], rtol=0, atol=1e-5)
    # Load balancing and tokens per expert are logged; token counts are summed over ranks and steps.
    assert got["logged"]["moe.balance_loss"] == pytest.approx(ref["logged"]["moe.balance_loss"], rel=1e-5)
    tokens = [got["logged"][f"moe.tokens.{i}"] for i in range(4)]
    assert tokens == [ref["logged"][f"moe.tokens.{i}"] for i in range(4)]
    assert sum(tokens) == STEPS * 4 * SEQ * 2 * 2  # steps x samples x tokens x top-2 x layers


def straight_stopped_resumed(config, options: dict, directory: str) -> dict:
    """In the open process group: 6 steps straight; 3 steps saved by the mesh backend's store; resumed to 6."""

    def run(callbacks, stop=None):
        engine = make_engine(
            config, MeshBackend(**options, timeout=30, device="cpu"), 2, [GradClip(max_norm=0.5), *callbacks],
            seed=dist.get_rank(), shuffle=True, steps=STEPS,
        )  # fmt: skip
        if stop is not None:
            engine.on(cadence.Event.ON_BEFORE_OPTIMIZER_STEP, once=stop)(lambda e: e.request_stop("test"))
        with engine:
            engine.fit()
            return engine.state.step, flat(engine.model), type(engine.backend.checkpoint_store(engine)).__name__

    out = {}
    _, out["straight"], _ = run([])
    out["stopped_at"], out["saved"], out["store"] = run([Checkpoint(dir=directory, interval=0)], stop=3)
    resumed = Checkpoint(dir=f"{directory}-resumed", interval=0, resume=f"{directory}/latest")
    out["resumed_to"], out["resumed"], _ = run([resumed])
    return out


def save_resume_experts(directory: str) -> dict:
    dist.init_process_group("gloo")
    try:
        return straight_stopped_resumed(model_config(n_experts=4), {"shard": 2, "expert": 2}, directory)
    finally:
        dist.destroy_process_group()


def test_expert_2_saves_resumes_bitwise_and_loads_on_one_process(tmp_path):
    # Through the engine and the Checkpoint callback with the mesh backend's store.
    directory = str(tmp_path / "checkpoints")
    got = launch(save_resume_experts, directory, nprocs=2, start_method="fork", timeout=100)
    assert got["store"] == "DCPStore" and got["stopped_at"] == 3 and got["resumed_to"] == STEPS
    assert torch.equal(got["resumed"], got["straight"])  # bitwise
    assert_loads_on_one_process(tmp_path, directory, got["saved"])


def assert_loads_on_one_process(tmp_path, directory: str, saved: torch.Tensor) -> None:
    """One process (a mesh of one, every expert whole) loads an expert-sharded checkpoint's weights:
    plain keys, global shapes, the saved values."""
    pretrained = Checkpoint(dir=str(tmp_path / "one"), interval=0, pretrained=f"{directory}/latest")
    engine = make_engine(model_config(n_experts=4), "mesh", 4, [pretrained], seed=5)
    try:
        engine.fit(steps=0)
        assert not hasattr(engine.model.layers[0].feed_forward.w1, "placements")
        assert torch.equal(flat(engine.model), saved)
    finally:
        engine.close()
    assert not dist.is_initialized()


def save_experts_with_dcp(directory: str) -> dict:
    """3 steps on expert 2, the backend's state saved with torch.distributed.checkpoint, loaded into a fresh engine."""
    import torch.distributed.checkpoint as dcp

    rank = int(os.environ["RANK"])
    config, options = model_config(n_experts=4), {"shard": 2, "expert": 2, "timeout": 30}
    with make_engine(
        config, MeshBackend(**{"device": "cpu", **options}), 2, [GradClip(max_norm=0.5)], seed=rank
    ) as engine:
        engine.fit(steps=3)
        backend = engine.backend
        dcp.save({"model": backend.model_state_dict(engine)}, checkpoint_id=directory)
        saved = flat(engine.model)
        with make_engine(config, MeshBackend(**{"device": "cpu", **options}), 2, seed=rank + 10) as fresh:
            state = {"model": fresh.backend.model_state_dict(fresh)}
            dcp.load(state, checkpoint_id=directory)
            fresh.backend.load_model_state_dict(fresh, state["model"])
            return {"saved": saved, "reloaded": flat(fresh.model)}


def test_expert_sharded_state_saves_and_loads_on_2_ranks_and_on_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    directory = str(tmp_path / "dcp")
    got = launch(save_experts_with_dcp, directory, nprocs=2, start_method="fork", timeout=100)
    assert torch.equal(got["reloaded"], got["saved"])
    model = lm.Transformer(model_config(n_experts=4))  # one process, no process group: every expert here
    state = {"model": model.state_dict()}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state["model"])
    assert torch.equal(flat(model), got["saved"])


# -- context parallel ------------------------------------------------------------------------


def train_context(options: dict) -> dict:
    rank = int(os.environ["RANK"])
    grads = Grads()
    callbacks = [grads, NonFiniteSkip(), GradClip(max_norm=0.5)]
    with make_engine(
        model_config(causal=False),
        MeshBackend(**options, timeout=30, device="cpu"),
        2,
        callbacks,
        seed=rank,
        grad_accum=2,
    ) as engine:
        inputs = engine.model.rope_cos.shape
        # Whether the last micro-batch's outputs are still alive when the next forward starts.
        last, alive_at_forward = [None], []

        def before_forward(module, args):  # returns None: the inputs stay as they are
            if last[0] is not None:
                alive_at_forward.append(last[0]() is not None)

        engine.model.register_forward_pre_hook(before_forward)
        engine.on(cadence.Event.ON_FORWARD)(lambda e: last.__setitem__(0, weakref.ref(e.outputs)))
        engine.fit(steps=STEPS)
        return {
            "outputs_alive_at_forward": alive_at_forward,
            "loss": grads.loss,
            "grads": grads.grads,
            "params": flat(engine.model),
            "norms": grads.norms,
            "data": (engine.backend.data_rank, engine.backend.data_size),
            "rope_restored": engine.model.rope_cos.shape == inputs,
            "schedule": engine.backend.build_step(engine).schedule is not None,
        }


def test_context_parallel_math_non_causal_equals_one_process():
    got = launch(train_context, {"shard": 1, "context": 2}, nprocs=2, start_method="fork", timeout=100)
    # Context ranks read the same batches; 2 micro-batches per step (gradient sync on the last only).
    ref = one_process(model_config(causal=False), batch_size=2, grad_accum=2)
    assert got["data"] == (0, 1) and got["schedule"] and got["rope_restored"]
    assert got["outputs_alive_at_forward"] == [False] * (2 * STEPS - 1)  # a forward never beside the last outputs
    # engine.loss is the whole sequence's loss (the context ranks' mean).
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-6, msg=name)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    # 6 AdamW steps amplify the 1.5e-8 gradient differences: 2.9e-5 measured (deterministic, bitwise across runs).
    torch.testing.assert_close(got["params"], ref["params"], rtol=0, atol=1e-4)


# -- bad configurations: one clear error each, before any process group ----------------------


def _setup_error(monkeypatch, world: int, model=None, **options) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    model = model or lm.Transformer(model_config(causal=False))
    with pytest.raises((ValueError, NotImplementedError)) as caught:
        cadence.Engine(
            model,
            torch.optim.AdamW(model.parameters()),
            token_data(8),
            loss_fn=lm.next_byte_loss,
            backend=MeshBackend(**options, timeout=30, device="cpu"),
            seed=0,
        )
    assert not dist.is_initialized()  # nothing was joined, so nothing can hang
    return str(caught.value)


def test_context_parallel_on_cpu_refuses_flash_and_causal_at_setup(monkeypatch):
    message = _setup_error(monkeypatch, 2, shard=1, context=2, context_attention="flash")
    assert "flash attention kernel and a non-causal mask cannot run on cpu" in message
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in message
    assert "context_attention='math'" in message
    causal = lm.Transformer(model_config(causal=True))
    message = _setup_error(monkeypatch, 2, model=causal, shard=1, context=2)
    assert "math attention kernel and a causal mask (Transformer.causal=True)" in message
    assert "aten.add.Tensor got mixed torch.Tensor and DTensor" in message


def test_context_axis_needs_sequence_buffers_and_a_mask(monkeypatch):
    plain = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8))
    message = _setup_error(monkeypatch, 2, model=plain, shard=1, context=2)
    assert "context=2 needs `model.context_parallel_buffers(batch)`" in message and "Sequential" in message
    message = _setup_error(monkeypatch, 4, shard=1, context=2, pipeline=2)
    assert "context=2 with pipeline=2 is not supported yet" in message


def test_expert_axis_errors_name_the_experts(monkeypatch):
    message = _setup_error(monkeypatch, 8, model=lm.Transformer(model_config(n_experts=4)), shard=8, expert=8)
    assert "expert axis (8) is larger than the number of experts of MoE (4)" in message
    message = _setup_error(monkeypatch, 2, model=lm.Transformer(model_config(n_experts=3)), shard=2, expert=2)
    assert "3 experts, not divisible by the expert axis (2)" in message
    message = _setup_error(monkeypatch, 2, shard=2, expert=2)
    assert "expert=2 needs mixture-of-experts modules" in message and "Transformer has none" in message
    message = _setup_error(
        monkeypatch, 2, model=lm.Transformer(model_config(n_experts=4)), replicate=2, shard=1, expert=2
    )
    assert "must divide shard x context (1 x 1 = 1)" in message
    # expert_tensor: tests/distributed/test_mesh_expert_tensor.py


# -- GPU only ----------------------------------------------------------------------------------


def train_context_causal_cuda() -> dict:
    grads = Grads()
    backend = MeshBackend(shard=1, context=2, context_attention="flash", precision="bf16", timeout=60, device="cuda")
    with make_engine(model_config(causal=True), backend, 2, [grads], seed=0) as engine:
        engine.fit(steps=1)
        return {"loss": grads.loss, "grads": {k: v.float().cpu() for k, v in grads.grads.items()}}


# Ring attention (causal context parallel) exists only for the CUDA flash/efficient/cudnn SDPA kernels.
@pytest.mark.cuda(gpus=2)
def test_context_parallel_ring_attention_causal():
    got = launch(train_context_causal_cuda, nprocs=2, start_method="spawn", timeout=110)
    torch.manual_seed(0)
    model = lm.Transformer(model_config(causal=True)).cuda().bfloat16()
    x, y = (t[:2].cuda() for t in token_data().tensors)
    loss = lm.next_byte_loss(model(x), y)
    loss.backward()
    assert got["loss"] == pytest.approx(float(loss), rel=2e-2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad.float().cpu(), rtol=5e-2, atol=5e-3, msg=name)
