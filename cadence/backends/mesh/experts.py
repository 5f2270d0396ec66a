"""Expert parallel on the mesh: each rank of an expert group holds its share of every mixture-of-experts layer's experts.

Two borrowed axes (not factors of the world size) lay out the expert weights:
`expert` splits the experts, `expert_tensor` splits each expert's hidden
dimension (tensor parallel inside each expert, as TorchTitan's ETP). Both are
carved out of the data x context ranks (ranks that read different data or
different slices of a sequence): the data x context ranks are laid out as
("expert_data", "expert", "expert_tensor"), expert_tensor innermost, so
`expert` x `expert_tensor` must divide shard x context.

The model's mixture-of-experts modules declare themselves with:

- `num_experts`: how many experts the layer has (the expert axis must divide it).
- `expert_hidden` (needed when expert_tensor > 1): the hidden size of each
  expert, which the expert_tensor axis must divide.
- `shard_experts(mesh)`: called once at setup with the 2-D `DeviceMesh`
  ("expert", "expert_tensor"). The module replaces its stacked expert
  weights (first dimension: the expert) by DTensors placed `Shard(0)` over
  "expert" and, over "expert_tensor", sharded on the hidden dimension
  (column-wise for the input projections, row-wise for the output one). Its
  parameters that are DTensors on that mesh are its expert parameters.
  Forward gathers the tokens of its expert_tensor peers (so the peers hold
  the same tokens), dispatches them to the experts' owners with an
  all-to-all on `mesh["expert"]`, runs its hidden slice of the local experts,
  sends the partial outputs back, and sums its peers' partial outputs for its
  own tokens (`torch.distributed._functional_collectives.all_to_all_single_autograd`
  throughout, so the backward is the transposed exchange).

FSDP2 shards every other parameter (router, attention, embeddings) over the
data axes as usual and averages their gradients over every data rank; it
ignores the expert parameters (`fully_shard(ignored_params=...)`), whose
gradients the backend finishes at `finish_gradients`:

- not all-reduced over the expert or expert_tensor axes: each rank owns a
  different slice of the weights, and the all-to-alls' backward already
  brought every rank's tokens' contribution to that slice;
- scaled by 1 / (data x context ranks), the mean the data ranks' losses imply;
- summed over the ranks holding the same slice (the other expert groups,
  "expert_data"), when there are several.

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
    """Refuse, before any process group exists, expert axes the model or the mesh cannot take."""
    expert, expert_tensor, name = sizes["expert"], sizes["expert_tensor"], type(model).__name__
    if expert * expert_tensor == 1:
        return
    axes = " x ".join(f"{axis}={sizes[axis]}" for axis in ("expert", "expert_tensor") if sizes[axis] > 1)
    modules = expert_modules(model)
    if not modules:
        raise ValueError(
            f"mesh: {axes} needs mixture-of-experts modules with `num_experts` and `shard_experts(mesh)`; "
            f"{name} has none, so the expert axes would be unused; set expert=1 and expert_tensor=1"
        )
    for module in modules:
        kind = type(module).__name__
        count = int(getattr(module, "num_experts"))  # noqa: B009  (a declared attribute, not a tensor)
        if count < expert:
            raise ValueError(
                f"mesh: the expert axis ({expert}) is larger than the number of experts of {kind} "
                f"({count}): a rank would hold no expert; use expert <= {count}"
            )
        if count % expert:
            raise ValueError(
                f"mesh: {kind} has {count} experts, not divisible by the expert axis ({expert}); "
                f"choose an expert axis that divides {count}"
            )
        if expert_tensor > 1:
            hidden = getattr(module, "expert_hidden", None)
            if hidden is None:
                raise ValueError(
                    f"mesh: expert_tensor={expert_tensor} splits each expert's hidden dimension, and {kind} does "
                    "not declare `expert_hidden` (its experts' hidden size, sharded by its `shard_experts`); "
                    "declare it, or set expert_tensor=1"
                )
            if int(hidden) % expert_tensor:
                raise ValueError(
                    f"mesh: {kind}'s experts have hidden size {int(hidden)}, not divisible by the expert_tensor "
                    f"axis ({expert_tensor}); choose an expert_tensor that divides {int(hidden)}"
                )
    for axis in ("tensor", "pipeline"):
        if sizes[axis] > 1:
            raise NotImplementedError(f"mesh: {axes} together with {axis}={sizes[axis]} is not built yet")
    inner = sizes["shard"] * sizes["context"]
    if inner % (expert * expert_tensor):
        raise ValueError(
            f"mesh: the expert axes group data ranks: expert x expert_tensor ({expert} x {expert_tensor} = "
            f"{expert * expert_tensor}) must divide shard x context ({sizes['shard']} x {sizes['context']} = {inner})"
        )


def build(
    model: torch.nn.Module, device_type: str, world_size: int, expert: int, expert_tensor: int
) -> tuple[Any, list[torch.Tensor], Any]:
    """The 3-D expert mesh ("expert_data", "expert", "expert_tensor"), the expert parameters after `shard_experts`,
    and the process group of the expert x expert_tensor ranks (for gradient norms: one all-reduce over both axes).

    Collective (every rank creates the mesh's groups).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    mesh = DeviceMesh(
        device_type,
        torch.arange(world_size).view(-1, expert, expert_tensor),
        mesh_dim_names=("expert_data", "expert", "expert_tensor"),
    )
    sub = mesh["expert", "expert_tensor"]
    # A DTensor norm partial over both axes would take two all-reduces (and torch warns that ranks may differ).
    norm_group = sub._flatten("expert_shard").get_group()
    params: list[torch.Tensor] = []
    for module in expert_modules(model):
        kind = type(module).__name__
        getattr(module, "shard_experts")(sub)  # noqa: B009
        found = [(n, p) for n, p in module.named_parameters() if getattr(p, "device_mesh", None) == sub]
        if not found:
            raise ValueError(
                f"{kind}.shard_experts(mesh) left no parameter as a DTensor on the expert mesh: "
                "it must replace the stacked expert weights by DTensors sharded on the expert dimension"
            )
        for n, p in found:
            placements = tuple(p.placements)  # type: ignore[attr-defined]
            on_hidden = placements[1]
            # A weight replicated over expert_tensor would be counted once per peer by the summed partial outputs.
            hidden_sharded = isinstance(on_hidden, Shard) and on_hidden.dim > 0
            if placements[0] != Shard(0) or (expert_tensor > 1 and not hidden_sharded):
                raise ValueError(
                    f"{kind}.shard_experts(mesh) placed {n} as {placements}: expert weights must be Shard(0) over "
                    "'expert' and sharded on a hidden dimension (> 0) over 'expert_tensor'"
                )
        params.extend(p for _, p in found)
    return mesh, params, norm_group


class ExpertGradients:
    """Finishes expert gradients once per step: scale by 1 / data ranks, sum over the expert groups ("expert_data")."""

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
