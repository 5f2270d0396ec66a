"""examples/lm.py in float8 on a GPU (torchao, compute capability >= 8.9): its loss follows bf16's.

The same job twice on one GPU, 60 steps of a small Transformer in bf16
autocast, with and without `float8.enabled=true` (tensorwise; the output head
stays bf16): the validation losses are within 0.1 of each other. Skipped, with
the reason, without such a GPU or without torchao; on the CPU the transform is
tested under emulation (tests/backends/test_float8.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.examples.test_lm import final_val_loss, run

pytest.importorskip("torchao.float8", reason="float8 needs torchao: pip install 'cadence[float8]'")


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_lm_float8_loss_follows_bf16_on_a_capable_gpu(tmp_path):
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        pytest.skip(f"float8 matmuls need compute capability >= 8.9; this GPU has {capability[0]}.{capability[1]}")
    size = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=704",
            "model.seq_len=256", "engine.train.batch_size=16", "data.max_bytes=2000000", "engine.steps=60",
            "engine.precision=bf16", "optim.lr=0.003"]  # fmt: skip
    bf16 = final_val_loss(run(tmp_path / "bf16", *size, device="cuda"))
    out = run(tmp_path / "float8", *size, "float8.enabled=true", device="cuda")
    assert "local(rank=0/1, device=cuda:0)" in out, out
    assert final_val_loss(out) == pytest.approx(bf16, abs=0.1), out
    assert final_val_loss(out) < 5.55 - 1.0, out  # it trained (log(256) = 5.55 untrained)
