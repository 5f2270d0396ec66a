"""The LM job on GPUs: Cadence against a hand-written loop, eager and compiled, its input pipeline, checkpoints,
float8 against bf16, and FSDP2's accumulation modes (2 GPUs).

    python benchmarks/gpu.py                   # one H100 / H200: about 5-7 minutes (float8 compiles 3 models)
    python benchmarks/gpu.py --json gpu.json   # the table also as JSON
    python benchmarks/gpu.py --smoke           # seconds on the CPU: a tiny model, every row once

The workload (issue 32): examples/lm.py's Transformer with dim 1024, 12 layers, 16 heads / 8 kv,
ffn 2816 (about 142M parameters), 16 x 1024 tokens a step, bf16 autocast, fused AdamW.

- `lm eager` / `lm compiled`: pinned, pre-batched data. The hand-written loop (`x.to(device,
  non_blocking=True)`, forward under autocast, backward, `optimizer.step()`, `zero_grad()`)
  and `Engine.fit` on `LocalBackend(device="cuda", precision="bf16")` run on two copies of the
  same model, in interleaved blocks (hand, Cadence, Cadence, hand, ...) so that the card's
  clocks and temperature hit both alike; each figure is the median over the blocks, the
  ratio the median of the per-round ratios. Compiled: `LocalBackend(compile=True)` against
  the hand loop with each block `module.compile()`d, after a warm-up block each.
- `loader`: a Dataset whose samples cost CPU work (about 0.3 ms each, a stand-in for decoding
  and tokenizing) through the loader the engine builds (`num_workers=0`, so the work runs in
  the training process): Cadence's default on CUDA (pinned, next micro-batch copied ahead)
  against unpinned batches without prefetch (`pin_memory=False, prefetch_to_device=False`),
  and the hand loop over `DataLoader(pin_memory=True)`.
- `checkpoint ...`: the rows of benchmarks/gpu_checkpoint.py (sync and async saves of the GPU
  state, restore) when that file is present.
- `float8 ...` (a GPU of compute capability >= 8.9): bf16 against bf16 with torchao's float8
  linear layers (`LocalBackend(float8=...)`: tensorwise and rowwise recipes; the output head and
  layers of odd sizes stay bf16), all compiled, through Cadence, interleaved as above; the
  `x hand` column is against bf16 there. Needs torchao (`pip install 'cadence[float8]'`).
- `accumulation ...` (2 GPUs): FSDP2 over 2 ranks (`MeshBackend(shard=2, precision="bf16")`),
  4 micro-batches of 4 x 1024 tokens a step, for each `mesh.accumulation_sync`: the peak of
  `torch.cuda.max_memory_allocated` over the timed steps (rank 0) and the step time. "last" holds
  the unsharded gradients between micro-batches, "every" only its shard (issue 35). With fewer
  GPUs the row says so.

Tokens/s are per GPU; MFU is the model's own training FLOPs per token (`flops_per_token`: 6 x
non-embedding parameters + attention) x tokens/s over the card's peak dense bf16 FLOP/s, looked
up by its name (H100 SXM and H200: 989 TFLOP/s; printed; `--peak-tflops` overrides).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import gpu_large  # noqa: E402  (benchmarks/gpu_large.py: what the spawned GPU workers import)
import lm  # noqa: E402  (examples/lm.py)

import cadence  # noqa: E402
from cadence.backends.local import LocalBackend  # noqa: E402
from cadence.launch import launch  # noqa: E402

FULL = {"dim": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 2816, "seq_len": 1024}
SMOKE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 176, "seq_len": 64}
# Peak dense bf16 FLOP/s by a substring of the card's name (first match).
PEAKS = [("H200", 989e12, "H200 (989 TFLOP/s bf16 dense)"), ("H100", 989e12, "H100 SXM (989 TFLOP/s bf16 dense)"),
         ("A100", 312e12, "A100 (312 TFLOP/s bf16 dense)")]  # fmt: skip


class Setup:
    """What every row shares: the device, the model's shape, the batch, the block sizes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = args.smoke
        self.device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
        self.cuda = self.device.type == "cuda"
        self.config = lm.ModelConfig(**(SMOKE if args.smoke else FULL))
        self.batch = 4 if args.smoke else 16
        self.block = 2 if args.smoke else args.block
        self.rounds = 2 if args.smoke else args.rounds
        self.tokens = self.batch * self.config.seq_len
        self.compile_backend = "eager" if args.smoke else "inductor"  # smoke: the compile path, no codegen
        self.peak, self.peak_note = peak_flops(args.peak_tflops, self.cuda)

    def model(self) -> tuple[lm.Transformer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = lm.Transformer(self.config).to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=self.cuda)
        return model, optimizer

    def batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Pre-batched (inputs, targets) on the host, pinned on CUDA."""
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, self.config.vocab, (count, self.batch, self.config.seq_len + 1), generator=g)
        pairs = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
        return [(x.pin_memory(), y.pin_memory()) for x, y in pairs] if self.cuda else pairs

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def peak_flops(override: float | None, cuda: bool) -> tuple[float | None, str]:
    if override:
        return override * 1e12, f"{override:g} TFLOP/s (--peak-tflops)"
    if not cuda:
        return None, "none: no GPU (MFU not computed)"
    name = torch.cuda.get_device_name(0)
    for key, flops, note in PEAKS:
        if key in name:
            return flops, note
    return None, f"unknown for {name!r}: pass --peak-tflops (MFU not computed)"


# -- the two loops ---------------------------------------------------------------------------------


class HandLoop:
    """nanoGPT's loop, on the same model: copy, forward under autocast, backward, step, zero_grad."""

    def __init__(self, setup: Setup, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any) -> None:
        self.setup, self.model, self.optimizer, self.data = setup, model, optimizer, data
        self.iterator = iter(data)
        self.loss = torch.zeros(())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            x, y = next(self.iterator)
        except StopIteration:
            self.iterator = iter(self.data)
            x, y = next(self.iterator)
        device = self.setup.device
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def run(self, steps: int) -> None:
        model, optimizer, device_type = self.model, self.optimizer, self.setup.device.type
        for _ in range(steps):
            x, y = self.next_batch()
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = lm.next_byte_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.loss = loss.detach()


