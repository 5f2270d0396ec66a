"""The `cadence` command: what is installed, which runs exist, what a checkpoint holds.

    cadence info                  versions, devices, backends that can run here, callbacks
    cadence runs [WORKSPACE]      one line per run directory (default workspace: ./runs)
    cadence inspect CHECKPOINT    step, epoch, config, tensors, callback keys, manifest check
    cadence plot RUN_DIR          plot a run's metrics (needs the `plot` extra)
    cadence --version             the installed version

Usage errors and a missing or foreign path print one line on stderr and exit
with status 2. Nothing imports torch until a subcommand needs it, so
`cadence --help` is quick. See docs/run-directory.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class UsageError(Exception):
    """A one-line problem with what the user asked for (exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `cadence` command; returns the exit status.

    Example:
        >>> main(["runs", "/no/such/folder"])  # doctest: +SKIP
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UsageError as exc:
        print(f"cadence {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cadence runs | head`
        sys.stderr.close()
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence", description="Cadence: inspect the environment, runs and checkpoints."
    )
    from cadence import __version__

    parser.add_argument("--version", action="version", version=f"cadence {_version('cadence') or __version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="versions, devices, backends that can run here, callbacks")
    info.set_defaults(run=_info)
    runs = commands.add_parser("runs", help="list the runs of a workspace, one line each")
    runs.add_argument("workspace", nargs="?", default="runs", help="workspace folder (default: ./runs)")
    runs.set_defaults(run=_runs)
    inspect = commands.add_parser("inspect", help="what a checkpoint holds, and whether it is complete")
    inspect.add_argument("checkpoint", help="a checkpoint directory (or a run's checkpoints/ folder: its latest)")
    inspect.set_defaults(run=_inspect)
    plot = commands.add_parser("plot", help="plot a run's metrics (needs cadence[plot])")
    plot.add_argument("run_dir", help="a run directory")
    plot.add_argument("--out", default=None, help="image file to write (default: inside the run directory)")
    plot.set_defaults(run=_plot)
    return parser


# --- cadence info ---------------------------------------------------------------------------

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
)
# pyproject.toml's dependencies besides torch (shown above them); tests/test_cli.py compares the two.
_CORE = ("torchdata", "attrs", "cattrs", "pyyaml", "tqdm", "xxhash", "numpy") + (
    ("tomli",) if sys.version_info < (3, 11) else ()
)


def _version(*distributions: str) -> str | None:
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        (indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]).rstrip() for row in rows
    ]


