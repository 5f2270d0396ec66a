"""Take Python's garbage collection off the hot path: collect on a schedule."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from cadence.engine.callback import Callback
from cadence.engine.order import Order
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.gc")


@attrs.define(kw_only=True)
class GarbageCollectionConfig:
    """When `GarbageCollection` collects.

    Attributes:
        interval: collect after every N optimizer steps.
        generation: the generation passed to `gc.collect` (0, 1 or 2; 2 is a full collection).
        collect_at_start: run one full collection at fit start, before automatic collection is disabled.
    """

    interval: int = attrs.field(default=100, validator=attrs.validators.ge(1))
    generation: int = attrs.field(default=1, validator=[attrs.validators.ge(0), attrs.validators.le(2)])
    collect_at_start: bool = True


class GarbageCollection(Callback):
    """Disables automatic garbage collection during fit and collects every `interval` steps.

    Automatic collections start at unpredictable moments, on each rank at a
    different one, and a long one stalls that rank while the others wait in
    the next collective. Here every rank collects after the same step
    (`engine.state.step % interval == 0`, the same on every rank), so the
    pauses line up. The previous gc state (enabled or not) is restored at
    teardown, also after an error.

    Order: `Order.GC` (75), in on_step_end after the state-changing callbacks.

    Example:
        >>> import gc, torch, cadence
        >>> from cadence.callbacks import GarbageCollection
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 4
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.mse_loss, callbacks=[GarbageCollection(interval=2)], seed=0)
        >>> engine.fit(steps=4)
        >>> gc.isenabled()
        True
    """

    order = Order.GC
    raises_requests = False

    def __init__(self, config: GarbageCollectionConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(GarbageCollectionConfig, config, kwargs, "garbage_collection")
        self._was_enabled: bool | None = None
        #: Seconds spent in the scheduled collections of the last fit.
        self.seconds = 0.0
        self.collections = 0

    def on_fit_start(self, engine: Engine) -> None:
        if self._was_enabled is None:  # not already disabled by an unfinished fit
            self._was_enabled = gc.isenabled()
        if self.config.collect_at_start:
            gc.collect()
        gc.disable()
        self.seconds, self.collections = 0.0, 0

    def on_step_end(self, engine: Engine) -> None:
        if engine.state.step % self.config.interval == 0:
            start = time.perf_counter()
            gc.collect(self.config.generation)
            self.seconds += time.perf_counter() - start
            self.collections += 1

    def on_fit_end(self, engine: Engine) -> None:
        if engine.backend.is_main and self.collections:
            logger.debug("%d scheduled gc collections took %.3f s", self.collections, self.seconds)

    def on_teardown(self, engine: Engine) -> None:
        if self._was_enabled is None:
            return
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
