"""`cadence inspect`: what a checkpoint holds, and whether it is complete."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cadence.cli.common import UsageError, human_size, table


def inspect_checkpoint(args: argparse.Namespace) -> int:
    """Print a checkpoint's manifest check and contents; 1 when it is damaged.

    The store that wrote it (the manifest's `"store"`: file, DCP, DeepSpeed)
    checks it with its own `verify`: every file's size and the XXH3-64 of all
    its bytes against the manifest, whose own checksum is checked first.
    """
    from cadence.checkpoint.store import CheckpointError

    target = Path(args.checkpoint)
    if not target.exists():
        raise UsageError(f"no such checkpoint: {target}")
    if (target / "checkpoints").is_dir():  # a run directory: its latest checkpoint
        target = target / "checkpoints"
    try:
        store, name = _locate(target)
    except _Damaged as damaged:
        return _damaged(target, damaged.error)
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
        f"manifest    ok: {len(files)} files, {human_size(total)}, {store.kind} store: every byte of every file "
        f"checked, sizes and XXH3-64 checksums match (created {manifest.get('created')})"
    )
    payload = store.read_whole(name)
    print("\n".join(_describe(payload)))
    return 0


class _Damaged(Exception):
    def __init__(self, error: Exception) -> None:
        self.error = error


def _locate(target: Path) -> tuple[Any, str]:
    """The store that wrote the checkpoint at `target` (the manifest's `"store"`), at its folder, and its name."""
    from cadence.checkpoint.store import STORES, CheckpointError, store_class

    kind = _kind(target)
    if kind is not None:
        found = store_class(kind)
        if found is None:
            raise _Damaged(
                CheckpointError(
                    f"the manifest names an unknown store {kind!r} (known: {', '.join(STORES)})", path=target
                )
            )
        return found.for_reading().locate(target)
    # No readable manifest: a folder of some store's files without it is a damaged checkpoint (1), else a wrong path (2).
    usage: CheckpointError | None = None
    for each in STORES:  # "file" first: its message for a folder that is no checkpoint
        cls = store_class(each)
        assert cls is not None
        try:
            return cls.for_reading().locate(target)
        except CheckpointError as exc:
            if exc.reason == getattr(cls, "NO_MANIFEST", None):  # a folder store's files, no manifest
                raise _Damaged(exc) from None
            usage = usage or exc
    raise UsageError(" ".join(str(usage).split()))


def _kind(target: Path) -> str | None:
    """The `"store"` field of the manifest at `target` or of its `latest` (`"file"` where it has none); None: unreadable."""
    import json

    for folder in (target, target / "latest"):
        try:
            manifest = json.loads((folder / "manifest.json").read_bytes())
        except (OSError, ValueError):
            continue
        return str(manifest.get("store", "file")) if isinstance(manifest, dict) else None
    return None


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
    lines += table([(key, *_tensor_cells(value)) for key, value in _tensors(model)] or [("(no tensors)", "")], "  ")
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
    return str(tensor.dtype).removeprefix("torch."), shape, human_size(tensor.numel() * tensor.element_size())


def _summary(obj: Any) -> str:
    tensors = [t for _, t in _tensors(obj)]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    elements = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return f"{len(tensors)} tensors, {elements:,} elements, {human_size(nbytes)} ({', '.join(dtypes) or 'no dtype'})"
