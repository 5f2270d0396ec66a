"""examples/lm.py's tensor-parallel plan with sequence parallel and loss parallel: 2 gloo ranks train like one process.

One launch trains the plan's variants (sequence parallel, loss
parallel, both) on a tensor axis of 2, each from the same start on the same
batches with accumulation and GradClip, and each equals the local backend
within 1e-5 (3.0e-6 measured: tensor parallel's row-wise sums add in another
order, as in tests/distributed/test_mesh.py).
Under loss parallel the logits a rank holds are its half of the vocabulary.
The config keys of the example reach the backends (`make_backend`).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel  # imported once here, not in every forked worker

import cadence
from cadence.backends.local import LocalBackend
from cadence.backends.mesh import MeshBackend
from cadence.callbacks import GradClip
from cadence.launch import launch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
try:
    import lm
finally:
    sys.path.remove(str(ROOT / "examples"))

pytestmark = pytest.mark.timeout(120)

CONFIG = lm.ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab=128, seq_len=16)
STEPS = 6
VARIANTS = [(True, False), (False, True), (True, True)]  # (sequence_parallel, loss_parallel)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, CONFIG.vocab, (64, CONFIG.seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class Logits(cadence.Callback):
    """The shape and placements of the logits this rank holds (the last forward's)."""

    def on_forward(self, engine) -> None:
        out = engine.outputs
        self.local = tuple((out.to_local() if hasattr(out, "to_local") else out).shape)
        self.placements = str(getattr(out, "placements", None))


def make_engine(backend, callbacks=()) -> cadence.Engine:
    torch.manual_seed(0)
    model = lm.Transformer(CONFIG)
    return cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        Tokens(),
        eval_data=Tokens(),
        loss_fn=lm.next_byte_loss,
        backend=backend,
        callbacks=[GradClip(max_norm=0.5), *callbacks],  # the norm over sharded and replicated gradients
        seed=0,
        grad_accum=2,
        train={"batch_size": 4, "shuffle": False},
        eval={"batch_size": 16},
        device="cpu",
    )


def flat(model) -> torch.Tensor:
    with torch.no_grad():
        parts = [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).reshape(-1)
            for _, p in sorted(model.named_parameters())
        ]
        return torch.cat(parts)


def train_variants() -> dict:
    dist.init_process_group("gloo")
    try:
        results = {}
        for sequence, loss in VARIANTS:
            plan = partial(lm.Transformer.parallelize, sequence_parallel=sequence, loss_parallel=loss)
            backend = MeshBackend(shard=1, tensor=2, loss_parallel=loss, parallelize=plan, timeout=30, device="cpu")
            logits = Logits()
            with make_engine(backend, [logits]) as engine:
                engine.fit(steps=STEPS)
                results[sequence, loss] = {
                    "params": engine.backend.all_gather(flat(engine.model), "optimizer"),
                    "val": engine.evaluate()["val.loss"],
                    "loss": type(engine.loss).__name__,
                    "logits": (logits.local, logits.placements),
                    "norm": type(engine.model.norm.weight).__name__,
                }
        return results
    finally:
        dist.destroy_process_group()


def test_sequence_and_loss_parallel_train_like_one_process():
    got = launch(train_variants, nprocs=2, start_method="fork", timeout=110)
    with make_engine(LocalBackend(device="cpu")) as engine:
        engine.fit(steps=STEPS)
        ref, val = flat(engine.model), engine.evaluate()["val.loss"]
    batch, seq, vocab = 4, CONFIG.seq_len, CONFIG.vocab
    for (sequence, loss), result in got.items():
        torch.testing.assert_close(
            result["params"][0], ref, rtol=0, atol=1e-5, msg=lambda m, k=(sequence, loss): f"{k}: {m}"
        )
        assert torch.equal(result["params"][0], result["params"][1])
        assert result["val"] == pytest.approx(val, abs=1e-5)
        assert result["loss"] == "Tensor"  # a plain tensor for the engine, also under loss parallel
        if loss:  # each rank holds half of the vocabulary's logits
            assert result["logits"] == ((batch, seq, vocab // 2), "(Shard(dim=2),)")
        else:
            assert result["logits"] == ((batch, seq, vocab), "None")
        assert result["norm"] == ("DTensor" if sequence else "Parameter")  # sequence parallel: norms on the mesh


def test_loss_parallel_without_a_tensor_axis_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"mesh\.loss_parallel .* needs a tensor axis > 1"):
        make_engine(MeshBackend(shard=2, loss_parallel=True, device="cpu"))
    assert not dist.is_initialized()


def test_the_example_exposes_each_option_as_a_config_key():
    args = [
        "--config", str(ROOT / "examples" / "lm.yaml"), "engine.backend=mesh", "engine.device=cpu",
        "mesh={shard: 1, tensor: 2, accumulation_sync: every}",
        "tensor_parallel={sequence_parallel: true, loss_parallel: true}",
        "precision_overrides={RMSNorm: fp32, output: fp32}", "float8={enabled: true, recipe: rowwise}",
    ]  # fmt: skip
    cfg = lm.parse_cli(lm.LMConfig, args, prog="lm.py")
    backend = lm.make_backend(cfg)
    config = backend.config
    assert config.accumulation_sync == "every" and config.loss_parallel
    assert config.precision_overrides == {"RMSNorm": "fp32", "output": "fp32"}
    assert config.float8.enabled and config.float8.recipe == "rowwise"
    assert backend.parallelize_fn.keywords == {"sequence_parallel": True, "loss_parallel": True}
    # The local and DDP backends take the precision options; tensor_parallel needs the mesh.
    local = lm.make_backend(lm.parse_cli(lm.LMConfig, [*args[:2], "engine.device=cpu", *args[6:]], prog="lm.py"))
    assert local.name == "local" and local.transforms.precision_overrides == {"RMSNorm": "fp32", "output": "fp32"}
    with pytest.raises(ValueError, match=r"tensor_parallel\.sequence_parallel needs engine\.backend=mesh"):
        lm.make_backend(lm.parse_cli(lm.LMConfig, [*args[:2], args[5]], prog="lm.py"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_example_trains_with_every_option_of_the_plan_in_bf16(tmp_path):
    from tests.examples.test_lm import final_val_loss, run

    overrides = [
        "nproc=2", "engine.backend=mesh", "mesh={shard: 1, tensor: 2, precision: bf16}", "engine.grad_accum=2",
        "tensor_parallel={sequence_parallel: true, loss_parallel: true}",
        "precision_overrides={RMSNorm: fp32, output: fp32}",
    ]  # fmt: skip
    out = run(tmp_path, "engine.steps=30", *overrides)
    assert "mesh(rank=0/2, tensor=2" in out
    assert final_val_loss(out) < 5.55 - 1.0, out  # log(256) = 5.55: a fresh byte model guesses uniformly
