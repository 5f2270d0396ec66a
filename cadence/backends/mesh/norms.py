"""Gradient norms and clipping over a mesh's gradients: DTensors on several meshes, plain tensors, pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm", "combine_norms", "local_tensors"]


def clip_grad_norm(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    *,
    norm_groups: Mapping[Any, Any],
    combine: Callable[[torch.Tensor, float], torch.Tensor] | None,
    device: torch.device,
) -> torch.Tensor:
    """Clip every gradient together; returns the pre-clip total norm as a plain tensor.

    Norms are taken per group of gradients on the same mesh (DTensors) or
    plain, made full (`full_tensor()`: over every shard), combined, and the
    scale is applied to each rank's local part. `norm_groups`: meshes whose
    gradients are sharded over several dims (experts) -> one process group
    spanning them; `combine`: sums the p-th powers over pipeline stages (a
    stage without gradients still takes part).
    """
    from torch.nn.utils import get_total_norm

    if not grads:
        zero = torch.zeros((), device=device)
        return combine(zero, norm_type) if combine is not None else zero
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = []
    for mesh, group in groups.items():
        if mesh in norm_groups:  # sharded over several mesh dims (experts): one all-reduce over them
            local = get_total_norm(local_tensors(group), norm_type, foreach=True)
            norms.append(combine_norms(local, norm_type, norm_groups[mesh]))
            continue
        norm = get_total_norm(group, norm_type, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = norms[0] if len(norms) == 1 else get_total_norm(norms, norm_type)
    if combine is not None:  # sum of p-th powers over the stages
        total = combine(total, norm_type)
    # As torch.nn.utils.clip_grads_with_norm_, on the local parts (no branch on the host).
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        torch._foreach_mul_(local_tensors(grads), coef.to(grads[0].device))
    return total


def combine_norms(local: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The norm over every rank of `group` from each rank's local norm (as DTensor's partial norm reduces)."""
    if norm_type == float("inf"):
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = local**norm_type
    dist.all_reduce(total, group=group)
    return total ** (1.0 / norm_type)


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Plain tensors holding this rank's part of each (a DTensor's local shard; else itself)."""
    with torch.no_grad():
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
