"""Step learning-rate schedulers on steps, epochs or evaluations."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.scheduler")


@attrs.define(kw_only=True)
class LRSchedulerConfig:
    """How `LRScheduler` steps its schedulers.

    Attributes:
        interval: "step" (after every optimizer step), "epoch" (at each epoch
            end, after its evaluation) or "eval" (after each evaluation run by fit).
        every: step once every N intervals.
        monitor: metric passed to `scheduler.step(value)` (ReduceLROnPlateau),
            dotted like `val.loss`; read from `engine.eval_results`, then `engine.logged`.
        strict: a missing monitored metric is an error (else a warning and no step).
        step_on_skip: with interval "step", also step when the optimizer step
            was skipped (by NonFiniteSkip or another skip request).
    """

    interval: Literal["step", "epoch", "eval"] = "step"
    every: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    monitor: str | None = None
    strict: bool = True
    step_on_skip: bool = False


class LRScheduler(Callback):
    """Steps torch LR schedulers: per optimizer step, per epoch or per evaluation.

    Without a scheduler it steps `engine.schedulers` (what `Engine(scheduler=...)`
    received; the engine registers an `LRScheduler()` for them by itself), whose
    states the checkpoint saves with the optimizers. Schedulers given here are
    saved in this callback's own state.

    A skipped optimizer step does not advance the schedule (`step_on_skip=False`):
    the LR follows the steps actually taken, as in a hand-written loop that
    `continue`s past a bad batch. Evaluations outside `fit` (a direct
    `engine.evaluate()`) never step the schedule.

    Order: `Order.SCHEDULER` (60), after clipping and checks, before EMA and loggers.

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import LRScheduler
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 2
        >>> engine = cadence.Engine(model, opt, data, eval_data=data, loss_fn=torch.nn.functional.mse_loss,
        ...     callbacks=[LRScheduler(plateau, interval="eval", monitor="val.loss")], seed=0)
        >>> engine.fit(epochs=2)
    """

    order = Order.SCHEDULER
    raises_requests = False

    def __init__(
        self,
        scheduler: Any = None,
        *,
        config: LRSchedulerConfig | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config_module.configure(LRSchedulerConfig, config, kwargs, "lr_scheduler")
        self._own: list[Any] = _as_list(scheduler)
        #: True when this callback steps `engine.schedulers` (the engine then adds none).
        self.steps_engine_schedulers = not self._own
        self._schedulers: list[Any] = list(self._own)
        self._evals = 0
        self._in_fit = False

    @property
    def schedulers(self) -> list[Any]:
        """The schedulers this callback steps (resolved at fit start when implicit)."""
        return self._schedulers

    def on_fit_start(self, engine: Engine) -> None:
        self._schedulers = self._own or list(engine.schedulers)
        for scheduler in self._schedulers:
            wants_metric = _takes_metric(scheduler)
            if wants_metric and self.config.monitor is None:
                raise ValueError(
                    f"LRScheduler: {type(scheduler).__name__} steps on a metric but no monitor was given; "
                    "register LRScheduler(monitor='val.loss', interval='eval') in callbacks=[...] "
                    "(it then steps the engine's schedulers) or pass the scheduler to it"
                )
        self._in_fit = True

    def on_step_end(self, engine: Engine) -> None:
        if self.config.interval != "step":
            return
        if engine.agreed("skip") and not self.config.step_on_skip:
            return
        if engine.state.step % self.config.every == 0:
            self._step(engine)

    def on_epoch_end(self, engine: Engine) -> None:
        if self.config.interval == "epoch" and engine.state.epoch % self.config.every == 0:
            self._step(engine)

    def on_eval_end(self, engine: Engine) -> None:
        if self.config.interval != "eval" or not self._in_fit:
            return
        monitor = self.config.monitor
        if monitor is not None:
            # engine.logged holds this evaluation's results: skip other splits (a test set).
            split = monitor.partition(".")[0] + "."
            if not any(name.startswith(split) for name in engine.logged):
                return
        self._evals += 1
        if self._evals % self.config.every == 0:
            self._step(engine)

    def on_fit_end(self, engine: Engine) -> None:
        self._in_fit = False

    def on_teardown(self, engine: Engine) -> None:
        self._in_fit = False

    def _step(self, engine: Engine) -> None:
        if self.config.monitor is None:
            for scheduler in self._schedulers:
                scheduler.step()
            return
        value = monitored_value(engine, self.config.monitor)
        if value is None:
            message = (
                f"LRScheduler: monitored metric {self.config.monitor!r} is not available at step "
                f"{engine.state.step} (interval {self.config.interval!r}); available: {sorted(_available(engine))}. "
                "Log it, evaluate before the scheduler steps, or fix monitor="
            )
            if self.config.strict:
                raise KeyError(message)
            logger.warning("%s; not stepping", message)
            return
        for scheduler in self._schedulers:
            if _takes_metric(scheduler):
                scheduler.step(value)
            else:
                scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        # Implicit schedulers live in engine.schedulers, which the checkpoint saves itself.
        return {"evals": self._evals, "schedulers": [s.state_dict() for s in self._own]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("schedulers", [])
        if len(saved) != len(self._own):
            raise ValueError(
                f"LRScheduler: the checkpoint holds {len(saved)} scheduler state(s), this callback "
                f"was given {len(self._own)} scheduler(s); pass the same schedulers as the saved run"
            )
        for scheduler, scheduler_state in zip(self._own, saved):
            scheduler.load_state_dict(scheduler_state)
        self._evals = int(state.get("evals", 0))


def monitored_value(engine: Engine, name: str) -> float | None:
    """A metric by dotted name: `engine.eval_results[split][name]`, else `engine.logged[name]`."""
    value = engine.eval_results.get(name.partition(".")[0], {}).get(name)
    if value is None:
        value = engine.logged.get(name)
    return None if value is None else float(value)


def _available(engine: Engine) -> set[str]:
    names = set(engine.logged)
    for results in engine.eval_results.values():
        names.update(results)
    return names


def _takes_metric(scheduler: Any) -> bool:
    """Whether `scheduler.step` needs a metric (ReduceLROnPlateau and alike)."""
    import torch

    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        parameters = inspect.signature(scheduler.step).parameters
    except (TypeError, ValueError):
        return False
    first = next(iter(parameters.values()), None)
    return first is not None and first.name in ("metrics", "metric") and first.default is inspect.Parameter.empty


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, Sequence):
        return list(value)
    return [value]
