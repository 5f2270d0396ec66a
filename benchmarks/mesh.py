"""Mesh benchmarks. Section `loop`: Cadence's step on FSDP2 and TP against hand-written loops;
section `dcp`: the DCP checkpoint store on 2 ranks against the disk.

    python benchmarks/mesh.py loop                 # LM job and W2, FSDP2 and TP on 2 ranks, 7 pairs each
    python benchmarks/mesh.py loop --steps 3 --repeats 3   # a quick smoke run
    python benchmarks/mesh.py dcp                  # ~1.2 GB of FSDP2-sharded state (params + AdamW), 5 repeats
    python benchmarks/mesh.py dcp --gb 0.1 --repeats 2   # a quick smoke run
    python benchmarks/mesh.py --smoke              # seconds: both sections at tiny sizes (tests/test_benchmarks.py)

Section `loop`. For each workload (the LM job: examples/lm.py's Transformer, dim 128, 4 layers,
sequences of 128 bytes, 8 sequences per data rank a step; W2 of benchmarks/overhead.py: an MLP
1024x4 -> 10, batch 128 a step in all) and each layout (FSDP2: `shard=2`, every block a unit,
each rank reading half the batch; TP: `shard=1, tensor=2`, the LM's `parallelize(mesh)` or W2's
column/row split, both ranks reading the whole batch), one launch of 2 forked gloo ranks holds
both loops, built from the same weights, and times them in turns:

- Cadence: one `Engine.fit` with `MeshBackend(...)` (its DataLoader and sampler, the events),
  AdamW, and one callback that times windows of `--steps` steps at `on_step_end` and runs the
  hand-written rounds between them (`fit_timing.Windows`, which requests nothing: no agreement
  per step); `--overlapped`: also `fit_timing.Requester`, a callback that may request, so the
  step's agreement all-reduce runs, overlapped with forward and backward, as in a run with
  `Preemption` or `EarlyStopping`; `--blocking`: `fit_timing.InStepRequester` instead, a no-op
  callback declaring `requests_in_step = True`, so the agreement runs, blocking, before the
  optimizer step, as it did on every step before 2026-11-26;
- by hand: `fully_shard` on the same units and the root over a 1-D mesh (FSDP2), or the same
  `parallelize_module` plan on a 1-D "tensor" mesh (TP); a `DataLoader` with a
  `DistributedSampler` over the data ranks; forward, loss, backward, `optimizer.step()`,
  `zero_grad()`, in rounds of `--steps` steps.

Cadence is timed inside one fit, in its steady state, as a run spends its time: what a `fit()`
call costs once (its start and end, one agreement of the ranks on the step's mode) is not
charged to a few steps, as rounds of one `fit(steps=N)` each did before 2026-11-27 (rounds of
10 steps measured about 1-2% more that way). The first window is a warm-up.

Reported per case: the median time per step of each (rank 0's clock, the ranks barrier-aligned
before every window and round) and the per-round ratios: each hand-written round against the mean
of the Cadence windows on either side of it (median, min-max). Target: <= 1.03.

Measured in one run, on the same disk (the folder given by --dir), with 2 forked gloo ranks
(`cadence.launch`), each holding half of an FSDP2-sharded model (`fully_shard` over a stack of
4096 x 4096 linear layers) and its AdamW state:

- durable sync save: `DCPStore.write` (every rank writes its shards, the main rank writes the
  manifest, fsyncs and commits by rename), against one `dd if=<random bytes> of=... bs=1M
  count=N conv=fdatasync` of the same number of bytes, from a file of random bytes in memory
  (/dev/shm), to the same disk;
- async save, loop blocked: the time `DCPStore.write_async` keeps the caller (DCP staging into
  the store's kept CPU buffers), from the second save on, as a fraction of a sync save.

Each measure and its reference run as a pair, in alternating order, every one from the same
state (the previous checkpoint's removal done, nothing dirty, the benchmark's files evicted
from the page cache). Reported: the medians and the ratio of each pair (median, min-max).
Targets: save >= 0.90 of dd; async blocked <= 0.20 of a sync save. Other work on the machine
counts: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WIDTH = 4096


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def evict(root: Path, keep: Path | None = None) -> None:
    """Write back and drop from the page cache every file under `root`."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file() and path != keep:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def random_file(path: Path, megabytes: int) -> None:
    generator = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator).numpy().tobytes())


