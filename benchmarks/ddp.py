"""Two-process DDP on gloo: Cadence against a hand-written DDP loop.

    python benchmarks/ddp.py             # 5 alternated pairs (about 3 minutes on 2 cores)
    python benchmarks/ddp.py --repeats 3
    python benchmarks/ddp.py --smoke     # seconds: tiny sizes, every part once (tests/test_benchmarks.py)

Workload W2 of benchmarks/overhead.py: an MLP with four 1024-wide layers
(1024-1024-1024-1024-10), Adam, 200 timed steps after 20 warm-up steps, global
batch 128 (64 per rank), pre-batched in-memory tensors. Both loops run in two
fresh processes started by `cadence.launch` (fork), one thread each, and
alternate so machine drift hits both alike; every pair must end with the same
parameters. The raw loop is `DistributedDataParallel` + forward, backward,
step, zero_grad; Cadence adds its per-step agreement (one 3-int all-reduce).
Reports the median per-step time of rank 0 and the ratio (target <= 1.05),
and the cost of one `agree` call measured alone (stable even on a busy machine).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import statistics
import sys
import time
from pathlib import Path

SIZES = [1024, 1024, 1024, 1024, 10]
GLOBAL_BATCH, STEPS, WARMUP = 128, 200, 20
AGREE_CALLS = 2000
LAUNCH_TIMEOUT = 900  # seconds


def smoke() -> None:
    """--smoke: a 64-wide MLP, a few steps and agree calls (set before the workers fork)."""
    global SIZES, STEPS, WARMUP, AGREE_CALLS, LAUNCH_TIMEOUT
    SIZES, STEPS, WARMUP, AGREE_CALLS, LAUNCH_TIMEOUT = [64, 64, 10], 5, 2, 20, 60
    print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)


def worker(kind: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    per_rank = GLOBAL_BATCH // world
    data = [
        (torch.randn(per_rank, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (per_rank,), generator=g))
        for _ in range(WARMUP + STEPS)
    ]
    if kind == "raw":
        ddp = torch.nn.parallel.DistributedDataParallel(model)

        def run(batches):
            for x, y in batches:
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        run(data[:WARMUP])
        dist.barrier()
        start = time.perf_counter()
        run(data[WARMUP:])
        elapsed = time.perf_counter() - start
    else:
        import tempfile

        import cadence
        from cadence.backends.ddp import DDPBackend

        engine = cadence.Engine(
            model,
            optimizer,
            data,
            loss_fn=F.cross_entropy,
            backend=DDPBackend(),
            seed=0,
            workspace=tempfile.mkdtemp(prefix="cadence-bench-"),
        )
        engine.fit(steps=WARMUP)
        dist.barrier()
        start = time.perf_counter()
        engine.fit(steps=STEPS)
        elapsed = time.perf_counter() - start
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    dist.destroy_process_group()
    return {"us_per_step": elapsed / STEPS * 1e6, "params": digest.hexdigest()[:16]}


def agree_cost() -> float:
    """Microseconds per `DDPBackend.agree` (the one collective Cadence adds per step)."""
    calls = AGREE_CALLS
    import torch

    import cadence
    from cadence.backends.ddp import DDPBackend

    model = torch.nn.Linear(2, 2)
    engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), backend=DDPBackend(), seed=0)
    backend, requests = engine.backend, engine.requests
    for _ in range(min(100, calls)):
        backend.agree(requests)
    backend.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        backend.agree(requests)
    elapsed = time.perf_counter() - start
    engine.close()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="alternated raw/Cadence pairs")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run at tiny sizes (2 pairs)")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        args.repeats = 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # No torch._dynamo import here to pay it once: with it, a forked worker hung in its first
    # torch.set_num_threads (3 of 4 runs of --smoke); each worker imports it building DDP, untimed.
    from cadence.launch import launch

    times: dict[str, list[float]] = {"raw": [], "cadence": []}
    for i in range(args.repeats):
        results = {}
        order = ("raw", "cadence") if i % 2 == 0 else ("cadence", "raw")
        for kind in order:
            results[kind] = launch(worker, kind, nprocs=2, start_method="fork", timeout=LAUNCH_TIMEOUT)
            times[kind].append(results[kind]["us_per_step"])
        if results["raw"]["params"] != results["cadence"]["params"]:
            raise SystemExit("parameters differ between the raw DDP loop and Cadence")
        print(
            f"pair {i + 1}: raw {times['raw'][-1]:.0f} us/step, cadence {times['cadence'][-1]:.0f} us/step", flush=True
        )
    raw, ours = statistics.median(times["raw"]), statistics.median(times["cadence"])
    agree_us = launch(agree_cost, nprocs=2, start_method="fork", timeout=min(300, LAUNCH_TIMEOUT))
    print(f"{'variant':24}  {'us/step':>9}  {'ratio':>6}")
    print(f"{'raw DDP loop':24}  {raw:9.1f}  {1.0:6.3f}")
    print(f"{'cadence, DDPBackend':24}  {ours:9.1f}  {ours / raw:6.3f}")
    print(f"agree alone (one 3-int MAX all-reduce + host read): {agree_us:.1f} us = {agree_us / raw:.2%} of a raw step")
    print(
        f"(W2, 2 gloo ranks, global batch {GLOBAL_BATCH}, {STEPS} steps; median of {args.repeats} alternated runs;"
        " parameters checked equal)"
    )


if __name__ == "__main__":
    main()
