"""The expert_tensor axis on the mesh backend (gloo, forked ranks): each expert's hidden dimension split over ranks.

examples/lm.py's mixture-of-experts Transformer, small (4 experts of hidden size
48, top-2), against one process on the same global batch: the loss and every
gradient, one clipping norm over the data and expert meshes, the same skip on
every rank for a NaN in one rank's expert gradient, and a checkpoint that
resumes bitwise and loads on one process. Bad configurations fail before any
process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cadence
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import GradClip, NonFiniteSkip
from cadence.launch import launch
from tests.distributed.test_mesh_context_expert import (
    NAN_STEP,
    STEPS,
    Grads,
    NaNInExpert,
    _collect_before_forking,  # noqa: F401  (an autouse fixture: collect before each launch forks)
    _setup_error,
    assert_loads_on_one_process,
    flat,
    lm,
    make_engine,
    model_config,
    one_process,
    straight_stopped_resumed,
    token_data,
)

pytestmark = pytest.mark.timeout(150)


def train_and_resume(options: dict, directory: str | None) -> dict:
    """The first-step gradients, clip norms and NaN skip; then (with `directory`) straight, stopped at 3, resumed."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config, out = model_config(n_experts=4), {}
    try:
        grads, logged = Grads(), {}
        callbacks = [grads, NonFiniteSkip(), GradClip(max_norm=0.5), NaNInExpert(rank=1, step=NAN_STEP)]
        with make_engine(config, MeshBackend(**options, timeout=30, device="cpu"), 2, callbacks, seed=rank) as engine:
            engine.on(cadence.Event.ON_LOG)(lambda e: logged.update(e.logged))
            engine.fit(steps=STEPS)
            backend = engine.backend
            w1, w2 = engine.model.layers[0].feed_forward.w1, engine.model.layers[0].feed_forward.w2
            out.update(
                loss=float(backend.reduce(torch.tensor(grads.loss), "mean")),
                grads=grads.grads,
                norms=grads.norms,
                params=flat(engine.model),
                skipped=backend.all_gather_object(engine.state.skipped_steps, domain="optimizer"),
                logged=logged,
                local=(tuple(w1.to_local().shape), tuple(w2.to_local().shape)),
                placements=(str(w1.placements), str(w2.placements)),
                mesh=backend.expert_mesh.mesh.tolist(),
            )
        if directory is not None:
            out.update(straight_stopped_resumed(config, options, directory))
        return out
    finally:
        dist.destroy_process_group()


def check_equals_one_process(got: dict, ref: dict, params_atol: float) -> None:
    # The first step: the loss (with the load-balancing loss) and every gradient as on one process.
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-6, msg=name)
    # One clipping norm over the data mesh and the expert mesh, the one-process norm at every step.
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5, nan_ok=True)
    # A NaN in rank 1's expert gradient: every rank skipped that step, as one process did.
    assert set(got["skipped"]) == {1} and ref["skipped"] == 1
    # After 6 AdamW steps, which normalise tiny gradients (amplifying their rounding).
    torch.testing.assert_close(got["params"], ref["params"], rtol=0, atol=params_atol)
    tokens = [got["logged"][f"moe.tokens.{i}"] for i in range(4)]
    assert tokens == [ref["logged"][f"moe.tokens.{i}"] for i in range(4)]


def test_expert_tensor_2_equals_one_process_and_resumes_bitwise(tmp_path):
    directory = str(tmp_path / "checkpoints")
    got = launch(
        train_and_resume, {"shard": 2, "expert_tensor": 2}, directory, nprocs=2, start_method="fork", timeout=140
    )
    # Both ranks hold all 4 experts, each half of every expert's hidden dimension (48): w1 by rows, w2 by columns.
    assert got["local"] == ((4, 24, 32), (4, 32, 24))
    assert got["placements"] == ("(Shard(dim=0), Shard(dim=1))", "(Shard(dim=0), Shard(dim=2))")
    assert got["mesh"] == [[[0, 1]]]  # (expert_data, expert, expert_tensor)
    # First-step gradients 1.9e-8 off (experts 5.2e-10), parameters 7.7e-7 after 6 steps: measured.
    ref = one_process(model_config(n_experts=4), batch_size=4, nan_step=NAN_STEP)
    check_equals_one_process(got, ref, params_atol=1e-5)
    # Through the engine and the Checkpoint callback (DCP store): stopped at 3 and resumed is bitwise.
    assert got["stopped_at"] == 3 and got["resumed_to"] == STEPS
    assert torch.equal(got["resumed"], got["straight"])
    assert_loads_on_one_process(tmp_path, directory, got["saved"])


