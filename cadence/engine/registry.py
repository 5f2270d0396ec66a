"""Find backends and callbacks by name without importing them up front.

The engine never imports a concrete backend or callback: built-ins are listed
here as `module:attribute` strings, third-party packages add theirs through
entry points (`cadence.backends`, `cadence.callbacks`), and anything can also be
named directly as `module:attribute`.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any


class Registry:
    """Names -> `module:attribute` targets, resolved lazily."""

    def __init__(self, kind: str, group: str, builtins: dict[str, str]) -> None:
        self.kind, self.group = kind, group
        self._builtins = dict(builtins)
        self._added: dict[str, str] = {}

    def add(self, name: str, target: str) -> None:
        """Register `name` -> `module:attribute`."""
        self._added[name] = target

    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        return {ep.name: ep for ep in metadata.entry_points(group=self.group)}

    def names(self) -> dict[str, str]:
        """Every known name with its target (built-ins, added, entry points)."""
        found = dict(self._builtins)
        found.update(self._added)
        for name, ep in self.entry_points().items():
            found.setdefault(name, ep.value)
        return found

    def resolve(self, name: str) -> Any:
        """The object a name (or a `module:attribute` string) stands for."""
        known = self.names()
        target = known.get(name)
        if target is None and ":" in name:
            target = name
        if target is None:
            raise KeyError(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(sorted(known)) or 'none'} (or name one as 'module:Class')")
        return load_target(target, what=f"{self.kind} {name!r}")


def load_target(target: str, *, what: str) -> Any:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attribute.split(".") if attribute else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{what}: module {module_name!r} has no attribute {attribute!r}") from None
    return obj


backends = Registry(
    "backend",
    "cadence.backends",
    {
        "local": "cadence.backends.local:LocalBackend",
        "ddp": "cadence.backends.ddp:DDPBackend",
    },
)

callbacks = Registry(
    "callback",
    "cadence.callbacks",
    {
        "checkpoint": "cadence.callbacks.checkpoint:Checkpoint",
        "lr_scheduler": "cadence.callbacks.scheduler:LRScheduler",
        "non_finite_skip": "cadence.callbacks.non_finite:NonFiniteSkip",
        "grad_clip": "cadence.callbacks.grad_clip:GradClip",
        "ema": "cadence.callbacks.ema:EMA",
        "early_stopping": "cadence.callbacks.early_stopping:EarlyStopping",
        "garbage_collection": "cadence.callbacks.garbage_collection:GarbageCollection",
        "heartbeat": "cadence.callbacks.heartbeat:Heartbeat",
        "preemption": "cadence.callbacks.preemption:Preemption",
        "train_metrics": "cadence.callbacks.metrics:TrainMetrics",
        "progress_bar": "cadence.callbacks.progress:ProgressBar",
        "tensorboard": "cadence.callbacks.tensorboard:TensorBoard",
        "wandb": "cadence.callbacks.wandb:WandB",
        "jsonl": "cadence.callbacks.jsonl:JSONL",
        "text_log": "cadence.callbacks.text_log:TextLog",
        "profiler": "cadence.callbacks.profiler:Profiler",
    },
)


def require(module: str, extra: str) -> Any:
    """Import an optional dependency or fail naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module!r} is needed here but is not installed; install it with: pip install 'cadence[{extra}]'"
        ) from exc
