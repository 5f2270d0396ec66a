"""Checkpoint throughput against the disk, and what async saves cost the training loop.

    python benchmarks/checkpoint.py --dcp --buffered-too   # the figures of docs/benchmarks.md: ~100M parameters
                                                           # + AdamW state (~1.2 GB), 5 repeats, ~5-10 min quiet
    python benchmarks/checkpoint.py --params 25 --repeats 3 # ~300 MB, a quicker run
    python benchmarks/checkpoint.py --params 5 --repeats 2  # a smoke test
    python benchmarks/checkpoint.py --drop-caches           # also drop the whole page cache before cold reads (root)
    python benchmarks/checkpoint.py --full-speed-too        # also async writes at full speed (async_write_share=1)
    python benchmarks/checkpoint.py --smoke                 # seconds: every part at tiny sizes (tests/test_benchmarks.py)

--dcp adds torch.distributed.checkpoint's async_save, --buffered-too the async saves written
through the page cache, as information rows (each costs about as long as the async part).

Every figure is a ratio within one run, per repeat, reported as the median and the range
(min-max) over the repeats; never a best case. Measured in one run, on the same disk (--dir):

- durable sync save: `Checkpoint.save` (payload, write, fsync, atomic commit), against
  `dd if=<random bytes> of=... bs=1M count=N conv=fdatasync`: the same number of real
  bytes, from a file of random bytes in memory (/dev/shm, or a cached file here), to the
  same disk. For information also against `dd if=/dev/zero`, which some virtual disks
  store faster than real data;
- restore: `load_checkpoint` (read, verify every checksum, load into the engine) from a
  cold cache, against `dd if=<that file of random bytes> of=/dev/null bs=1M` from a cold
  cache, and (for information) against reading that file, cold, into newly allocated
  memory, which any loader that materializes tensors pays and dd, streaming through one
  1 MB buffer, does not. Cold: the files' pages are evicted with posix_fadvise(DONTNEED)
  after an fsync (no root needed), plus `echo 3 > /proc/sys/vm/drop_caches` with --drop-caches;
- async, in a training loop on the same model (forward, backward and AdamW step of a
  batch of 16, torch's threads as for the sync part): the time `Checkpoint.save` blocks
  the loop, from the second save of a run on (against the sync save of the same repeat);
  the first save of a run, staging buffers reserved at the first step's end as in
  `Engine.fit` and faulted in while training goes on (how long that took is printed), and,
  for information, without: a save before any step, as every first save was before; the mean time of
  the steps that start while the background write runs, over the median of the steps just
  before the save (each write is one sample), and how long the write took (to the end of the
  step that saw it done). The writer is paced as `Checkpoint`'s default (`async_write_share`,
  or --share); --full-speed-too adds the same measures for an unpaced write (share 1);
- the background write's CPU time (all threads, user + system, nothing else running in the
  process) per GB: what the steps lose to it when the loop keeps every core busy; a figure
  that load elsewhere on the machine changes little, unlike the step ratio;
- the checksum's cost: seconds per GB, one thread, over bytes in memory.

Each sync measure and its reference run as a pair, in alternating order, so that a slow
spell of a shared disk hits both sides alike, and each measurement starts from the same
state (the previous checkpoint's removal done, nothing dirty, the benchmark's files evicted
from the page cache). That last point matters on virtual machines that back guest memory
lazily: writing into page cache that was not freed just before can cost twice as much, and
`dd` after deleting its previous file always reuses just-freed pages. The process runs with
glibc's malloc thresholds fixed (it re-executes itself with them), so that the training
steps reuse their memory instead of faulting it in again at every step.
Targets: save >= 0.90 of dd (real bytes), restore >= 0.90 of the cold dd read, async
blocking <= 0.20 of a sync save, steps during a background write <= 1.10 of a normal step.
The load average is printed before and after: other work on the machine counts.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import cadence
from cadence.callbacks.checkpoint import Checkpoint
from cadence.checkpoint import direct_io, file_io
from cadence.checkpoint.launch_modes import load_checkpoint

WIDTH = 2048  # 16 MB weights: below glibc's largest mmap threshold, so the steps reuse their memory
BATCH = 16
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
NORMAL_STEPS = 4  # steps timed before each async save: its reference
CHECKSUM = getattr(file_io, "Checksum", None) or file_io.TensorChecksum  # (named Checksum since XXH3-64)
HASH_MEGABYTES = 256  # hashed in memory for the checksum's cost


def smoke(args: argparse.Namespace) -> None:
    """--smoke: 256-wide layers (0.5M parameters), one repeat, every optional measure."""
    global WIDTH, HASH_MEGABYTES
    WIDTH, HASH_MEGABYTES = 256, 8
    args.params, args.repeats = 0.5, 1
    args.dcp = args.buffered_too = args.full_speed_too = True


def build_model(params_millions: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(params_millions * 1e6 / WIDTH**2))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates AdamW's two moment buffers per parameter
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return model, optimizer


def build(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    async_mode: str,
    share: float | None = None,
):
    shared = {} if share is None else {"async_write_share": share}
    checkpoint = Checkpoint(dir=str(directory), async_mode=async_mode, interval=0, save_on_fit_end=False, **shared)
    engine = cadence.Engine(model, optimizer, callbacks=[checkpoint], seed=0, backend="local")
    checkpoint.on_setup(engine)  # as the engine's first run would: the store, the sweep
    checkpoint.on_fit_start(engine)  # starts the async writer (and arms the staging reserve at the first step end)
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


def timed(fn: Callable[[], object]) -> float:
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
    parser.add_argument("--dcp", action="store_true", help="also time steps during torch DCP's async_save (info)")
    parser.add_argument(
        "--buffered-too", action="store_true", help="also async saves written through the page cache (info)"
    )
    parser.add_argument(
        "--share", type=float, default=None, help="Checkpoint(async_write_share=...) (default: the config's)"
    )
    parser.add_argument(
        "--full-speed-too", action="store_true", help="also async saves written at full speed, share 1 (info)"
    )
    parser.add_argument("--smoke", action="store_true", help="seconds-long run of every part at tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        smoke(args)
    if any(os.environ.get(k) != v for k, v in FIXED_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **FIXED_MALLOC})
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    root = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=args.dir or "."))
    if args.drop_caches and os.geteuid() != 0:
        sys.exit("--drop-caches needs root")
    shm = Path("/dev/shm")
    source = Path(tempfile.mkstemp(prefix=".bench-checkpoint-", suffix=".random", dir=shm if shm.is_dir() else root)[1])
    try:
        if args.smoke:
            print("--smoke: tiny sizes, to see every part run; the figures are not measurements")
        print("load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        print(f"torch threads {torch.get_num_threads()}, CPUs {os.cpu_count()}, checksum {CHECKSUM.ALGORITHM}")
        run(root, source, args)
        print("load average (1, 5, 15 min) at end:   {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    finally:
        source.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def run(root: Path, source: Path, args: argparse.Namespace) -> None:
    keys = ("save", "dd_write", "dd_zero", "restore", "dd_read", "read_new")
    keys += ("async", "first", "first_unreserved", "normal_step", "step_ratio", "dcp_blocked", "dcp_step_ratio", "hash")
    keys += ("buffered_async", "buffered_first", "buffered_first_unreserved", "buffered_normal_step")
    keys += ("buffered_step_ratio", "writer_cpu", "buffered_writer_cpu", "reserve", "buffered_reserve")
    keys += ("write_s", "buffered_write_s", "full_async", "full_normal_step", "full_step_ratio", "full_write_s")
    keys += ("full_first", "full_first_unreserved", "full_writer_cpu", "full_reserve")
    results: dict[str, list[float]] = {k: [] for k in keys}
    model, optimizer = build_model(args.params)
    size = measure_sync(model, optimizer, root, source, args, results)
    measure_async(model, optimizer, root, args, results)
    if args.full_speed_too:
        measure_async(model, optimizer, root, args, results, prefix="full_", share=1.0)
    if args.buffered_too:
        direct, direct_io.O_DIRECT = direct_io.O_DIRECT, 0  # the staged files written through the page cache
        try:
            measure_async(model, optimizer, root, args, results, prefix="buffered_")
        finally:
            direct_io.O_DIRECT = direct
    if args.dcp:
        measure_dcp(model, optimizer, root, args, results)
    measure_hash(results, args.repeats)
    median = {k: statistics.median(v) for k, v in results.items() if v}

    def per_pair(ours: str, theirs: str, lower_is_better: bool) -> list[float]:
        """Each measure over its reference of the same repeat (repeat i of n measures: reference i * m // n)."""
        a, b = results[ours], results[theirs]
        pairs = [(x, b[i * len(b) // len(a)]) for i, x in enumerate(a)]
        return [x / y if lower_is_better else y / x for x, y in pairs]

    rows = [
        ("durable sync save", "save", "dd fdatasync, random bytes", "dd_write", False, ">= 0.90"),
        ("durable sync save", "save", "dd fdatasync, zeros", "dd_zero", False, "(info)"),
        ("restore (cold)", "restore", "dd read (cold)", "dd_read", False, ">= 0.90"),
        ("restore (cold)", "restore", "read into new memory", "read_new", False, "(info)"),
        ("async save, loop blocked", "async", "sync save", "save", True, "<= 0.20"),
        ("first async save, blocked", "first", "sync save", "save", True, "(info)"),
        ("first, nothing reserved", "first_unreserved", "sync save", "save", True, "(info)"),
    ]
    gb = size / 1e9
    print(f"\npayload {gb:.2f} GB; ratios per repeat: median (min-max) over the repeats\n")
    print(f"{'measure':27} {'s':>7} {'GB/s':>6}   {'against':27} {'s':>7} {'GB/s':>6}   {'ratio':17} target")
    for name, ours, against, theirs, lower, target in rows:
        if not results[ours]:
            continue
        a, b = median[ours], median[theirs]
        ratios = per_pair(ours, theirs, lower)
        print(f"{name:27} {a:7.3f} {gb / a:6.2f}   {against:27} {b:7.3f} {gb / b:6.2f}   {spread(ratios):17} {target}")
    step = median["normal_step"]
    print(
        f"{'steps during an async write':27} {'':7} {'':6}   {'the steps just before':27} {step:7.3f} {'':6}   "
        f"{spread(results['step_ratio']):17} <= 1.10"
    )
    print(f"{'':27} {'':7} {'':6}   the background write took {spread(results['write_s'])} s (to the end of a step)")
    if results["full_step_ratio"]:
        print(
            f"{'... written at full speed':27} {'':7} {'':6}   {'the steps just before':27} {'':7} {'':6}   "
            f"{spread(results['full_step_ratio']):17} (info, share 1; took {spread(results['full_write_s'])} s)"
        )
    if results["buffered_step_ratio"]:
        print(
            f"{'... written buffered':27} {'':7} {'':6}   {'the steps just before':27} {'':7} {'':6}   "
            f"{spread(results['buffered_step_ratio']):17} (info; blocked {spread(results['buffered_async'])} s)"
        )
    if results["dcp_step_ratio"]:
        print(
            f"{'steps during DCP async_save':27} {'':7} {'':6}   {'the steps just before':27} {'':7} {'':6}   "
            f"{spread(results['dcp_step_ratio']):17} (info; blocked {spread(results['dcp_blocked'])} s)"
        )
    print(f"staging reserve faulted in, in the background, while training: {spread(results['reserve'])} s")
    print(f"checksum ({CHECKSUM.ALGORITHM}): {spread(results['hash'])} s per GB, one thread")
    print(f"background write, CPU time of all threads: {spread(results['writer_cpu'])} s per GB", end="")
    print(f"; written buffered {spread(results['buffered_writer_cpu'])}" if results["buffered_writer_cpu"] else "")
    print("\nall runs:", {k: [round(x, 3) for x in v] for k, v in results.items() if v})


def random_file(path: Path, megabytes: int) -> None:
    """`megabytes` MiB of random bytes (incompressible, as trained weights are), left in the page cache."""
    generator = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator).numpy().tobytes())


def measure_sync(model, optimizer, root: Path, source: Path, args: argparse.Namespace, results) -> int:
    """Sync saves and restores, each paired with dd; returns the payload's size in bytes."""
    engine, checkpoint = build(model, optimizer, root / "sync", "disabled")
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
                quiesce(root, checkpoint, source)
                step()
    checkpoint.on_teardown(engine)
    return size


def quiesce(root: Path, checkpoint: Checkpoint, source: Path | None = None) -> None:
    checkpoint.store.wait()
    os.sync()
    for path in root.rglob("*"):
        if path.is_file() and path != source:
            evict(path)


def trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], float]:
    """One training step on the saved model (forward, backward, AdamW); returns its seconds."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(BATCH, WIDTH, generator=generator)

    def step() -> float:
        start = time.perf_counter()
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients kept: no memory allocated per step
        return time.perf_counter() - start

    return step


def steps_while(step: Callable[[], float], pending: Callable[[], bool]) -> list[float]:
    """Train while `pending()`: the steps that start while a background write runs."""
    times = []
    while pending():
        times.append(step())
    return times


def reserving() -> bool:
    """Whether the staging reserve is still being faulted in (by its thread)."""
    return any(thread.name == "cadence-staging-prefault" for thread in threading.enumerate())


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def checkpoint_bytes(checkpoint: Checkpoint) -> int:
    return sum(f["size"] for f in checkpoint.store.manifest("latest")["files"].values())


def saver(engine: cadence.Engine, checkpoint: Checkpoint) -> Callable[[], None]:
    return lambda: checkpoint.save(engine)


def writing(checkpoint: Checkpoint) -> Callable[[], bool]:
    """Whether the checkpoint's background write still runs."""
    return lambda: not checkpoint.wait(0)


