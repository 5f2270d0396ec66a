"""`cadence info`: versions, devices, the backends that can run here, the callbacks installed."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cadence.cli.common import table, version

# (shown name, distributions that provide it, extra that installs it)
_OPTIONAL = (
    ("tensorboard", ("tensorboard",), "tensorboard"),
    ("wandb", ("wandb",), "wandb"),
    ("deepspeed", ("deepspeed",), "deepspeed"),
    ("torchft", ("torchft-nightly", "torchft"), "ft"),
    ("submitit", ("submitit",), "slurm"),
    ("matplotlib", ("matplotlib",), "plot"),
    ("torchmetrics", ("torchmetrics",), "metrics"),
    ("scikit-learn", ("scikit-learn",), "examples"),
    ("torchao", ("torchao",), "float8"),
    ("safetensors", ("safetensors",), "hf"),
    ("s3fs", ("s3fs",), "s3"),
)
# pyproject.toml's dependencies besides torch (shown above them); tests/test_cli.py compares the two.
_CORE = ("torchdata", "attrs", "cattrs", "pyyaml", "tqdm", "xxhash", "numpy") + (
    ("tomli",) if sys.version_info < (3, 11) else ()
)


def show_info(args: argparse.Namespace) -> int:
    """Print what is installed and what can run here."""
    import platform

    import torch

    lines = [
        f"cadence {version('cadence') or 'unknown'}",
        f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        "",
        "dependencies:",
        *table([(name, version(name) or "MISSING", "") for name in _CORE]),
        "",
        "optional dependencies:",
        *table(
            [
                (name, installed, f"cadence[{extra}]")
                if (installed := version(*dists))
                else (name, "not installed", f"pip install 'cadence[{extra}]'")
                for name, dists, extra in _OPTIONAL
            ]
        ),
        "",
        "devices:",
        *table(_devices(torch)),
        "",
        "backends (can run here?):",
        *table(_backends(torch)),
        "",
        "callbacks (name, target, package):",
        *table(_callbacks()),
    ]
    print("\n".join(lines))
    return 0


def _devices(torch: Any) -> list[tuple[str, str]]:
    rows = [("cpu", f"{os.cpu_count()} logical cores, torch uses {torch.get_num_threads()} threads")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            rows.append((f"cuda:{i}", torch.cuda.get_device_name(i)))
    else:
        why = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device or driver found"
        rows.append(("cuda", f"not available: {why}"))
    mps = getattr(torch.backends, "mps", None)
    rows.append(("mps", "available" if mps is not None and mps.is_available() else "not available"))
    return rows


def _backends(torch: Any) -> list[tuple[str, str, str]]:
    import importlib.util

    from cadence.run import registry

    dist = torch.distributed
    has_dist = dist.is_available()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    groups = [name for name, ok in (("gloo", has_dist and dist.is_gloo_available()),
                                    ("nccl", has_dist and gpus > 0 and dist.is_nccl_available())) if ok]  # fmt: skip
    multi = f"several processes ({', '.join(groups) or 'no process group backend'})"
    if gpus == 0:
        multi += "; nccl needs CUDA devices"

    def needs(*dists: str, extra: str) -> str | None:
        return None if version(*dists) else f"needs {dists[0]}: pip install 'cadence[{extra}]'"

    requirements: dict[str, Any] = {
        "local": lambda: None,
        "ddp": lambda: None if has_dist and groups else "torch.distributed has no usable process group backend",
        "mesh": lambda: None if has_dist and groups else "needs torch.distributed with a process group backend",
        "deepspeed": lambda: needs("deepspeed", extra="deepspeed"),
        "ft": lambda: needs("torchft-nightly", "torchft", extra="ft"),
    }
    rows = []
    for name, target in sorted(registry.backends.names().items()):
        module = target.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        problem = f"module {module} is not installed" if not found else requirements.get(name, lambda: None)()
        if problem is None:
            where = "this process" if name == "local" else multi
            rows.append((name, "yes", where))
        else:
            rows.append((name, "no", problem))
    return rows


def _callbacks() -> list[tuple[str, str, str]]:
    from cadence.run import registry

    describe = getattr(registry, "describe_callbacks", None)
    if describe is not None:
        return [(i.name, i.target, f"{i.package} {i.version or ''}".strip()) for i in describe()]
    return [(name, target, "") for name, target in sorted(registry.callbacks.names().items())]
