"""Hugging Face folders: `config.json` and safetensors weights under the names a model hook gives.

A *key mapping* is any object with these methods (the LM example's `HFLlama`
is one, see examples/lm.py):

- `to_hf(key) -> str | None`: the Hugging Face name of a Cadence model key (None: not exported);
- `from_hf(name) -> str | None`: the Cadence key of a Hugging Face name (None: not loaded);
- `hf_config(payload) -> dict`: the folder's `config.json`, from the checkpoint's payload
  (`payload["config"]["run"]` holds the run config).

`load_mapping("examples/lm.py:HFLlama")` imports one (a module or a `.py`
file, then an attribute; a class is instantiated without arguments).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from cadence.checkpoint import safetensors_io
from cadence.checkpoint.store import CheckpointError

CONFIG = "config.json"


@runtime_checkable
class KeyMapping(Protocol):
    """Names between a Cadence model and a Hugging Face folder (see the module docstring)."""

    def to_hf(self, key: str) -> str | None: ...

    def from_hf(self, name: str) -> str | None: ...

    def hf_config(self, payload: Mapping[str, Any]) -> dict[str, Any]: ...


def load_mapping(spec: str | KeyMapping) -> KeyMapping:
    """The key mapping `spec` names (`module:attr` or `path/file.py:attr`), or `spec` itself."""
    if not isinstance(spec, str):
        return _checked(spec, repr(spec))
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute:
        raise ValueError(f"key mapping {spec!r}: expected 'module:NAME' or 'path/to/file.py:NAME'")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        name = f"cadence_mapping_{path.stem}"
        loader = importlib.util.spec_from_file_location(name, path)
        if loader is None or loader.loader is None or not path.is_file():
            raise ValueError(f"key mapping {spec!r}: no such file {path}")
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # attrs and dataclasses look their module up while the file runs
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"key mapping {spec!r}: {where} has no attribute {attribute!r}") from None
    return _checked(found() if isinstance(found, type) else found, spec)


def _checked(mapping: Any, spec: str) -> KeyMapping:
    if not isinstance(mapping, KeyMapping):
        raise TypeError(
            f"key mapping {spec}: needs the methods to_hf, from_hf and hf_config (see cadence.checkpoint.hf)"
        )
    return mapping


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file() and safetensors_io.is_safetensors(path)


def write_folder(
    model: Mapping[str, torch.Tensor],
    payload: Mapping[str, Any],
    out: Path,
    mapping: KeyMapping,
    *,
    metadata: Mapping[str, str],
    max_shard_bytes: int,
) -> list[Path]:
    """`config.json` and the weights under their Hugging Face names (keys mapped to None are left out)."""
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in model.items():
        name = mapping.to_hf(key)
        if name is None:
            continue
        if name in renamed:
            raise ValueError(f"key mapping: two model keys map to the Hugging Face name {name!r}")
        renamed[name] = tensor
    if not renamed:
        raise ValueError("key mapping: it maps none of the model's keys (to_hf returned None for every one)")
    config = mapping.hf_config(payload)
    written = safetensors_io.write(renamed, out, metadata=metadata, max_shard_bytes=max_shard_bytes)
    tmp = out / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True))
    tmp.replace(out / CONFIG)
    return [*written, out / CONFIG]


def source_keys(source: safetensors_io.SafetensorsSource, mapping: KeyMapping | None) -> dict[str, str]:
    """Cadence key -> the name in the files (through `mapping.from_hf` when given)."""
    if mapping is None:
        return {key: key for key in source.keys()}
    out: dict[str, str] = {}
    for name in source.keys():
        key = mapping.from_hf(name)
        if key is None:
            continue
        if key in out:
            raise CheckpointError(f"key mapping: {out[key]!r} and {name!r} both map to {key!r}", path=source.path)
        out[key] = name
    return out
