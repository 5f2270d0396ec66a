"""Checkpoints out of Cadence: one torch.save file, safetensors, a Hugging Face folder, or DCP.

`export_checkpoint` reads a checkpoint of any store (the manifest's `"store"`
picks the class from `STORES`: a file checkpoint, a DCP checkpoint of any
mesh and sharding, a DeepSpeed checkpoint of any ZeRO stage), verifies every
checksum before reading a byte of it, and writes the model's weights (and,
asked, the optimizer state) whole, in one process. `read_export` reads what
it wrote back. The command is `cadence export` (cadence/cli/export.py); see
docs/checkpoints.md, "Moving checkpoints".

Example:
    >>> from cadence.checkpoint.export import export_checkpoint
    >>> export_checkpoint("runs/x/checkpoints/latest", "out/model.safetensors", to="safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from cadence.checkpoint import export_formats
from cadence.checkpoint.hf import KeyMapping, load_mapping
from cadence.checkpoint.safetensors_io import DEFAULT_SHARD_BYTES
from cadence.checkpoint.store import CheckpointError, CheckpointStore, store_class

__all__ = ["FORMATS", "Source", "export_checkpoint", "read_export", "read_source"]

FORMATS = ("torch", "safetensors", "hf", "dcp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@attrs.frozen
class Source:
    """A checkpoint read whole: its payload, its manifest, the store kind that wrote it, and where it is."""

    payload: dict[str, Any]
    manifest: dict[str, Any]
    kind: str
    path: Path


def _kind(folder: Path) -> str:
    try:
        manifest = json.loads((folder / "manifest.json").read_bytes())
    except FileNotFoundError:
        raise CheckpointError("manifest.json is missing: not a complete checkpoint", path=folder) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"manifest.json is unreadable: {exc}", path=folder) from exc
    return str(manifest.get("store", "file")) if isinstance(manifest, dict) else "file"


def open_store(path: str | os.PathLike[str]) -> tuple[CheckpointStore, str]:
    """`(store, name)` of the checkpoint at `path` (or of the `latest` in the folder `path`), by its manifest's kind."""
    folder = Path(path).expanduser().absolute()
    if not (folder / "manifest.json").exists() and (folder / "latest").is_dir():
        folder = folder / "latest"
    if not folder.exists():
        raise CheckpointError("no such file or folder; check the path", path=folder)
    kind = _kind(folder)
    cls = store_class(kind)
    if cls is None:
        raise CheckpointError(f"written by an unknown store {kind!r} (known: file, dcp, deepspeed)", path=folder)
    return cls.for_reading().at(folder.parent), folder.name


def read_source(path: str | os.PathLike[str]) -> Source:
    """Verify every file of the checkpoint at `path` against its manifest, then read it whole on the CPU."""
    store, name = open_store(path)
    manifest = store.verify(name)  # every checksum, before anything is unpickled
    payload = store.read_whole(name)
    return Source(payload, manifest, store.kind, store.path(name))


def provenance(source: Source) -> dict[str, str]:
    """Where the weights come from: code id, config hash, step, epoch, source store and path (strings)."""
    from cadence.run import config as config_module

    meta = source.payload.get("meta") or {}
    config = source.payload.get("config") or {}
    chosen = config.get("run") or config.get("engine")
    try:
        config_hash = config_module.config_hash(chosen) if chosen else ""
    except Exception:  # a config the hash cannot canonicalize: leave it out rather than guess
        config_hash = ""
    code_id = ""
    run_yaml = source.path.parent.parent / "metadata" / "run.yaml"  # <run>/checkpoints/<name>
    if run_yaml.is_file():
        import yaml

        try:
            code_id = str((yaml.safe_load(run_yaml.read_text()) or {}).get("code_id") or "")
        except (OSError, yaml.YAMLError):
            code_id = ""
    return {
        "format": "cadence-export",
        "code_id": code_id,
        "config_hash": config_hash,
        "step": str(meta.get("step", "")),
        "epoch": str(meta.get("epoch", "")),
        "source_store": source.kind,
        "source": str(source.path),
    }


