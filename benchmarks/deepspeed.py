"""Two-process DeepSpeed (ZeRO 2 and 3): Cadence against a hand-written DeepSpeed loop.

    python benchmarks/deepspeed.py                         # 3 alternated pairs per stage, 50 steps (~7 min on 2 CPU cores)
    python benchmarks/deepspeed.py --repeats 1 --steps 20  # a quick check that it runs
    python benchmarks/deepspeed.py --stages 3 --precision bf16

Workload W2 of benchmarks/overhead.py (an MLP with four 1024-wide layers,
1024-1024-1024-1024-10), torch Adam (no compiled DeepSpeed op), global batch
128 (64 per rank) in two micro-batches of 32 per rank (gradient accumulation
2), pre-batched in-memory tensors, 20 warm-up steps, then the timed steps.
Both loops run in two fresh processes started by `cadence.launch` (fork), one
thread each on CPU (`DS_ACCELERATOR=cpu`, gloo) or one GPU each (nccl), and
alternate so machine drift hits both alike; every pair must end with the same
parameters. The raw loop is what the backend does, written by hand: the same
DeepSpeed config (`cadence.backends.deepspeed.build_config`), per micro-batch
`ds(x)`, loss, `ds.backward(loss / 2, scale_wrt_gas=False)`, one `ds.step()`
per step. Cadence adds its events and the per-step agreement (one small
all-reduce). Reports the median per-step time of rank 0 per stage and the
ratio (target <= 1.03).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

# This file is named like the package it measures: keep its folder off the import path,
# or `import deepspeed` would import this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

SIZES = [1024, 1024, 1024, 1024, 10]
GLOBAL_BATCH, ACCUM, WARMUP = 128, 2, 20


def _model_and_data(world: int, rank: int, steps: int, device: str):
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    micro = GLOBAL_BATCH // world // ACCUM
    data = [
        (
            torch.randn(micro, SIZES[0], generator=g).to(device),
            torch.randint(0, SIZES[-1], (micro,), generator=g).to(device),
        )
        for _ in range((WARMUP + steps) * ACCUM)
    ]
    return model, optimizer, data, micro


def worker(kind: str, stage: int, precision: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    model, optimizer, data, micro = _model_and_data(world, rank, steps, device)
    from cadence.backends.deepspeed import DeepSpeedBackend, DeepSpeedConfig, build_config

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if kind == "raw":
        import importlib

        import deepspeed

        ds_torch = importlib.import_module("deepspeed.comm.torch")
        ds_torch.build_shm_op = lambda: None  # as the backend does by default: no JIT compile
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
        config = build_config(DeepSpeedConfig(zero_stage=stage), precision, ACCUM, micro)
        ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
        dtype = torch.bfloat16 if precision == "bf16" else None

        def run(micro_batches):
            for i in range(0, len(micro_batches), ACCUM):
                for x, y in micro_batches[i : i + ACCUM]:
                    if dtype is not None:
                        x = x.to(dtype)
                    loss = F.cross_entropy(ds(x), y)
                    ds.backward(loss / ACCUM, scale_wrt_gas=False)
                ds.step()

        run(data[: WARMUP * ACCUM])
        dist.barrier()
        sync()
        start = time.perf_counter()
        run(data[WARMUP * ACCUM :])
        sync()
        elapsed = time.perf_counter() - start
        gather_from = ds
    else:
        import tempfile

        import cadence

        engine = cadence.Engine(
            model,
            optimizer,
            data,
            loss_fn=F.cross_entropy,
            backend=DeepSpeedBackend(zero_stage=stage, precision=precision),
            seed=0,
            grad_accum=ACCUM,
            train={"batch_size": micro},
            workspace=tempfile.mkdtemp(prefix="cadence-bench-"),
        )
        engine.fit(steps=WARMUP)
        dist.barrier()
        sync()
        start = time.perf_counter()
        engine.fit(steps=steps)
        sync()
        elapsed = time.perf_counter() - start
        gather_from = engine.backend.ds
    digest = hashlib.sha256()
    params = list(gather_from.module.parameters())
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(params):
            for p in params:
                digest.update(p.detach().float().cpu().numpy().tobytes())
    else:
        for p in params:
            digest.update(p.detach().float().cpu().numpy().tobytes())
    dist.destroy_process_group()
    return {"us_per_step": elapsed / steps * 1e6, "params": digest.hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="alternated raw/Cadence pairs per stage")
    parser.add_argument("--steps", type=int, default=50, help="timed optimizer steps per run")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  pay the import once here, not in every forked worker

    from cadence.launch import launch

    rows = []
    for stage in args.stages:
        times: dict[str, list[float]] = {"raw": [], "cadence": []}
        for i in range(args.repeats):
            results = {}
            order = ("raw", "cadence") if i % 2 == 0 else ("cadence", "raw")
            for kind in order:
                results[kind] = launch(
                    worker, kind, stage, args.precision, args.steps, nprocs=2, start_method="fork", timeout=1800
                )
                times[kind].append(results[kind]["us_per_step"])
            if results["raw"]["params"] != results["cadence"]["params"]:
                raise SystemExit(f"ZeRO-{stage}: parameters differ between the raw DeepSpeed loop and Cadence")
            print(
                f"ZeRO-{stage} pair {i + 1}: raw {times['raw'][-1]:.0f} us/step, "
                f"cadence {times['cadence'][-1]:.0f} us/step",
                flush=True,
            )
        rows.append((stage, statistics.median(times["raw"]), statistics.median(times["cadence"])))
    print(f"{'variant':28}  {'us/step':>9}  {'ratio':>6}")
    for stage, raw, ours in rows:
        print(f"{f'raw DeepSpeed loop, ZeRO-{stage}':28}  {raw:9.1f}  {1.0:6.3f}")
        print(f"{f'cadence, ZeRO-{stage}':28}  {ours:9.1f}  {ours / raw:6.3f}")
    device = "1 GPU per rank, nccl" if torch.cuda.is_available() else "CPU, gloo"
    print(
        f"(W2, 2 ranks ({device}), {args.precision}, global batch {GLOBAL_BATCH} in {ACCUM} micro-batches, "
        f"{args.steps} steps; median of {args.repeats} alternated runs; parameters checked equal)"
    )


if __name__ == "__main__":
    main()