def measure_async(
    model, optimizer, root: Path, args: argparse.Namespace, results, prefix: str = "", share: float | None = None
) -> None:
    """Per repeat a fresh run (engine, callback, writer): its first save, then two more, each timed against steps."""
    share = args.share if share is None else share
    step = trainer(model, optimizer)
    for _ in range(2):
        step()  # warm-up
    for repeat in range(args.repeats):
        folder = root / f"async-{repeat}"
        engine, checkpoint = build(model, optimizer, folder, "async", share)
        step()
        engine.fire(cadence.Event.ON_STEP_END)  # as Engine.fit: the first step end reserves the staging
        # Training goes on while a low-priority thread faults the reserve in; a run's first save usually comes
        # much later than that takes (seconds: it yields to the loop's threads). Up to 60 s of steps here.
        start = time.perf_counter()
        while reserving() and time.perf_counter() - start < 60:
            step()
        results[prefix + "reserve"].append(time.perf_counter() - start)
        for save in range(3):
            quiesce(root, checkpoint)
            normal = statistics.median(step() for _ in range(NORMAL_STEPS))
            engine.state.step += 1
            start = time.perf_counter()
            blocked = timed(saver(engine, checkpoint))
            during = steps_while(step, writing(checkpoint))
            results[prefix + "write_s"].append(time.perf_counter() - start)  # to a step's end: a bound
            checkpoint.wait()
            results[prefix + ("first" if save == 0 else "async")].append(blocked)
            results[prefix + "normal_step"].append(normal)
            if during:  # a write shorter than a step is not a sample
                results[prefix + "step_ratio"].append(statistics.mean(during) / normal)
        # The background write's CPU time, all threads, with nothing else running in this process: what the
        # steps lose to it on a machine whose cores the loop keeps busy. Unlike the step ratio, load elsewhere
        # on the machine changes this one little.
        quiesce(root, checkpoint)
        engine.state.step += 1
        checkpoint.save(engine)
        before = cpu_seconds()
        checkpoint.wait()
        checkpoint.store.wait()  # the removal of the superseded checkpoint counts too
        results[prefix + "writer_cpu"].append((cpu_seconds() - before) / (checkpoint_bytes(checkpoint) / 1e9))
        checkpoint.on_teardown(engine)
        # For information: the first save of a run that never reached a step end (nothing reserved).
        engine, checkpoint = build(model, optimizer, folder, "async", share)
        engine.state.step += 1000
        quiesce(root, checkpoint)
        results[prefix + "first_unreserved"].append(timed(saver(engine, checkpoint)))
        checkpoint.wait()
        checkpoint.on_teardown(engine)
        del engine, checkpoint
        gc.collect()  # the staging buffers go before the next run's
        shutil.rmtree(folder)