@pytest.mark.slow
def test_expert_2_by_expert_tensor_2_on_4_ranks_equals_one_process():
    options = {"shard": 4, "expert": 2, "expert_tensor": 2}
    got = launch(train_and_resume, options, None, nprocs=4, start_method="fork", timeout=140)
    assert got["local"] == ((2, 24, 32), (2, 32, 24))
    assert got["mesh"] == [[[0, 1], [2, 3]]]  # expert_tensor peers are consecutive ranks
    # First-step gradients 1.9e-8 off (experts 3.5e-10); parameters 2.4e-5 after 6 AdamW steps, measured, where
    # expert=2 alone on these 4 ranks drifts 1.2e-5 and expert_tensor=4 alone 2.1e-5 (data-rank rounding, amplified).
    ref = one_process(model_config(n_experts=4), batch_size=8, nan_step=NAN_STEP)
    check_equals_one_process(got, ref, params_atol=5e-5)


class ReplicatedHidden(lm.MoE):
    """Shards its experts over "expert" but replicates them over "expert_tensor" (summed peers would double count)."""

    def shard_experts(self, mesh) -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        for name in ("w1", "w3", "w2"):
            full = getattr(self, name).detach()
            setattr(self, name, torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Replicate()])))


def setup_replicated_hidden() -> str:
    model = lm.Transformer(model_config(n_experts=4))
    model.layers[0].feed_forward = ReplicatedHidden(model_config(n_experts=4))
    try:
        cadence.Engine(
            model,
            torch.optim.AdamW(model.parameters()),
            token_data(8),
            loss_fn=lm.next_byte_loss,
            backend=MeshBackend(shard=2, expert_tensor=2, timeout=30, device="cpu"),
            seed=0,
        )
    except ValueError as error:
        return f"{error} (group left: {dist.is_initialized()})"
    return "no error"


def test_expert_weights_not_sharded_over_expert_tensor_are_an_error():
    message = launch(setup_replicated_hidden, nprocs=2, start_method="fork", timeout=60)
    assert "ReplicatedHidden.shard_experts(mesh) placed w1 as (Shard(dim=0), Replicate())" in message
    assert "sharded on a hidden dimension (> 0) over 'expert_tensor'" in message
    assert message.endswith("(group left: False)")  # the failed setup released the group it joined


class NoHiddenSize(torch.nn.Module):
    """Declares experts but not the hidden size the expert_tensor axis would split."""

    num_experts = 2

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 4, 4))

    def shard_experts(self, mesh) -> None:
        raise AssertionError("refused before setup calls it")

    def forward(self, x):
        return x


def test_expert_tensor_errors_name_the_axis_and_values(monkeypatch):
    moe = lm.Transformer(model_config(n_experts=4, ffn_hidden=50))
    message = _setup_error(monkeypatch, 4, model=moe, shard=4, expert_tensor=4)
    assert "hidden size 50, not divisible by the expert_tensor axis (4)" in message
    moe = lm.Transformer(model_config(n_experts=4))
    message = _setup_error(monkeypatch, 4, model=moe, replicate=2, shard=2, expert=2, expert_tensor=2)
    assert "expert x expert_tensor (2 x 2 = 4) must divide shard x context (2 x 1 = 2)" in message
    message = _setup_error(monkeypatch, 4, model=moe, shard=2, tensor=2, expert_tensor=2)
    assert "expert_tensor=2 together with tensor=2 is not built yet" in message
    message = _setup_error(monkeypatch, 2, shard=2, expert_tensor=2)
    assert "expert_tensor=2 needs mixture-of-experts modules" in message and "Transformer has none" in message
    message = _setup_error(monkeypatch, 2, model=torch.nn.Sequential(NoHiddenSize()), shard=2, expert_tensor=2)
    assert "NoHiddenSize does not declare `expert_hidden`" in message
    with pytest.raises(ValueError, match=r"mesh\.expert_tensor must be a size >= 1 \(it divides the data ranks\)"):
        MeshBackend(expert_tensor=-1, device="cpu")
