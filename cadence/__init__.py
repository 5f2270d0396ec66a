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

from cadence.engine.backend import Backend
from cadence.engine.bus import Handle, HookError, OrderError
from cadence.engine.callback import Callback
from cadence.engine.config import ConfigError
from cadence.engine.control import Requests
from cadence.engine.data import DataConfig
from cadence.engine.engine import Engine, EngineConfig
from cadence.engine.events import Event
from cadence.engine.order import Order
from cadence.engine.state import State, seed_everything

__version__ = "0.1.0"

__all__ = [
    "Backend",
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
    "Requests",
    "State",
    "__version__",
    "seed_everything",
]
