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
from cadence.checkpoint.dcp_commit import MANIFEST_KEY, METADATA, OBJECTS, STORE, manifest_digest, objects_file
from cadence.checkpoint.folders import MANIFEST
from cadence.checkpoint.store import CheckpointError


def check_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """A readable cadence manifest's DCP checks: its own checksum, written by the DCP store, `.metadata` present."""
    step = manifest.get("step")
    if manifest.get(MANIFEST_KEY) != manifest_digest(manifest):
        raise CheckpointError(
            f"{MANIFEST} fails its own checksum: the file is damaged (the step it names cannot be trusted)",
            path=folder,
            step=step if isinstance(step, int) else None,
        )
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


def skeleton(
    folder: Path, manifest: dict[str, Any], rank: int, template: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The main rank's objects, with this rank's own entries over them, and the model keys of other ranks it needs.

    Ranks of a pipeline hold different model keys (each its stages'), saved in
    their own objects files. A reader whose model wants keys this rank's
    objects lack (one process or another layout reading a pipeline
    checkpoint) takes them, with their optimizer state, from the ranks that
    saved them; with no template (export), every rank's keys are taken.
    """
    step = manifest.get("step")
    files = manifest["files"]
    per_rank = sorted(f for f in files if f.startswith("objects-"))
    out = _load_objects(folder, OBJECTS, step)
    if objects_file(rank) in files:
        out.update(_load_objects(folder, objects_file(rank), step))
    model = out.get("model")
    if not per_rank or not isinstance(model, dict):
        return out
    others = [OBJECTS, *(f for f in per_rank if f != objects_file(rank))]  # the main rank's too: ours replaced it
    wanted = None
    if template is not None:
        live = template.get("model")
        wanted = set(live) - set(model) if isinstance(live, Mapping) else set()
        if not wanted:
            return out
    out = dict(out, model=dict(model))
    for part in others:
        other = _load_objects(folder, part, step)
        theirs = other.get("model")
        if not isinstance(theirs, dict):
            continue
        taken = [k for k in theirs if k not in out["model"] and (wanted is None or k in wanted)]
        for key in taken:
            out["model"][key] = theirs[key]
        if taken:
            out["optimizers"] = _merge_optimizers(out.get("optimizers"), other.get("optimizers"), taken)
            out["callbacks"] = _merge_missing(out.get("callbacks"), other.get("callbacks"))
    return out


def _load_objects(folder: Path, part: str, step: Any) -> dict[str, Any]:
    try:
        loaded = torch.load(folder / part, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"cannot unpickle {part}: {exc}", path=folder, step=step) from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{part} holds no payload structure", path=folder, step=step)
    return loaded


def _merge_optimizers(mine: Any, theirs: Any, keys: list[str]) -> Any:
    """Optimizer states keyed by parameter name (DCP's): the entries and group members of `keys` added to `mine`."""
    if not isinstance(mine, list) or not isinstance(theirs, list) or len(mine) != len(theirs):
        return mine
    wanted, merged = set(keys), []
    for own, other in zip(mine, theirs):
        if not isinstance(own, dict) or not isinstance(other, dict):
            merged.append(own)
            continue
        state = dict(own.get("state", {}))
        state.update({k: v for k, v in other.get("state", {}).items() if k in wanted and k not in state})
        groups = [dict(g) for g in own.get("param_groups", [])]
        for group, extra in zip(groups, other.get("param_groups", [])):
            group["params"] = list(group["params"]) + [
                p for p in extra.get("params", []) if p in wanted and p not in group["params"]
            ]
        merged.append({**own, "state": state, "param_groups": groups})
    return merged


def _merge_missing(mine: Any, theirs: Any) -> Any:
    """`mine` with the dict entries only `theirs` has (recursively)."""
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return mine
    out = dict(mine)
    for key, value in theirs.items():
        out[key] = _merge_missing(out[key], value) if key in out else value
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
