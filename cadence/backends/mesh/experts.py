"""Expert parallel on the mesh: each rank of an expert group holds its share of every mixture-of-experts layer's experts.

The model's mixture-of-experts modules declare themselves with two members:

- `num_experts`: how many experts the layer has (the expert axis must divide it).
- `shard_experts(mesh)`: called once at setup with the 1-D expert `DeviceMesh`;
  the module replaces its stacked expert weights (first dimension: the expert)
  by DTensors sharded on that dimension (`Shard(0)`), and dispatches tokens to
  the experts' owners in forward with an all-to-all on `mesh.get_group()`
  (`torch.distributed._functional_collectives.all_to_all_single_autograd`).
  Its parameters that are DTensors on that mesh are its expert parameters.

The expert axis is not a factor of the world size: it groups `expert`
consecutive data x context ranks (ranks that read different data or different
slices of a sequence), so it must divide shard x context. FSDP2 shards every
other parameter (router, attention, embeddings) over the data axes as usual and
averages their gradients over every data rank; it ignores the expert
parameters (`fully_shard(ignored_params=...)`), whose gradients the backend
finishes at `finish_gradients`:

- not all-reduced over the expert axis: each rank owns different experts, and
  the all-to-all's backward already brought every rank's contribution;
- scaled by 1 / (data x context ranks), the mean the data ranks' losses imply;
- summed over the ranks holding the same experts (the other expert groups),
  when there are several.

Gradient clipping combines the norms per mesh (`MeshBackend.clip_grad_norm_`),
so one total norm covers parameters on the data mesh and on the expert mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's mixture-of-experts modules (those with `num_experts` and `shard_experts`)."""
    return [m for m in model.modules() if callable(getattr(m, "shard_experts", None)) and hasattr(m, "num_experts")]


def validate(model: torch.nn.Module, sizes: Mapping[str, int]) -> None:
    """Refuse, before any process group exists, an expert axis the model or the mesh cannot take."""
    expert, name = sizes["expert"], type(model).__name__
    if sizes["expert_tensor"] > 1:
        raise NotImplementedError(
            f"mesh: expert_tensor={sizes['expert_tensor']} (each expert's weights split over ranks) is not built: "
            "this version shards whole experts over the expert axis; set expert_tensor=1"
        )
    if expert == 1:
        return
    modules = expert_modules(model)
    if not modules:
        raise ValueError(
            f"mesh: expert={expert} needs mixture-of-experts modules with `num_experts` and `shard_experts(mesh)`; "
            f"{name} has none, so the expert axis would be unused; set expert=1"
        )
    for module in modules:
        count = int(getattr(module, "num_experts"))  # noqa: B009  (a declared attribute, not a tensor)
        if count < expert:
            raise ValueError(
                f"mesh: the expert axis ({expert}) is larger than the number of experts of {type(module).__name__} "
                f"({count}): a rank would hold no expert; use expert <= {count}"
            )
        if count % expert:
            raise ValueError(
                f"mesh: {type(module).__name__} has {count} experts, not divisible by the expert axis ({expert}); "
                f"choose an expert axis that divides {count}"
            )
    for axis in ("tensor", "pipeline"):
        if sizes[axis] > 1:
            raise NotImplementedError(f"mesh: expert={expert} together with {axis}={sizes[axis]} is not built yet")
    inner = sizes["shard"] * sizes["context"]
    if inner % expert:
        raise ValueError(
            f"mesh: the expert axis ({expert}) groups data ranks and must divide shard x context "
            f"({sizes['shard']} x {sizes['context']} = {inner})"
        )


def build(model: torch.nn.Module, device_type: str, world_size: int, expert: int) -> tuple[Any, list[torch.Tensor]]:
    """The 2-D expert mesh ("expert_data", "expert") and the expert parameters after `shard_experts`.

    Collective (every rank creates the mesh's groups).
    """
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(
        device_type,
        torch.arange(world_size).view(-1, expert),
        mesh_dim_names=("expert_data", "expert"),
    )
    sub = mesh["expert"]
    params: list[torch.Tensor] = []
    for module in expert_modules(model):
        getattr(module, "shard_experts")(sub)  # noqa: B009
        found = [p for p in module.parameters() if getattr(p, "device_mesh", None) == sub]
        if not found:
            raise ValueError(
                f"{type(module).__name__}.shard_experts(mesh) left no parameter as a DTensor on the expert mesh: "
                "it must replace the stacked expert weights by DTensors sharded on the expert dimension"
            )
        params.extend(found)
    return mesh, params


class ExpertGradients:
    """Finishes expert gradients once per step: scale by 1 / data ranks, sum over the expert groups."""

    def __init__(self, params: Sequence[torch.Tensor], mesh: Any, data_ranks: int) -> None:
        self.params = list(params)
        self.scale = 1.0 / data_ranks
        outer = mesh["expert_data"]
        self.group = outer.get_group() if outer.size() > 1 else None

    def __call__(self) -> None:
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]  # type: ignore[attr-defined]
        if not grads:
            return
        with torch.no_grad():
            torch._foreach_mul_(grads, self.scale)
            if self.group is not None:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.group)
                torch._foreach_copy_(
                    grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]
                )