def sharded_state(gigabytes: float) -> tuple[Any, Any]:
    """An FSDP2 model over all ranks and an AdamW with its moments: 12 bytes per parameter in all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(gigabytes * 1e9 / 12 / WIDTH**2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates AdamW's two moments per parameter
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def dcp_rank(root: str, source: str, gigabytes: float, repeats: int) -> dict[str, Any]:
    """One rank: paired sync saves and dd writes, then async saves; rank 0's timings are returned."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from cadence.checkpoint.dcp_store import DCPStore
    from cadence.checkpoint.store import FORMAT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, base = dist.get_rank(), Path(root)
    model, optimizer = sharded_state(gigabytes)
    model_state, optimizer_state = get_state_dict(model, optimizer)

    def payload(step: int) -> dict[str, Any]:
        meta = {"step": step, "epoch": 0}
        return {"format": FORMAT, "version": 1, "meta": meta, "engine": meta, "model": model_state,
                "optimizers": [optimizer_state], "callbacks": {}}  # fmt: skip

    sync_store, async_store = DCPStore(base / "sync"), DCPStore(base / "async")
    sync_store.write("latest", payload(0))  # warm-up: the group, imports, first-touch costs
    size = sum(f["size"] for f in sync_store.manifest("latest")["files"].values()) if rank == 0 else 0
    megabytes = max(1, size >> 20)
    reference = base / "dd.bin"
    results: dict[str, list[float]] = {"save": [], "dd": [], "async": [], "pairs": []}
    step = 0

    def settle() -> None:
        sync_store.wait()
        async_store.wait()
        dist.barrier()
        if rank == 0:
            evict(base)
        dist.barrier()

    def save() -> float:
        nonlocal step
        step += 1
        return timed(lambda: sync_store.write("latest", payload(step)))

    def dd() -> float:
        if rank != 0:
            return 0.0
        reference.unlink(missing_ok=True)
        command = ["dd", f"if={source}", f"of={reference}", "bs=1M", f"count={megabytes}", "conv=fdatasync"]
        return timed(lambda: subprocess.run([*command, "status=none"], check=True))

    for i in range(repeats):
        pair = {}
        for name, fn in (("save", save), ("dd", dd)) if i % 2 == 0 else (("dd", dd), ("save", save)):
            settle()
            pair[name] = fn()
            dist.barrier()
        results["save"].append(pair["save"])
        results["dd"].append(pair["dd"])
    for i in range(repeats + 1):
        settle()
        step += 1
        state = payload(step)
        blocked = timed(lambda: async_store.write_async("latest", state))  # noqa: B023 - called at once
        async_store.wait()
        if i:  # from the second save on: the staging buffers exist and are reused
            results["async"].append(blocked)
    dist.barrier()
    dist.destroy_process_group()
    return {"size": size, **results}


