"""Built-in callbacks, one module each; imported on first use.

`from cadence.callbacks import Checkpoint` imports only `cadence.callbacks.checkpoint`,
so optional dependencies (TensorBoard, W&B) load only when their callback is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from cadence.run.registry import callbacks as _registry

# Class name -> module, derived from the registry's built-in names.
_CLASSES: dict[str, str] = {
    target.partition(":")[2]: target.partition(":")[0] for target in _registry.builtins.values()
}


def __getattr__(name: str) -> Any:
    module = _CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module 'cadence.callbacks' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(_CLASSES)


__all__ = sorted(_CLASSES)
