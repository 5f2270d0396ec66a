"""One process on CPU, CUDA or MPS."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.backends.device import make_current, resolve_device
from cadence.backends.transforms import ModelTransforms, UnitsFn, unwrap_compiled
from cadence.engine.backend import NULL_CONTEXT, Backend

if TYPE_CHECKING:
    from cadence.engine.engine import Engine, EngineConfig


@attrs.define(kw_only=True)
class Precision:
    """Mixed precision for one device: an autocast context and, for fp16, a GradScaler."""

    precision: str
    device: torch.device
    scaler: Any = None

    @classmethod
    def create(cls, precision: str, device: torch.device) -> Precision:
        if precision == "fp16" and device.type != "cuda":
            raise ValueError(f"precision 'fp16' needs a CUDA device (got {device}); use precision='bf16'")
        scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        return cls(precision=precision, device=device, scaler=scaler)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return NULL_CONTEXT
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)


class LocalBackend(Backend):
    """One process: device placement, autocast, file checkpoints; collectives are identities.

    Args:
        device: `"cpu"`, `"cuda"` (this process's local-rank GPU), `"cuda:1"`, `"mps"`; None picks
            CUDA (the local-rank GPU), then MPS, then the CPU (`cadence.backends.device`).
        precision: `"fp32"`, `"bf16"` (autocast), or `"fp16"` (autocast + GradScaler, CUDA only).
        compile: `torch.compile` of the model's blocks or forward: True, a
            `cadence.backends.transforms.CompileConfig` or a mapping of its fields.
        activation_checkpointing: an `ActivationCheckpointConfig` or a mapping
            (`{"mode": "full", "every": 2}`).
        units: class names of the model's blocks (default: `model.fsdp_units()`).
        units_fn: a function `model -> [blocks]` instead.
        precision_overrides: `{module class, name or pattern: "fp32"}`: modules
            that run with autocast off, in fp32 (`cadence.backends.precision`).
        float8: float8 training through torchao (`cadence.backends.float8.Float8Config`
            or a mapping of its fields); needs a CUDA GPU of capability >= 8.9.

    Transforms run at `setup` in the order of `cadence.backends.transforms`
    (float8, precision overrides, checkpointing, then compile); checkpoints
    keep the plain module's keys.
    """

    name = "local"

    def __init__(
        self,
        device: str | None = None,
        precision: str = "fp32",
        *,
        compile: Any = None,
        activation_checkpointing: Any = None,
        units: list[str] | None = None,
        units_fn: UnitsFn | None = None,
        precision_overrides: dict[str, str] | None = None,
        float8: Any = None,
    ) -> None:
        self.requested_device = device
        self.precision_name = precision
        # Chosen now (fp16 is checked against it); made current at setup, so that building a
        # backend touches no CUDA context.
        self.device = resolve_device(device, rank=0, current=False)
        self.set_precision(precision, self.device)
        self.transforms = ModelTransforms.build(
            compile, activation_checkpointing, units, type(self).name,
            precision_overrides=precision_overrides, float8=float8,
        )  # fmt: skip
        self.units_fn = units_fn

    def setup(self, engine: Engine) -> None:
        self.transforms.check(self.device, type(self).name)  # float8's GPU, before CUDA is made current
        make_current(self.device)
        forward = self.prepare_model(engine)
        engine.model.to(self.device)
        engine.wrapped_model = forward

    def prepare_model(self, engine: Engine) -> torch.nn.Module:
        """Unwrap a `torch.compile`d model into `engine.model` and apply the transforms; returns what forward calls."""
        plain, forward = unwrap_compiled(engine.model)
        engine.model = plain
        if self.transforms.active:
            autocast = self.device.type if self.precision_name != "fp32" else None
            self.transforms.apply(plain, self.units_fn, autocast_device=autocast, where=type(self).name)
        return forward

    def set_precision(self, precision: str, device: torch.device) -> None:
        self.precision = Precision.create(precision, device)
        self.scaler = self.precision.scaler  # fp16 only; read on every step

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LocalBackend:
        return cls(device=config.device, precision=config.precision)

    @property
    def moves_batches(self) -> bool:
        # CPU batches already live where the model does: the engine skips the walk over them.
        return self.device.type != "cpu"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        if micro_batches > 1:
            loss = loss / micro_batches
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def finish_gradients(self, engine: Engine) -> None:
        if self.scaler is not None:
            for optimizer in engine.optimizers:
                self.scaler.unscale_(optimizer)

    def optimizer_step(self, engine: Engine) -> bool | None:
        scaler = self.scaler
        if scaler is None:
            for optimizer in engine.optimizers:
                optimizer.step()
            return None
        # The scaler skips a step whose gradients overflowed and then lowers its
        # scale: a lower scale after update() is how that skip is seen (the
        # scaler's step already read its overflow flag to the host, so reading
        # the scale adds no sync that matters). Reported as not applied.
        before = scaler.get_scale()
        for optimizer in engine.optimizers:
            scaler.step(optimizer)
        scaler.update()
        return False if scaler.get_scale() < before else None

    @property
    def checks_gradients_itself(self) -> bool:
        """True with fp16: the GradScaler skips steps whose gradients overflowed."""
        return self.scaler is not None

    def skip_step(self, engine: Engine) -> None:
        # finish_gradients unscaled this step's gradients; the scaler refuses the
        # next unscale_ until update() closes the step. Inf gradients (a
        # NonFiniteSkip) back the scale off, as a GradScaler's own skip does.
        if self.scaler is not None:
            self.scaler.update()

    def checkpoint_store(self, engine: Engine) -> Any:
        from cadence.checkpoint.file_store import FileStore

        return FileStore()