def _info(args: argparse.Namespace) -> int:
    import platform

    import torch

    lines = [
        f"cadence {_version('cadence') or 'unknown'}",
        f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        "",
        "dependencies:",
        *_table([(name, _version(name) or "MISSING", "") for name in _CORE]),
        "",
        "optional dependencies:",
        *_table(
            [
                (name, version, f"cadence[{extra}]")
                if (version := _version(*dists))
                else (name, "not installed", f"pip install 'cadence[{extra}]'")
                for name, dists, extra in _OPTIONAL
            ]
        ),
        "",
        "devices:",
        *_table(_devices(torch)),
        "",
        "backends (can run here?):",
        *_table(_backends(torch)),
        "",
        "callbacks (name, target, package):",
        *_table(_callbacks()),
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

    from cadence.engine import registry

    dist = torch.distributed
    has_dist = dist.is_available()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    groups = [name for name, ok in (("gloo", has_dist and dist.is_gloo_available()),
                                    ("nccl", has_dist and gpus > 0 and dist.is_nccl_available())) if ok]  # fmt: skip
    multi = f"several processes ({', '.join(groups) or 'no process group backend'})"
    if gpus == 0:
        multi += "; nccl needs CUDA devices"

    def needs(*dists: str, extra: str) -> str | None:
        return None if _version(*dists) else f"needs {dists[0]}: pip install 'cadence[{extra}]'"

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
    from cadence.engine import registry

    describe = getattr(registry, "describe_callbacks", None)
    if describe is not None:
        return [(i.name, i.target, f"{i.package} {i.version or ''}".strip()) for i in describe()]
    return [(name, target, "") for name, target in sorted(registry.callbacks.names().items())]


# --- cadence runs ---------------------------------------------------------------------------


def _run_dirs(root: Path) -> list[Path]:
    """Run directories at `root` itself, one level down (a lineage) or two (a workspace)."""
    for pattern in ("metadata/run.yaml", "*/metadata/run.yaml", "*/*/metadata/run.yaml"):
        found = sorted(path.parent.parent for path in root.glob(pattern))
        if found:
            return found
    return []


def _existing_dir(path: str, what: str) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise UsageError(f"no such {what}: {folder}")
    if not folder.is_dir():
        raise UsageError(f"not a directory: {folder} (expected a {what})")
    return folder


def _runs(args: argparse.Namespace) -> int:
    import yaml

    from cadence.engine import rundir

    root = _existing_dir(args.workspace, "workspace")
    runs = _run_dirs(root)
    if not runs:
        raise UsageError(f"{root} is not a Cadence workspace: no run directory (*/*/metadata/{rundir.RUN_FILE}) in it")
    rows = []
    for path in runs:
        try:
            run = yaml.safe_load((path / rundir.METADATA / rundir.RUN_FILE).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            run = {"run_id": path.name, "lineage": "?", "code_id": f"unreadable run.yaml: {exc}"}
        records = rundir.read_attempts(path)
        last = records[-1] if records else {}
        best = next((r["best"] for r in reversed(records) if isinstance(r.get("best"), dict)), None)
        rows.append(
            (
                str(last.get("time", "")),
                str(run.get("run_id", path.name)),
                str(run.get("lineage", "?")),
                str(run.get("code_id") or "-"),
                str(max((r.get("step", 0) for r in records), default="-")),
                _format_best(best),
                str(last.get("time", "-")).replace("T", " ")[:19],
                _state(last),
            )
        )
    rows.sort(key=lambda row: row[0])
    header = ("RUN ID", "LINEAGE", "CODE ID", "STEP", "BEST", "LAST ATTEMPT", "STATE")
    print("\n".join(_table([header, *(row[1:] for row in rows)], indent="")))
    return 0


def _format_best(best: dict[str, Any] | None) -> str:
    if not best:
        return "-"
    value = best.get("value")
    shown = f"{value:.6g}" if isinstance(value, float) else str(value)
    return f"{best.get('metric', 'score')}={shown}"


def _state(record: dict[str, Any]) -> str:
    """The last recorded state; a `running` attempt whose process is gone on this host is `lost`."""
    import socket

    state = str(record.get("state", "-"))
    if state == "running" and record.get("host") == socket.gethostname():
        pid = record.get("pid")
        if isinstance(pid, int) and not _alive(pid):
            return "lost"
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# --- cadence inspect ------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from cadence.checkpoint.file_store import FileStore
    from cadence.checkpoint.store import CheckpointError

    target = Path(args.checkpoint)
    if not target.exists():
        raise UsageError(f"no such checkpoint: {target}")
    if (target / "checkpoints").is_dir():  # a run directory: its latest checkpoint
        target = target / "checkpoints"
    try:
        store, name = FileStore().locate(target)
    except CheckpointError as exc:
        # A folder of checkpoint files without its manifest is a damaged checkpoint (1), not a wrong path (2).
        if not (target.is_dir() and any(f.name == "payload.pt" or f.suffix == ".bin" for f in target.iterdir())):
            raise UsageError(" ".join(str(exc).split())) from None
        return _damaged(target, exc)
    try:
        manifest = store.manifest(name)
    except CheckpointError as exc:
        return _damaged(store.path(name), exc)
    folder = store.path(name)
    files = manifest["files"]
    total = sum(entry["size"] for entry in files.values())
    print(f"checkpoint  {folder}")
    try:
        store.verify(name)
    except CheckpointError as exc:
        print(f"manifest    FAILED: {' '.join(str(exc).split())}")
        print(f"step        {manifest.get('step')} (from the manifest)")
        return 1
    print(
        f"manifest    ok: {len(files)} files, {_size(total)}, sizes and XXH3-64 checksums match (created {manifest.get('created')})"
    )
    payload = store.read(name)
    print("\n".join(_describe(payload)))
    return 0


def _damaged(folder: Path, error: Exception) -> int:
    print(f"checkpoint  {folder}")
    print(f"manifest    FAILED: {' '.join(str(error).split())}")
    return 1


def _describe(payload: dict[str, Any]) -> list[str]:
    import yaml

    meta, state = payload.get("meta") or {}, payload.get("engine") or {}
    lines = [
        f"step        {meta.get('step', state.get('step'))}",
        f"epoch       {meta.get('epoch', state.get('epoch'))} (micro-batch {meta.get('batch_in_epoch', 0)} of the epoch)",
        f"saved by    {meta.get('backend', '?')} backend, world size {meta.get('world_size', '?')}"
        + (f", data size {meta['data_size']}" if "data_size" in meta else ""),
        "state       " + ", ".join(f"{k}={v}" for k, v in state.items() if k not in ("step", "epoch")),
        f"callbacks   {', '.join(payload.get('callbacks') or {}) or 'none'}",
        f"data        {', '.join(payload.get('data') or {}) or 'no saved position (epoch boundary)'}",
        f"rng         {len(payload.get('rng') or [])} rank(s)",
        f"schedulers  {len(payload.get('schedulers') or [])}",
    ]
    model = payload.get("model") or {}
    lines.append(f"model       {_summary(model)}")
    lines += _table([(key, *_tensor_cells(value)) for key, value in _tensors(model)] or [("(no tensors)", "")], "  ")
    for i, optimizer in enumerate(payload.get("optimizers") or []):
        groups = len(optimizer.get("param_groups", [])) if isinstance(optimizer, dict) else "?"
        lines.append(f"optimizer   #{i}: {groups} param group(s); state {_summary(optimizer.get('state', {}))}")
    for key, value in (payload.get("callbacks") or {}).items():
        if any(True for _ in _tensors(value)):
            lines.append(f"callback    {key}: {_summary(value)}")
    config = payload.get("config") or {}
    for part in ("run", "engine"):
        if config.get(part):
            lines.append(f"config ({part}):")
            dumped = yaml.safe_dump(config[part], sort_keys=False, default_flow_style=False)
            lines += ["  " + line for line in dumped.splitlines()]
            break  # the run config holds the engine's; show one
    return lines


def _tensors(obj: Any, prefix: str = "") -> Any:
    """(dotted key, tensor) for every tensor nested in dicts, lists and tuples."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix or "(tensor)", obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


def _tensor_cells(tensor: Any) -> tuple[str, str, str]:
    shape = "[" + ", ".join(str(d) for d in tensor.shape) + "]"
    return str(tensor.dtype).removeprefix("torch."), shape, _size(tensor.numel() * tensor.element_size())


def _summary(obj: Any) -> str:
    tensors = [t for _, t in _tensors(obj)]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    elements = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return f"{len(tensors)} tensors, {elements:,} elements, {_size(nbytes)} ({', '.join(dtypes) or 'no dtype'})"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"  # pragma: no cover


# --- cadence plot ---------------------------------------------------------------------------


def _plot(args: argparse.Namespace) -> int:
    folder = _existing_dir(args.run_dir, "run directory")
    if not (folder / "metrics.jsonl").exists() and not (folder / "metadata").is_dir():
        raise UsageError(f"{folder} is not a Cadence run directory: it has neither metrics.jsonl nor metadata/")
    try:
        from cadence.plot import plot

        written = plot(folder, out=args.out)
    except ImportError as exc:  # matplotlib is an optional dependency
        raise UsageError(f"cannot plot: {exc}") from None
    except (FileNotFoundError, ValueError) as exc:  # no metrics.jsonl, or an empty one
        raise UsageError(str(exc).removeprefix("cadence plot: ")) from None
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
