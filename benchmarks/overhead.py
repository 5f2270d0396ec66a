"""Per-step overhead of Cadence against a hand-written PyTorch loop.

    python benchmarks/overhead.py            # full run (10-14 minutes)
    python benchmarks/overhead.py --quick    # fewer repeats, for a smoke test
    python benchmarks/overhead.py --workloads W2   # W2 only: bare Cadence against the raw loop (a few minutes)
    python benchmarks/overhead.py --sinks-only --repeats 11   # W1: bare Cadence and the default sinks (pipe, file, terminal)
    python benchmarks/overhead.py --instructions   # W1: instructions per step, counted by valgrind (5-10 minutes)
    python benchmarks/overhead.py --bytecodes      # W1: Python bytecodes per step, by function (1 minute)
    python benchmarks/overhead.py --smoke          # seconds: every part at tiny sizes (tests/test_benchmarks.py)

`--sinks-only` also measures bare Cadence and the default sinks in their steady state
(`sinks_windows`: one fit each, cut into 100-step windows with raw blocks between them), in
`--processes` processes per output, the figure for the default sinks' target (<= 1.05 of the raw
loop): the median over the processes of each one's median ratio. One process's median carries a
bias of its own (where its heap, code and data landed): two processes of the same loops differed
by 2% where each one's median was known to 0.3%, so no single process decides the figure.

`--instructions` counts, with valgrind's callgrind, the instructions each loop executes per W1
step (raw, bare Cadence, the default sinks to a pipe): what the engine and the sinks add to a
step, for comparing a change before and after. The same command counts the same; runs that differ
in anything (the command line, the code before the steps) moved a count by up to 0.4%, against
±1% and more for the timed figures between runs. It does not say what those instructions cost in
time; the timed figures do.

Each measurement runs in a fresh process with one thread and glibc's malloc
thresholds fixed (see FIXED_MALLOC); raw and Cadence runs alternate so drift
in the machine hits both alike. Both loops use the same
seed, model, optimizer and pre-batched in-memory tensors, and every pair is
checked to end with identical parameters. Reports the median per-step time
over the repeats and the ratio to the raw loop (the median, over the
alternations, of each run's time over the raw run just before it); the cost of no-op callbacks
that override every step hook (us per callback per step, the median over the
alternations of the difference to the bare Cadence run), next to its floor: the
raw loop calling the same hooks of 100 objects itself, from plain loops over
bound methods at the same seven points of the step; the cost of the
default sinks (TrainMetrics, progress bar, JSONL, text log; log interval 50),
once writing to a pipe (the progress bar writes throttled lines, as in CI),
once to a file (stderr redirected to a regular file, as `python train.py 2> log`
or a batch job's output file: throttled lines, each written through to the
page cache) and once to a terminal (a pseudo-terminal the parent drains: the
progress bar is a tqdm bar, as for a person watching);
the callbacks' cost once more in one process, from interleaved blocks of 100
steps (see `callback_blocks`: the fresh-process estimate is at the mercy of
the machine's drift); and how long `import cadence` takes after `import torch`.

Workloads:
    W1: MLP 32-64-10, batch 32, 2000 steps, Adam  (overhead dominates)
    W2: MLP 1024x4, batch 128, 200 steps, Adam    (compute dominates)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = {
    "W1": {"sizes": [32, 64, 10], "batch": 32, "steps": 2000, "warmup": 200},
    "W2": {"sizes": [1024, 1024, 1024, 1024, 10], "batch": 128, "steps": 200, "warmup": 20},
}
# glibc's malloc by default maps large blocks (W2's 4 MB weights and gradients)
# with mmap and returns freed heap tops to the system, with thresholds it
# adjusts as the process runs: whether a W2 step then page-faults its
# gradients back in (3,600 to 7,000 minor faults per step seen, 30-36 ms) or
# not (24 ms) depends on the process's allocation history, imports included,
# not on the loop. Both sides run with the thresholds fixed, so large blocks
# stay in the heap and the benchmark measures loops, not page faults.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
#: --smoke: tiny workloads, every worker in this process but the default path's file and terminal ones.
SMOKE = False
STEP_HOOKS = (
    "on_step_start",
    "on_batch",
    "on_forward",
    "on_backward",
    "on_before_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
)


def smoke() -> None:
    """--smoke: W1 of 100 steps, W2 64 wide and 5 steps, the workers in this process (see `run_worker`).

    W1's warm-up stays a multiple of the log interval: `instructions_worker` marks its steps there.
    """
    global SMOKE
    SMOKE = True
    WORKLOADS["W1"].update(steps=100, warmup=50)
    WORKLOADS["W2"].update(sizes=[64, 64, 64, 64, 10], steps=5, warmup=2)


def build(workload: str):
    import torch

    spec = WORKLOADS[workload]
    torch.manual_seed(0)
    sizes = spec["sizes"]
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    n = spec["steps"] + spec["warmup"]
    data = [
        (torch.randn(spec["batch"], sizes[0], generator=g), torch.randint(0, sizes[-1], (spec["batch"],), generator=g))
        for _ in range(n)
    ]
    return model, optimizer, data


def param_hash(model) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def raw_loop(model, optimizer):
    """The hand-written loop: forward, loss, backward, step, zero_grad."""
    from torch.nn import functional as F

    def run(batches):
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def hooked_loop(model, optimizer, callbacks: int):
    """The floor for callbacks: the raw loop calling the no-op hooks of `callbacks` objects itself.

    Each of the seven step points is a plain loop over bound methods.
    """
    from torch.nn import functional as F

    noop = type("NoOp", (), {h: (lambda self, engine: None) for h in STEP_HOOKS})
    objects = [noop() for _ in range(callbacks)]
    start_, batch_, forward_, backward_, before_, stepped_, end_ = (
        tuple(getattr(o, h) for o in objects) for h in STEP_HOOKS
    )
    state = object()

    def run(batches):
        for x, y in batches:
            for hook in start_:
                hook(state)
            for hook in batch_:
                hook(state)
            loss = F.cross_entropy(model(x), y)
            for hook in forward_:
                hook(state)
            loss.backward()
            for hook in backward_:
                hook(state)
            for hook in before_:
                hook(state)
            optimizer.step()
            for hook in stepped_:
                hook(state)
            optimizer.zero_grad(set_to_none=True)
            for hook in end_:
                hook(state)

    return run


def worker(kind: str, workload: str, callbacks: int) -> dict:
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    spec = WORKLOADS[workload]
    model, optimizer, data = build(workload)
    warm, steps = spec["warmup"], spec["steps"]
    if kind in ("raw", "hand-hooks"):
        run = raw_loop(model, optimizer) if kind == "raw" else hooked_loop(model, optimizer, callbacks)
        run(data[:warm])
        start = time.perf_counter()
        run(data[warm:])
        elapsed = time.perf_counter() - start
    else:
        import cadence

        noop = type("NoOp", (cadence.Callback,), {h: (lambda self, engine: None) for h in STEP_HOOKS})
        cbs = []
        for i in range(callbacks):
            cb = noop()
            cb.state_key = f"noop{i}"
            cbs.append(cb)
        if kind in ("sinks", "sinks-file", "sinks-tty"):
            from cadence.callbacks.metrics import default_callbacks

            cbs += default_callbacks()
        workspace = tempfile.mkdtemp(prefix="cadence-bench-")
        engine = cadence.Engine(
            model,
            optimizer,
            data,
            loss_fn=F.cross_entropy,
            callbacks=cbs,
            seed=0,
            log_interval=50,
            workspace=workspace,
        )
        engine.fit(steps=warm)
        start = time.perf_counter()
        engine.fit(steps=steps)
        elapsed = time.perf_counter() - start
    return {"us_per_step": elapsed / steps * 1e6, "params": param_hash(model)}


def block_runner(data: list, block: int, loops: dict, engines: dict):
    """`run(name)`: the seconds of one block of `block` steps of a hand-written loop or an engine's fit.

    The hand-written loops take the next `block` batches of `data` (cycling);
    an engine trains `block` more steps on its own data.
    """
    position = 0

    def run(name: str) -> float:
        nonlocal position
        batches = data[position : position + block]
        position = (position + block) % (len(data) - block)
        started = time.perf_counter()
        if name in loops:
            loops[name](batches)
        else:
            engines[name].fit(steps=block)
        return time.perf_counter() - started

    return run


def callback_blocks(callbacks: int, rounds: int, block: int = 100) -> dict:
    """The cost of `callbacks` no-op callbacks measured in one process, in interleaved blocks.

    Four loops share one model, optimizer and data and take turns, `block`
    steps each, in a rotating order: the raw loop, the raw loop calling the
    hooks of `callbacks` objects itself (the floor), a bare Cadence engine and
    one with `callbacks` no-op callbacks. Each round's differences (Cadence
    with and without callbacks; hand-written hooks and the raw loop) are taken
    within seconds of each other, so the machine's drift, which in fresh
    processes moves a W1 run by more than 100 callbacks cost, cancels.
    """
    import torch
    from torch.nn import functional as F

    import cadence

    torch.set_num_threads(1)
    model, optimizer, data = build("W1")
    noop = type("NoOp", (cadence.Callback,), {h: (lambda self, engine: None) for h in STEP_HOOKS})
    hooked = []
    for i in range(callbacks):
        cb = noop()
        cb.state_key = f"noop{i}"
        hooked.append(cb)
    workspace = tempfile.mkdtemp(prefix="cadence-bench-")
    engines = {
        name: cadence.Engine(
            model, optimizer, data, loss_fn=F.cross_entropy, callbacks=cbs, seed=0, log_interval=50, workspace=workspace
        )
        for name, cbs in (("cadence", []), ("callbacks", hooked))
    }
    loops = {"raw": raw_loop(model, optimizer), "hand": hooked_loop(model, optimizer, callbacks)}
    timed = block_runner(data, block, loops, engines)

    def run(name: str) -> float:
        return timed(name) / block * 1e6

    names = ["raw", "hand", "cadence", "callbacks"]
    for name in names:  # warm every path up
        run(name)
    bus, floor = [], []
    for r in range(rounds):
        order = names[r % 4 :] + names[: r % 4]
        t = {name: run(name) for name in order}
        bus.append((t["callbacks"] - t["cadence"]) / callbacks)
        floor.append((t["hand"] - t["raw"]) / callbacks)
    for engine in engines.values():
        engine.close()
    return {
        "bus": statistics.quantiles(bus, n=4),
        "floor": statistics.quantiles(floor, n=4),
        "over_floor": statistics.quantiles([b - f for b, f in zip(bus, floor)], n=4),
    }


def sinks_windows(rounds: int, block: int = 100) -> dict:
    """Bare Cadence and the default sinks against the raw loop in one process, in their steady state (W1).

    For each of the two (bare Cadence, then Cadence with `default_callbacks()`), one `fit` is cut
    into windows of `block` steps by a metrics collector at the log intervals
    (`fit_timing.Windows.cut_at_log_intervals`: no per-step hook is added to Cadence's side), which runs a
    timed block of the raw loop between two windows; each raw block is set against the mean of the
    windows on either side of it. The three share one model, optimizer and data. No `fit` start or
    end falls inside a window (a run pays those once), and neighbouring windows and blocks are
    tens of ms apart, so the machine's drift cancels far better than between fresh processes.
    Reported: the quartiles of the ratios and a 95% bootstrap interval of their median. Where stderr
    goes (pipe, file, terminal) is the parent's choice, as for the fresh-process variants.
    """
    import random

    import torch
    from fit_timing import Windows
    from torch.nn import functional as F

    import cadence
    from cadence.callbacks.metrics import default_callbacks

    torch.set_num_threads(1)
    model, optimizer, data = build("W1")
    workspace = tempfile.mkdtemp(prefix="cadence-bench-")
    raw = raw_loop(model, optimizer)
    position = 0

    def raw_block() -> float:
        nonlocal position
        batches = data[position : position + block]
        position = (position + block) % (len(data) - block)
        started = time.perf_counter()
        raw(batches)
        return (time.perf_counter() - started) / block

    raw(data[:block])  # warm up
    result = {}
    for name, callbacks in (("cadence", []), ("sinks", default_callbacks())):
        windows = Windows(block, rounds, raw_block)
        engine = cadence.Engine(
            model,
            optimizer,
            data,
            loss_fn=F.cross_entropy,
            callbacks=callbacks,
            seed=0,
            log_interval=50,
            workspace=workspace,
        )
        windows.cut_at_log_intervals(engine)  # no per-step hook on Cadence's side
        engine.fit(steps=(rounds + 2) * block)  # the first window is a warm-up
        engine.close()
        ratios = windows.ratios()
        generator = random.Random(0)
        medians = sorted(statistics.median(generator.choices(ratios, k=len(ratios))) for _ in range(1000))
        result[name] = [*statistics.quantiles(ratios, n=4), medians[25], medians[974]]
    return result


# The default sinks to a pipe only: under valgrind a step takes about 50 times as long, so what
# is throttled by time (the progress bar's refresh in a terminal, the text lines to a file) runs
# many times as often per step as it does at full speed, and its count would say nothing.
INSTRUCTION_KINDS = ("raw", "cadence", "sinks")


def instructions_worker(kind: str, steps: int, mark: Any = os.getppid) -> dict:
    """`steps` W1 steps of one loop between two calls of `mark`, for `instructions` (under callgrind).

    The markers are calls of `os.getppid`, before which callgrind dumps its counts: the second
    part of the run is exactly the measured steps (`bytecodes_worker` passes its own `mark`).
    Cadence's are those after its warm-up steps, cut at log intervals (no fit start or end
    inside), the raw loop's the same batches after the same warm-up.
    """
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    model, optimizer, data = build("W1")
    warm = WORKLOADS["W1"]["warmup"]
    if steps > len(data) - warm:
        raise SystemExit(f"--steps {steps}: W1 has {len(data) - warm} batches after its warm-up")
    if steps % 50:
        raise SystemExit(f"--steps {steps}: give a multiple of the log interval, 50")
    if kind == "raw":
        run = raw_loop(model, optimizer)
        run(data[:warm])
        mark()
        run(data[warm : warm + steps])
        mark()
        return {"params": param_hash(model)}
    import cadence
    from cadence.callbacks.metrics import default_callbacks

    engine = cadence.Engine(
        model,
        optimizer,
        data,
        loss_fn=F.cross_entropy,
        callbacks=default_callbacks() if kind.startswith("sinks") else [],
        seed=0,
        log_interval=50,
        workspace=tempfile.mkdtemp(prefix="cadence-bench-"),
    )
    # The markers come from a collector, which the engine runs at each log interval (both marks
    # are multiples of it) before TrainMetrics' own: no per-step hook is added to Cadence's side,
    # and the part holds whole steps, with one reduction per 50 steps.
    marks = (warm, warm + steps)
    engine.metrics.add_collector(lambda: engine.state.step in marks and mark())
    engine.fit(steps=warm + steps)
    engine.close()
    return {"params": param_hash(model)}


def bytecodes_worker(kind: str, steps: int) -> dict:
    """Python bytecodes per W1 step of one loop, by function, traced between `instructions_worker`'s marks.

    `sys.settrace` with opcode events, set on the frames running at the first mark (the loop's
    own) and on every frame entered after it, until the second mark. Deterministic: the same tree
    counts the same, to the bytecode.
    """
    import collections

    counts: collections.Counter[str] = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            code = frame.f_code
            where = code.co_filename.split("site-packages/")[-1].removeprefix(os.path.dirname(_HERE) + "/")
            counts[f"{where}:{code.co_name}"] += 1
        return trace

    tracing = False

    def mark() -> None:
        nonlocal tracing
        tracing = not tracing
        sys.settrace(trace if tracing else None)
        frame = sys._getframe(1)
        while frame is not None:  # the frames already running: the loop itself
            frame.f_trace = trace if tracing else None
            frame.f_trace_opcodes = tracing
            frame = frame.f_back

    result = instructions_worker(kind, steps, mark)
    sys.settrace(None)
    return {**result, "per_step": {name: count / steps for name, count in counts.items()}}


def bytecodes(steps: int) -> None:
    """Prints the bytecodes per W1 step of each of `INSTRUCTION_KINDS` and Cadence's share by function."""
    per_step = {}
    for kind in INSTRUCTION_KINDS:
        result = run_worker(f"bytecodes-{kind}", "W1", steps=steps)
        per_step[kind] = result["per_step"]
    raw = sum(per_step["raw"].values())
    print(f"W1 Python bytecodes per step (sys.settrace opcode events, {steps} steps each):")
    for kind, label in (("raw", "raw loop"), ("cadence", "bare Cadence"), ("sinks", "default sinks, pipe")):
        total = sum(per_step[kind].values())
        print(f"  {label:24} {total:8,.1f}  (+{total - raw:,.1f})")
    print("Cadence's functions, default sinks (bytecodes per step):")
    own = {name: n for name, n in per_step["sinks"].items() if name.startswith("cadence/")}
    for name, n in sorted(own.items(), key=lambda item: -item[1]):
        if n >= 0.5:
            print(f"  {n:8.1f}  {name}")


