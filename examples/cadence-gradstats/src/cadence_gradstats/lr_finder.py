"""A learning-rate range test: sweep the LR upward and watch the loss."""

from __future__ import annotations

import math
from typing import Any

import attrs

import cadence


@attrs.define(kw_only=True)
class LRFinderConfig:
    """How `LRFinder` sweeps.

    Attributes:
        min_lr: learning rate of the first step.
        max_lr: learning rate of the last step (the sweep is exponential).
        num_steps: steps of the sweep.
        smoothing: weight of the newest loss in the exponential moving average.
        diverge: end the sweep when the smoothed loss exceeds `diverge` x its best.
    """

    min_lr: float = attrs.field(default=1e-6, validator=attrs.validators.gt(0))
    max_lr: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    num_steps: int = attrs.field(default=100, validator=attrs.validators.ge(2))
    smoothing: float = attrs.field(default=0.05, validator=[attrs.validators.gt(0), attrs.validators.le(1)])
    diverge: float = attrs.field(default=4.0, validator=attrs.validators.gt(1))

    def __attrs_post_init__(self) -> None:
        if self.min_lr >= self.max_lr:
            raise ValueError(f"LRFinderConfig: min_lr ({self.min_lr}) must be below max_lr ({self.max_lr})")


class LRFinder(cadence.Callback):
    """Sweeps the learning rate from `min_lr` to `max_lr` and suggests one.

    Each step sets every param group's LR to the next point of the sweep and
    records the loss, averaged over ranks (one small all-reduce per step: the
    sweep is a short diagnostic run, and every rank must record the same curve
    to take the same decision). When the sweep ends or the loss diverges it
    requests a stop, agreed across ranks like any control request.
    `suggestion()` is the LR where the smoothed loss fell fastest.

    Run it on a throwaway copy of your model: the sweep leaves the weights
    trained at large learning rates. Its position and curve are checkpointed,
    so an interrupted sweep resumes where it stopped. Do not combine it with
    `LRScheduler`, which would fight over the LR.

    Order: `Order.DEFAULT` (50).

    Example:
        >>> import torch, cadence
        >>> from cadence_gradstats import LRFinder
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(50)]
        >>> finder = LRFinder(min_lr=1e-4, max_lr=10.0, num_steps=30)
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, callbacks=[finder], seed=0)
        >>> engine.fit(epochs=1)
        >>> engine.state.step <= 30 and finder.done
        True
        >>> 1e-4 <= finder.suggestion() <= 10.0
        True
    """

    requests_in_step = True  # stops in on_before_optimizer_step, in the step that ends the sweep

    def __init__(self, config: LRFinderConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError(f"LRFinder: pass config= or keyword arguments, not both (got {sorted(kwargs)})")
        self.config = config if config is not None else LRFinderConfig(**kwargs)
        self.lrs: list[float] = []
        self.losses: list[float] = []  # smoothed, averaged over ranks
        self.best = math.inf
        self.done = False
        self._average: float | None = None

    def lr_at(self, index: int) -> float:
        """The learning rate of sweep step `index`."""
        cfg = self.config
        return cfg.min_lr * (cfg.max_lr / cfg.min_lr) ** (min(index, cfg.num_steps - 1) / (cfg.num_steps - 1))

    def on_step_start(self, engine: cadence.Engine) -> None:
        if self.done:  # a later fit: the sweep is over, stop at once
            engine.request_stop("LRFinder: the sweep is over")
            return
        lr = self.lr_at(len(self.lrs))
        for optimizer in engine.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def on_before_optimizer_step(self, engine: cadence.Engine) -> None:
        if self.done or engine.loss is None:
            return
        # A host sync per step: acceptable in a diagnostic sweep, never in a training callback.
        loss = float(engine.backend.reduce(engine.loss.detach().float(), "mean"))
        beta = self.config.smoothing
        self._average = loss if self._average is None else (1 - beta) * self._average + beta * loss
        self.lrs.append(self.lr_at(len(self.lrs)))
        self.losses.append(self._average)
        self.best = min(self.best, self._average)
        diverged = not math.isfinite(self._average) or self._average > self.config.diverge * self.best
        if diverged or len(self.lrs) >= self.config.num_steps:
            self.done = True
            engine.request_stop("LRFinder: " + ("the loss diverged" if diverged else "the sweep is complete"))

    def suggestion(self) -> float | None:
        """The LR where the smoothed loss decreased fastest (per log-LR), or None with < 3 points."""
        if len(self.losses) < 3:
            return None
        end = len(self.losses) - (1 if self.losses[-1] > self.best else 0)
        slopes = [
            (self.losses[i + 1] - self.losses[i]) / (math.log(self.lrs[i + 1]) - math.log(self.lrs[i]))
            for i in range(max(1, end - 1))
        ]
        return self.lrs[min(range(len(slopes)), key=slopes.__getitem__)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "lrs": list(self.lrs),
            "losses": list(self.losses),
            "best": self.best,
            "done": self.done,
            "average": self._average,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lrs, self.losses = list(state["lrs"]), list(state["losses"])
        self.best, self.done, self._average = state["best"], state["done"], state["average"]
