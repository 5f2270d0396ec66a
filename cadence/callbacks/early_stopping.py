"""Stop training when a monitored metric stops improving."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.early_stopping")


@attrs.define(kw_only=True)
class EarlyStoppingConfig:
    """When `EarlyStopping` stops.

    Attributes:
        monitor: the evaluation metric, dotted as `split.name` (`val.loss`,
            `val.accuracy`); evaluations of other splits are ignored.
        mode: "min" (lower is better) or "max".
        patience: evaluations without improvement before stopping.
        min_delta: an improvement must beat the best by more than this.
        check_finite: stop at once when the metric is NaN or infinite.
        strict: a missing metric is an error (else a warning and the evaluation is ignored).
    """

    monitor: str = "val.loss"
    mode: Literal["min", "max"] = "min"
    patience: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    min_delta: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    check_finite: bool = True
    strict: bool = True


class EarlyStopping(Callback):
    """Requests an agreed stop after `patience` evaluations without improvement.

    Checked at the end of each evaluation run by `fit` (a direct
    `engine.evaluate()` outside fit is not counted). The stop is a request:
    every rank stops after the same step, at the epoch end that follows the
    evaluation (or the next step, for mid-epoch evaluations). The best value,
    the wait counter and the evaluations seen are saved in checkpoints, so a
    resumed run stops at the same epoch as an uninterrupted one.

    Order: `Order.EARLY_STOPPING` (70).

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import EarlyStopping
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 2
        >>> stopper = EarlyStopping(monitor="val.loss", patience=2)
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), data, eval_data=data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[stopper], seed=0)
        >>> engine.fit(epochs=10)   # lr 0: no improvement after the first evaluation
        >>> engine.state.epoch
        3
    """

    order = Order.EARLY_STOPPING
    raises_requests = True  # requests `stop`

    def __init__(self, config: EarlyStoppingConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(EarlyStoppingConfig, config, kwargs, "early_stopping")
        self.best: float | None = None
        self.wait = 0
        self.evaluations = 0
        self.stopped_at: int | None = None
        self._in_fit = False

    def on_fit_start(self, engine: Engine) -> None:
        self._in_fit = True

    def on_fit_end(self, engine: Engine) -> None:
        self._in_fit = False

    def on_teardown(self, engine: Engine) -> None:
        self._in_fit = False

    def improved(self, value: float) -> bool:
        """Whether `value` beats the best by more than `min_delta`."""
        if self.best is None:
            return not math.isnan(value)
        if self.config.mode == "min":
            return value < self.best - self.config.min_delta
        return value > self.best + self.config.min_delta

    def on_eval_end(self, engine: Engine) -> None:
        if not self._in_fit:
            return
        config = self.config
        # engine.logged holds the results of the evaluation that just ended;
        # an evaluation of another split (a test set) is not ours to count.
        value = engine.logged.get(config.monitor)
        split = config.monitor.partition(".")[0] + "."
        if value is None and not any(name.startswith(split) for name in engine.logged):
            return
        if value is None:
            message = (
                f"EarlyStopping: monitored metric {config.monitor!r} is not in this evaluation's results "
                f"at step {engine.state.step}; available: {sorted(engine.logged)}. Fix monitor= or log it"
            )
            if config.strict:
                raise KeyError(message)
            logger.warning("%s; evaluation ignored", message)
            return
        value = float(value)
        self.evaluations += 1
        if config.check_finite and not math.isfinite(value):
            self._stop(engine, f"{config.monitor} is {value} at step {engine.state.step}")
            return
        if self.improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= config.patience:
            self._stop(
                engine,
                f"{config.monitor} did not improve on {self.best:.6g} (mode {config.mode}, min_delta "
                f"{config.min_delta}) for {self.wait} evaluation(s)",
            )

    def _stop(self, engine: Engine, reason: str) -> None:
        self.stopped_at = engine.state.step
        if engine.backend.is_main:
            logger.info("early stopping at step %d, epoch %d: %s", engine.state.step, engine.state.epoch, reason)
        engine.request_stop(f"early stopping: {reason}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "evaluations": self.evaluations, "stopped_at": self.stopped_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.wait = int(state["wait"])
        self.evaluations = int(state["evaluations"])
        self.stopped_at = state.get("stopped_at")