def instructions(steps: int) -> dict[str, float]:
    """Instructions per W1 step of each of `INSTRUCTION_KINDS`, counted by valgrind's callgrind.

    Unlike time, the count does not move with the machine's load; it does not tell what those
    instructions cost in time (cache misses, branches). One process per kind, as many at once as
    there are cores.
    """
    import concurrent.futures
    import glob
    import shutil

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt install valgrind)")
    with tempfile.TemporaryDirectory(prefix="cadence-callgrind-") as out:

        def count(kind: str) -> tuple[float, str]:
            prefix = (
                "valgrind",
                "--tool=callgrind",
                "--dump-before=os_getppid*",
                f"--callgrind-out-file={out}/{kind}.%p",
            )
            result = run_worker(f"instructions-{kind}", "W1", steps=steps, prefix=prefix)
            parts = sorted(glob.glob(f"{out}/{kind}.*"))
            measured = [path for path in parts if path.endswith(".2")]
            if len(parts) != 3 or len(measured) != 1:
                raise SystemExit(f"{kind}: callgrind wrote {len(parts)} parts, not 3: was os.getppid called elsewhere?")
            with open(measured[0]) as dump:
                total = next(int(line.split()[1]) for line in dump if line.startswith("summary:"))
            return total / steps, result["params"]

        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            counts = dict(zip(INSTRUCTION_KINDS, pool.map(count, INSTRUCTION_KINDS)))
    if len({params for _, params in counts.values()}) != 1:
        raise SystemExit("--instructions: the loops ended with different parameters")
    return {kind: per_step for kind, (per_step, _) in counts.items()}


