"""What the DCP store checks and builds before DCP loads: checksums, the objects, the tensors DCP loads into.

`DCPStore.read` checks every file's checksum (split over the ranks), loads
the main rank's objects with this rank's own entries over them (`skeleton`),
and builds the tensors DCP loads into (`destinations`), each checked against
`.metadata` and the live template; any problem on any rank is raised on every
rank before DCP reads a byte. See cadence/checkpoint/dcp_store.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint import dcp_io
from cadence.checkpoint.dcp_commit import METADATA, OBJECTS, STORE, objects_file
from cadence.checkpoint.store import CheckpointError


def check_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """A readable cadence manifest's DCP checks (after its own checksum): written by the DCP store, `.metadata` present."""
    step = manifest.get("step")
    if manifest.get("store") != STORE:
        raise CheckpointError(
            f"not a DCP checkpoint (written by the {manifest.get('store', 'file')!r} store): load it with that "
            "store, e.g. a backend with checkpoint='file'",
            path=folder,
            step=step,
        )
    if METADATA not in manifest["files"] or not (folder / METADATA).is_file():
        raise CheckpointError(
            f"{METADATA} is missing (DCP's index of the tensors): not a complete checkpoint, it is never loaded; "
            "use another checkpoint",
            path=folder,
            step=step,
        )


def unverified_step(folder: Path) -> int | None:
    """The step `objects.pt` names, for the message about a folder without a manifest (not trusted otherwise)."""
    try:
        step = torch.load(folder / OBJECTS, weights_only=True, map_location="cpu")["meta"]["step"]
    except Exception:
        return None
    return step if isinstance(step, int) else None


def check_checksum(folder: Path, manifest: dict[str, Any], file: str) -> None:
    """`file`'s XXH3-64 (read in full) against the manifest."""
    entry, step = manifest["files"][file], manifest.get("step")
    if entry.get("algorithm") != dcp_io.ALGORITHM:
        raise CheckpointError(
            f"{file}: checksum algorithm {entry.get('algorithm')!r} is not {dcp_io.ALGORITHM!r}",
            path=folder,
            step=step,
        )
    try:
        _, value = dcp_io.file_digest(folder / file)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing (the manifest lists it)", path=folder, step=step) from None
    if value != entry["checksum"]:
        raise CheckpointError(
            f"{file}: checksum mismatch (XXH3-64 {value}, the manifest says {entry['checksum']}): the file is "
            "corrupted; use another checkpoint",
            path=folder,
            step=step,
        )


def skeleton(folder: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """The main rank's objects, with this rank's own entries over them (where it saved some)."""
    step = manifest.get("step")
    parts = [OBJECTS] + ([objects_file(rank)] if objects_file(rank) in manifest["files"] else [])
    out: dict[str, Any] = {}
    for part in parts:
        try:
            loaded = torch.load(folder / part, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(f"cannot unpickle {part}: {exc}", path=folder, step=step) from exc
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{part} holds no payload structure", path=folder, step=step)
        out.update(loaded)
    return out


def destinations(
    folder: Path, manifest: dict[str, Any], objects: Any, template: Mapping[str, Any] | None, in_place: bool
) -> dict[str, torch.Tensor]:
    """The tensors DCP loads into, each checked against `.metadata` (key present, same global shape).

    A tensor the template has: a new tensor like it (the template's own with
    `in_place`); one it lacks: a whole tensor on the CPU.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step = manifest.get("step")
    try:
        metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"cannot read {METADATA}: {type(exc).__name__}: {exc}", path=folder, step=step) from exc
    out: dict[str, torch.Tensor] = {}
    for key, path in dcp_io.placeholders(objects):
        saved = metadata.get(key)
        if not isinstance(saved, TensorStorageMetadata):
            raise CheckpointError(
                f"tensor {key} is in {OBJECTS} but not in {METADATA}: the checkpoint is damaged",
                path=folder,
                step=step,
            )
        live = dcp_io.lookup(template, path) if template is not None else None
        if isinstance(live, torch.Tensor):
            if tuple(live.shape) != tuple(saved.size):
                raise CheckpointError(
                    f"tensor {key} has shape {tuple(saved.size)} in the checkpoint and {tuple(live.shape)} in this "
                    "run (global shapes); load a checkpoint of this model",
                    path=folder,
                    step=step,
                )
            out[key] = live.detach() if in_place else torch.empty_like(live)
        else:
            out[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    return out
