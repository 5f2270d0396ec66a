"""What torch's flight recorder costs: the DDP step and one small all-reduce, with the recorder on and off.

    python benchmarks/flight_recorder.py             # 5 alternated pairs (about 2 minutes on 2 cores)
    python benchmarks/flight_recorder.py --repeats 3
    python benchmarks/flight_recorder.py --smoke     # seconds: tiny sizes, every part once

Cadence's backends start their process group with the recorder on (`flight_recorder=2000` entries,
`cadence.backends.flight_recorder`): every collective then stores its group, sequence number, sizes and the
Python stack that issued it. Measured on 2 gloo ranks started by `cadence.launch` (fork), one thread each:
workload W2 of benchmarks/overhead.py (an MLP with four 1024-wide layers, Adam, global batch 128) trained
by `Engine` on `DDPBackend(flight_recorder=N)`, 200 timed steps after 20 warm-up steps; and a loop of
2000 one-float all-reduces. Reports medians of rank 0 and the ratio on / off.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES = [1024, 1024, 1024, 1024, 10]
GLOBAL_BATCH, STEPS, WARMUP, CALLS = 128, 200, 20, 2000
ENTRIES = 2000


def smoke() -> None:
    """--smoke: a 64-wide MLP, a few steps and calls (set before the workers fork)."""
    global SIZES, STEPS, WARMUP, CALLS
    SIZES, STEPS, WARMUP, CALLS = [64, 64, 10], 5, 2, 20
    print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)


def worker(entries: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    import cadence
    from cadence.backends.ddp import DDPBackend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(1 + rank)
    per_rank = GLOBAL_BATCH // world
    data = [
        (torch.randn(per_rank, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (per_rank,), generator=g))
        for _ in range(WARMUP + STEPS)
    ]
    engine = cadence.Engine(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), data, loss_fn=F.cross_entropy,
        backend=DDPBackend(flight_recorder=entries, device="cpu"), seed=0,
        workspace=tempfile.mkdtemp(prefix="cadence-bench-"),
    )  # fmt: skip
    engine.fit(steps=WARMUP)
    engine.backend.barrier()
    start = time.perf_counter()
    engine.fit(steps=STEPS)
    step_us = (time.perf_counter() - start) / STEPS * 1e6
    one = torch.ones(1)
    for _ in range(min(100, CALLS)):
        dist.all_reduce(one)
    engine.backend.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        dist.all_reduce(one)
    call_us = (time.perf_counter() - start) / CALLS * 1e6
    from torch._C import _distributed_c10d as c10d

    recorded = len(pickle.loads(c10d._dump_fr_trace()).get("entries", []))
    engine.close()
    return {"step_us": step_us, "call_us": call_us, "recorded": recorded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="alternated on/off pairs")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run at tiny sizes (1 pair)")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        args.repeats = 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cadence.backends.flight_recorder import BUFFER_VARIABLES
    from cadence.launch import launch

    for name in BUFFER_VARIABLES:  # a size in the environment wins over flight_recorder=: on and off would be one
        if os.environ.pop(name, None) is not None:
            print(f"{name} unset for this benchmark: it compares the recorder on and off itself", flush=True)

    results: dict[int, list[dict[str, float]]] = {ENTRIES: [], 0: []}
    for i in range(args.repeats):
        for entries in (ENTRIES, 0) if i % 2 == 0 else (0, ENTRIES):
            results[entries].append(launch(worker, entries, nprocs=2, start_method="fork", timeout=900))
        on, off = results[ENTRIES][-1], results[0][-1]
        print(f"pair {i + 1}: step {on['step_us']:.0f} / {off['step_us']:.0f} us, "
              f"all-reduce {on['call_us']:.1f} / {off['call_us']:.1f} us (on / off)", flush=True)  # fmt: skip
    if any(r["recorded"] for r in results[0]) or not all(r["recorded"] for r in results[ENTRIES]):
        raise SystemExit("the recorder did not follow flight_recorder= (a size fixed before the first group?)")
    print(f"{'':28}{'on (2000)':>12}{'off':>12}{'on / off':>10}")
    for key, label in (("step_us", "W2 DDP step, us"), ("call_us", "one-float all-reduce, us")):
        on, off = (statistics.median(r[key] for r in results[n]) for n in (ENTRIES, 0))
        print(f"{label:28}{on:12.1f}{off:12.1f}{on / off:10.3f}")
    print(f"(2 gloo ranks, median of {args.repeats} alternated runs, rank 0)")


if __name__ == "__main__":
    main()
