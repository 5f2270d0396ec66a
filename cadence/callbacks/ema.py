"""An exponential moving average of the model's parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

import attrs
import torch

from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from cadence.engine.engine import Engine


def _decay(instance: Any, attribute: Any, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"ema.decay must be in [0, 1), got {value!r}")


@attrs.define(kw_only=True)
class EMAConfig:
    """How `EMA` averages.

    Attributes:
        decay: weight of the old average at each update (`shadow = decay * shadow + (1 - decay) * param`).
        every: update after every N-th optimizer step.
        start_step: the average starts as a copy of the parameters at the first
            step >= start_step, and is updated from the next one.
        eval_with_ema: evaluate with the averaged parameters (swapped in for
            `evaluate()` and back after).
        best_with_ema: the `best` checkpoint holds the averaged parameters (the
            Checkpoint callback swaps them in through `EMA.swapped`).
    """

    decay: float = attrs.field(default=0.999, validator=_decay)
    every: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    start_step: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    eval_with_ema: bool = True
    best_with_ema: bool = False


class EMA(Callback):
    """Keeps an exponential moving average ("shadow") of the trainable parameters.

    Updated after each taken optimizer step with one fused `_foreach_lerp_`
    (no host sync, no allocation). Saved in checkpoints with the shadow
    tensors, keyed by parameter name, and restored right after the model
    (`restore_with_model = True`), before the optimizer.

    Order: `Order.EMA` (65): after the scheduler, before metrics and checkpoints.

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import EMA
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
        >>> ema = EMA(decay=0.9)
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[ema], seed=0)
        >>> engine.fit(steps=3)
        >>> with ema.swapped(engine):   # the model holds the average here
        ...     averaged = model.weight.clone()
    """

    order = Order.EMA
    raises_requests = False
    #: The checkpoint restores this callback right after the model.
    restore_with_model: ClassVar[bool] = True

    def __init__(self, config: EMAConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(EMAConfig, config, kwargs, "ema")
        self.names: list[str] = []
        self.shadow: list[torch.Tensor] = []
        self.started = False
        self.updates = 0
        self._params: list[torch.Tensor] = []
        self._locals: list[torch.Tensor] = []  # this rank's part of each parameter (see Backend.local_parameters)
        self._shadow_locals: list[torch.Tensor] = []
        self._pending: dict[str, Any] | None = None
        self._backup: list[torch.Tensor] | None = None

    @property
    def best_with_ema(self) -> bool:
        """Whether the `best` checkpoint should hold the averaged parameters.

        With `swapped`, the `BestWeights` contract (`cadence.checkpoint.saver`) by
        which the `Checkpoint` callback finds the weights `best` holds.
        """
        return self.config.best_with_ema

    # -- building ---------------------------------------------------------

    def _ensure(self, engine: Engine) -> bool:
        """Bind to the model's parameters and build the shadow; False if there is none yet."""
        if not self._params:
            # This rank's part of each parameter (the parameter itself on one process and DDP,
            # a DTensor's local shard on a mesh): the fused ops below run on plain tensors.
            local = engine.backend.local_parameters(engine)
            self.names = [lp.name for lp in local]
            self._params = [lp.param for lp in local]
            self._locals = [lp.local for lp in local]
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None
        return bool(self.shadow)

    def _load(self, shadow: Mapping[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in shadow]
        unexpected = [n for n in shadow if n not in set(self.names)]
        if missing or unexpected:
            raise KeyError(
                f"EMA: the saved average does not match the model's trainable parameters "
                f"(missing: {missing[:5]}, unexpected: {unexpected[:5]}); load a checkpoint of the same model"
            )
        with torch.no_grad():
            self.shadow = [_like(shadow[n], p, local) for n, p, local in zip(self.names, self._params, self._locals)]
        self._shadow_locals = [_local_view(s) for s in self.shadow]

    def on_fit_start(self, engine: Engine) -> None:
        self._ensure(engine)
        if not self.shadow and self.config.start_step == 0:
            self._start()

    def _start(self) -> None:
        with torch.no_grad():
            # The shadow keeps the parameters' own type (DTensors on a mesh, so it reshards with
            # a checkpoint); a part the backend keeps outside the parameter (a DeepSpeed partition)
            # is averaged as that part.
            self.shadow = [
                (p if local is p or _is_distributed(p) else local).detach().clone()
                for p, local in zip(self._params, self._locals)
            ]
        self._shadow_locals = [_local_view(s) for s in self.shadow]
        self.started = True

    # -- updating ---------------------------------------------------------

    def on_optimizer_step(self, engine: Engine) -> None:
        step = engine.state.step + 1  # the step being taken (state.step counts completed ones)
        if step < self.config.start_step or step % self.config.every:
            return
        if not self.started:
            self._start()
            return
        with torch.no_grad():
            torch._foreach_lerp_(self._shadow_locals, self._locals, 1.0 - self.config.decay)
        self.updates += 1

    # -- swapping ---------------------------------------------------------

    def swap_in(self, engine: Engine) -> bool:
        """Put the average into the model (keeping its parameters aside); False if there is none."""
        if self._backup is not None or not self._ensure(engine):
            return False
        with torch.no_grad():
            self._backup = [local.detach().clone() for local in self._locals]
            torch._foreach_copy_(self._locals, self._shadow_locals)
        return True

    def swap_out(self, engine: Engine | None = None) -> None:
        """Put the model's own parameters back (no-op when the average is not in)."""
        if self._backup is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._locals, self._backup)
        self._backup = None

    @contextlib.contextmanager
    def swapped(self, engine: Engine) -> Iterator[bool]:
        """Context in which the model holds the average (yields whether it does)."""
        swapped = self.swap_in(engine)
        try:
            yield swapped
        finally:
            if swapped:
                self.swap_out(engine)

    def on_eval_start(self, engine: Engine) -> None:
        if self.config.eval_with_ema:
            self.swap_in(engine)

    def on_eval_end(self, engine: Engine) -> None:
        self.swap_out(engine)

    def on_exception(self, engine: Engine) -> None:
        self.swap_out(engine)

    def on_teardown(self, engine: Engine) -> None:
        self.swap_out(engine)

    # -- state ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        shadow = self._pending if self._pending is not None else dict(zip(self.names, self.shadow))
        return {
            "shadow": shadow,
            "started": self.started,
            "updates": self.updates,
            "decay": self.config.decay,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.started = bool(state["started"])
        self.updates = int(state["updates"])
        shadow = state["shadow"]
        if not shadow:
            self.shadow = []
        elif self._params:
            self._load(shadow)
        else:  # not bound to the model yet: build when it is
            self._pending = dict(shadow)


def _is_distributed(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")  # a DTensor


def _local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's part of `tensor` (a DTensor's shard; else itself)."""
    return tensor.to_local() if _is_distributed(tensor) else tensor


def _like(saved: torch.Tensor, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A saved average placed like the parameter it averages (a full tensor is sharded like a DTensor one)."""
    if _is_distributed(param):
        if _is_distributed(saved):
            return saved.detach().to(dtype=param.dtype).clone()
        from torch.distributed.tensor import distribute_tensor

        full = saved.detach().to(device=local.device, dtype=param.dtype)
        return distribute_tensor(full, param.device_mesh, param.placements)  # type: ignore[attr-defined]
    target = param if local is param else local
    return saved.detach().to(device=target.device, dtype=target.dtype).clone()
