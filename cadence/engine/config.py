"""The engine's own configuration (`EngineConfig`), built from a config, a mapping and keyword overrides.

Each callback and backend has its own config; the run's whole configuration
(`cadence.run.config`) holds this one under `engine`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from cadence.engine import checks
from cadence.engine.backend import Backend
from cadence.engine.data import DataConfig
from cadence.run import config as config_module
from cadence.run import registry, rundir

if TYPE_CHECKING:
    from cadence.engine.state import State

_optional_ge0 = attrs.validators.optional(attrs.validators.ge(0))


def _known_backend(instance: Any, attribute: Any, value: str) -> None:
    """attrs validator of `EngineConfig.backend`: a misspelled name is a config error, before anything starts."""
    if value != "auto" and not registry.backends.is_known(value):
        raise ValueError(registry.backends.unknown(value))


@attrs.define(kw_only=True)
class EvalSetConfig:
    """One evaluation set's schedule and loader settings (`EngineConfig.eval_sets[split]`).

    Attributes:
        every_epochs: evaluate this set after every N epochs; None: as `eval_every_epochs`; 0: never.
        every_steps: evaluate this set after every N steps; None: as `eval_every_steps`; 0: never.
        data: loader settings when this set is a Dataset; None: the engine's `eval` settings.
    """

    every_epochs: int | None = attrs.field(default=None, validator=_optional_ge0)
    every_steps: int | None = attrs.field(default=None, validator=_optional_ge0)
    data: DataConfig | None = None


@attrs.define(kw_only=True)
class EngineConfig:
    """What the loop does; each callback and backend has its own config.

    Attributes:
        steps: total optimizer steps that `fit()` trains to (step mode).
        epochs: total epochs that `fit()` trains to (epoch mode). With both
            `steps` and `epochs`, `fit()` stops at whichever bound it reaches first.
        grad_accum: micro-batches per optimizer step (gradient accumulation).
        eval_every_epochs: evaluate after every N epochs (None: never at epoch end).
        eval_every_steps: evaluate after every N steps (None: never mid-epoch).
        log_interval: reduce logged metrics and fire on_log every N steps, and
            at the end of a fit that stopped between two multiples of N.
        precision: fp32, bf16 (autocast) or fp16 (autocast with a GradScaler, CUDA only).
        device: cpu, cuda (this process's local-rank GPU), cuda:1, mps; None picks the backend's
            default (see docs/gpus.md).
        prefetch_to_device: copy each training micro-batch to the device one ahead of its use, on a
            side stream on CUDA, so the copy overlaps compute (`cadence.engine.placement`); None: on
            when batches go to a CUDA device.
        backend: backend name (auto, local, ddp, ...); auto picks ddp when WORLD_SIZE > 1.
        seed: seeds python, numpy and torch (plus the rank) and data shuffling; None draws one and records it.
        deterministic: deterministic torch kernels and cuBLAS workspace (slower on GPU; see docs/run-directory.md).
        workspace: root folder of run directories (`workspace/lineage[-code_id]/run_id/`).
        lineage: name grouping the runs of one experiment.
        run_id: the run's folder name; None derives a stable one from the config.
        train: loader settings for training data given as a Dataset.
        eval: loader settings for evaluation data given as a Dataset.
        predict: loader settings for prediction data given as a Dataset.
        eval_sets: per evaluation set (by split name, as in `eval_data={"val": ..., "test": ...}`),
            its own schedule and loader settings; a set not listed follows `eval_every_*` and `eval`.
    """

    steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))
    epochs: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))
    grad_accum: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    eval_every_epochs: int | None = attrs.field(
        default=1,
        validator=attrs.validators.optional(attrs.validators.ge(1)),  # type: ignore[arg-type]
    )
    eval_every_steps: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    log_interval: int = attrs.field(default=50, validator=attrs.validators.ge(1))
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: str | None = None
    prefetch_to_device: bool | None = None
    backend: str = attrs.field(default="auto", validator=_known_backend)
    seed: int | None = None
    deterministic: bool = False
    workspace: str = "runs"
    lineage: str = attrs.field(default="default", validator=rundir.folder_name)
    run_id: str | None = attrs.field(default=None, validator=attrs.validators.optional(rundir.folder_name))
    train: DataConfig = attrs.field(factory=DataConfig)
    eval: DataConfig = attrs.field(factory=DataConfig)
    predict: DataConfig = attrs.field(factory=DataConfig)
    eval_sets: dict[str, EvalSetConfig] = attrs.field(factory=dict)


def build_config(config: Any, overrides: dict[str, Any], backend: Any) -> EngineConfig:
    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, EngineConfig):
        data = config_module.unstructure(config)
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"config must be an EngineConfig or a mapping, got {type(config).__name__}")
    checks.check_keywords(overrides, [a.name for a in attrs.fields(EngineConfig)])
    data = config_module.merge(data, {k: _plain(v) for k, v in overrides.items()})
    if isinstance(backend, str):
        data["backend"] = backend
    return config_module.structure(EngineConfig, data)


def _plain(value: Any) -> Any:
    return config_module.unstructure(value) if attrs.has(type(value)) else value


def make_backend(backend: Backend | str, config: EngineConfig) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a Backend or a name, got {type(backend).__name__}")
    name = backend
    if name == "auto":
        name = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "local"
    cls = registry.backends.resolve(name)
    return cls.from_engine_config(config) if hasattr(cls, "from_engine_config") else cls()


def check_budget(config: EngineConfig, steps: int | None, epochs: int | None) -> None:
    """`fit(steps=..., epochs=...)`'s arguments: ints >= 0, or None with a budget in the config."""
    for name, value in (("steps", steps), ("epochs", epochs)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"fit({name}=...) must be an int >= 0, got {value!r}")
    if steps is None and epochs is None and config.steps is None and config.epochs is None:
        raise ValueError("nothing to fit: pass fit(steps=...) or fit(epochs=...), or set config steps / epochs")


def fit_target(config: EngineConfig, state: State, steps: int | None, epochs: int | None) -> tuple[float, float]:
    """The absolute (step, epoch) a fit trains to (inf: unbounded): `steps` / `epochs` more than `state`,
    or else the config's `steps` / `epochs`."""
    if steps is not None or epochs is not None:
        return (
            state.step + steps if steps is not None else math.inf,
            state.epoch + epochs if epochs is not None else math.inf,
        )
    return (
        config.steps if config.steps is not None else math.inf,
        config.epochs if config.epochs is not None else math.inf,
    )
