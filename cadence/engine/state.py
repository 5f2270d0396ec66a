"""The engine's counters, and RNG capture/restore."""

from __future__ import annotations

import random
from typing import Any

import attrs
import torch

from cadence.engine.control import Requests


@attrs.define
class State:
    """Counters of a run; everything a resume needs besides the tensors.

    Attributes:
        step: optimizer steps completed (skipped ones included).
        epoch: epochs completed.
        micro_step: micro-batches processed in total.
        batch_in_epoch: micro-batches consumed in the current epoch.
        samples_seen: samples processed in training on this rank.
        tokens_seen: tokens processed, counted by the user's code or a callback.
        skipped_steps: optimizer steps skipped by an agreed request.
        consecutive_skips: skipped steps in a row, reset by a taken step.
        last_loss: the last loss as a float, filled when the state is saved.
        requests: the control requests (`engine.requests`); those raised and
            not agreed yet are saved, so a resumed run agrees them at the same
            step as an uninterrupted one (a stop raised in on_step_end before
            a save still stops the next step).
    """

    step: int = 0
    epoch: int = 0
    micro_step: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    last_loss: float | None = None
    requests: Requests = attrs.field(factory=Requests, eq=False, repr=False)

    def state_dict(self) -> dict[str, Any]:
        state = attrs.asdict(self, filter=lambda field, _: field.name != "requests")
        state["requests"] = self.requests.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fields = {f.name for f in attrs.fields(State)}
        unknown = set(state) - fields
        if unknown:
            raise KeyError(f"engine state has unknown keys {sorted(unknown)}; expected {sorted(fields)}")
        for name, value in state.items():
            if name != "requests":
                setattr(self, name, value)
        self.requests.load_state_dict(state.get("requests", {}))  # none pending in older checkpoints


def capture_rng() -> dict[str, Any]:
    """Snapshot of python, numpy (when installed), torch CPU and CUDA RNG states."""
    snapshot: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with most torch installs
        pass
    else:
        snapshot["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snapshot["cuda"] = torch.cuda.get_rng_state_all()
    return snapshot


def restore_rng(snapshot: dict[str, Any]) -> None:
    """Restore what `capture_rng` returned (parts absent here are ignored)."""
    random.setstate(_as_python_state(snapshot["python"]))
    torch.set_rng_state(snapshot["torch"])
    if "numpy" in snapshot:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            pass
        else:
            np.random.set_state(snapshot["numpy"])
    if "cuda" in snapshot and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(snapshot["cuda"])


def _as_python_state(state: Any) -> tuple[Any, ...]:
    # A state that went through a serializer may come back with lists for tuples.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when installed) and torch (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return
    np.random.seed(seed % 2**32)
