"""Cadence: a PyTorch training loop built as an event bus.

Example:
    >>> import torch, cadence
    >>> model = torch.nn.Linear(2, 1)
    >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
    >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
    ...                         loss_fn=torch.nn.functional.mse_loss, seed=0)
    >>> engine.fit(epochs=1)
    >>> engine.state.step
    3
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.engine.backend import Backend
    from cadence.engine.bus import CadenceError, Handle, HookError, OrderError
    from cadence.engine.callback import Callback
    from cadence.engine.control import Requests, RequestTimingError
    from cadence.engine.data import DataConfig
    from cadence.engine.engine import Engine, EngineConfig
    from cadence.engine.events import Event
    from cadence.engine.order import Order
    from cadence.engine.state import State, seed_everything
    from cadence.run.config import ConfigError

# Imported on first use, so `import cadence.cli` (the `cadence` command) does not import torch.
_ENGINE = {
    "Backend": "cadence.engine.backend", "CadenceError": "cadence.engine.bus", "Handle": "cadence.engine.bus", "HookError": "cadence.engine.bus",
    "OrderError": "cadence.engine.bus", "Callback": "cadence.engine.callback", "ConfigError": "cadence.run.config",
    "Requests": "cadence.engine.control", "RequestTimingError": "cadence.engine.control", "DataConfig": "cadence.engine.data", "Engine": "cadence.engine.engine",
    "EngineConfig": "cadence.engine.engine", "Event": "cadence.engine.events", "Order": "cadence.engine.order",
    "State": "cadence.engine.state", "seed_everything": "cadence.engine.state",
}  # fmt: skip

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "CadenceError",
    "Callback",
    "ConfigError",
    "DataConfig",
    "Engine",
    "EngineConfig",
    "Event",
    "Handle",
    "HookError",
    "Order",
    "OrderError",
    "RequestTimingError",
    "Requests",
    "State",
    "__version__",
    "seed_everything",
]

_LAZY = {
    "launch": "cadence.launch", "SlurmConfig": "cadence.launch_slurm", "WorkerError": "cadence.launch",
    "Preempted": "cadence.launch",
    "plot": "cadence.plot",  # matplotlib loads on first use
}  # fmt: skip


def __getattr__(name: str) -> object:
    # `launch` pulls in multiprocessing machinery: import it on first use only.
    import importlib

    if name in _ENGINE:
        value = globals()[name] = getattr(importlib.import_module(_ENGINE[name]), name)
        return value
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
