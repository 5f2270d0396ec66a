"""Model transforms every backend applies in one order: parallelize, precision, checkpoint, compile, then wrap.

1. **parallelize** (mesh backend only): `model.parallelize(mesh)` or a user
   function lays tensor-parallel (and later context/expert) placements on the
   modules.
2. **precision** (`apply_precision`): float8 training (`cadence.backends.float8`,
   torchao's `Float8Linear` swapped in), then per-module precision
   (`cadence.backends.precision`: modules that compute in fp32; under FSDP2
   they become their own units with an fp32 policy at the wrap instead).
3. **activation checkpointing** (`ActivationCheckpointConfig`): the forward of
   every block, or of every k-th block, recomputes its activations in backward
   (`mode="full"`), or keeps only the outputs of matrix multiplications and
   attention and recomputes the rest (`mode="selective"`).
4. **compile** (`CompileConfig`): `torch.compile` of each block's forward (or of
   the model's forward when the model names no blocks).
5. **wrap**: FSDP2 `fully_shard` per block and at the root (mesh), or
   `DistributedDataParallel` (ddp); nothing on the local backend.

Blocks ("units") are the model's repeated layers: what `model.fsdp_units()`
returns (modules, or class names), the module class names a config lists, or
what a user function returns; the same units are FSDP2's sharding units.

Checkpointing and compiling replace the unit's `forward` on the instance and
leave the module tree alone, so parameter names (and checkpoint keys) stay
those of the plain module: no `_orig_mod.` (torch.compile's wrapper) and no
`_checkpoint_wrapped_module.`. A checkpoint of a compiled or checkpointed model
loads into the plain model and back. A model the user compiled with
`torch.compile(model)` is unwrapped by `unwrap_compiled`: the engine keeps the
plain module (`engine.model`, whose state checkpoints hold) and forward runs the
compiled one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

from cadence.backends.float8 import Float8Config

__all__ = [
    "ActivationCheckpointConfig",
    "CompileConfig",
    "ModelTransforms",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_precision",
    "find_units",
    "unwrap_compiled",
]

UnitsFn = Callable[[torch.nn.Module], Sequence[torch.nn.Module]]


def _every(instance: Any, attribute: Any, value: int) -> None:
    if value < 1:
        raise ValueError(f"activation_checkpointing.every must be >= 1 (1: every block), got {value!r}")


@attrs.define(kw_only=True)
class ActivationCheckpointConfig:
    """Which blocks recompute their activations in backward.

    Attributes:
        mode: "none"; "full": the whole block's forward is recomputed;
            "selective": outputs of matrix multiplications and attention are
            kept, everything else (norms, activations, element-wise ops) is
            recomputed (`torch.utils.checkpoint.create_selective_checkpoint_contexts`).
        every: checkpoint every k-th block (1: every block; 2: the 2nd, 4th, ...).
    """

    mode: Literal["none", "full", "selective"] = "none"
    every: int = attrs.field(default=1, validator=_every)


@attrs.define(kw_only=True)
class CompileConfig:
    """`torch.compile` of the model's blocks (or of its forward when it names none).

    Attributes:
        enabled: compile at all.
        mode: torch.compile's mode (None, "default", "reduce-overhead", "max-autotune", ...).
        fullgraph: fail on a graph break instead of splitting the graph.
        dynamic: dynamic shapes (None: torch decides after a shape changes).
        backend: the compiler backend ("inductor", "aot_eager", "eager", ...).
    """

    enabled: bool = False
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"


def find_units(
    model: torch.nn.Module, classes: Sequence[str] | None = None, fn: UnitsFn | None = None
) -> list[torch.nn.Module]:
    """The model's blocks, from `fn(model)`, else `classes` (class names), else `model.fsdp_units()`.

    `model.fsdp_units()` may return modules, classes or class names. The model
    itself is never a unit (it is the root). Raises ValueError when a listed
    class name matches no module (a typo would otherwise shard nothing).
    """
    if fn is not None:
        units = list(fn(model))
        where = "the units function"
    elif classes:
        units = _modules_of_classes(model, classes, "units")
        where = "units"
    elif callable(declared := getattr(model, "fsdp_units", None)):
        found = list(declared())
        named = [u for u in found if not isinstance(u, torch.nn.Module)]
        if named:
            names = [u if isinstance(u, str) else getattr(u, "__name__", repr(u)) for u in named]
            found = [u for u in found if isinstance(u, torch.nn.Module)] + _modules_of_classes(
                model, names, f"{type(model).__name__}.fsdp_units()"
            )
        units = found
        where = f"{type(model).__name__}.fsdp_units()"
    else:
        return []
    owned = {id(m) for m in model.modules()}
    for unit in units:
        if not isinstance(unit, torch.nn.Module) or id(unit) not in owned:
            raise ValueError(f"{where} returned {unit!r}, which is not a submodule of the model")
    order = {id(m): i for i, m in enumerate(model.modules())}
    unique = {id(u): u for u in units if u is not model}
    return sorted(unique.values(), key=lambda m: order[id(m)])


def _modules_of_classes(model: torch.nn.Module, classes: Sequence[str], where: str) -> list[torch.nn.Module]:
    wanted = set(classes)
    found = [m for m in model.modules() if type(m).__name__ in wanted or type(m).__qualname__ in wanted]
    seen = {type(m).__name__ for m in found} | {type(m).__qualname__ for m in found}
    missing = sorted(wanted - seen)
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"{where}: no module of class {missing} in the model; its module classes are {present}")
    return found


def apply_activation_checkpointing(units: Sequence[torch.nn.Module], config: ActivationCheckpointConfig) -> int:
    """Make every `config.every`-th unit recompute its activations; returns how many were changed.

    Raises ValueError when checkpointing is on and there are no units to apply it to.
    """
    if config.mode == "none":
        return 0
    if not units:
        raise ValueError(
            f"activation_checkpointing.mode={config.mode!r} needs the model's blocks: define "
            "`model.fsdp_units()`, list their classes in the backend's `units`, or pass a units function"
        )
    from torch.utils.checkpoint import checkpoint

    context_fn = _selective_context if config.mode == "selective" else None
    changed = 0
    for unit in units[config.every - 1 :: config.every]:
        if getattr(unit, "_cadence_checkpointed", False):
            continue  # the same model given to a second engine
        inner = unit.forward
        options: dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            options["context_fn"] = context_fn

        def forward(*args: Any, _inner: Callable[..., Any] = inner, _options: Any = options, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, **_options, **kwargs)

        unit.forward = functools.wraps(inner)(forward)  # type: ignore[method-assign]
        unit._cadence_checkpointed = True  # type: ignore[assignment]
        changed += 1
    return changed


def _save_policy() -> Callable[..., Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )  # fmt: skip
    # Looked up one by one: a build may lack an attention kernel.
    keep = {getattr(aten, name).default for name in names if hasattr(aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_policy())


def apply_compile(model: torch.nn.Module, units: Sequence[torch.nn.Module], config: CompileConfig) -> int:
    """`torch.compile` every unit's forward (the model's when there are none); returns how many.

    The forward is replaced on the instance, so hooks a wrapper registers later
    (FSDP2's all-gathers, DDP's) run outside the compiled code, and names stay
    the plain module's.
    """
    if not config.enabled:
        return 0
    options: dict[str, Any] = {"fullgraph": config.fullgraph, "dynamic": config.dynamic, "backend": config.backend}
    if config.mode is not None:
        options["mode"] = config.mode
    compiled = 0
    for module in units or [model]:
        if getattr(module, "_cadence_compiled", False):
            continue
        module.forward = torch.compile(module.forward, **options)  # type: ignore[method-assign]
        module._cadence_compiled = True  # type: ignore[assignment]
        compiled += 1
    return compiled


def apply_precision(
    model: torch.nn.Module,
    units: Sequence[torch.nn.Module],
    overrides: Mapping[str, str],
    float8: Float8Config,
    *,
    where: str,
    autocast_device: str | None,
    fsdp: bool = False,
    strict: bool = True,
) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """float8 conversion, then per-module precision; returns `(units, fp32 modules)` as they are afterwards.

    Modules with a precision override (and what is inside them) stay out of
    float8. With `autocast_device` (the backend autocasts on that device type)
    the overridden modules run with autocast off; without it (FSDP2's policy
    does the work at the wrap, or the run is fp32) they are only returned.
    Units are looked up again by name: float8 replaces `nn.Linear` modules.
    `strict=False` (a pipeline stage) lets keys match modules of other stages.
    """
    from cadence.backends import float8 as float8_module
    from cadence.backends.precision import exclude_from_autocast, find_overridden

    names = {id(m): n for n, m in model.named_modules()}
    unit_names = [names[id(u)] for u in units]
    try:
        fp32 = find_overridden(model, overrides, f"{where}.precision_overrides" if where else "precision_overrides")
    except ValueError:
        if strict:
            raise
        fp32 = []
    float8_module.convert(model, float8, [n for n, _ in fp32], fsdp=fsdp)
    modules = [m for _, m in fp32]
    if autocast_device is not None:
        exclude_from_autocast(modules, autocast_device)
    return [model.get_submodule(n) for n in unit_names], modules


def unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(plain module, what forward calls) for a model that may be `torch.compile(module)`.

    The plain module's state has no `_orig_mod.` prefix: checkpoints then load
    into an uncompiled model and back.
    """
    plain = model
    # Tested by name: importing torch._dynamo to test the type costs ~1.5 s.
    while type(plain).__name__ == "OptimizedModule" and isinstance(getattr(plain, "_orig_mod", None), torch.nn.Module):
        plain = plain._orig_mod  # type: ignore[assignment]
    return plain, model


