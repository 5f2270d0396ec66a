"""What benchmarks/gpu.py's `accumulation` part runs on each of its 2 GPU ranks (a module: spawned workers import it).

Each rank trains examples/lm.py's Transformer with FSDP2 over 2 ranks in bf16, 4 micro-batches a
step, once per `mesh.accumulation_sync` mode, and reports its step time and the peak of
`torch.cuda.max_memory_allocated` over the timed steps (None on the CPU: `--smoke`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import lm  # noqa: E402  (examples/lm.py)

import cadence  # noqa: E402
from cadence.backends.mesh import MeshBackend  # noqa: E402


def accumulation_worker(config: dict[str, Any], smoke: bool) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    micro_batch, steps, warm = (2, 3, 1) if smoke else (4, 10, 3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config["vocab"], (64 * micro_batch, config["seq_len"] + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    results = {}
    for mode in ("last", "every"):
        torch.manual_seed(0)
        model = lm.Transformer(lm.ModelConfig(**config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
        backend = MeshBackend(
            shard=2, precision="bf16", accumulation_sync=mode, device=str(device)
        )  # fmt: skip
        with cadence.Engine(model, optimizer, data, loss_fn=lm.next_byte_loss, backend=backend, seed=0,
                            grad_accum=4, log_interval=10**9, train={"batch_size": micro_batch}) as engine:  # fmt: skip
            engine.fit(steps=warm)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            engine.fit(steps=steps)
            if cuda:
                torch.cuda.synchronize(device)
            step_s = (time.perf_counter() - start) / steps
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        results[mode] = {"step_s": step_s, "peak_gib": peak, "micro_batch": micro_batch}
    return results
