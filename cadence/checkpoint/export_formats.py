"""The formats `cadence export` writes and reads back: one torch.save file, safetensors, a DCP checkpoint.

Optimizer state in safetensors: every tensor under `optimizers.<i>.<n>`
(numbered in order), the rest of the structure (parameter groups,
hyperparameters, non-tensor state) as JSON in the header's
`cadence.optimizers` field, with `{"__tensor__": name}` where a tensor was.
See cadence/checkpoint/export.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint import safetensors_io
from cadence.checkpoint.hf import KeyMapping, source_keys
from cadence.checkpoint.store import CheckpointError

OPTIMIZERS = "cadence.optimizers"
TENSOR = "__tensor__"
KEYS = "__keys__"  # a dict whose keys are not all strings (torch's parameter ids): its keys, in JSON


def write_torch(model: dict[str, Any], optimizers: list[Any] | None, meta: dict[str, str], out: Path) -> Path:
    """The model's state dict alone (`torch.load` gives it back), or with `optimizers` and `provenance`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    obj: Any = model if optimizers is None else {"model": model, "optimizers": optimizers, "provenance": meta}
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, out)
    return out


def read_torch(path: Path) -> dict[str, Any]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load it with torch.load: {exc}", path=path) from exc
    if isinstance(obj, dict) and "model" in obj and "optimizers" in obj:
        return {"model": obj["model"], "optimizers": obj["optimizers"], "metadata": obj.get("provenance", {})}
    return {"model": obj, "optimizers": None, "metadata": {}}


def _flatten_tensors(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    if torch.is_tensor(obj):
        name = f"{prefix}.{len(tensors)}"
        tensors[name] = obj
        return {TENSOR: name}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _flatten_tensors(v, tensors, prefix) for k, v in obj.items()}
        return {KEYS: list(obj), "values": [_flatten_tensors(v, tensors, prefix) for v in obj.values()]}
    if isinstance(obj, (list, tuple)):
        return [_flatten_tensors(v, tensors, prefix) for v in obj]
    return obj


def _unflatten(obj: Any, read: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {TENSOR}:
            return read(obj[TENSOR])
        if set(obj) == {KEYS, "values"}:
            return {k: _unflatten(v, read) for k, v in zip(obj[KEYS], obj["values"])}
        return {k: _unflatten(v, read) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, read) for v in obj]
    return obj


def write_safetensors(
    model: dict[str, Any], optimizers: list[Any] | None, meta: dict[str, str], out: Path, max_shard_bytes: int
) -> list[Path]:
    tensors = {k: v for k, v in model.items() if torch.is_tensor(v)}
    metadata = dict(meta)
    if optimizers is not None:
        extra: dict[str, torch.Tensor] = {}
        structure = [_flatten_tensors(state, extra, f"optimizers.{i}") for i, state in enumerate(optimizers)]
        clash = sorted(set(extra) & set(tensors))
        if clash:
            raise ValueError(f"model keys {clash} clash with the optimizer tensors' names; export the model alone")
        tensors.update(extra)
        metadata[OPTIMIZERS] = json.dumps(structure)
    return safetensors_io.write(tensors, out, metadata=metadata, max_shard_bytes=max_shard_bytes)


def read_safetensors(path: Path, mapping: KeyMapping | None) -> dict[str, Any]:
    source = safetensors_io.SafetensorsSource(path)
    metadata = source.metadata()
    structure = metadata.pop(OPTIMIZERS, None)
    optimizers = None if structure is None else _unflatten(json.loads(structure), source.read)
    names = source_keys(source, mapping)
    model = {key: source.read(name) for key, name in names.items() if not name.startswith("optimizers.")}
    return {"model": model, "optimizers": optimizers, "metadata": metadata}


def write_dcp(
    payload: dict[str, Any], model: dict[str, Any], optimizers: list[Any] | None, meta: dict[str, str], out: Path
) -> list[Path]:
    """A Cadence DCP checkpoint at `out` (one process): the payload with these weights (and optimizer state)."""
    from cadence.checkpoint.dcp_store import DCPStore
    from cadence.checkpoint.payload import RESTORED_BY_STORE

    written = {k: v for k, v in payload.items() if k != RESTORED_BY_STORE}
    written["model"], written["optimizers"] = model, list(optimizers or [])
    written["meta"] = {**(payload.get("meta") or {}), "exported_from": meta}
    store = DCPStore().at(out.parent)
    manifest = store.write(out.name, written)
    return [out / name for name in sorted(manifest["files"])] + [out / "manifest.json"]
