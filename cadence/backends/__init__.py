"""Backends adapt the loop to a distribution strategy; see `cadence.engine.backend`.

`LocalBackend`, `DDPBackend`, `MeshBackend` (with `MeshConfig`) and
`DeepSpeedBackend` (with `DeepSpeedConfig`) are importable from here; each is
imported on first use: `import cadence.backends` imports neither
torch.distributed's wrappers nor DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cadence.backends.ddp import DDPBackend
    from cadence.backends.deepspeed import DeepSpeedBackend, DeepSpeedConfig
    from cadence.backends.local import LocalBackend
    from cadence.backends.mesh import MeshBackend, MeshConfig

_LAZY = {
    "LocalBackend": "cadence.backends.local",
    "DDPBackend": "cadence.backends.ddp",
    "DeepSpeedBackend": "cadence.backends.deepspeed",
    "DeepSpeedConfig": "cadence.backends.deepspeed",
    "MeshBackend": "cadence.backends.mesh",
    "MeshConfig": "cadence.backends.mesh",
}

__all__ = ["DDPBackend", "DeepSpeedBackend", "DeepSpeedConfig", "LocalBackend", "MeshBackend", "MeshConfig"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cadence.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
