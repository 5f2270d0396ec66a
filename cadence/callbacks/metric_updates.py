"""Metric objects during training: updated every micro-batch, computed at every log interval."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from cadence.engine.callback import Callback
from cadence.engine.evaluation import MetricSet, scalar
from cadence.engine.metrics import Collector
from cadence.engine.order import Order

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


class MetricUpdates(Callback):
    """Updates metric objects on every training micro-batch; logs their values at every log interval.

    The engine registers one when given `train_metrics=`. At on_forward each
    metric's `update` receives `inputs(engine.outputs, engine.batch)` (default:
    the outputs and the targets of `(inputs, targets)` batches), without
    gradients. At every reduction of the training metrics (each
    `log_interval`, and the end of a fit that stopped between two), the
    metrics are synchronized over the data domain in one round, computed,
    logged by name (a scalar value; every value is kept in
    `engine.metric_values["train"]`) and reset: each logged value covers the
    samples of every rank since the previous one. Their states are not saved
    in checkpoints: a resumed run starts a fresh interval.

    Order: `Order.METRICS` (80), with `TrainMetrics`.

    Args:
        metrics: as `Engine(metrics=...)`: a `cadence.metrics.Metric`, a
            torchmetrics `Metric` or `MetricCollection`, or a mapping of names to them.
        inputs: `inputs(outputs, batch)` gives update's arguments (a tuple or
            a mapping of keywords); default `(outputs, targets)`.

    Example:
        >>> import torch, cadence
        >>> from cadence.metrics import Accuracy
        >>> model = torch.nn.Linear(4, 3)
        >>> data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(4)]
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...     loss_fn=torch.nn.functional.cross_entropy, train_metrics={"accuracy": Accuracy()},
        ...     log_interval=2, seed=0)
        >>> engine.fit(steps=2)
        >>> 0.0 <= engine.logged["accuracy"] <= 1.0
        True
    """

    order = Order.METRICS
    requests_in_step = False
    raises_requests = False

    def __init__(self, metrics: Any, inputs: Callable[[Any, Any], Any] | None = None) -> None:
        self.metric_set = MetricSet(metrics, inputs, argument="train_metrics")
        self._collector: Collector | None = None
        self._updated = False

    def on_fit_start(self, engine: Engine) -> None:
        if self.metric_set.backend is not engine.backend:
            self.metric_set.bind(engine.backend)
        self.metric_set.reset()  # a fit starts a fresh interval
        self._updated = False
        if self._collector is None:
            self._collector = engine.metrics.add_collector(partial(self._collect, engine))

    def on_forward(self, engine: Engine) -> None:
        self.metric_set.update(engine.outputs, engine.batch, partial(_training, engine))
        self._updated = True

    def _collect(self, engine: Engine) -> None:
        if not self._updated:  # every rank runs the same micro-batches: all skip, or none
            return
        values = self.metric_set.compute(_training(engine))
        self.metric_set.reset()
        self._updated = False
        engine.metric_values["train"] = values
        for name, value in values.items():
            number = scalar(value)
            if number is not None:
                engine.log(name, number, reduce="last")  # the same on every rank already

    def on_teardown(self, engine: Engine) -> None:
        if self._collector is not None:
            self._collector.remove()
            self._collector = None


def _training(engine: Engine) -> str:
    return f"while training at step {engine.state.step}"