def _trainable(source: Source, model: dict[str, Any]) -> dict[str, Any]:
    names = (source.payload.get("meta") or {}).get("trainable")
    if names is None:
        raise CheckpointError(
            "params='trainable': the checkpoint does not record which parameters were trainable (saved before "
            "Cadence recorded it); export all parameters",
            path=source.path,
        )
    return {k: v for k, v in model.items() if k in set(names)}


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: str,
    dtype: str | None = None,
    params: str = "all",
    with_optimizer: bool = False,
    mapping: str | KeyMapping | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write the checkpoint at `checkpoint` to `out` in the format `to`; returns the files written.

    Args:
        checkpoint: a checkpoint folder (or a folder holding `latest`) of any store.
        out: `torch`: a file; `safetensors`: a `.safetensors` file, or a folder (sharded with
            `model.safetensors.index.json` above `max_shard_bytes`); `hf`: a folder; `dcp`: the
            checkpoint folder to create (a Cadence DCP checkpoint: `resume=` and `pretrained=` read it).
        to: one of `FORMATS`.
        dtype: `bf16`, `fp16` or `fp32`: floating model weights cast to it (default: as saved).
        params: `all`, or `trainable`: only the parameters that were trainable (an adapter).
        with_optimizer: the optimizer state too (not `hf`).
        mapping: the Hugging Face key mapping (`hf`; see `cadence.checkpoint.hf`).
        max_shard_bytes: the largest safetensors file before the weights are split.
    """
    if to not in FORMATS:
        raise ValueError(f"export to={to!r}: expected one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if params not in ("all", "trainable"):
        raise ValueError(f"export params={params!r}: expected 'all' or 'trainable'")
    if to == "hf" and (mapping is None or with_optimizer):
        raise ValueError(
            "export to='hf' needs a key mapping (mapping='module:NAME', e.g. examples/lm.py:HFLlama) and holds "
            "weights only (no with_optimizer)"
        )
    source = read_source(checkpoint)
    model = dict(source.payload.get("model") or {})
    if params == "trainable":
        model = _trainable(source, model)
    if dtype is not None:
        target = DTYPES[dtype]
        model = {k: v.to(target) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in model.items()}
    optimizers: list[Any] | None = None
    if with_optimizer:
        optimizers = list(source.payload.get("optimizers") or [])
        if not optimizers:
            raise CheckpointError(
                f"with_optimizer: the {source.kind} checkpoint holds no whole optimizer state to export "
                "(DeepSpeed keeps its own partitions: convert them with DeepSpeed's tools); export the model alone",
                path=source.path,
            )
    meta = provenance(source)
    target_path = Path(out).expanduser().absolute()
    if to == "torch":
        return [export_formats.write_torch(model, optimizers, meta, target_path)]
    if to == "safetensors":
        return export_formats.write_safetensors(model, optimizers, meta, target_path, max_shard_bytes)
    if to == "hf":
        from cadence.checkpoint.hf import write_folder

        assert mapping is not None
        return write_folder(
            model, source.payload, target_path, load_mapping(mapping), metadata=meta, max_shard_bytes=max_shard_bytes
        )
    return export_formats.write_dcp(source.payload, model, optimizers, meta, target_path)


def read_export(path: str | os.PathLike[str], *, mapping: str | KeyMapping | None = None) -> dict[str, Any]:
    """What `export_checkpoint` wrote, back: `{"model": ..., "optimizers": [...] or None, "metadata": {...}}`.

    `path`: a torch.save file, a safetensors file or folder, a Hugging Face folder (names through
    `mapping`), or a checkpoint of any store.
    """
    from cadence.checkpoint import safetensors_io

    p = Path(path).expanduser().absolute()
    if p.is_file() and p.suffix != ".safetensors":
        return export_formats.read_torch(p)
    if safetensors_io.is_safetensors(p):
        return export_formats.read_safetensors(p, None if mapping is None else load_mapping(mapping))
    source = read_source(p)
    return {"model": source.payload.get("model"), "optimizers": source.payload.get("optimizers"), "metadata": {}}
