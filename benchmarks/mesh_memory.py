"""Memory of the mesh backend's large-model options on the CPU (gloo ranks): accumulation modes and loss parallel.

    python benchmarks/mesh_memory.py accumulation   # FSDP2 on 2 ranks and HSDP 2 x 2 on 4, each mode of mesh.accumulation_sync
    python benchmarks/mesh_memory.py loss_parallel  # tensor 2, a 32768-token vocabulary, with and without loss parallel
    python benchmarks/mesh_memory.py --smoke        # seconds: both sections at tiny sizes (figures meaningless)

Bytes are what the process has allocated (glibc's `mallinfo2()`: bytes in use in every arena plus
mmapped chunks; torch's CPU tensors come from malloc), read on each rank at two points of a step
and subtracted, so everything but what the step adds cancels out. Rank 0's figures are printed.

Section `accumulation`. examples/lm.py's Transformer (dim 256, 4 layers, 4 heads / 2 kv, ffn 704,
vocabulary 256: 3.1M parameters, 11.8 MiB of fp32 gradients in all), 4 micro-batches of 2 x 128
tokens a step, fp32, AdamW. "held" is allocated after the first micro-batch's backward minus at the
step's start (before the first forward, gradients set to None by the previous zero_grad): the
gradients a rank carries into the next micro-batch. Expected: "last" holds the whole model's
unsharded gradients (FSDP2 has not reduced them yet); "every" and "replicate_last" hold the shard
(1 / shard of them: the reduce-scatter ran). Also the step time (median of 10 steps after 3) for
the communication each mode adds.

Section `loss_parallel`. The same Transformer with a vocabulary of 32768 (19.7M parameters, the
output projection 8.4M of them), 4 x 256 tokens a step, on `tensor=2`: "logits" is the bytes of
the logits tensor this rank holds (its shape x 4 bytes), "forward" is allocated after the first
forward and loss minus at the step's start (the last step's logits let go of first): activations,
logits and what the loss keeps for backward, with and without loss parallel (and sequence parallel). Analytically the full logits are 4 x 256 x 32768 x 4 bytes
= 128 MiB per rank without loss parallel and 64 MiB with it, plus the same again for the
log-softmax the loss keeps.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
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
from cadence.launch import launch  # noqa: E402

MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@functools.cache
def _mallinfo() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc.mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None


def allocated() -> int | None:
    """Bytes this process has allocated through malloc (in use in every arena, plus mmapped chunks), or None."""
    info = _mallinfo()
    if info is None:
        return None
    m = info()
    return int(m.uordblks + m.hblkhd)


class Probe(cadence.Callback):
    """Allocated bytes at the step's start and after the first micro-batch's forward and backward; step times."""

    order = 0
    raises_requests = False

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.held: list[int] = []
        self.forward: list[int] = []
        self.times: list[float] = []
        self.logits = 0

    def on_step_start(self, engine) -> None:
        self.micro = 0
        engine.outputs = None  # the last step's logits, which the loop lets go of before the next forward anyway
        self.start_bytes = allocated() or 0
        self.start_time = time.perf_counter()

    def on_forward(self, engine) -> None:
        if self.micro == 0 and engine.state.step >= self.warmup:
            self.forward.append((allocated() or 0) - self.start_bytes)
            out = engine.outputs
            local = out.to_local() if hasattr(out, "to_local") else out
            self.logits = local.numel() * local.element_size()

    def on_backward(self, engine) -> None:
        if self.micro == 0 and engine.state.step >= self.warmup:
            self.held.append((allocated() or 0) - self.start_bytes)
        self.micro += 1

    def on_step_end(self, engine) -> None:
        if engine.state.step > self.warmup:
            self.times.append(time.perf_counter() - self.start_time)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, seq_len: int, count: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (count, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def measure(config: dict[str, Any], backend: dict[str, Any], batch: int, accum: int, steps: int) -> dict[str, Any]:
    """One engine on this rank's process group; rank 0's medians."""
    torch.manual_seed(0)
    model_config = lm.ModelConfig(**config)
    model = lm.Transformer(model_config)
    probe = Probe(warmup=3)
    options = dict(backend)
    tp = options.pop("plan", None)
    if tp is not None:
        options["parallelize"] = functools.partial(lm.Transformer.parallelize, **tp)
    with cadence.Engine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4),
        Tokens(model_config.vocab, model_config.seq_len, 4096),
        loss_fn=lm.next_byte_loss, callbacks=[probe], seed=0, grad_accum=accum, log_interval=10**9,
        backend=MeshBackend(**options, timeout=60, device="cpu"),
        train={"batch_size": batch, "shuffle": False}, device="cpu",
    ) as engine:  # fmt: skip
        engine.fit(steps=steps)
        params = sum(p.numel() for p in lm.Transformer(model_config).parameters())
    return {
        "held_mib": statistics.median(probe.held) / MiB,
        "forward_mib": statistics.median(probe.forward) / MiB,
        "logits_mib": probe.logits / MiB,
        "step_ms": 1e3 * statistics.median(probe.times),
        "grads_mib": 4 * params / MiB,
    }


def run_cases(cases: list[tuple[str, dict[str, Any]]], config: dict[str, Any], batch: int, accum: int, steps: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return {name: measure(config, backend, batch, accum, steps) for name, backend in cases}
    finally:
        dist.destroy_process_group()


ACCUMULATION = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 704, "seq_len": 128}
LOSS_PARALLEL = {**ACCUMULATION, "seq_len": 256, "vocab": 32768}
SMOKE = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "seq_len": 16}


def accumulation(args: argparse.Namespace) -> None:
    config = SMOKE if args.smoke else ACCUMULATION
    steps = 4 if args.smoke else 13
    layouts = [("fsdp2 shard=2", {"shard": 2}, 2, ["last", "every"])]
    if not args.smoke:
        layouts.append(
            ("hsdp replicate=2 x shard=2", {"replicate": 2, "shard": 2}, 4, ["last", "every", "replicate_last"])
        )
    print(f"accumulation: {4} micro-batches of 2 x {config['seq_len']} tokens a step, fp32, AdamW")
    print(f"{'layout':28} {'mode':15} {'held MiB':>9} {'of grads':>9} {'step ms':>9}")
    for name, axes, nprocs, modes in layouts:
        cases = [(mode, {**axes, "accumulation_sync": mode}) for mode in modes]
        got = launch(run_cases, cases, config, 2, 4, steps, nprocs=nprocs, start_method="fork", timeout=600)
        for mode, result in got.items():
            share = result["held_mib"] / result["grads_mib"]
            print(f"{name:28} {mode:15} {result['held_mib']:9.2f} {share:9.2f} {result['step_ms']:9.1f}")
        print(f"{'':28} (the model's fp32 gradients: {next(iter(got.values()))['grads_mib']:.2f} MiB)")


def loss_parallel(args: argparse.Namespace) -> None:
    config = {**SMOKE, "vocab": 512} if args.smoke else LOSS_PARALLEL
    batch, steps = (2, 4) if args.smoke else (4, 8)
    plans = [("tensor parallel", {}), ("+ loss parallel", {"loss_parallel": True}),
             ("+ sequence parallel", {"sequence_parallel": True}),
             ("+ both", {"sequence_parallel": True, "loss_parallel": True})]  # fmt: skip
    cases = [
        (name, {"shard": 1, "tensor": 2, "loss_parallel": bool(plan.get("loss_parallel")), "plan": plan})
        for name, plan in plans
    ]
    got = launch(run_cases, cases, config, batch, 1, steps, nprocs=2, start_method="fork", timeout=600)
    full = batch * config["seq_len"] * config["vocab"] * 4 / MiB
    print(f"loss parallel: tensor=2, {batch} x {config['seq_len']} tokens, vocabulary {config['vocab']}, fp32 "
          f"(full logits {full:.1f} MiB)")  # fmt: skip
    print(f"{'plan':22} {'logits MiB':>11} {'forward MiB':>12} {'step ms':>9}")
    for name, result in got.items():
        print(f"{name:22} {result['logits_mib']:11.1f} {result['forward_mib']:12.1f} {result['step_ms']:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", nargs="?", choices=["accumulation", "loss_parallel"])
    parser.add_argument("--smoke", action="store_true", help="seconds: both sections at tiny sizes")
    args = parser.parse_args()
    if args.section is None and not args.smoke:
        parser.error("name a section (accumulation or loss_parallel), or give --smoke")
    if allocated() is None:
        print("glibc's mallinfo2 is not available here: the byte counts read 0")
    if args.smoke:
        print("--smoke: tiny sizes, the figures mean nothing")
    print("load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.section in ("accumulation", None):
        accumulation(args)
    if args.section in ("loss_parallel", None):
        loss_parallel(args)
    print("load average (1, 5, 15 min) at end:   {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
