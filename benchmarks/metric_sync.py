"""Synchronizing metric objects on two gloo ranks: the engine's one round against torchmetrics' own sync.

    python benchmarks/metric_sync.py              # 20 evaluations, 4001 samples, 10 classes
    python benchmarks/metric_sync.py --samples 20001 --repeats 5
    python benchmarks/metric_sync.py --smoke      # seconds: 101 samples, 2 evaluations (tests/test_benchmarks.py)

A `MetricCollection` of F1, accuracy and AUROC (each with the engine's default
compute groups) is filled with the same per-rank shard (unequal: the sample
count is odd) and computed two ways on each of two forked ranks:

- the engine's way (`MetricSet.compute`): every state gathered in one round,
  `gather_tensors` (2 all_gathers whatever the number of metrics and states),
  then computed locally;
- torchmetrics' own `compute()` over the same process group, as without the
  engine: each member syncs each of its states (2 all_gathers per state).

Reports the all_gathers each way (counted on `torch.distributed`) and the median
time of one compute, and checks that both give the same values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from cadence.launch import launch

#: What tests/test_benchmarks.py needs installed to run this file: module -> the extra that installs it.
REQUIRES = {"torchmetrics": "metrics"}


def collection(classes: int):
    import torchmetrics
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

    return torchmetrics.MetricCollection(
        {
            "f1": MulticlassF1Score(classes, average="macro"),
            "accuracy": MulticlassAccuracy(classes),
            "auroc": MulticlassAUROC(classes),
        }
    )


def worker(samples: int, classes: int, repeats: int) -> dict[str, object]:
    from cadence.backends.ddp import DDPBackend
    from cadence.engine.evaluation import MetricSet

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    backend = DDPBackend()
    backend.group, backend.rank, backend.world_size = dist.group.WORLD, rank, 2
    backend.data_rank, backend.data_size = rank, 2
    g = torch.Generator().manual_seed(0)
    scores, targets = torch.randn(samples, classes, generator=g), torch.randint(0, classes, (samples,), generator=g)
    mine = (scores[rank::2], targets[rank::2])
    calls = {"n": 0}
    original = dist.all_gather, getattr(dist, "all_gather_single", None), dist.all_gather_into_tensor

    def counted(fn):
        def call(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)

        return call

    dist.all_gather = counted(original[0])
    if original[1] is not None:
        dist.all_gather_single = counted(original[1])
    dist.all_gather_into_tensor = counted(original[2])
    results: dict[str, object] = {}
    for way in ("engine", "torchmetrics"):
        times, counts, values = [], [], None
        for _ in range(repeats):
            metrics = collection(classes)
            if way == "engine":
                metric_set = MetricSet(metrics)
                metric_set.bind(backend)
                metric_set.update(mine[0], (None, mine[1]), where="benchmark")  # outputs, (inputs, targets)
                compute = partial(metric_set.compute, "benchmark")
            else:
                metrics.update(*mine)
                compute = metrics.compute
            dist.barrier()
            calls["n"] = 0
            started = time.perf_counter()
            values = {k: float(v) for k, v in compute().items()}
            times.append(time.perf_counter() - started)
            counts.append(calls["n"])
        results[way] = {"all_gathers": counts[0], "median_ms": 1e3 * statistics.median(times), "values": values}
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4001)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="seconds-long run: 101 samples, 2 evaluations")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.repeats = 101, 2
        print("--smoke: tiny sizes, to see every part run; the figures are not measurements", flush=True)
    result = launch(worker, args.samples, args.classes, args.repeats, nprocs=2, start_method="fork", timeout=600)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.samples} samples, {args.classes} classes, rank 0")
    for way in ("engine", "torchmetrics"):
        r = result[way]
        print(f"{way:>12}: {r['all_gathers']:3d} all_gathers, median {r['median_ms']:.2f} ms per compute")
    same = all(abs(result["engine"]["values"][k] - v) < 1e-6 for k, v in result["torchmetrics"]["values"].items())
    print("same values:", same)


if __name__ == "__main__":
    main()
