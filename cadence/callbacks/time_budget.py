"""A wall-clock budget: when it is spent, every rank saves and stops at the same step, as a preemption does."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module
from cadence.run import registry

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.time_budget")

_REQUEST = "time_budget"
_CLOCK = re.compile(r"^(?:(\d+):)?(\d+):(\d{1,2}):(\d{1,2}(?:\.\d*)?)$")  # [D:]HH:MM:SS


def parse_duration(value: float | str, where: str = "time_budget.max_time") -> float:
    """Seconds from a number of seconds or a `"HH:MM:SS"` / `"D:HH:MM:SS"` string; > 0.

    Example:
        >>> parse_duration("01:30:00"), parse_duration("1:00:00:00"), parse_duration(90)
        (5400.0, 86400.0, 90.0)
    """
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        match = _CLOCK.match(value.strip())
        if match is not None and int(match.group(3)) < 60 and float(match.group(4)) < 60:
            days, hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
            seconds = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    if seconds is None:
        raise ValueError(f'{where}: expected seconds or "HH:MM:SS" (or "D:HH:MM:SS"), got {value!r}')
    if not seconds > 0:
        raise ValueError(f"{where} must be more than 0 seconds, got {value!r}")
    return seconds


def _duration(instance: Any, attribute: Any, value: float | str) -> None:
    parse_duration(value)


@attrs.define(kw_only=True)
class TimeBudgetConfig:
    """The wall-clock budget of a fit.

    Attributes:
        max_time: seconds, or `"HH:MM:SS"` / `"D:HH:MM:SS"`: how long a fit may
            run, counted from its start (for an engine's first fit, from its
            setup, so restoring a checkpoint counts). Leave a job's time limit
            room for the last step and the save.
        save: ask for a checkpoint at the step the run stops at (the
            `Checkpoint` callback writes `latest` then).
    """

    max_time: float | str = attrs.field(validator=_duration)
    save: bool = True

    @property
    def seconds(self) -> float:
        return parse_duration(self.max_time)


class TimeBudget(Callback):
    """Stops the fit, on every rank at the same step and with a checkpoint, once `max_time` has passed.

    At each step's start, before the step's requests go out, it compares the
    clock with the budget; once spent it raises the `time_budget`, `save` and
    `stop` requests. The step's agreement makes every rank see them at the same
    step (a rank whose clock runs ahead decides for all), the `Checkpoint`
    callback saves `latest` at that step's save point, and the loop stops after
    it. `fit` then returns normally; `callback.expired` is True and
    `callback.stopped_at` the step. A later run with `Checkpoint(auto_resume=True)`
    goes on from there. Each fit gets the budget anew.

    Checking costs one clock read per step. Order: `Order.CHECKPOINT + 5`
    (after the checkpoint of its step, before `Preemption`).

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks import TimeBudget
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
        >>> budget = TimeBudget(max_time="00:10:00")
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[budget], seed=0, device="cpu")
        >>> engine.fit(steps=3)
        >>> budget.expired, engine.state.step
        (False, 3)
    """

    order = Order.CHECKPOINT + 5
    raises_requests = True  # save and stop once the budget is spent
    requests_in_step = False  # in on_step_start, before the step's agreement goes out

    def __init__(self, config: TimeBudgetConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(TimeBudgetConfig, config, kwargs, "time_budget")
        self.seconds = self.config.seconds
        #: True once the budget stopped the last fit; `stopped_at` is that step.
        self.expired = False
        self.stopped_at: int | None = None
        self._setup_time: float | None = None
        self._deadline = float("inf")
        self._requested = False

    @property
    def remaining(self) -> float:
        """Seconds left of this fit's budget (inf outside a fit)."""
        return self._deadline - time.monotonic()

    def on_setup(self, engine: Engine) -> None:
        engine.requests.register(_REQUEST)
        self._setup_time = time.monotonic()  # the engine's first run: its setup (a restore) counts

    def on_fit_start(self, engine: Engine) -> None:
        engine.requests.register(_REQUEST)
        start = self._setup_time if self._setup_time is not None else time.monotonic()
        self._deadline, self._setup_time = start + self.seconds, None
        self.expired, self.stopped_at, self._requested = False, None, False
        if not any(_is_checkpoint(cb) for cb in engine.callbacks) and self.config.save:
            logger.warning("TimeBudget: no Checkpoint callback is registered; the run will stop without saving")

    def on_step_start(self, engine: Engine) -> None:
        if self._requested or time.monotonic() < self._deadline:
            return
        self._requested = True
        reason = f"time budget of {self.config.max_time} spent on rank {engine.backend.rank}"
        engine.request(_REQUEST, reason=reason)
        if self.config.save:
            engine.request_save(reason)
        engine.request_stop(reason)

    def on_save_point(self, engine: Engine) -> None:
        if self.expired or not engine.agreed(_REQUEST):
            return
        self.expired, self.stopped_at = True, engine.state.step
        if engine.backend.is_main:
            logger.warning(
                "time budget of %s spent: every rank stops after step %d%s",
                self.config.max_time,
                self.stopped_at,
                " (checkpoint saved at this step)" if self.config.save else "",
            )

    def on_teardown(self, engine: Engine) -> None:
        self._deadline, self._setup_time = float("inf"), None


def _is_checkpoint(callback: Any) -> bool:
    try:
        checkpoint = registry.callbacks.resolve("checkpoint")
    except ImportError:
        return False
    return isinstance(callback, checkpoint)