def dcp(args: argparse.Namespace) -> None:
    import cadence

    root = Path(tempfile.mkdtemp(prefix=".bench-mesh-", dir=args.dir or "."))
    shm = Path("/dev/shm")
    source = Path(tempfile.mkstemp(prefix=".bench-mesh-", suffix=".random", dir=shm if shm.is_dir() else root)[1])
    try:
        random_file(source, max(1, int(args.gb * 1.05e9) >> 20))
        result = cadence.launch(
            dcp_rank, str(root), str(source), args.gb, args.repeats, nprocs=2, start_method="fork", timeout=3600
        )
    finally:
        source.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    size = result["size"]
    saves, dds, blocked = result["save"], result["dd"], result["async"]
    save_ratios = [d / s for s, d in zip(saves, dds)]  # >= 0.9: the save is at least 90% as fast as dd
    async_ratios = [b / statistics.median(saves) for b in blocked]
    rate = lambda seconds: size / seconds / 1e9  # noqa: E731
    print(f"DCP store, 2 ranks, {size / 1e9:.2f} GB of FSDP2-sharded state (params + AdamW), disk folder {root}")
    print(f"{'measure':28} {'median s':>9} {'GB/s':>6}   {'ratio median (min-max)':24} target")
    print(
        f"{'sync save (durable)':28} {statistics.median(saves):9.3f} {rate(statistics.median(saves)):6.2f}   "
        f"{_spread(save_ratios):24} >= 0.90 of dd"
    )
    print(f"{'dd conv=fdatasync':28} {statistics.median(dds):9.3f} {rate(statistics.median(dds)):6.2f}")
    print(
        f"{'async save, loop blocked':28} {statistics.median(blocked):9.3f} {'':6}   {_spread(async_ratios):24} <= 0.20"
    )
    print("all runs (s):", {k: [round(x, 3) for x in result[k]] for k in ("save", "dd", "async")})


# -- loop: Cadence against hand-written FSDP2 / TP loops ------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
W2 = [1024, 1024, 1024, 1024, 10]
LM = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "seq_len": 128}


def smoke(args: argparse.Namespace) -> None:
    """--smoke: both sections at tiny sizes, each workload and each layout once (set before the ranks fork)."""
    global WIDTH, W2
    WIDTH, W2 = 256, [64, 64, 64, 64, 10]
    LM.update(dim=64, n_layers=2, ffn_hidden=192, seq_len=32)
    args.steps, args.repeats, args.gb = 2, 1, 0.005
    args.cases = [("lm", "fsdp2"), ("w2", "tp")]
    print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)


def _lm_case(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "examples"))
    import lm

    config = lm.ModelConfig(**LM)
    torch.manual_seed(0)
    model = lm.Transformer(config)
    seq = config.seq_len
    data = lm.ByteSequences(
        torch.randint(0, 256, (seq * 16 * 64 + 1,), generator=torch.Generator().manual_seed(1)), seq
    )
    return {
        "model": model,
        "data": data,
        "loss": lm.next_byte_loss,
        "units": lambda m: list(m.layers),
        "parallelize": lambda m, mesh: m.parallelize(mesh),
        "batch": 16,  # sequences a step in all: 8 per data rank on FSDP2
    }


