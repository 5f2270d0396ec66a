"""Pipeline benchmark: Cadence's pipeline step against a hand-written `schedule.step` loop, on the LM job.

    python benchmarks/pipeline.py                         # 2 ranks, 1F1B, 4 micro-batches, 7 rounds of 20 steps
    python benchmarks/pipeline.py --steps 5 --repeats 2   # a quick smoke run
    python benchmarks/pipeline.py --smoke                 # seconds: tiny sizes (tests/test_benchmarks.py)

Two forked gloo ranks (`cadence.launch`), each holding one stage of examples/lm.py's Transformer
(embeddings + first half of the blocks; second half + norm + output). In one process group, in
alternating order per round:

- Cadence: `Engine.fit(steps=N)` with `MeshBackend(pipeline=2)` (its schedule, the step's
  `grad_accum` micro-batches from the engine's loader concatenated, the events fired per
  micro-batch, the agreement all-reduce, AdamW), no callbacks;
- by hand: the same split made with `torch.distributed.pipelining` directly, a plain
  `DataLoader` giving one batch of `batch x accum` samples per step, `schedule.step(x)` on the
  first stage and `schedule.step(target=y, losses=losses)` on the last, `optimizer.step()`,
  `zero_grad()`.

Reported: the median time per step of each (rank 0's clock, ranks barrier-aligned before every
timed round), and the median of the per-round ratios Cadence / by hand with its min-max.
Target: <= 1.03. Other work on the machine counts: the load average is printed.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "examples"))
    import lm

    config = lm.ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, ffn_hidden=args.dim * 3, seq_len=args.seq
    )
    torch.manual_seed(0)
    model = lm.Transformer(config)
    data = lm.ByteSequences(torch.randint(0, 256, (args.seq * args.batch * args.accum * 64 + 1,)), args.seq)
    return lm, model, data


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import cadence
    from cadence.backends.mesh import MeshBackend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    lm, model, data = build(args)
    split = model.pipeline_split(2)

    # -- Cadence --
    engine = cadence.Engine(
        copy.deepcopy(model),
        None,
        data,
        loss_fn=lm.next_byte_loss,
        backend=MeshBackend(pipeline=2, shard=1, timeout=120),
        seed=0,
        grad_accum=args.accum,
        log_interval=10**9,
        eval_every_epochs=None,
        train={"batch_size": args.batch, "drop_last": True},
    )
    engine.optimizers = [torch.optim.AdamW(engine.model.parameters(), lr=1e-3)]

    # -- by hand --
    stage_model = copy.deepcopy(model)
    keep = set(split[rank])
    for i in range(len(stage_model.layers)):
        if f"layers.{i}" not in keep:
            del stage_model.layers._modules[str(i)]
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(stage_model, name, None)
    stage = PipelineStage(stage_model, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.accum, loss_fn=lm.next_byte_loss)
    optimizer = torch.optim.AdamW(stage_model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=args.batch * args.accum,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    batches = iter(loader)

    def by_hand(steps: int) -> None:
        nonlocal batches
        losses: list[torch.Tensor] = []
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            x, y = batch
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            optimizer.step()
            optimizer.zero_grad()

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) / args.steps

    engine.fit(steps=2)  # warm up both (schedule init, allocator)
    by_hand(2)
    cadence_times, hand_times, ratios = [], [], []
    for i in range(args.repeats):
        order = [("c", lambda: engine.fit(steps=args.steps)), ("h", lambda: by_hand(args.steps))]
        got = dict((name, timed(fn)) for name, fn in (order if i % 2 == 0 else order[::-1]))
        cadence_times.append(got["c"])
        hand_times.append(got["h"])
        ratios.append(got["c"] / got["h"])
    engine.close()
    dist.destroy_process_group()
    return {"cadence": cadence_times, "hand": hand_times, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds of each (alternating order)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step (grad_accum)")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run at tiny sizes (2 rounds of 2 steps)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.dim, args.layers, args.seq, args.batch, args.accum = 2, 2, 64, 2, 32, 2, 2
        print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from cadence.launch import launch

    print(f"load average before: {os.getloadavg()}")
    got = launch(worker, args, nprocs=2, start_method="fork", timeout=3600)
    print(f"load average after: {os.getloadavg()}")
    c, h, r = statistics.median(got["cadence"]), statistics.median(got["hand"]), got["ratios"]
    print(
        f"pipeline 1F1B, 2 ranks, {args.accum} micro-batches of {args.batch} x {args.seq} tokens, "
        f"dim {args.dim}, {args.layers} layers, {args.repeats} rounds of {args.steps} steps"
    )
    print(f"cadence   {c * 1e3:8.2f} ms/step")
    print(f"by hand   {h * 1e3:8.2f} ms/step")
    print(f"ratio     {statistics.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f}); target <= 1.03")


if __name__ == "__main__":
    main()
