"""Per-module precision: modules that compute in fp32 inside a bf16 (or fp16) run.

`precision_overrides={"RMSNorm": "fp32", "output": "fp32"}` on any backend:
each key is a module class name (`type(m).__name__` or its qualified name), a
module's name in the model (`"output"`, `"layers.0.ffn_norm"`), or a pattern on
names (`"layers.*.router"`, `fnmatch`). Norms, mixture-of-experts routers and
the output head are the usual ones: their reductions and softmaxes lose the
most in bf16.

How each backend applies them (`Backend` setup, in the transforms' order:
after parallelize and float8, before activation checkpointing and compile):

- local, ddp, and a mesh whose parameters are not sharded (autocast):
  `exclude_from_autocast` wraps the module's forward so that it runs with
  autocast disabled and its floating inputs cast to fp32; its parameters are
  fp32 already (autocast keeps fp32 weights), so it computes in fp32, and the
  modules after it autocast its fp32 output as usual.
- a sharded mesh (FSDP2's `MixedPrecisionPolicy`): each overridden module is
  its own `fully_shard` unit with `MixedPrecisionPolicy(param_dtype=fp32,
  reduce_dtype=fp32, output_dtype=<the run's param dtype>)`: fp32 parameters
  and inputs inside, its output cast back for the bf16 modules after it
  (`cadence.backends.mesh.sharding`).

A key that matches no module is an error naming it and the model's module
classes (a typo would otherwise leave the module in bf16, silently). With
precision "fp32" there is nothing to override: the keys are still checked.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["OVERRIDE_DTYPES", "exclude_from_autocast", "find_overridden", "to_fp32"]

#: What a module may be overridden to.
OVERRIDE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32}


def _matches(key: str, name: str, module: torch.nn.Module) -> bool:
    cls = type(module)
    if key in (cls.__name__, cls.__qualname__) or key == name:
        return True
    return any(c in key for c in "*?[") and fnmatch.fnmatchcase(name, key)


def find_overridden(
    model: torch.nn.Module, overrides: Mapping[str, str], where: str
) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module `overrides` names, outermost only (a module inside one runs in fp32 with it).

    Raises ValueError naming the keys that match no module, or a value other
    than "fp32"; `where` is the config's path (`"mesh.precision_overrides"`).
    """
    for key, value in overrides.items():
        if value not in OVERRIDE_DTYPES:
            raise ValueError(f"{where}[{key!r}] = {value!r}: expected one of {sorted(OVERRIDE_DTYPES)}")
    if not overrides:
        return []
    named = list(model.named_modules())
    matched = {key: [n for n, m in named if _matches(key, n, m)] for key in overrides}
    missing = [key for key, names in matched.items() if not names]
    if missing:
        classes = sorted({type(m).__name__ for _, m in named})
        raise ValueError(
            f"{where}: {missing} match no module of {type(model).__name__} (a key is a module class, a module name "
            f"such as 'output' or 'layers.0.norm', or a pattern such as 'layers.*.norm'); its module classes are {classes}"
        )
    chosen = {n for names in matched.values() for n in names}
    # Outermost only: a chosen module inside another chosen one is covered by it.
    return [(n, m) for n, m in named if n in chosen and not any(_inside(n, o) for o in chosen if o != n)]


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def to_fp32(value: Any) -> Any:
    """`value` with every floating tensor in it (tuples, lists, dicts) cast to fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: to_fp32(v) for k, v in value.items()}
    return value


def exclude_from_autocast(modules: list[torch.nn.Module], device_type: str) -> int:
    """Make each module's forward run with autocast off on `device_type`, its floating inputs in fp32; returns how many.

    The forward is replaced on the instance (names and checkpoint keys stay the
    plain module's), once: a model given to a second engine is not wrapped again.
    """
    changed = 0
    for module in modules:
        if getattr(module, "_cadence_fp32", False):
            continue
        inner = module.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            with torch.autocast(device_type, enabled=False):
                return _inner(*to_fp32(args), **to_fp32(kwargs))

        module.forward = functools.wraps(inner)(forward)  # type: ignore[method-assign]
        module._cadence_fp32 = True  # type: ignore[assignment]
        changed += 1
    return changed