def measure_dcp(model, optimizer, root: Path, args: argparse.Namespace, results) -> None:
    """For information: the same steps during torch.distributed.checkpoint.async_save of the same state."""
    import torch.distributed.checkpoint as dcp

    step = trainer(model, optimizer)
    for repeat in range(args.repeats + 1):
        os.sync()
        normal = statistics.median(step() for _ in range(NORMAL_STEPS))
        start = time.perf_counter()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        future = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{repeat}"))
        blocked = time.perf_counter() - start
        during = steps_while(step, lambda: not future.done())  # noqa: B023
        future.result()
        shutil.rmtree(root / f"dcp-{repeat}", ignore_errors=True)
        if repeat and during:  # from the second on, as for the cadence saves
            results["dcp_blocked"].append(blocked)
            results["dcp_step_ratio"].append(statistics.mean(during) / normal)


def measure_hash(results, repeats: int) -> None:
    """Seconds per GB of the checksum the store writes, in one thread, over `HASH_MEGABYTES` in memory."""
    data = torch.randint(0, 256, (HASH_MEGABYTES << 20,), dtype=torch.uint8)
    for _ in range(repeats):
        checksum = CHECKSUM(threaded=False)
        start = time.perf_counter()
        for i in range(0, data.numel(), file_io.CHUNK):
            checksum.update(data[i : i + file_io.CHUNK])
        checksum.finish()
        results["hash"].append((time.perf_counter() - start) / (data.numel() / 1e9))


if __name__ == "__main__":
    main()
