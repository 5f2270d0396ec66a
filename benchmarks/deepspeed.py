"""Two-process DeepSpeed (ZeRO 2 and 3): Cadence against a hand-written DeepSpeed loop.

    python benchmarks/deepspeed.py                          # one launch per stage, 21 alternated rounds of 20 steps (~4 min)
    python benchmarks/deepspeed.py --rounds 3 --steps 5     # a quick check that it runs
    python benchmarks/deepspeed.py --stages 3 --precision bf16
    python benchmarks/deepspeed.py --separate --repeats 3   # each side in fresh processes, 3 pairs of 50 steps
    python benchmarks/deepspeed.py --smoke                  # seconds: both modes at tiny sizes (tests/test_benchmarks.py)

Workload W2 of benchmarks/overhead.py (an MLP with four 1024-wide layers,
1024-1024-1024-1024-10), torch Adam (no compiled DeepSpeed op), global batch
128 (64 per rank) in two micro-batches of 32 per rank (gradient accumulation
2), pre-batched in-memory tensors, 20 warm-up steps, then the timed steps.
Two processes started by `cadence.launch` (fork), one thread each on CPU
(`DS_ACCELERATOR=cpu`, gloo) or one GPU each (nccl). The hand-written loop is
what the backend does, written by hand: the same DeepSpeed config
(`cadence.backends.deepspeed.build_config`), per micro-batch `ds(x)`, loss,
`ds.backward(loss / 2, scale_wrt_gas=False)`, one `ds.step()` per step.
Cadence adds its events; with `--overlapped` (a callback that may request)
or `--blocking` also the per-step agreement (one small all-reduce).

By default one launch per stage holds both loops (two DeepSpeed engines on
copies of one model, each with its own Adam) and times them in alternated
rounds (ranks barrier-aligned before each), so that the drift of a shared
machine hits both alike; both must end with the same parameters. Reported:
the median per-step time of rank 0 of each, the median (quartiles) of the
per-round ratios, and the ratio of the medians (target <= 1.03). With
`--separate`, each side runs in two fresh processes per pair instead (the
first form of this benchmark; one process to the next varies by about 10%
here).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

# This file is named like the package it measures: keep its folder off the import path,
# or `import deepspeed` would import this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _fit_timing():
    """benchmarks/fit_timing.py, loaded from this folder (which is off the import path, see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_timing", _HERE / "fit_timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIZES = [1024, 1024, 1024, 1024, 10]
GLOBAL_BATCH, ACCUM, WARMUP = 128, 2, 20
#: What tests/test_benchmarks.py needs installed to run this file: module -> the extra that installs it.
REQUIRES = {"deepspeed": "deepspeed"}


def smoke(args: argparse.Namespace) -> None:
    """--smoke: a 64-wide MLP; ZeRO-3 in one launch (with the overlapped agreement), then ZeRO-2 separately."""
    global SIZES, WARMUP
    SIZES, WARMUP = [64, 64, 10], 2
    args.steps, args.rounds, args.repeats, args.agreement = 2, 2, 1, "overlapped"
    print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)


def _model_and_data(world: int, rank: int, steps: int, device: str):
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    micro = GLOBAL_BATCH // world // ACCUM
    data = [
        (
            torch.randn(micro, SIZES[0], generator=g).to(device),
            torch.randint(0, SIZES[-1], (micro,), generator=g).to(device),
        )
        for _ in range((WARMUP + steps) * ACCUM)
    ]
    return model, optimizer, data, micro


def _join() -> tuple:
    """Join the process group; (rank, world size, device, a device sync)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    return rank, world, device, torch.cuda.synchronize if cuda else (lambda: None)


def _hand_written(model, optimizer, stage: int, precision: str, micro: int):
    """The DeepSpeed engine of the hand-written loop: the backend's config, no JIT-compiled op."""
    import importlib

    import deepspeed
    import torch.distributed as dist

    from cadence.backends.deepspeed import DeepSpeedConfig, build_config

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None  # as the backend does by default: no JIT compile
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    config = build_config(DeepSpeedConfig(zero_stage=stage), precision, ACCUM, micro)
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return ds