class CadenceLoop:
    """`Engine.fit(steps=...)` on the local backend: the same work through the event loop."""

    def __init__(self, engine: cadence.Engine) -> None:
        self.engine = engine

    def run(self, steps: int) -> None:
        self.engine.fit(steps=steps)

    @property
    def loss(self) -> torch.Tensor:
        loss = self.engine.loss
        return torch.full((), float("nan")) if loss is None else loss.detach()


def engine(setup: Setup, model: torch.nn.Module, optimizer: Any, data: Any, *, compile: bool = False, **kw: Any):
    compiled = {"enabled": True, "backend": setup.compile_backend} if compile else None
    backend = LocalBackend(device=str(setup.device), precision="bf16", compile=compiled)
    return cadence.Engine(
        model, optimizer, data, loss_fn=lm.next_byte_loss, backend=backend, seed=0, log_interval=10**9,
        eval_every_epochs=None, **kw,
    )  # fmt: skip


def interleaved(setup: Setup, loops: dict[str, Any]) -> dict[str, Any]:
    """Per loop: the median step time over interleaved blocks, and the per-round ratios to the first loop."""
    names = list(loops)
    for name in names:  # warm-up block: allocator, autotuning, compilation
        loops[name].run(setup.block)
    setup.sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(setup.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            setup.sync()
            start = time.perf_counter()
            loops[name].run(setup.block)
            setup.sync()  # the block's GPU work is done: the clock stops after the last kernel
            times[name].append((time.perf_counter() - start) / setup.block)
    first = names[0]
    return {
        name: {
            "step_s": statistics.median(times[name]),
            "ratio": statistics.median(t / f for t, f in zip(times[name], times[first])),
            "loss": float(loops[name].loss),
        }
        for name in names
    }


def lm_rows(setup: Setup, compile: bool) -> list[dict[str, Any]]:
    data = setup.batches(8 if setup.smoke else 32)
    hand_model, hand_optimizer = setup.model()
    if compile:
        for block in hand_model.layers:
            block.compile(backend=setup.compile_backend)
    ours_model, ours_optimizer = setup.model()
    started = time.perf_counter()
    loops = {
        "hand-written loop": HandLoop(setup, hand_model, hand_optimizer, data),
        "Cadence": CadenceLoop(engine(setup, ours_model, ours_optimizer, data, compile=compile)),
    }
    result = interleaved(setup, loops)
    flops = hand_model.flops_per_token()
    label = "lm compiled" if compile else "lm eager"
    rows = [row(setup, f"{label}: {name}", r, flops) for name, r in result.items()]
    rows[-1]["note"] += f"; {time.perf_counter() - started:.0f} s with warm-up" + (
        " and compilation" if compile else ""
    )
    release(loops)
    return rows


def row(setup: Setup, name: str, result: dict[str, Any], flops_per_token: float) -> dict[str, Any]:
    tokens_per_s = setup.tokens / result["step_s"]
    mfu = flops_per_token * tokens_per_s / setup.peak if setup.peak else None
    return {
        "row": name,
        "step_ms": 1e3 * result["step_s"],
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "ratio": result["ratio"],
        "note": f"loss {result['loss']:.4f}",
    }


def release(loops: dict[str, Any]) -> None:
    for loop in loops.values():
        if isinstance(loop, CadenceLoop):
            loop.engine.close()
    loops.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the input pipeline ----------------------------------------------------------------------------


class WorkingSequences(torch.utils.data.Dataset):
    """Random byte windows whose every sample costs CPU work (a stand-in for decoding and tokenizing)."""

    def __init__(self, setup: Setup, count: int, rounds: int) -> None:
        g = torch.Generator().manual_seed(2)
        self.data = torch.randint(0, setup.config.vocab, (count * setup.config.seq_len + 1,), generator=g)
        self.seq_len, self.count, self.rounds = setup.config.seq_len, count, rounds

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[index * self.seq_len : (index + 1) * self.seq_len + 1]
        mixed = window.clone()
        for _ in range(self.rounds):  # deterministic work on the sample; the tokens stay the same
            mixed = (mixed * 31 + window) % 65521
        window = window + 0 * mixed  # the work's result is used
        return window[:-1], window[1:]


def loader_rows(setup: Setup) -> list[dict[str, Any]]:
    dataset = WorkingSequences(setup, count=setup.batch * (64 if setup.smoke else 400), rounds=60)
    started = time.perf_counter()
    for i in range(64):
        dataset[i]
    per_sample = (time.perf_counter() - started) / 64
    models = [setup.model() for _ in range(3)]
    train = {"batch_size": setup.batch, "drop_last": True}
    pinned = setup.cuda
    plain = torch.utils.data.DataLoader(
        dataset, batch_size=setup.batch, shuffle=True, drop_last=True, pin_memory=pinned
    )
    loops = {
        "hand-written loop, DataLoader(pin_memory)": HandLoop(setup, *models[0], plain),
        "Cadence, pinned + prefetch (default)": CadenceLoop(engine(setup, *models[1], dataset, train=train)),
        "Cadence, unpinned, no prefetch": CadenceLoop(
            engine(setup, *models[2], dataset, train={**train, "pin_memory": False}, prefetch_to_device=False)
        ),
    }
    result = interleaved(setup, loops)
    flops = models[0][0].flops_per_token()
    rows = [row(setup, f"loader: {name}", r, flops) for name, r in result.items()]
    rows[0]["note"] += f"; {1e3 * per_sample:.2f} ms CPU work per sample, num_workers=0"
    release(loops)
    return rows


# -- checkpoint rows (benchmarks/gpu_checkpoint.py) --------------------------------------------------


def checkpoint_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    path = Path(__file__).with_name("gpu_checkpoint.py")
    if not path.exists():
        return [{"row": "checkpoint", "note": "benchmarks/gpu_checkpoint.py is absent: no checkpoint rows"}]
    spec = importlib.util.spec_from_file_location("gpu_checkpoint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return [dict(r) for r in module.rows(args)]
    except Exception as exc:  # one part failing must not lose the table of the others
        return [{"row": "checkpoint", "note": f"benchmarks/gpu_checkpoint.py failed: {type(exc).__name__}: {exc}"}]


# -- float8 and accumulation (issue 35) ----------------------------------------------------------------


def float8_rows(setup: Setup) -> list[dict[str, Any]]:
    """bf16, then bf16 + float8 tensorwise and rowwise, compiled, through Cadence; ratios to bf16."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return [{"row": "float8", "note": "torchao is not installed: pip install 'cadence[float8]'"}]
    if not setup.smoke:
        capability = torch.cuda.get_device_capability(0) if setup.cuda else None
        if capability is None or capability < (8, 9):
            have = (
                "no GPU"
                if capability is None
                else f"{torch.cuda.get_device_name(0)} is {capability[0]}.{capability[1]}"
            )
            return [{"row": "float8", "note": f"needs a CUDA GPU of compute capability >= 8.9; {have}"}]
    data = setup.batches(8 if setup.smoke else 32)
    loops: dict[str, Any] = {}
    started = time.perf_counter()
    for name, recipe in (("bf16", None), ("float8 tensorwise", "tensorwise"), ("float8 rowwise", "rowwise")):
        model, optimizer = setup.model()
        float8 = {"enabled": True, "recipe": recipe, "emulate": not setup.cuda} if recipe else None
        compiled = {"enabled": True, "backend": setup.compile_backend}
        backend = LocalBackend(device=str(setup.device), precision="bf16", compile=compiled, float8=float8)
        loops[name] = CadenceLoop(
            cadence.Engine(model, optimizer, data, loss_fn=lm.next_byte_loss, backend=backend, seed=0,
                           log_interval=10**9, eval_every_epochs=None)
        )  # fmt: skip
    result = interleaved(setup, loops)
    flops = lm.Transformer(setup.config).flops_per_token()
    rows = [row(setup, f"float8: {name}", r, flops) for name, r in result.items()]
    rows[0]["note"] += f"; compiled; x hand = against this row; {time.perf_counter() - started:.0f} s with compilation"
    release(loops)
    return rows


def accumulation_rows(setup: Setup) -> list[dict[str, Any]]:
    """FSDP2 on 2 GPUs: peak memory and step time of each accumulation mode."""
    gpus = torch.cuda.device_count() if setup.cuda else 0
    if not setup.smoke and gpus < 2:
        return [{"row": "accumulation", "note": f"needs 2 GPUs (FSDP2 over 2 ranks); {gpus} visible"}]
    config = attrs.asdict(setup.config)
    method = "spawn"  # a CUDA parent cannot fork; and by now this process ran groups and async-save threads
    got = launch(gpu_large.accumulation_worker, config, setup.smoke, nprocs=2, start_method=method, timeout=900)
    rows = []
    for mode, r in got.items():
        tokens = 2 * 4 * r["micro_batch"] * setup.config.seq_len  # both ranks, 4 micro-batches
        peak = f"peak {r['peak_gib']:.2f} GiB allocated on rank 0" if r["peak_gib"] is not None else "no CUDA: no peak"
        rows.append({"row": f"accumulation: {mode}", "step_ms": 1e3 * r["step_s"], "tokens_per_s": tokens / r["step_s"],
                     "note": f"{peak}; FSDP2 shard=2, bf16, 4 micro-batches"})  # fmt: skip
    return rows


# -- the table ----------------------------------------------------------------------------------------

COLUMNS = [("step_ms", "step ms", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
           ("ratio", "x hand", "{:.3f}")]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    width = max(len(str(r.get("row", ""))) for r in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{title:>10}" for _, title, _ in COLUMNS) + "  note"]
    for r in rows:
        cells = []
        for key, _, form in COLUMNS:
            value = r.get(key)
            cells.append(f"{form.format(value) if isinstance(value, (int, float)) else '':>10}")
        # Rows of gpu_checkpoint.py: `value` `unit`, `target`, then any other field as key=value.
        extra = [f"{_short(r['value'])} {r.get('unit', '')}".strip()] if r.get("value") is not None else []
        extra += [f"target {r['target']}"] if r.get("target") else []
        known = {"row", "note", "value", "unit", "target", *(key for key, _, _ in COLUMNS)}
        extra += [f"{k}={_short(v)}" for k, v in r.items() if k not in known]
        note = "; ".join([*extra, *([str(r["note"])] if r.get("note") else [])])
        lines.append(f"{r.get('row', '')!s:{width}}  " + "  ".join(cells) + f"  {note}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds on the CPU: a tiny model, every row once")
    parser.add_argument("--json", help="also write the table (and the machine) as JSON to this path")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved blocks per loop and row")
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    parser.add_argument("--peak-tflops", type=float, help="the card's peak dense bf16 TFLOP/s (default: by its name)")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["eager", "compiled", "loader", "checkpoint", "float8", "accumulation"]
    )
    args = parser.parse_args()
    setup = Setup(args)
    card = torch.cuda.get_device_name(0) if setup.cuda else "CPU (no GPU)"
    params = sum(p.numel() for p in lm.Transformer(setup.config).parameters())
    print(f"device: {card}; torch {torch.__version__}; peak assumed: {setup.peak_note}", flush=True)
    print(
        f"model: {params / 1e6:.1f}M parameters, {setup.batch} x {setup.config.seq_len} tokens a step, bf16", flush=True
    )
    rows: list[dict[str, Any]] = []
    parts = [("eager", lambda: lm_rows(setup, False)), ("compiled", lambda: lm_rows(setup, True)),
             ("loader", lambda: loader_rows(setup)), ("checkpoint", lambda: checkpoint_rows(args)),
             ("float8", lambda: float8_rows(setup)), ("accumulation", lambda: accumulation_rows(setup))]  # fmt: skip
    for name, part in parts:
        if name in args.skip:
            continue
        started = time.perf_counter()
        rows.extend(part())
        print(f"[{name}: {time.perf_counter() - started:.0f} s]", flush=True)
    print(table(rows))
    if args.json:
        report = {"device": card, "torch": torch.__version__, "peak": setup.peak_note, "parameters": params,
                  "tokens_per_step": setup.tokens, "smoke": setup.smoke, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