def run_in_process(kind: str, workload: str, callbacks: int, steps: int, repeats: int) -> dict:
    """What the worker process of `kind` prints, as a dict (`--worker`)."""
    if kind.startswith("bytecodes-"):
        return bytecodes_worker(kind.removeprefix("bytecodes-"), steps)
    if kind.startswith("instructions-"):
        return instructions_worker(kind.removeprefix("instructions-"), steps)
    if kind == "blocks":
        return callback_blocks(callbacks, rounds=repeats)
    if kind.startswith("sinks-windows"):
        return sinks_windows(rounds=repeats)
    return worker(kind, workload, callbacks)


def run_worker(
    kind: str,
    workload: str,
    callbacks: int = 0,
    steps: int = 1000,
    repeats: int = 11,
    prefix: tuple[str, ...] = (),
    timeout: float | None = None,
) -> dict:
    """A worker of `kind` in a fresh process (--smoke: in this one, but "sinks-file" and "sinks-tty")."""
    if SMOKE and not prefix and kind not in ("sinks-file", "sinks-tty"):
        return run_in_process(kind, workload, callbacks, steps, repeats)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", **FIXED_MALLOC)
    if timeout is None:
        timeout = 3600 if prefix else 900  # under valgrind a step takes about 50 times as long
    command = [*prefix, sys.executable, __file__, "--worker", kind, "--workload", workload]
    command += ["--callbacks", str(callbacks), "--steps", str(steps), "--repeats", str(repeats)]
    command += ["--smoke"] if SMOKE else []
    if kind.endswith("-file"):
        # stderr to a regular file, as a shell's `2> log` or a scheduler's output file.
        with tempfile.TemporaryFile() as log:
            out = subprocess.run(
                command, check=True, stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=timeout
            )
        return json.loads(out.stdout.strip().splitlines()[-1])
    if not kind.endswith("-tty"):
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=env, timeout=timeout)
        return json.loads(out.stdout.strip().splitlines()[-1])
    # stderr is a terminal (the progress bar draws its tqdm bar), read as a terminal would be.
    import fcntl
    import pty
    import struct
    import termios
    import threading

    terminal, worker_side = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, where tqdm draws nothing: give it a terminal's size.
    fcntl.ioctl(worker_side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=worker_side, text=True, env=env)
    os.close(worker_side)

    def drain() -> None:
        try:
            while os.read(terminal, 65536):
                pass
        except OSError:  # the worker closed its side
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stdout, _ = process.communicate(timeout=timeout)
    reader.join(10)
    os.close(terminal)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, stdout)
    return json.loads(stdout.strip().splitlines()[-1])


