"""How a run starts from a checkpoint: a given one, auto-resume's pick of the newest complete one, pretrained weights.

The `Checkpoint` callback applies the launch modes in `on_setup` (resume >
auto_resume > pretrained, docs/checkpoints.md, "Launch modes"); reading,
checking and picking the checkpoint is done here, beside the stores.
`from_checkpoint` builds an engine and restores it at construction.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.payload import load_pretrained, restore
from cadence.checkpoint.store import CheckpointError, CheckpointStore, for_location, store_class, store_errors
from cadence.engine.engine import Engine
from cadence.engine.events import Event

logger = logging.getLogger("cadence.checkpoint")


def from_checkpoint(path: str | os.PathLike[str], *args: Any, strict: bool = True, **kwargs: Any) -> Engine:
    """Build `Engine(*args, **kwargs)` and restore the full state saved at `path`.

    `path` is a checkpoint (`.../checkpoints/latest`) or a checkpoint folder
    (its `latest` is used). Fires `on_load`; a `Checkpoint` callback among
    the callbacks then skips its own launch modes. See docs/checkpoints.md.

    Example:
        >>> from cadence.checkpoint import from_checkpoint
        >>> engine = from_checkpoint("runs/x/checkpoints/latest", model, opt, data)  # doctest: +SKIP
    """
    engine = Engine(*args, **kwargs)
    try:
        load_checkpoint(engine, path, strict=strict)
    except BaseException:
        engine.close()
        raise
    return engine


def load_checkpoint(engine: Engine, path: str | os.PathLike[str], *, strict: bool = True) -> dict[str, Any]:
    """Read the checkpoint at `path` with the backend's store and `restore` it; returns the payload.

    Every rank calls it. Store errors are raised as `CheckpointError` naming the checkpoint.
    """
    store, name = locate(engine, engine.backend.checkpoint_store(engine), path)
    with store_errors("reading", store.path(name)):
        payload = store.read(name)
    restore(engine, payload, strict=strict, source=str(store.path(name)))
    return payload


def locate(engine: Engine, store: CheckpointStore, path: str | os.PathLike[str]) -> tuple[CheckpointStore, str]:
    """`store.locate(path)` on every rank: a collective store's main rank locates and tells the others.

    A checkpoint of another kind than a non-collective store's own (the
    manifest's `"store"`) is read by that kind's store where it can read on
    any backend (`CheckpointStore.reader_for`: a sharded DCP checkpoint on one
    process or on DDP's process group).
    """
    backend = engine.backend
    store = for_location(store, path)  # a URL: the object store of the same kind
    if not (store.collective and backend.world_size > 1):
        with store_errors("locating", path):
            at, name = store.locate(path)
        kind = _written_by(at.path(name))
        if not store.collective and kind is not None and kind != at.kind:
            found = store_class(kind)
            reader = found.reader_for(engine) if found is not None else None
            if reader is not None:
                return reader.at(at.path(name).parent), name
        return at, name
    found_at: tuple[str, str] | None = None
    problem: tuple[str, str | None, int | None] | None = None
    if backend.is_main:
        try:
            with store_errors("locating", path):
                at, name = store.locate(path)
            found_at = (str(at.directory), name)
        except CheckpointError as exc:
            problem = (exc.reason, exc.path, exc.step)  # the step a folder without its manifest seems to hold
    found_at, problem = backend.broadcast_object((found_at, problem))
    if found_at is None:
        assert problem is not None
        raise CheckpointError(problem[0], path=problem[1] or path, step=problem[2])
    return store.at(found_at[0]), found_at[1]


def _written_by(folder: os.PathLike[str]) -> str | None:
    """The manifest's `"store"` field (`"file"` where it has none); None if it cannot be read (the store reports it)."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return None
    return str(manifest.get("store", "file")) if isinstance(manifest, dict) else None


def auto_resume(engine: Engine, store: CheckpointStore, *, strict: bool) -> bool:
    """Restore the newest complete checkpoint of this run; False if there is none.

    The main rank picks: a collective store's candidates are checked with
    `manifest` and `verify` only (its `read` is a collective), a file
    store's are read (the read verifies, and the pick's payload is kept).
    The pick is broadcast, then every other rank reads it (a collective
    store: every rank together), and the ranks agree that every read
    succeeded.
    """
    backend = engine.backend
    picked, payload, problems = None, None, []
    if backend.is_main:
        for name in candidates(store):
            try:
                with store_errors("checking", store.path(name)):
                    if store.collective:
                        store.manifest(name)
                        store.verify(name)
                    else:
                        payload = store.read(name)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            picked = name
            break
    if backend.world_size > 1:
        picked, problems = backend.broadcast_object((picked, problems))
    if picked is None:
        if problems:
            raise CheckpointError(
                "auto_resume: no complete checkpoint to resume from: "
                + " | ".join(problems)
                + "; delete the damaged checkpoints to start from scratch",
                path=store.directory,
            )
        logger.info("auto_resume: no checkpoint in %s; starting from scratch", store.directory)
        return False
    if problems:
        logger.warning(
            "auto_resume: falling back to the previous complete checkpoint %r: %s", picked, " | ".join(problems)
        )
    payload = read_everywhere(engine, store, picked, payload)
    restore(engine, payload, strict=strict, source=str(store.path(picked)))
    return True


def read_everywhere(
    engine: Engine, store: CheckpointStore, name: str, payload: dict[str, Any] | None
) -> dict[str, Any]:
    """`name`'s payload on every rank (read where not given); an error on any rank is raised on every rank."""
    backend = engine.backend
    error: CheckpointError | None = None
    if payload is None:
        try:
            with store_errors("reading", store.path(name)):
                payload = store.read(name)
        except CheckpointError as exc:
            error = exc
    if backend.world_size > 1:
        failed = [
            (rank, text)
            for rank, text in enumerate(backend.all_gather_object(error and str(error), domain="optimizer"))
            if text
        ]
        if failed and error is None:
            error = CheckpointError(f"rank {failed[0][0]} could not read it: {failed[0][1]}", path=store.path(name))
    if error is not None:
        raise error
    assert payload is not None
    return payload


def candidates(store: CheckpointStore) -> list[str]:
    """`latest`, then history snapshots newest first (present even when damaged)."""
    directory = store.directory
    if directory is None or not directory.is_dir():
        return []
    history = []
    for path in directory.iterdir():
        if path.is_dir() and path.name.startswith(("ckpt-s", "ckpt-e")):
            try:
                step = store.manifest(path.name).get("step") or 0
            except CheckpointError:
                step = -1
            history.append((step, path.name))
    history.sort(reverse=True)
    return (["latest"] if (directory / "latest").exists() else []) + [name for _, name in history]


def load_pretrained_weights(
    engine: Engine,
    own: CheckpointStore,
    pretrained: str,
    *,
    exclude: list[str],
    strict: bool,
    mapping: Any = None,
) -> None:
    """Load model weights from `pretrained`: a safetensors file or folder (a Hugging Face folder), a file saved
    with torch.save, or a checkpoint (of any store). `mapping`: a key mapping (`cadence.checkpoint.hf`)."""
    from cadence.checkpoint import safetensors_io

    path = Path(str(pretrained)).expanduser()
    if safetensors_io.is_safetensors(path):
        from cadence.checkpoint.weights_in import read_model_state

        state = read_model_state(engine, path, mapping=mapping, exclude=exclude)
        load_pretrained(engine, state, strict=strict, exclude=exclude, source=str(path))
        return
    if mapping is not None:
        raise ValueError(
            f"Checkpoint(pretrained_mapping=...): key mappings apply to safetensors and Hugging Face folders, "
            f"not to {path}"
        )
    if path.is_file():  # weights saved with torch.save
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"cannot load pretrained weights: {exc}", path=path) from exc
        state = obj.get("model", obj.get("state_dict", obj)) if isinstance(obj, Mapping) else obj
        step = None
    else:
        store, name = locate(engine, own, path)
        if store.restores_model:  # the store loads the module weights itself (DeepSpeed)
            if exclude:
                raise ValueError(
                    f"Checkpoint(pretrained_exclude={exclude}): the {type(store).__name__} "
                    "loads module weights as a whole; load them without exclusions"
                )
            with store_errors("reading pretrained weights", store.path(name)):
                store.read(name, keys=["model"])
            logger.info("loaded pretrained weights from %s (through the store)", path)
            engine.fire(Event.ON_LOAD)
            return
        with store_errors("reading pretrained weights", store.path(name)):
            payload = store.read(name, keys=["model"])
        state, step = payload["model"], payload.get("meta", {}).get("step")
    if not isinstance(state, Mapping):
        raise CheckpointError(f"pretrained weights must be a state dict, got {type(state).__name__}", path=path)
    load_pretrained(engine, state, strict=strict, exclude=exclude, source=str(path), step=step)