def _w2_case(args: argparse.Namespace) -> dict[str, Any]:
    import itertools

    from torch.nn import functional as F

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(W2):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(128 * 64, W2[0], generator=g), torch.randint(0, 10, (128 * 64,), generator=g)
    )

    def parallelize(m: torch.nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
        parallelize_module(m, mesh["tensor"], plan)

    return {
        "model": model,
        "data": data,
        "loss": F.cross_entropy,
        "units": lambda m: [layer for layer in m if isinstance(layer, torch.nn.Linear)],
        "parallelize": parallelize,
        "batch": 128,
    }


CASES = {"lm": _lm_case, "w2": _w2_case}
LAYOUTS = {"fsdp2": {"shard": 2}, "tp": {"shard": 1, "tensor": 2}}


def loop_rank(args: argparse.Namespace, workload: str, layout: str) -> dict[str, Any]:
    """One rank: both loops on the same weights, timed in alternated pairs of rounds of `args.steps` steps."""
    import copy

    import torch.distributed as dist
    from fit_timing import Windows, agreement_callbacks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import cadence
    from cadence.backends.mesh import MeshBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    case = CASES[workload](args)
    fsdp = layout == "fsdp2"
    per_rank = case["batch"] // world if fsdp else case["batch"]

    # -- Cadence --
    model = copy.deepcopy(case["model"])
    engine = cadence.Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        case["data"],
        loss_fn=case["loss"],
        backend=MeshBackend(**LAYOUTS[layout], units_fn=case["units"], parallelize=case["parallelize"], timeout=300),
        seed=0,
        log_interval=10**9,
        eval_every_epochs=None,
        train={"batch_size": per_rank, "drop_last": True},
        callbacks=agreement_callbacks(args.agreement),
    )

    # -- by hand --
    hand = copy.deepcopy(case["model"])
    if fsdp:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for unit in case["units"](hand):
            fully_shard(unit, mesh=mesh)
        fully_shard(hand, mesh=mesh, reshard_after_forward=False)
        sampler = torch.utils.data.DistributedSampler(case["data"], world, dist.get_rank(), shuffle=True, seed=0)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
        case["parallelize"](hand, mesh)
        sampler = torch.utils.data.RandomSampler(case["data"], generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(hand.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(case["data"], batch_size=per_rank, sampler=sampler, drop_last=True)
    epoch, batches = 0, iter(loader)
    loss_fn = case["loss"]

    def by_hand(steps: int) -> None:
        nonlocal epoch, batches
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                epoch += 1
                if isinstance(sampler, torch.utils.data.DistributedSampler):
                    sampler.set_epoch(epoch)
                batches = iter(loader)
                batch = next(batches)
            x, y = batch
            loss = loss_fn(hand(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) / args.steps

    windows = Windows(args.steps, args.repeats, lambda: timed(lambda: by_hand(args.steps)), align=dist.barrier)
    engine.add_callback(windows)
    by_hand(2)  # warm up (lazy state, allocator); Cadence's first window is its warm-up
    engine.fit(steps=(args.repeats + 2) * args.steps)
    out = {"cadence": windows.windows, "hand": windows.references, "ratios": windows.ratios()}
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def loop(args: argparse.Namespace) -> None:
    from fit_timing import AGREEMENTS

    import cadence

    print(f"{'case':14} {'cadence ms/step':>16} {'by hand ms/step':>16}   {'ratio median (min-max)':24} target")
    for workload, layout in args.cases:
        got = cadence.launch(loop_rank, args, workload, layout, nprocs=2, start_method="fork", timeout=3600)
        c, h = statistics.median(got["cadence"]), statistics.median(got["hand"])
        print(f"{workload + ' ' + layout:14} {c * 1e3:16.2f} {h * 1e3:16.2f}   {_spread(got['ratios']):24} <= 1.03")
    print(
        f"({args.repeats} hand-written rounds of {args.steps} steps between {args.repeats + 1} Cadence windows of as many "
        f"steps in one fit, 2 gloo ranks, 1 thread each; "
        f"Cadence's agreement: {AGREEMENTS[args.agreement]})"
    )


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    from fit_timing import add_agreement_options

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", nargs="?", choices=["loop", "dcp"], help="which benchmark (--smoke: both)")
    parser.add_argument("--steps", type=int, default=10, help="loop: steps per timed round and window")
    parser.add_argument("--workloads", nargs="+", choices=sorted(CASES), default=["lm", "w2"], help="loop: workloads")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["fsdp2", "tp"], help="loop: layouts")
    parser.add_argument("--gb", type=float, default=1.2, help="DCP: gigabytes of sharded state in all (default 1.2)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default: loop 7, dcp 5)")
    add_agreement_options(parser)
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temp folder here)")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run of both sections at tiny sizes")
    args = parser.parse_args()
    args.cases = [(workload, layout) for workload in args.workloads for layout in args.layouts]
    if args.section is None and not args.smoke:
        parser.error("name a section (loop or dcp), or give --smoke")
    if args.smoke:
        smoke(args)
    print("load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.section in ("loop", None):
        args.repeats = args.repeats or 7
        loop(args)
    if args.section in ("dcp", None):
        args.repeats = args.repeats or 5
        dcp(args)
    print("load average (1, 5, 15 min) at end:   {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    sys.exit(main())