def _hand_steps(ds, micro_batches, precision: str) -> None:
    """The hand-written loop's steps over `micro_batches` (ACCUM per step)."""
    import torch
    from torch.nn import functional as F

    dtype = torch.bfloat16 if precision == "bf16" else None
    for i in range(0, len(micro_batches), ACCUM):
        for x, y in micro_batches[i : i + ACCUM]:
            if dtype is not None:
                x = x.to(dtype)
            loss = F.cross_entropy(ds(x), y)
            ds.backward(loss / ACCUM, scale_wrt_gas=False)
        ds.step()


def _cadence_engine(model, optimizer, data, stage: int, precision: str, micro: int, **options):
    """Cadence on the DeepSpeed backend, as the hand-written loop's engine is configured."""
    import tempfile

    from torch.nn import functional as F

    import cadence
    from cadence.backends.deepspeed import DeepSpeedBackend

    return cadence.Engine(
        model,
        optimizer,
        data,
        loss_fn=F.cross_entropy,
        backend=DeepSpeedBackend(zero_stage=stage, precision=precision),
        seed=0,
        grad_accum=ACCUM,
        train={"batch_size": micro},
        workspace=tempfile.mkdtemp(prefix="cadence-bench-"),
        **options,
    )


def worker(kind: str, stage: int, precision: str, steps: int) -> dict:
    import torch.distributed as dist

    rank, world, device, sync = _join()
    model, optimizer, data, micro = _model_and_data(world, rank, steps, device)

    if kind == "raw":
        ds = _hand_written(model, optimizer, stage, precision, micro)
        _hand_steps(ds, data[: WARMUP * ACCUM], precision)
        dist.barrier()
        sync()
        start = time.perf_counter()
        _hand_steps(ds, data[WARMUP * ACCUM :], precision)
        sync()
        elapsed = time.perf_counter() - start
        gather_from = ds
    else:
        engine = _cadence_engine(model, optimizer, data, stage, precision, micro)
        engine.fit(steps=WARMUP)
        dist.barrier()
        sync()
        start = time.perf_counter()
        engine.fit(steps=steps)
        sync()
        elapsed = time.perf_counter() - start
        gather_from = engine.backend.ds
    params = _digest(gather_from.module, stage)
    dist.destroy_process_group()
    return {"us_per_step": elapsed / steps * 1e6, "params": params}


