"""Model weights from safetensors files and Hugging Face folders (`Checkpoint(pretrained=...)`).

Every tensor is memory-mapped and read by name; where the live model holds
a DTensor (FSDP, tensor parallel), each rank reads only the region of its
own shard (DTensor's chunk list gives its offsets and sizes) and the shard is
put back as a DTensor of the same placements. Names go through a key mapping
(`cadence.checkpoint.hf`) when given; excluded keys are never read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cadence.checkpoint import dcp_io
from cadence.checkpoint.hf import KeyMapping, load_mapping, source_keys
from cadence.checkpoint.safetensors_io import SafetensorsSource
from cadence.checkpoint.store import CheckpointError

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


def read_model_state(
    engine: Engine, path: Path, *, mapping: str | KeyMapping | None, exclude: Sequence[str]
) -> dict[str, Any]:
    """The weights at `path` under this model's keys; a DTensor's rank reads only its shard."""
    source = SafetensorsSource(path)
    names = source_keys(source, None if mapping is None else load_mapping(mapping))
    if not names:
        raise CheckpointError(
            "no tensor of these files maps to a model key" + (" (check the key mapping)" if mapping else ""), path=path
        )
    live = engine.backend.model_state_dict(engine)
    out: dict[str, Any] = {}
    for key, name in names.items():
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in exclude):
            continue
        target = live.get(key)
        if target is not None and dcp_io.is_dtensor(target):
            out[key] = _shard(source, name, target, path)
        else:
            out[key] = source.read(name)
    return out


def _shard(source: SafetensorsSource, name: str, target: Any, path: Path) -> Any:
    """This rank's part of `name`, as a DTensor placed like `target` (only that region is read)."""
    from torch.distributed.tensor import DTensor

    shape = source.shape(name)
    if shape != tuple(target.shape):
        # The whole tensor's shape is wrong: read nothing, `load_pretrained` names it.
        return torch.empty(shape, dtype=target.dtype)
    chunks = target.__create_chunk_list__()
    local = target.to_local()
    if len(chunks) != 1:  # no shard on this rank, or one split in several regions: rarely met, read it whole
        raise CheckpointError(
            f"{name}: this rank holds {len(chunks)} regions of it ({target.placements}); load these weights from a "
            "torch.save file or a checkpoint instead",
            path=path,
        )
    region = tuple(slice(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes))
    part = source.read_slice(name, region).to(device=local.device, dtype=local.dtype)
    return DTensor.from_local(
        part, target.device_mesh, target.placements, run_check=False, shape=target.shape, stride=target.stride()
    )
