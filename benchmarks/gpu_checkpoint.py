"""Checkpoints of the LM's GPU state (issue 32): sync and async saves, restore, the DCP store on a one-process mesh.

    python benchmarks/gpu_checkpoint.py                 # one H100 / H200: about a minute
    python benchmarks/gpu_checkpoint.py --smoke         # seconds on the CPU: a tiny model, every row once
    python benchmarks/gpu_checkpoint.py --json out.json # the rows also as JSON
    python benchmarks/gpu.py                            # these rows in the GPU benchmark's table (`rows(args)`)

The state: examples/lm.py's Transformer (dim 1024, 12 layers, 16 heads / 8 kv, ffn 2816; about
142M parameters) and its fused AdamW state on the GPU, trained in bf16 autocast on 16 x 1024
random tokens a step: about 1.7 GB. Rows (`row`, `value`, `unit`, `target`, `note`):

- `file: sync save`: `build_payload` + `FileStore.write` (what `Checkpoint.save()` does in sync
  mode: every file fsynced, committed), against `torch.save` of the model's and optimizer's
  state dicts + fsync, in alternating order, the median of `--repeats`.
- `file: async save held`: in `Engine.fit` with `Checkpoint(async_mode="async")`, the host time
  of the save point (target: <= 0.1 s per GB of state); then `file: step +k after`, each of the
  5 steps after the save against the median of 5 normal steps before it (target <= 1.10; the
  write runs throughout them, paced at `async_write_share=0.2`). Each step is timed from the end
  of the previous step's save point to its own end, with `torch.cuda.synchronize()` at each
  step's end, so a copy the GPU waits for shows in the step that waits.
- `file: restore`: `cadence.checkpoint.from_checkpoint` of that checkpoint into a new model and optimizer,
  checked bit for bit against the state at the saving step (cloned on the GPU just before).
- `file: D2H copy`: the copy alone, `Staging.stage` + `wait_copied` into the reused pinned buffer.
- `dcp: ...`: the same under `MeshBackend(device="cuda")` on one process (FSDP2 over a mesh of
  one, NCCL; the store's own gloo group writes), sync and async.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import lm  # noqa: E402  (examples/lm.py)

import cadence  # noqa: E402
from cadence.callbacks import Checkpoint  # noqa: E402
from cadence.checkpoint import from_checkpoint  # noqa: E402
from cadence.checkpoint.payload import build_payload  # noqa: E402
from cadence.engine.callback import Callback  # noqa: E402
from cadence.engine.order import Order  # noqa: E402

BEFORE, AFTER = 5, 5  # normal steps measured before the save, steps measured after it
WARM = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mesh_backend(device: str) -> Any:
    from cadence.backends.mesh import MeshBackend

    return MeshBackend(device=device)


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def state_of(engine: cadence.Engine) -> list[tuple[str, torch.Tensor]]:
    """The model's and optimizers' tensors as the backend saves them, by name (on their device)."""
    backend, out = engine.backend, []
    out += [(f"model.{k}", v) for k, v in backend.model_state_dict(engine).items() if isinstance(v, torch.Tensor)]
    for n, optimizer in enumerate(backend.optimizer_state_dicts(engine)):
        for index, state in optimizer["state"].items():
            out += [(f"optimizers.{n}.{index}.{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    return out


def gigabytes(state: list[tuple[str, torch.Tensor]]) -> float:
    return sum(full(t).numel() * full(t).element_size() for _, t in state) / 1e9


class Clock(Callback):
    """Step ends (synchronized) and save points; at the saving step, the state is cloned first (the reference)."""

    raises_requests = False

    def __init__(self, save_step: int, saver: Checkpoint) -> None:
        self.save_step, self.saver, self.reference = save_step, saver, None
        self.ends: dict[int, float] = {}
        self.points: dict[int, list[float]] = {}
        self.writing: dict[int, bool] = {}

    def on_step_end(self, engine: cadence.Engine) -> None:
        sync(engine.backend.device)
        self.ends[engine.state.step] = time.perf_counter()
        self.writing[engine.state.step] = not self.saver.wait(0)  # a look: is the background write still running


class Before(Callback):
    order = Order.CHECKPOINT - 1
    raises_requests = False

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_save_point(self, engine: cadence.Engine) -> None:
        if engine.state.step == self.clock.save_step:
            with torch.no_grad():
                self.clock.reference = [(k, full(v).clone()) for k, v in state_of(engine)]
            sync(engine.backend.device)
        self.clock.points[engine.state.step] = [time.perf_counter()]


class After(Callback):
    order = Order.CHECKPOINT + 1
    raises_requests = False

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_save_point(self, engine: cadence.Engine) -> None:
        self.clock.points[engine.state.step].append(time.perf_counter())


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = bool(getattr(args, "smoke", False))
        self.cuda = torch.cuda.is_available() and not self.smoke
        self.device = "cuda" if self.cuda else "cpu"
        if self.smoke:
            self.config = lm.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, seq_len=32)
            self.batch = 2
        else:
            self.config = lm.ModelConfig(dim=1024, n_layers=12, n_heads=16, n_kv_heads=8, ffn_hidden=2816, seq_len=1024)
            self.batch = 16
        self.repeats = 1 if self.smoke else int(getattr(args, "repeats", 2) or 2)
        self.dir = Path(getattr(args, "dir", None) or tempfile.mkdtemp(prefix="cadence-gpu-ckpt-"))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.config.vocab, (self.batch * 64, self.config.seq_len + 1), generator=g)
        self.data = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def engine(self, callbacks: list[Any], mesh: bool = False, **kwargs: Any) -> cadence.Engine:
        torch.manual_seed(0)
        model = lm.Transformer(self.config)
        fused = self.cuda and not mesh  # fused AdamW on the local backend, as the LM job; foreach on the mesh
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
        placement: dict[str, Any] = {"backend": mesh_backend(self.device)} if mesh else {}
        return cadence.Engine(
            model, optimizer, self.data, loss_fn=lm.next_byte_loss, callbacks=callbacks, seed=0,
            precision="bf16" if self.cuda else "fp32", log_interval=1000,
            train={"batch_size": self.batch, "shuffle": False, "drop_last": True},
            **({} if mesh else {"device": self.device}), **placement, **kwargs,
        )  # fmt: skip


def row(name: str, value: Any, unit: str = "", target: str = "", note: str = "") -> dict[str, Any]:
    return {"row": name, "value": value, "unit": unit, "target": target, "note": note}


def async_rows(setup: Setup, kind: str) -> list[dict[str, Any]]:
    """Train, save asynchronously at one step, train on; held time, the steps after, then restore bitwise."""
    save_step = WARM + BEFORE
    folder = setup.dir / f"{kind}-async"
    saver = Checkpoint(dir=str(folder), interval=save_step, unit="step", async_mode="async", save_on_fit_end=False)
    clock = Clock(save_step, saver)
    mesh = kind == "dcp"
    with setup.engine([clock, Before(clock), saver, After(clock)], mesh=mesh) as engine:
        engine.fit(steps=save_step + AFTER)  # its teardown waits for the write (at full speed)
        size = gigabytes(state_of(engine))
    ends, points = clock.ends, clock.points
    steps = {k: ends[k] - points[k - 1][-1] for k in range(WARM + 1, save_step + AFTER + 1)}
    normal = statistics.median(steps[k] for k in range(WARM + 1, save_step + 1))
    held = points[save_step][1] - points[save_step][0]
    rows = [
        row(f"{kind}: state", round(size, 3), "GB", note=f"model + AdamW on {setup.device}"),
        row(f"{kind}: async save held", round(held, 4), "s", note=f"{held / size:.4f} s/GB (target <= 0.1 s/GB)"),
        row(f"{kind}: normal step", round(normal, 4), "s", note=f"median of {BEFORE} steps before the save"),
    ]
    for k in range(1, AFTER + 1):
        ratio = steps[save_step + k] / normal
        rows.append(row(f"{kind}: step +{k} after", round(ratio, 3), "x normal", "<= 1.10"))
    during = sum(clock.writing[save_step + k] for k in range(1, AFTER + 1))
    rows.append(row(f"{kind}: steps during the write", during, f"of {AFTER}", note="the write ran beside them"))
    rows.append(restore_row(setup, kind, folder / f"ckpt-s{save_step:012d}", clock.reference, mesh))
    return rows


def restore_row(setup: Setup, kind: str, path: Path, reference: Any, mesh: bool) -> dict[str, Any]:
    started = time.perf_counter()
    keep = Checkpoint(dir=str(setup.dir / f"{kind}-restore"), interval=0, save_on_fit_end=False)
    torch.manual_seed(1)
    model = lm.Transformer(setup.config)
    placement: dict[str, Any] = {"backend": mesh_backend(setup.device)} if mesh else {}
    with from_checkpoint(
        path, model, torch.optim.AdamW(model.parameters(), lr=1e-4), setup.data, loss_fn=lm.next_byte_loss,
        callbacks=[keep], seed=0, precision="bf16" if setup.cuda else "fp32",
        train={"batch_size": setup.batch, "shuffle": False, "drop_last": True},
        **({} if mesh else {"device": setup.device}), **placement,
    ) as engine:  # fmt: skip
        sync(engine.backend.device)
        took = time.perf_counter() - started
        restored = dict((k, full(v)) for k, v in state_of(engine))
        wrong = [k for k, v in reference if k not in restored or not torch.equal(restored[k], v)]
    verdict = "bitwise equal" if not wrong else f"DIFFERS in {len(wrong)} tensors, e.g. {wrong[:3]}"
    return row(f"{kind}: restore", round(took, 3), "s", "bitwise", f"{verdict} ({len(reference)} tensors)")


def sync_rows(setup: Setup, kind: str) -> list[dict[str, Any]]:
    """The sync save (payload + store write, durable) against torch.save + fsync of the same state, alternating."""
    mesh = kind == "dcp"
    with setup.engine([], mesh=mesh) as engine:
        engine.fit(steps=2)  # the optimizer's state exists
        store = engine.backend.checkpoint_store(engine).at(setup.dir / f"{kind}-sync")
        ours, theirs = [], []
        for repeat in range(setup.repeats):
            for which in ("ours", "theirs") if repeat % 2 == 0 else ("theirs", "ours"):
                sync(engine.backend.device)
                started = time.perf_counter()
                if which == "ours":
                    store.write("latest", build_payload(engine))
                    ours.append(time.perf_counter() - started)
                else:
                    path = setup.dir / f"{kind}-torch.pt"
                    state = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state_of(engine)}
                    with open(path, "wb") as f:
                        torch.save(state, f)
                        f.flush()
                        os.fsync(f.fileno())
                    theirs.append(time.perf_counter() - started)
                    path.unlink()
        if hasattr(store, "close"):
            store.close()
    a, b = statistics.median(ours), statistics.median(theirs)
    what = "DCP's save" if mesh else "the file store"
    return [
        row(f"{kind}: sync save", round(a, 3), "s", "<= torch.save + fsync", f"{a / b:.3f} x torch.save + fsync"),
        row(f"{kind}: torch.save + fsync", round(b, 3), "s", note=f"of the same tensors, against {what}"),
    ]


def copy_row(setup: Setup) -> dict[str, Any]:
    """The device-to-host copy alone: into the reused pinned staging, as an async file save copies."""
    from cadence.checkpoint.staging import Staging

    with setup.engine([]) as engine:
        engine.fit(steps=1)
        payload = build_payload(engine)
        staging, times = Staging(), []
        for _ in range(3):
            sync(engine.backend.device)
            started = time.perf_counter()
            staging.stage(payload)
            staging.release()
            staging.wait_copied()
            times.append(time.perf_counter() - started)
        size = gigabytes(state_of(engine))
    best = statistics.median(times[1:]) if len(times) > 1 else times[0]
    return row("file: D2H copy", round(size / best, 2), "GB/s", note=f"{best:.4f} s for {size:.3f} GB (median)")


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row (benchmarks/gpu.py calls this with its own arguments: `smoke` is read, the rest defaulted)."""
    setup = Setup(args)
    out = sync_rows(setup, "file") + async_rows(setup, "file")
    if setup.cuda:
        out.append(copy_row(setup))
    out += sync_rows(setup, "dcp") + async_rows(setup, "dcp")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds on the CPU: a tiny model, every row once")
    parser.add_argument("--repeats", type=int, default=2, help="sync saves against torch.save + fsync, alternating")
    parser.add_argument("--dir", help="where checkpoints are written (default: a new temporary folder)")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else "CPU"
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    table = rows(args)
    width = max(len(r["row"]) for r in table)
    for r in table:
        value = f"{r['value']} {r['unit']}".strip()
        target = f"target {r['target']}" if r["target"] else ""
        print(f"{r['row']:{width}}  {value:>18}  {target:>24}  {r['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