def steady_state(rounds: int, processes: int) -> None:
    """`sinks_windows` in `processes` processes per output, the outputs in turn; prints each figure.

    Per output and loop: the median over the processes of each one's median ratio, the range of
    those medians, and a 95% bootstrap interval of their median (the processes resampled).
    """
    import random

    outputs = ("pipe", "file", "tty")
    medians: dict[tuple[str, str], list[float]] = {}
    for _ in range(processes):
        for output in outputs:
            kind = "sinks-windows" + ("" if output == "pipe" else f"-{output}")
            result = run_worker(kind, "W1", repeats=rounds)
            for name in ("cadence", "sinks"):
                medians.setdefault((output, name), []).append(result[name][1])
    print(
        f"\nW1 steady state: {processes} processes per output, each one fit per loop with {rounds} raw blocks "
        "of 100 steps between windows of 100 steps;\nthe median over the processes of each one's median ratio:"
    )
    generator = random.Random(0)
    for output in outputs:
        for name, label in (("cadence", "bare Cadence"), ("sinks", "default sinks")):
            values = medians[(output, name)]
            resampled = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(1000))
            print(
                f"  stderr to a {output:5} {label:14} / raw {statistics.median(values):.3f} "
                f"(processes {min(values):.3f}-{max(values):.3f}; median's 95% interval "
                f"{resampled[25]:.3f}-{resampled[974]:.3f})"
            )


