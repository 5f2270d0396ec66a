"""Backends adapt the loop to a distribution strategy; see `cadence.engine.backend`.

`LocalBackend`, `DDPBackend` and `DeepSpeedBackend` (with `DeepSpeedConfig`)
are imported on first use: `import cadence.backends` imports neither
torch.distributed's wrappers nor DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.backends.ddp import DDPBackend
    from cadence.backends.deepspeed import DeepSpeedBackend, DeepSpeedConfig
    from cadence.backends.local import LocalBackend

_LAZY = {
    "LocalBackend": "cadence.backends.local",
    "DDPBackend": "cadence.backends.ddp",
    "DeepSpeedBackend": "cadence.backends.deepspeed",
    "DeepSpeedConfig": "cadence.backends.deepspeed",
}

__all__ = ["DDPBackend", "DeepSpeedBackend", "DeepSpeedConfig", "LocalBackend"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cadence.backends' has no attribute {name!r}")
