"""float8 training through torchao: `nn.Linear` layers swapped for torchao's `Float8Linear`.

A model transform (`cadence.backends.transforms`): after parallelize, before
activation checkpointing, compile and the FSDP2/DDP wrap. Matrix
multiplications of the chosen linear layers run in float8 (e4m3) with dynamic
scales; everything else keeps the run's precision (bf16 usually).

- **Recipes**: `"tensorwise"` (one scale per tensor: the fastest, and the one
  FSDP2 can all-gather in float8) or `"rowwise"` (one scale per row: more
  accurate, somewhat slower), torchao's `Float8LinearConfig.from_recipe_name`.
- **Which layers** (`select`): every `nn.Linear` whose both dimensions are
  multiples of 16 (float8 matmuls need it) and at least `min_features`, except
  those whose name matches an `exclude` pattern (`fnmatch` on module names),
  the output head when `skip_head` (the model's last `nn.Linear` in module
  order: an LM's vocabulary projection, the most sensitive layer), and layers
  inside a module with a precision override (`precision_overrides`: fp32).
- **FSDP2** (`fsdp_all_gather`, mesh backend, tensorwise only): parameters are
  all-gathered in float8 (half of bf16's traffic); their scales are computed
  for the next step right after each optimizer update
  (`precompute_float8_dynamic_scale_for_fsdp`, one all-reduce of the weights'
  maxima), registered by the backend on `on_optimizer_step`.
- **Hardware**: float8 matmuls need a CUDA GPU of compute capability 8.9 or
  newer (Ada: L4, L40, RTX 4090; Hopper: H100, H200; Blackwell). Elsewhere
  `require_device` refuses before any process group starts. `emulate=True`
  (torchao's emulation, for tests only) runs the same casts with high-precision
  matmuls on any device, the CPU included.

torchao is an optional dependency: `pip install 'cadence[float8]'`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Collection
from typing import Any, Literal

import attrs
import torch

__all__ = [
    "MIN_CAPABILITY", "Float8Config", "convert", "precompute_scales", "register_scale_precompute", "require_device", "select",
]  # fmt: skip

#: The lowest CUDA compute capability with float8 tensor cores (Ada Lovelace).
MIN_CAPABILITY = (8, 9)


def _min_features(instance: Any, attribute: Any, value: int) -> None:
    if value < 0:
        raise ValueError(f"float8.min_features must be >= 0, got {value!r}")


@attrs.define(kw_only=True)
class Float8Config:
    """float8 training options (torchao); see `cadence.backends.float8`.

    Attributes:
        enabled: convert the chosen linear layers.
        recipe: "tensorwise" or "rowwise" scaling.
        exclude: module-name patterns never converted (`fnmatch`, e.g. `"layers.0.*"`).
        min_features: convert only layers whose input and output sizes are both
            at least this (float8 loses to bf16 on small matmuls).
        skip_head: leave the model's last `nn.Linear` (the output head) alone.
        fsdp_all_gather: FSDP2 all-gathers the converted weights in float8 and
            precomputes their scales after each optimizer step (tensorwise; mesh
            backend with sharded parameters).
        emulate: torchao's emulation: float8 casts with high-precision matmuls,
            on any device (tests; not a speed-up).
    """

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    exclude: list[str] = attrs.field(factory=list)
    min_features: int = attrs.field(default=0, validator=_min_features)
    skip_head: bool = True
    fsdp_all_gather: bool = False
    emulate: bool = False

    def __attrs_post_init__(self) -> None:
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"float8.fsdp_all_gather needs recipe='tensorwise' (one scale per weight, which FSDP2 can gather), "
                f"got recipe={self.recipe!r}; set fsdp_all_gather=False or recipe='tensorwise'"
            )


def require_device(config: Float8Config, device: torch.device, where: str) -> None:
    """Raise ValueError unless `device` runs float8 matmuls (or `config.emulate`); call before any process group.

    Asking a CUDA device for its capability initializes CUDA in this process
    (each rank's own, at setup, as the backend does next anyway).
    """
    if not config.enabled or config.emulate:
        return
    need = f"float8 training ({where}) needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (L4, L40, H100, H200, B200, ...)"
    if device.type != "cuda":
        raise ValueError(
            f"{need}; this process trains on {device}. Turn float8 off here (emulate=True runs torchao's "
            "emulation on any device, for tests only)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{need}; {device} is {name}, capability {capability[0]}.{capability[1]}")


def _import_torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise ImportError(
            f"float8 training needs torchao ({exc}); install it with: pip install 'cadence[float8]'"
        ) from None
    return float8


def select(model: torch.nn.Module, config: Float8Config, skip: Collection[str] = ()) -> list[str]:
    """The names of the `nn.Linear` layers `convert` swaps (see the module docstring); `skip`: names left alone, with what is inside them."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    head = linears[-1][0] if config.skip_head and linears else None
    chosen = []
    for name, module in linears:
        if name in ("", head) or type(module).__name__ == "Float8Linear":  # the root; converted already
            continue
        sizes = (module.in_features, module.out_features)
        if any(s % 16 or s < config.min_features for s in sizes):
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude):
            continue
        if any(name == s or name.startswith(s + ".") or s == "" for s in skip):
            continue
        chosen.append(name)
    return chosen


def convert(
    model: torch.nn.Module, config: Float8Config, skip: Collection[str] = (), *, fsdp: bool = False
) -> list[str]:
    """Swap the selected layers for `Float8Linear` in place; returns their names.

    `fsdp`: the model is sharded with FSDP2 next, and `config.fsdp_all_gather`
    asks for float8 all-gathers. Raises ImportError naming the extra without torchao.
    """
    if not config.enabled:
        return []
    float8 = _import_torchao()
    names = set(select(model, config, skip))
    options = float8.Float8LinearConfig.from_recipe_name(config.recipe)
    options = dataclasses.replace(
        options, enable_fsdp_float8_all_gather=fsdp and config.fsdp_all_gather, emulate=config.emulate
    )
    float8.convert_to_float8_training(model, config=options, module_filter_fn=lambda _, name: name in names)
    return sorted(names)


def precompute_scales(model: torch.nn.Module) -> None:
    """The float8 scales of FSDP2's next all-gathers, from the updated (sharded) weights: one all-reduce."""
    _import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def register_scale_precompute(engine: Any, order: int) -> None:
    """Precompute FSDP2's float8 scales on `engine` whenever the weights may have changed.

    After each optimizer update (first), at fit start (a restored checkpoint)
    and at evaluation start and end with `order` (after a callback that swaps
    weights in and out there: EMA).
    """
    from cadence.engine.events import Event

    def precompute(engine: Any) -> None:
        precompute_scales(engine.model)

    engine.add_handler(Event.ON_OPTIMIZER_STEP, precompute, order=0)
    for event in (Event.ON_FIT_START, Event.ON_EVAL_START, Event.ON_EVAL_END):
        engine.add_handler(event, precompute, order=order)