def run_blocks(callbacks: int, rounds: int) -> dict:
    if SMOKE:
        return callback_blocks(callbacks, rounds)
    env = dict(os.environ, OMP_NUM_THREADS="1", **FIXED_MALLOC)
    command = [sys.executable, __file__, "--worker", "blocks", "--callbacks", str(callbacks), "--repeats", str(rounds)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def import_time(repeats: int) -> float:
    # cadence/__init__ is lazy: touch the engine so its modules really load.
    code = (
        "import time; import torch; t = time.perf_counter(); import cadence; cadence.Engine; "
        "print(time.perf_counter() - t)"
    )
    times = [
        float(
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120).stdout
        )
        for _ in range(repeats)
    ]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11, help="alternated raw/Cadence pairs per measurement")
    parser.add_argument("--quick", action="store_true", help="3 repeats, W1 only")
    parser.add_argument(
        "--sinks-only", action="store_true", help="W1 only: the raw loop, bare Cadence and the default sinks"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="W1 only: instructions per step of the raw loop, bare Cadence and the default sinks (valgrind)",
    )
    parser.add_argument(
        "--bytecodes",
        action="store_true",
        help="W1 only: Python bytecodes per step of the raw loop, bare Cadence and the default sinks, by function",
    )
    parser.add_argument("--steps", type=int, default=1000, help="--instructions/--bytecodes: W1 steps counted per loop")
    parser.add_argument(
        "--processes",
        type=int,
        default=5,
        help="--sinks-only: steady-state processes per output (pipe, file, terminal)",
    )
    parser.add_argument(
        "--workloads", default="W1,W2", help="the workloads of a full run, comma-separated (W2: just W2, a few minutes)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="W1", help=argparse.SUPPRESS)
    parser.add_argument("--callbacks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke", action="store_true", help="seconds-long run of every part at tiny sizes (not --instructions)"
    )
    args = parser.parse_args()
    if args.smoke:
        smoke()
    if args.worker:
        print(json.dumps(run_in_process(args.worker, args.workload, args.callbacks, args.steps, args.repeats)))
        return
    if args.smoke:
        print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)
        args.repeats, args.steps = 1, 50
    if args.bytecodes:
        bytecodes(args.steps)
        return
    if args.instructions:
        counts = instructions(args.steps)
        raw = counts["raw"]
        print(f"W1 instructions per step (callgrind, {args.steps} steps each, 1 thread; parameters checked equal):")
        for kind, label in (("raw", "raw loop"), ("cadence", "bare Cadence"), ("sinks", "default sinks, pipe")):
            print(f"  {label:24} {counts[kind]:12,.0f}  {counts[kind] / raw:.4f}  (+{counts[kind] - raw:,.0f})")
        return
    repeats = 3 if args.quick and not args.smoke else args.repeats
    workloads = ["W1"] if args.quick or args.sinks_only else args.workloads.split(",")
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"--workloads: no workload {unknown} (there are {sorted(WORKLOADS)})")
    rows = []
    for workload in workloads:
        variants = [("cadence", 0)]
        if workload == "W1" and args.sinks_only:
            variants += [("sinks", 0), ("sinks-file", 0), ("sinks-tty", 0)]
        elif workload == "W1":
            variants += [
                ("cadence", 10),
                ("cadence", 100),
                ("hand-hooks", 100),
                ("sinks", 0),
                ("sinks-file", 0),
                ("sinks-tty", 0),
            ]
        times: dict[tuple[str, int], list[float]] = {("raw", 0): [], **{v: [] for v in variants}}
        for _ in range(repeats):
            raw = run_worker("raw", workload)
            times[("raw", 0)].append(raw["us_per_step"])
            for kind, n in variants:
                result = run_worker(kind, workload, n)
                if result["params"] != raw["params"]:
                    raise SystemExit(f"{workload} {kind}({n}): parameters differ from the raw loop's")
                times[(kind, n)].append(result["us_per_step"])
        raw_times = times[("raw", 0)]
        raw_median = statistics.median(raw_times)
        rows.append((workload, "raw loop", raw_median, 1.0, ""))
        for kind, n in variants:
            median = statistics.median(times[(kind, n)])
            # Each alternation's run against the raw run just before it: drift of
            # the machine over the minutes of a benchmark cancels within a pair.
            ratios = sorted(t / r for t, r in zip(times[(kind, n)], raw_times))
            ratio = statistics.median(ratios)
            label = {
                "sinks": "cadence, default sinks, pipe",
                "sinks-file": "cadence, default sinks, file",
                "sinks-tty": "cadence, default sinks, terminal",
                "hand-hooks": f"raw loop calling {n} no-op hook sets",
            }.get(kind, f"cadence, {n} no-op callbacks")
            # Likewise per alternation: n callbacks' run against the run without them
            # (bare Cadence for Cadence, the raw loop for the hand-written hooks).
            base = raw_times if kind == "hand-hooks" else times[("cadence", 0)]
            per_callback = statistics.median((t - b) / n for t, b in zip(times[(kind, n)], base)) if n else 0
            extra = f"{per_callback:.3f} us/callback/step; " if n else ""
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio, ratio, ratio]
            extra += f"ratios {quartiles[0]:.3f}-{quartiles[2]:.3f} (quartiles)"
            rows.append((workload, label, median, ratio, extra))
    print(f"{'workload':8}  {'variant':32}  {'us/step':>9}  {'ratio':>6}  notes")
    for workload, label, median, ratio, extra in rows:
        print(f"{workload:8}  {label:32}  {median:9.1f}  {ratio:6.3f}  {extra}")
    if args.sinks_only:
        print(f"({repeats} alternated runs per variant, fresh process each, 1 thread; parameters checked equal)")
        steady_state(rounds=30 if args.quick else 120, processes=2 if args.quick else args.processes)
        return
    if "W1" not in workloads:  # the callbacks' and the import's figures are W1's
        print(f"({repeats} alternated runs per variant, fresh process each, 1 thread; parameters checked equal)")
        return
    rounds = 2 if args.smoke else 20 if args.quick else 80
    blocks = run_blocks(100, rounds)
    for key, label in (
        ("bus", "Cadence, 100 no-op callbacks"),
        ("floor", "raw loop calling 100 hook sets"),
        ("over_floor", "Cadence over the floor"),
    ):
        low, median, high = blocks[key]
        print(f"W1 in one process, {label:30} {median:6.3f} us/callback/step ({low:.3f}-{high:.3f}, quartiles)")
    print(
        f"import cadence after import torch: {import_time(1 if args.smoke else 3 if args.quick else 5):.3f} s (median)"
    )
    print(
        f"({repeats} alternated runs per variant, fresh process each, 1 thread; parameters checked equal;\n"
        " us/step: median over the runs; ratio: median over the alternations of run / the raw run before it;\n"
        f" in one process: {rounds} rounds of 100-step blocks of each loop in rotating order, one model)"
    )
    if args.smoke:  # the other modes' parts (--instructions runs under valgrind: minutes)
        steady_state(rounds=2, processes=1)
        bytecodes(args.steps)


if __name__ == "__main__":
    main()
