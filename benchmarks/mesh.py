"""Mesh benchmarks. Section `dcp`: the DCP checkpoint store on 2 ranks against the disk.

    python benchmarks/mesh.py dcp                  # ~1.2 GB of FSDP2-sharded state (params + AdamW), 5 repeats
    python benchmarks/mesh.py dcp --gb 0.1 --repeats 2   # a quick smoke run

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


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=["dcp"], help="which benchmark")
    parser.add_argument("--gb", type=float, default=1.2, help="DCP: gigabytes of sharded state in all (default 1.2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temp folder here)")
    args = parser.parse_args()
    print("load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.section == "dcp":
        dcp(args)
    print("load average (1, 5, 15 min) at end:   {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    sys.exit(main())