@attrs.define(kw_only=True)
class ModelTransforms:
    """The transforms the local and ddp backends apply (the mesh backend adds parallelize and sharding).

    Attributes:
        compile: `torch.compile` options (`CompileConfig`, or a mapping of its fields).
        activation_checkpointing: `ActivationCheckpointConfig` (or a mapping).
        units: class names of the model's blocks, when it has no `fsdp_units()`.
        precision_overrides: `{module class, name or pattern: "fp32"}`: modules
            that compute in fp32 under bf16/fp16 autocast (`cadence.backends.precision`).
        float8: float8 training through torchao (`Float8Config`, or a mapping).
    """

    compile: CompileConfig = attrs.field(factory=CompileConfig)
    activation_checkpointing: ActivationCheckpointConfig = attrs.field(factory=ActivationCheckpointConfig)
    units: list[str] | None = None
    precision_overrides: dict[str, str] = attrs.field(factory=dict)
    float8: Float8Config = attrs.field(factory=Float8Config)

    def __attrs_post_init__(self) -> None:
        if self.float8.fsdp_all_gather:
            raise ValueError(
                "float8.fsdp_all_gather all-gathers FSDP2's sharded weights in float8: it needs the mesh backend "
                "with sharded parameters; set fsdp_all_gather=False here"
            )

    @classmethod
    def build(cls, compile: Any, activation_checkpointing: Any, units: Any, where: str, **more: Any) -> ModelTransforms:
        """From a backend's keywords (None: the default); `more`: `precision_overrides`, `float8`."""
        from cadence.run.config import structure

        data: dict[str, Any] = {}
        given = {"compile": compile, "activation_checkpointing": activation_checkpointing, **more}
        for name, value in given.items():
            if value is None:
                continue
            if isinstance(value, bool) and name == "compile":
                value = {"enabled": value}
            data[name] = attrs.asdict(value) if attrs.has(type(value)) else value
        if units is not None:
            data["units"] = list(units)
        return structure(cls, data, path=where)

    @property
    def active(self) -> bool:
        return (
            self.compile.enabled
            or self.activation_checkpointing.mode != "none"
            or bool(self.precision_overrides)
            or self.float8.enabled
        )

    def check(self, device: torch.device, where: str) -> None:
        """What cannot run on `device` (float8 without a capable GPU), refused before any process group."""
        from cadence.backends.float8 import require_device

        require_device(self.float8, device, where)

    def apply(
        self,
        model: torch.nn.Module,
        units_fn: UnitsFn | None = None,
        *,
        autocast_device: str | None = None,
        where: str = "",
    ) -> list[torch.nn.Module]:
        """float8, per-module precision (with `autocast_device`: the run autocasts), checkpoint, compile; returns the units."""
        units = find_units(model, self.units, units_fn)
        units, _ = apply_precision(
            model, units, self.precision_overrides, self.float8, where=where, autocast_device=autocast_device
        )
        apply_activation_checkpointing(units, self.activation_checkpointing)
        apply_compile(model, units, self.compile)
        return units
