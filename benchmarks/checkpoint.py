"""Checkpoint throughput against the disk: durable save, cold restore, async blocking time.

    python benchmarks/checkpoint.py                 # ~100M parameters + AdamW state (~1.2 GB), 5 repeats
    python benchmarks/checkpoint.py --params 10     # 10M parameters, a quick smoke run
    python benchmarks/checkpoint.py --drop-caches   # also drop the whole page cache before cold reads (root)

Measured in one run, on the same disk (the folder given by --dir):

- durable sync save: `Checkpoint.save` (payload, write, fsync, atomic commit), against
  `dd if=<random bytes> of=... bs=1M count=N conv=fdatasync`: the same number of real
  bytes, from a file of random bytes in memory (/dev/shm, or a cached file here), to the
  same disk. For information also against `dd if=/dev/zero`, which some virtual disks
  store faster than real data (about 20% here);
- restore: `load_checkpoint` (read, verify every checksum, load into the engine) from a
  cold cache, against `dd if=<that file of random bytes> of=/dev/null bs=1M` from a cold
  cache, and (for information) against reading that file, cold, into newly allocated
  memory, which any loader that materializes tensors pays and dd, streaming through one
  1 MB buffer, does not. Cold: the files' pages are evicted with posix_fadvise(DONTNEED)
  after an fsync (no root needed), plus `echo 3 > /proc/sys/vm/drop_caches` with --drop-caches;
- async: the time `Checkpoint.save` blocks the loop in async mode (snapshot into the
  reused CPU staging buffers), from the second save on, as a fraction of a sync save.

Medians over --repeats; each measure and its reference run as a pair, in alternating order,
so that a slow spell of a shared disk hits both sides alike, and each measurement starts from
the same state (the previous checkpoint's removal done, nothing dirty, the benchmark's files
evicted from the page cache). That last point matters on virtual machines that back guest
memory lazily: writing into page cache that was not freed just before can cost twice as
much, and `dd` after deleting its previous file always reuses just-freed pages.
Targets: save >= 90% of dd (real bytes), restore >= 90% of the cold dd read, async <= 20% of
a sync save. The load average is printed before and after: other work on the machine counts.
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

import torch

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint.payload import load_checkpoint

WIDTH = 4096


def build(params_millions: float, directory: Path, async_mode: str) -> tuple[cadence.Engine, Checkpoint]:
    layers = max(1, round(params_millions * 1e6 / WIDTH**2))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates AdamW's two moment buffers per parameter
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    checkpoint = Checkpoint(dir=str(directory), async_mode=async_mode, interval=0, save_on_fit_end=False)
    engine = cadence.Engine(model, optimizer, callbacks=[checkpoint], seed=0, backend="local")
    checkpoint.on_setup(engine)  # as the engine's first run would: the store, the sweep
    checkpoint.on_fit_start(engine)  # starts the async writer
    return engine, checkpoint


def evict(path: Path) -> None:
    """Make the next read of `path` (a file or a folder of files) come from the disk."""
    for file in [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_into_new_memory(path: Path) -> None:
    buffer = torch.empty(path.stat().st_size, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    with open(path, "rb", buffering=0) as f:
        position = 0
        while position < len(view):
            position += f.readinto(view[position : position + (32 << 20)])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd(*args: str) -> None:
    subprocess.run(["dd", *args, "bs=1M", "status=none"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100.0, help="millions of parameters (default 100)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temp folder here)")
    parser.add_argument("--drop-caches", action="store_true", help="also drop the page cache (needs root)")
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    root = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=args.dir or "."))
    if args.drop_caches and os.geteuid() != 0:
        sys.exit("--drop-caches needs root")
    shm = Path("/dev/shm")
    source = Path(tempfile.mkstemp(prefix=".bench-checkpoint-", suffix=".random", dir=shm if shm.is_dir() else root)[1])
    try:
        print("load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        run(root, source, args)
        print("load average (1, 5, 15 min) at end:   {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    finally:
        source.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, source: Path, args: argparse.Namespace) -> None:
    keys = ("save", "dd_write", "dd_zero", "restore", "dd_read", "read_new", "async")
    results: dict[str, list[float]] = {k: [] for k in keys}
    size = measure_sync(root, source, args, results)
    measure_async(root, args, results)
    median = {k: statistics.median(v) for k, v in results.items()}
    rate = lambda seconds: size / seconds / 1e9  # noqa: E731
    rows = [
        ("durable sync save", "save", "dd fdatasync, random", "dd_write", ">= 0.90"),
        ("durable sync save", "save", "dd fdatasync, zeros", "dd_zero", "(info)"),
        ("restore (cold)", "restore", "dd read (cold)", "dd_read", ">= 0.90"),
        ("restore (cold)", "restore", "read into new memory", "read_new", "(info)"),
        ("async save, loop blocked", "async", "sync save", "save", "<= 0.20"),
    ]
    print(f"\n{'measure':26} {'s':>7} {'GB/s':>6}   {'against':20} {'s':>7} {'GB/s':>6}   {'ratio':>6}  target")
    for name, ours, against, theirs, target in rows:
        a, b = median[ours], median[theirs]
        ratio = a / b if target.startswith("<=") else b / a
        print(f"{name:26} {a:7.3f} {rate(a):6.2f}   {against:20} {b:7.3f} {rate(b):6.2f}   {ratio:6.2f}  {target}")
    print("\nall runs (s):", {k: [round(x, 3) for x in v] for k, v in results.items()})


def random_file(path: Path, megabytes: int) -> None:
    """`megabytes` MiB of random bytes (incompressible, as trained weights are), left in the page cache."""
    generator = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator).numpy().tobytes())


def measure_sync(root: Path, source: Path, args: argparse.Namespace, results: dict[str, list[float]]) -> int:
    """Sync saves and restores, each paired with dd; returns the payload's size in bytes."""
    engine, checkpoint = build(args.params, root / "sync", "disabled")
    checkpoint.save(engine)  # warm-up: first-touch costs, imports
    size = sum(f["size"] for f in checkpoint.store.manifest("latest")["files"].values())
    megabytes, reference, latest = max(1, size >> 20), root / "dd.bin", root / "sync" / "latest"
    random_file(source, megabytes)
    parameters = sum(p.numel() for p in engine.model.parameters()) / 1e6
    print(f"payload {size / 1e9:.2f} GB ({parameters:.0f}M parameters + AdamW state); disk folder {root.resolve()}")

    def save() -> None:
        engine.state.step += 1  # a new state each time (a save at the same state only adds names)
        results["save"].append(timed(lambda: checkpoint.save(engine)))

    def dd_write() -> None:  # leaves dd.bin, random bytes, for the read references
        reference.unlink(missing_ok=True)
        command = (f"if={source}", f"of={reference}", f"count={megabytes}", "conv=fdatasync")
        results["dd_write"].append(timed(lambda: dd(*command)))

    def dd_zero() -> None:
        zeros = root / "dd-zero.bin"
        command = ("if=/dev/zero", f"of={zeros}", f"count={megabytes}", "conv=fdatasync")
        results["dd_zero"].append(timed(lambda: dd(*command)))
        zeros.unlink()

    def restore() -> None:
        evict(latest)
        drop_caches(args.drop_caches)
        results["restore"].append(timed(lambda: load_checkpoint(engine, latest)))

    def read_new() -> None:
        # What any loader pays at least: the same bytes, cold, into newly allocated memory.
        evict(reference)
        drop_caches(args.drop_caches)
        results["read_new"].append(timed(lambda: read_into_new_memory(reference)))

    def dd_read() -> None:
        evict(reference)
        drop_caches(args.drop_caches)
        results["dd_read"].append(timed(lambda: dd(f"if={reference}", "of=/dev/null")))

    # Each measure and its references in alternating order, so that a slow spell of the shared disk hits both sides; each
    # measurement starts from the same state: nothing dirty, no page cache of the benchmark's files (but the source).
    for group in ((save, dd_write, dd_zero), (restore, dd_read, read_new)):
        for i in range(args.repeats):
            for step in group if i % 2 == 0 else group[::-1]:
                checkpoint.store.wait()
                os.sync()
                for path in root.rglob("*"):
                    if path.is_file() and path != source:
                        evict(path)
                step()
    checkpoint.on_teardown(engine)
    return size


def measure_async(root: Path, args: argparse.Namespace, results: dict[str, list[float]]) -> None:
    engine, checkpoint = build(args.params, root / "async", "async")
    for i in range(args.repeats + 1):
        engine.state.step += 1
        blocked = timed(lambda: checkpoint.save(engine))
        if i:  # from the second save on: the staging buffers exist and are reused
            results["async"].append(blocked)
        checkpoint.wait()  # the next save comes after this one is written (saves sparser than writes)
    checkpoint.on_teardown(engine)


if __name__ == "__main__":
    main()
