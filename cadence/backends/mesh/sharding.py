"""FSDP2 on the mesh backend: which modules are sharded, with which precision policy, and what setup leaves behind.

`shard` applies `fully_shard` to every unit (block), to every module with a
precision override (`cadence.backends.precision`: its own unit with an fp32
`MixedPrecisionPolicy`), and to the root, children before parents (FSDP2 takes
for each module the parameters no sharded child holds). `rebind_optimizers`
points optimizers at the DTensor parameters that replaced the ones they were
built with; `release_groups` lets go of the process groups FSDP2 and the mesh
hold, at teardown.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from cadence.backends.mesh.config import MeshConfig

__all__ = ["policies", "rebind_optimizers", "release_groups", "shard"]


def policies(config: MeshConfig) -> tuple[Any, Any]:
    """(the units' `MixedPrecisionPolicy`, the fp32 modules' one); both None in an fp32 run (nothing to cast)."""
    if config.precision != "bf16":
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.float32 if config.reduce_dtype == "fp32" else torch.bfloat16
    default = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    # fp32 inside (parameters, inputs, gradient reduction); the output back in bf16 for the modules after it.
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
    return default, fp32


def shard(
    model: torch.nn.Module,
    units: Sequence[torch.nn.Module],
    fp32_modules: Sequence[torch.nn.Module],
    *,
    mesh: Any,
    config: MeshConfig,
    ignored_params: Sequence[torch.Tensor] = (),
) -> list[tuple[Any, bool]]:
    """`fully_shard` units, fp32 modules and the root over `mesh`; returns every `(FSDPModule, reshard_after_forward)`.

    A unit inside an fp32 module (or one itself) gets the fp32 policy; the
    root keeps its parameters gathered after forward (they are used first in
    backward) and the run's policy.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    options: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    }
    if ignored_params:  # expert gradients are finished by experts.ExpertGradients, not FSDP2
        options["ignored_params"] = set(ignored_params)
    default, fp32 = policies(config)
    if default is None or any(m is model for m in fp32_modules):  # everything in fp32: no policy, no extra unit
        default, fp32, fp32_modules = None, None, []
    order = {id(m): i for i, m in enumerate(model.modules())}
    inside_fp32 = {id(m) for outer in fp32_modules for m in outer.modules()}
    chosen = {id(m): m for m in [*units, *fp32_modules] if m is not model}
    sharded: list[tuple[Any, bool]] = []
    # Reversed pre-order: every child before its parent.
    for module in sorted(chosen.values(), key=lambda m: -order[id(m)]):
        policy = fp32 if id(module) in inside_fp32 else default
        fully_shard(module, reshard_after_forward=config.reshard_after_forward, **_with(options, policy))
        sharded.append((module, config.reshard_after_forward))
    fully_shard(model, reshard_after_forward=False, **_with(options, default))
    sharded.append((model, False))
    return sharded


def _with(options: dict[str, Any], policy: Any) -> dict[str, Any]:
    return options if policy is None else {**options, "mp_policy": policy}


def rebind_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str], params: dict[str, torch.nn.Parameter]
) -> None:
    """Point each optimizer at the parameters that replaced the ones it was built with (by name).

    `fully_shard` and tensor-parallel styles register new DTensor parameters;
    an optimizer built before setup still holds the old ones.
    """
    for optimizer in optimizers:
        replaced: dict[int, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for i, old in enumerate(group["params"]):
                name = names.get(id(old))
                if name is None:
                    if any(old is p for p in params.values()):
                        continue
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a parameter of shape {tuple(old.shape)} that is not "
                        "the model's: build the optimizer from model.parameters()"
                    )
                new = params[name]
                if new is not old:
                    group["params"][i] = new
                    replaced[id(old)] = new
        if replaced and optimizer.state:
            state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
            state.update({replaced.get(id(k), k): v for k, v in optimizer.state.items()})
            optimizer.state = state


def release_groups(modules: Sequence[Any], mesh: Any) -> None:
    """Drop the process groups FSDP2 states and device meshes keep (after they were destroyed).

    Private torch fields, each looked up defensively: on another torch version
    this releases less, never fails.
    """
    seen: set[int] = set()

    def clear_mesh(value: Any) -> None:
        root = getattr(value, "_root_mesh", None) or value
        registry = getattr(root, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()

    def clear_info(info: Any) -> None:
        if info is None or id(info) in seen:
            return
        seen.add(id(info))
        for name in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
            if isinstance(getattr(info, name, None), dist.ProcessGroup):
                with contextlib.suppress(Exception):
                    setattr(info, name, None)
        clear_mesh(getattr(info, "mesh", None))

    if mesh is not None:
        clear_mesh(mesh)
    for module in modules:
        with contextlib.suppress(Exception):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            for owner in (group, *group.fsdp_params):
                clear_info(getattr(owner, "mesh_info", None))
                clear_info(getattr(owner, "post_forward_mesh_info", None))
                clear_mesh(getattr(owner, "_spmd_mesh", None))
