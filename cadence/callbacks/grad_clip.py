"""Clip the gradient norm before the optimizer step."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cadence.engine.callback import Callback
from cadence.engine.metrics import Collector
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


def _positive(instance: Any, attribute: Any, value: float) -> None:
    if not value > 0:
        raise ValueError(f"grad_clip.{attribute.name} must be > 0, got {value!r}")


@attrs.define(kw_only=True)
class GradClipConfig:
    """How `GradClip` clips.

    Attributes:
        max_norm: the largest total gradient norm allowed.
        norm_type: the p of the p-norm (2.0; `inf` for the largest absolute value).
        log: log the pre-clip norm as `grad_norm` at log intervals (and a fit's end).
    """

    max_norm: float = attrs.field(validator=_positive)
    norm_type: float = attrs.field(default=2.0, validator=_positive)
    log: bool = True


class GradClip(Callback):
    """Clips all gradients together to `max_norm` through the backend.

    The backend's `clip_grad_norm_` computes the total norm over every rank's
    shard (sharded backends override it), so clipping is correct however the
    model is distributed; it returns the pre-clip norm as a plain 0-d tensor.
    The norm stays on the device as `engine.grad_norm` (no sync); at each
    reduction of the training metrics (every log interval, and the end of a
    fit) the last step's norm is logged as `grad_norm` (reduced with `max`
    over the ranks).

    Under DeepSpeed clipping happens inside DeepSpeed's optimizer step, after
    its gradient reduction: `clip_grad_norm_` sets DeepSpeed's clipping to
    `max_norm` and returns a "deferred" norm, a 0-d tensor that the optimizer
    step fills with DeepSpeed's global pre-clip 2-norm. In
    `on_before_optimizer_step` it still holds the previous step's value (NaN
    before the first step and for a skipped step); from `on_optimizer_step`
    on it is this step's. Only `norm_type=2` is supported there.

    Order: `Order.GRAD_CLIP` (20), after `NonFiniteSkip` (which must see the
    raw gradients: clipping a NaN norm spreads NaN into every gradient).

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import GradClip
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[GradClip(max_norm=1.0)], seed=0)
        >>> engine.fit(steps=3)
        >>> float(engine.grad_norm) >= 0
        True
    """

    order = Order.GRAD_CLIP
    requests_in_step = False  # clips; requests nothing
    raises_requests = False

    def __init__(self, config: GradClipConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        norm_type = kwargs.get("norm_type")
        if isinstance(norm_type, str):
            try:
                kwargs["norm_type"] = float(norm_type)  # "inf"
            except ValueError:
                raise config_module.ConfigError(
                    f"config error at 'grad_clip.norm_type': expected a number > 0 or 'inf' (the p of the total "
                    f"p-norm over all gradients; 'fro' is 2.0), got {norm_type!r}",
                    path="grad_clip.norm_type",
                    expected="float > 0 or 'inf'",
                    received=norm_type,
                ) from None
        self.config = config_module.configure(GradClipConfig, config, kwargs, "grad_clip")
        self._norm: torch.Tensor | None = None
        self._collector: Collector | None = None

    @property
    def clipping(self) -> tuple[float, float]:
        """`(max_norm, norm_type)`: a backend that clips inside its own step (DeepSpeed) checks it at setup."""
        return (self.config.max_norm, self.config.norm_type)

    def on_fit_start(self, engine: Engine) -> None:
        if self.config.log and self._collector is None:
            self._collector = engine.metrics.add_collector(partial(self._log_norm, engine))

    def on_before_optimizer_step(self, engine: Engine) -> None:
        config = self.config
        norm = engine.backend.clip_grad_norm_(engine, config.max_norm, config.norm_type)
        engine.grad_norm = self._norm = norm  # the step context's declared field: TrainMetrics and users read it

    def _log_norm(self, engine: Engine) -> None:
        if self._norm is not None:  # the last step's norm, logged when the engine reduces
            engine.log("grad_norm", self._norm.detach(), reduce="max")

    def on_teardown(self, engine: Engine) -> None:
        self._norm = None
        if self._collector is not None:
            self._collector.remove()
            self._collector = None
