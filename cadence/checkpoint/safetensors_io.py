"""Safetensors files in and out: one file, or shards with an index (Hugging Face's layout).

Writing (`write`): tensors by name into `model.safetensors`, or, above
`max_shard_bytes`, into `model-00001-of-0000N.safetensors` ... with
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {name: file}}`);
string metadata (provenance) goes into every file's header and the index.

Reading (`SafetensorsSource`): a file, a folder with one file, or a folder
with an index; tensors are memory-mapped and read by name, or only a slice
of one (`read_slice`: a rank's shard of a DTensor reads only its rows).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.store import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 << 30  # Hugging Face's default shard size (5 GiB)


def safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "safetensors files need the safetensors package, which is not installed; install it with: "
            "pip install 'cadence[hf]'"
        ) from exc
    return safetensors


def _plain(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        value = tensor.detach().to("cpu").contiguous()
        pointer = value.untyped_storage().data_ptr()
        if pointer in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[name] = value
    return out


def shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, grouped greedily into shards of at most `max_shard_bytes` (a larger tensor alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


def write(
    tensors: Mapping[str, torch.Tensor],
    out: Path,
    *,
    metadata: Mapping[str, str],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write `tensors` to `out`: a `.safetensors` file, else a folder (sharded with an index above the limit).

    Returns the files written. Each file is written under a temporary name and renamed.
    """
    save_file = safetensors().torch.save_file
    plain = _plain(tensors)
    meta = {str(k): str(v) for k, v in metadata.items()}
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        _save(save_file, plain, out, meta)
        return [out]
    out.mkdir(parents=True, exist_ok=True)
    groups = shards(plain, max_shard_bytes)
    if len(groups) == 1:
        _save(save_file, plain, out / SINGLE, meta)
        return [out / SINGLE]
    written, weight_map = [], {}
    for number, group in enumerate(groups, 1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        _save(save_file, group, out / name, meta)
        weight_map.update(dict.fromkeys(group, name))
        written.append(out / name)
    total = sum(t.numel() * t.element_size() for t in plain.values())
    index = {"metadata": {"total_size": total, **meta}, "weight_map": weight_map}
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
    os.replace(tmp, out / INDEX)
    return [*written, out / INDEX]


def _save(save_file: Any, tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def is_safetensors(path: Path) -> bool:
    """A `.safetensors` file, or a folder holding `model.safetensors` or an index."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and ((path / INDEX).is_file() or (path / SINGLE).is_file())


class SafetensorsSource:
    """The tensors of a safetensors file or folder, by name, memory-mapped (nothing is read until asked).

    Example:
        >>> source = SafetensorsSource(Path("out/model.safetensors"))  # doctest: +SKIP
        >>> weight = source.read("head.weight")  # doctest: +SKIP
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_file():
            files = {None: path}
            self.weight_map: dict[str, Path] = {}
        elif (path / INDEX).is_file():
            try:
                index = json.loads((path / INDEX).read_text())
                mapping = index["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{INDEX} is not a safetensors index: {exc}", path=path) from exc
            self.weight_map = {str(k): path / str(v) for k, v in mapping.items()}
            missing = sorted({p.name for p in self.weight_map.values() if not p.is_file()})
            if missing:
                raise CheckpointError(f"{INDEX} names files that are not there: {missing}", path=path)
            files = {}
        elif (path / SINGLE).is_file():
            files, self.weight_map = {None: path / SINGLE}, {}
        else:
            raise CheckpointError(f"no {SINGLE} and no {INDEX} here: not a safetensors folder", path=path)
        self._handles: dict[Path, Any] = {}
        if files:
            only = files[None]
            self.weight_map = {key: only for key in self._open(only).keys()}

    def _open(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safetensors().safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"cannot open {file.name}: {exc}", path=self.path) from exc
            self._handles[file] = handle
        return handle

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def metadata(self) -> dict[str, str]:
        """The string metadata of the (first) file's header."""
        first = next(iter(self.weight_map.values()), None)
        return dict(self._open(first).metadata() or {}) if first is not None else {}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[key]).get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._open(self.weight_map[key]).get_tensor(key)
        return tensor

    def read_slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Only `index` of the tensor (slices per dimension): the bytes of that region are read."""
        sliced = self._open(self.weight_map[key]).get_slice(key)
        tensor: torch.Tensor = sliced[index] if index else sliced[:]
        return tensor

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.weight_map:
            yield key, self.read(key)