def _digest(module, stage: int) -> str:
    digest = hashlib.sha256()
    params = list(module.parameters())
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(params):
            for p in params:
                digest.update(p.detach().float().cpu().numpy().tobytes())
    else:
        for p in params:
            digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def alternating_worker(stage: int, precision: str, steps: int, rounds: int, agreement: str = "none") -> dict:
    """One launch holding both loops (two DeepSpeed engines on copies of one model), timed in alternated rounds."""
    import copy

    import torch
    import torch.distributed as dist

    rank, world, device, sync = _join()
    model, optimizer, data, micro = _model_and_data(world, rank, steps * rounds, device)
    hand_model = copy.deepcopy(model)
    hand_optimizer = torch.optim.Adam(hand_model.parameters(), lr=1e-3)

    ds = _hand_written(hand_model, hand_optimizer, stage, precision, micro)
    position = 0

    def by_hand(n: int) -> None:
        nonlocal position
        _hand_steps(ds, data[position : position + n * ACCUM], precision)
        position += n * ACCUM

    engine = _cadence_engine(
        model,
        optimizer,
        data,
        stage,
        precision,
        micro,
        log_interval=10**9,
        callbacks=_fit_timing().agreement_callbacks(agreement),
    )

    def timed(fn) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) / steps * 1e6

    by_hand(WARMUP)
    engine.fit(steps=WARMUP)
    out: dict = {"raw": [], "cadence": []}
    for i in range(rounds):
        sides = [("raw", lambda: by_hand(steps)), ("cadence", lambda: engine.fit(steps=steps))]
        for kind, fn in sides if i % 2 == 0 else sides[::-1]:
            out[kind].append(timed(fn))
    out["equal"] = _digest(ds.module, stage) == _digest(engine.backend.ds.module, stage)
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def one_launch(args: argparse.Namespace) -> None:
    from cadence.launch import launch

    print(f"{'stage':8} {'raw us/step':>12} {'cadence us/step':>16}   pair ratio median (quartiles)   ratio of medians")
    for stage in args.stages:
        got = launch(
            alternating_worker, stage, args.precision, args.steps, args.rounds, args.agreement, nprocs=2,
            start_method="fork", timeout=3600,
        )  # fmt: skip
        if not got["equal"]:
            raise SystemExit(f"ZeRO-{stage}: parameters differ between the hand-written DeepSpeed loop and Cadence")
        ratios = sorted(c / r for r, c in zip(got["raw"], got["cadence"]))
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        raw, ours = statistics.median(got["raw"]), statistics.median(got["cadence"])
        print(f"ZeRO-{stage:<3} {raw:12.0f} {ours:16.0f}   {median:.3f} ({q1:.3f}-{q3:.3f}){'':14} {ours / raw:.3f}")
    print(
        f"(W2, 2 ranks, {args.precision}, {args.rounds} alternated rounds of {args.steps} steps in one launch, "
        f"Cadence's agreement: {_fit_timing().AGREEMENTS[args.agreement]}, "
        "parameters checked equal at the end; target <= 1.03)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="alternated raw/Cadence pairs per stage")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 20; --separate: 50)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=21, help="alternated rounds in one launch (the default mode)")
    _fit_timing().add_agreement_options(parser)
    parser.add_argument(
        "--separate", action="store_true", help="each side in fresh processes per pair (--repeats pairs) instead"
    )
    parser.add_argument("--smoke", action="store_true", help="seconds-long run of both modes at tiny sizes")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 50 if args.separate else 20
    if args.smoke:
        smoke(args)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  pay the import once here, not in every forked worker

    if args.smoke:
        one_launch(argparse.Namespace(**{**vars(args), "stages": [3]}))
        separate(argparse.Namespace(**{**vars(args), "stages": [2]}))
    elif args.separate:
        separate(args)
    else:
        one_launch(args)


def separate(args: argparse.Namespace) -> None:
    """--separate: each side in two fresh processes per pair."""
    import torch

    from cadence.launch import launch

    rows = []
    for stage in args.stages:
        times: dict[str, list[float]] = {"raw": [], "cadence": []}
        for i in range(args.repeats):
            results = {}
            order = ("raw", "cadence") if i % 2 == 0 else ("cadence", "raw")
            for kind in order:
                results[kind] = launch(
                    worker, kind, stage, args.precision, args.steps, nprocs=2, start_method="fork", timeout=1800
                )
                times[kind].append(results[kind]["us_per_step"])
            if results["raw"]["params"] != results["cadence"]["params"]:
                raise SystemExit(f"ZeRO-{stage}: parameters differ between the raw DeepSpeed loop and Cadence")
            print(
                f"ZeRO-{stage} pair {i + 1}: raw {times['raw'][-1]:.0f} us/step, "
                f"cadence {times['cadence'][-1]:.0f} us/step",
                flush=True,
            )
        rows.append((stage, statistics.median(times["raw"]), statistics.median(times["cadence"])))
    print(f"{'variant':28}  {'us/step':>9}  {'ratio':>6}")
    for stage, raw, ours in rows:
        print(f"{f'raw DeepSpeed loop, ZeRO-{stage}':28}  {raw:9.1f}  {1.0:6.3f}")
        print(f"{f'cadence, ZeRO-{stage}':28}  {ours:9.1f}  {ours / raw:6.3f}")
    device = "1 GPU per rank, nccl" if torch.cuda.is_available() else "CPU, gloo"
    print(
        f"(W2, 2 ranks ({device}), {args.precision}, global batch {GLOBAL_BATCH} in {ACCUM} micro-batches, "
        f"{args.steps} steps; median of {args.repeats} alternated runs; parameters checked equal)"
    )


if __name__ == "__main__":
    main()
