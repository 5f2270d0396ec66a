"""Cutting a model into pipeline stages: the layers a stage keeps, by module FQN, nothing renumbered.

`prune` removes, in place, what a rank's stages do not hold; `shell` builds one
stage's view of a rank's model when the rank holds several stages.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def prune(module: torch.nn.Module, keep: Sequence[str]) -> None:
    """Remove, in place, every submodule that holds none of `keep` (FQNs); FQNs of the rest are kept.

    Entries of containers (ModuleList, ModuleDict, Sequential) are deleted
    without renumbering (a container with no entry left stays, empty, so
    `for layer in self.layers` runs no layer); other attributes become None,
    so the model's forward skips them (`x = self.norm(x) if self.norm is not
    None else x`).
    """
    _cut(module, keep, "", in_place=True)


def shell(module: torch.nn.Module, keep: Sequence[str]) -> torch.nn.Module:
    """A module sharing `module`'s parameters and kept layers, with the layers not in `keep` removed as `prune` does.

    Only the path from the root to the kept layers is copied (shallow: the
    same parameter and buffer objects), so several stages on one rank train
    the parameters the rank's model holds.
    """
    return _cut(module, keep, "", in_place=False)


def _cut(module: torch.nn.Module, keep: Sequence[str], prefix: str, in_place: bool) -> torch.nn.Module:
    """The one walk of `prune` and `shell`: `module` itself, or a shallow copy of the path to the kept layers."""
    cut = module if in_place else copy.copy(module)
    if not in_place:
        cut._modules = dict(module._modules)
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        fqn = f"{prefix}{name}"
        if fqn in keep:
            continue
        if any(k.startswith(fqn + ".") for k in keep) or isinstance(child, _CONTAINERS):
            # A container none of whose entries is kept stays, empty.
            cut._modules[name] = _cut(child, keep, fqn + ".", in_place)
        elif isinstance(module, _CONTAINERS):
            del cut._modules[name]
        else:
            cut._modules[name] = None
    return cut
