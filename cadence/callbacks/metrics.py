"""Built-in training metrics (loss, learning rate, timing, throughput, MFU) and the default sinks.

The step pays for the loss and one clock read: the detached loss is kept (no
copy, no host sync; on the CPU its ready value is summed), the time is a Python
float, and everything else is computed by a collector right before the
engine reduces the metrics (every `log_interval`, and at the end of a fit).
See docs/observability.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from cadence.engine import config as config_module
from cadence.engine.bus import Handle
from cadence.engine.callback import Callback
from cadence.engine.events import Event
from cadence.engine.metrics import Collector
from cadence.engine.order import Order

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

C = TypeVar("C")


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"TrainMetrics: {attribute.name} must be > 0, got {value!r}")


@attrs.define(kw_only=True)
class TrainMetricsConfig:
    """Which built-in metrics `TrainMetrics` logs.

    Attributes:
        loss: log `loss` (mean over the micro-batches of the interval and the ranks).
        learning_rate: log `lr` (`lr.<group>` / `lr.opt<i>.<group>` for several groups / optimizers).
        grad_norm: log `grad_norm` from `engine.grad_norm` (set by `GradClip`) if nobody logged it.
        timing: log `time.step`: wall seconds per step, from the previous step's end to
            this one's (fetching its micro-batches included; evaluation and checkpoint
            saves between steps excluded), the interval's mean.
        data_wait: also log `time.data_wait`, the part of `time.step` spent before
            `on_step_start` (fetching the micro-batches). It costs a second hook and
            clock read per step (about 1% of a tiny CPU step), so it is off by default.
        throughput: log `throughput.samples_per_sec` and, once `state.tokens_seen`
            advances, `throughput.tokens_per_sec` (summed over the data ranks).
        flops_per_sample: training FLOPs per sample (forward + backward, about 6 x parameters x tokens
            for a transformer); enables `throughput.tflops` per device.
        flops_per_token: the same per token (give one of the two).
        peak_flops: peak FLOP/s of one device (e.g. 989e12 for an H100 in bf16); enables `mfu`.
    """

    loss: bool = True
    learning_rate: bool = True
    grad_norm: bool = True
    timing: bool = True
    data_wait: bool = False
    throughput: bool = True
    flops_per_sample: float | None = attrs.field(default=None, validator=_positive)
    flops_per_token: float | None = attrs.field(default=None, validator=_positive)
    peak_flops: float | None = attrs.field(default=None, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.flops_per_sample is not None and self.flops_per_token is not None:
            raise ValueError("TrainMetrics: give flops_per_sample or flops_per_token, not both")
        if self.peak_flops is not None and self.flops_per_sample is None and self.flops_per_token is None:
            raise ValueError(
                f"TrainMetrics: peak_flops={self.peak_flops!r} needs flops_per_sample or flops_per_token to compute MFU"
            )


class TrainMetrics(Callback):
    """Logs the built-in training metrics through `engine.log`.

    Per step: one `perf_counter` read and the loss, taken at on_step_end, or
    at each micro-batch's on_forward under gradient accumulation (and, with
    `data_wait=True`, a second read at on_step_start). On an
    accelerator the loss is kept as a reference to the detached tensor (no
    copy, no host sync) and the interval's losses are averaged on the device
    once; on the CPU, where the value is ready when the loss is returned, it
    is read and summed as a float. Either way the interval's mean is logged
    once, weighted by the number of losses. At each reduction (every log
    interval, and the end of a fit that stopped between two), from a
    collector (`MetricStore.add_collector`): learning rates, gradient norm,
    mean step time (and data-wait time), samples/s, tokens/s, TFLOP/s and MFU,
    over the steps since the previous one.
    A step's time runs from the end of the previous step to the end of this
    one: its micro-batches are fetched in between, evaluation and checkpoint
    saves in that gap are not counted. Data wait is its part before
    on_step_start. Throughput divides the interval's samples by its steps'
    time.

    Where `engine.loss` is None (pipeline stages before the last), nothing is
    kept and `loss` is declared, so the reduction (which takes the last
    stage's values on every stage) finds the same names everywhere.

    Order: `Order.METRICS` (80), after the callbacks that change the step and
    before the sinks (`Order.LOGGER`), which read `engine.logged` in `on_log`.

    Example:
        >>> import torch, cadence
        >>> from cadence.callbacks.metrics import TrainMetrics
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))] * 4
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, log_interval=2,
        ...                         callbacks=[TrainMetrics()], seed=0)
        >>> engine.fit(steps=2)
        >>> sorted(engine.logged)[:3]
        ['loss', 'lr', 'throughput.samples_per_sec']
    """

    order = Order.METRICS
    requests_in_step = False  # reads the loss in on_forward under accumulation
    raises_requests = False

    def __init__(self, config: TrainMetricsConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = config_module.configure(TrainMetricsConfig, config, kwargs, "TrainMetrics")
        self._log_loss = self.config.loss
        self._collector: Collector | None = None
        # The interval's time is from its start to the last step's end, less the gaps between
        # steps that are not step time (evaluation, saves): one clock read per step.
        self._window_start = 0.0
        self._last_end = 0.0  # the last step's end, or the end of a gap after it
        self._gaps = 0.0
        # Between two steps while the last step's end is not before the last start (with
        # data_wait; without, on_step_start is not watched and a gap always counts from the
        # last step's end): no flag to flip twice a step.
        self._step_start = 0.0
        self._start_handle: Handle | None = None
        self._loss_at_step_end = False
        self._forward_handle: Handle | None = None
        self._losses: list[torch.Tensor] = []  # this interval's micro-batch losses (off the CPU)
        self._loss_sum = 0.0  # ... or their sum and count, read as they come (on the CPU)
        self._loss_count = 0
        self._read_losses = False
        self._no_loss = False  # this rank saw `engine.loss is None` (a pipeline stage without the loss)
        self._data_time = 0.0
        self._step0 = self._samples0 = self._tokens0 = 0

    def _reset_window(self, engine: Engine) -> None:
        state = engine.state
        self._window_start = self._last_end
        self._gaps = self._data_time = 0.0
        self._step0, self._samples0, self._tokens0 = state.step, state.samples_seen, state.tokens_seen

    # -- per step (the hot path) ----------------------------------------------

    def on_fit_start(self, engine: Engine) -> None:
        if self._collector is None:
            self._collector = engine.metrics.add_collector(partial(self._collect, engine))
        self._last_end = perf_counter()  # the first step's time includes opening the epoch
        self._reset_window(engine)
        # One loss per step is read at on_step_end; with accumulation, each
        # micro-batch's loss is kept from on_forward (a call per micro-batch
        # only when there is more than one).
        self._loss_at_step_end = self._log_loss and engine.config.grad_accum == 1
        # A CPU loss is computed by the time it is returned: reading it waits for
        # nothing, and costs less than keeping an interval's tensors alive. On an
        # accelerator it would wait for the device: keep references instead.
        self._read_losses = engine.backend.device.type == "cpu"
        if self._log_loss and not self._loss_at_step_end and self._forward_handle is None:
            self._forward_handle = engine.on(Event.ON_FORWARD, order=self.order)(self._keep_loss)
        if self.config.timing and self.config.data_wait and self._start_handle is None:
            self._start_handle = engine.on(Event.ON_STEP_START, order=self.order)(self._step_started)

    def _step_started(self, engine: Engine) -> None:
        now = perf_counter()
        self._data_time += now - self._last_end
        self._step_start = now

    def _keep_loss(self, engine: Engine) -> None:
        loss = engine.loss
        if loss is None:  # a pipeline stage before the last: the loss is logged from the last stage
            self._no_loss = True
            return
        if self._read_losses:
            self._loss_sum += loss.item()
            self._loss_count += 1
        else:  # a reference to the detached loss: no copy, no host sync until the interval
            self._losses.append(loss.detach())

    def on_step_end(self, engine: Engine) -> None:
        self._last_end = perf_counter()
        if self._loss_at_step_end:
            loss = engine.loss
            if self._read_losses and loss is not None:  # _keep_loss's CPU case, without the call
                self._loss_sum += loss.item()
                self._loss_count += 1
            else:
                self._keep_loss(engine)

    # -- gaps that are not step time ------------------------------------------

    def on_eval_end(self, engine: Engine) -> None:
        self._skip_gap()

    def on_save(self, engine: Engine) -> None:
        self._skip_gap()

    def on_load(self, engine: Engine) -> None:
        # A restore moved the step and sample counts: the window starts again from here.
        self._last_end = perf_counter()
        self._reset_window(engine)

    def _skip_gap(self) -> None:
        """The time since the last step ended is not step time (a fit's next start resets it anyway)."""
        if self._last_end >= self._step_start:  # between steps
            now = perf_counter()
            self._gaps += now - self._last_end
            self._last_end = now

    def on_teardown(self, engine: Engine) -> None:
        for handle in (self._forward_handle, self._start_handle):
            if handle is not None:
                handle.remove()
        self._forward_handle = self._start_handle = None
        if self._collector is not None:
            self._collector.remove()
            self._collector = None

    # -- per reduction (the collector) ------------------------------------------

    def _collect(self, engine: Engine) -> None:
        config, state = self.config, engine.state
        if self._losses:
            # One device op per interval instead of one logged value per micro-batch.
            losses, self._losses = self._losses, []
            stacked = torch.stack(losses)
            dtype = torch.float32 if stacked.device.type == "mps" else torch.float64
            engine.log("loss", stacked.mean(dtype=dtype), "mean", weight=float(len(losses)))
        if self._loss_count:
            engine.log("loss", self._loss_sum / self._loss_count, "mean", weight=float(self._loss_count))
            self._loss_sum, self._loss_count = 0.0, 0
        if self._no_loss:  # the same names on every rank: the reduction takes the loss from the last stage
            engine.metrics.declare("loss")
        if config.learning_rate:
            for name, value in learning_rates(engine.optimizers):
                engine.log(name, value, "last")
        if config.grad_norm:
            grad_norm = getattr(engine, "grad_norm", None)
            if grad_norm is not None and "grad_norm" not in engine.metrics:
                engine.log("grad_norm", grad_norm, "max")  # as GradClip logs it
        steps = state.step - self._step0
        if steps:
            elapsed = self._last_end - self._window_start - self._gaps
            if config.timing:
                engine.log("time.step", elapsed / steps, "mean")
                if config.data_wait:
                    engine.log("time.data_wait", self._data_time / steps, "mean")
            if config.throughput and elapsed > 0:
                self._log_throughput(engine, elapsed)
        self._reset_window(engine)

    def _log_throughput(self, engine: Engine, elapsed: float) -> None:
        config, state = self.config, engine.state
        samples_per_sec = (state.samples_seen - self._samples0) / elapsed
        tokens_per_sec = (state.tokens_seen - self._tokens0) / elapsed
        # Rates of this rank: summed over the data ranks they are the global rates.
        engine.log("throughput.samples_per_sec", samples_per_sec, "sum")
        if state.tokens_seen > 0:
            engine.log("throughput.tokens_per_sec", tokens_per_sec, "sum")
        flops = None
        if config.flops_per_sample is not None:
            flops = config.flops_per_sample * samples_per_sec
        elif config.flops_per_token is not None:
            flops = config.flops_per_token * tokens_per_sec
        if flops is not None:
            # Per device, so the mean over ranks is the run's TFLOP/s per device and its MFU.
            engine.log("throughput.tflops", flops / 1e12, "mean")
            if config.peak_flops is not None:
                engine.log("mfu", flops / config.peak_flops, "mean")


def learning_rates(optimizers: list[Any]) -> list[tuple[str, Any]]:
    """`(name, lr)` of every param group: `lr`, `lr.<group>` or `lr.opt<i>[.<group>]`."""
    result = []
    for i, optimizer in enumerate(optimizers):
        groups = optimizer.param_groups
        prefix = f"lr.opt{i}" if len(optimizers) > 1 else "lr"
        for j, group in enumerate(groups):
            name = prefix if len(groups) == 1 else f"{prefix}.{group.get('name', j)}"
            result.append((name, group["lr"]))
    return result


def default_callbacks() -> list[Callback]:
    """The default observability callbacks: metrics, progress bar, JSONL and text log.

    Example:
        >>> from cadence.callbacks.metrics import default_callbacks
        >>> [type(c).__name__ for c in default_callbacks()]
        ['TrainMetrics', 'ProgressBar', 'JSONL', 'TextLog']
    """
    from cadence.callbacks.jsonl import JSONL
    from cadence.callbacks.progress import ProgressBar
    from cadence.callbacks.text_log import TextLog

    return [TrainMetrics(), ProgressBar(), JSONL(), TextLog()]


# -- helpers shared by the sinks -------------------------------------------------


class LineThrottle:
    """At most one training line per `interval` seconds, for the human-readable sinks.

    Evaluation lines are always written (after a held-back training line, so
    the order is kept), and the last held-back line when the fit ends. A line
    is a zero-argument callable that writes it, so a throttled line costs no
    formatting. `interval=0` writes every line. JSONL keeps every logged step.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.reset()

    def reset(self) -> None:
        self._last = -math.inf
        self._held: Callable[[], None] | None = None

    def offer(self, write: Callable[[], None], *, always: bool = False) -> None:
        if always:
            self.flush()
            write()
            return
        now = perf_counter()
        if now - self._last >= self.interval:
            self._held, self._last = None, now
            write()
        else:
            self._held = write

    def flush(self) -> None:
        """Write the held-back line, if any (at fit end, before an evaluation line)."""
        if self._held is not None:
            held, self._held = self._held, None
            held()


def is_main(engine: Engine) -> bool:
    """True on the global main process, the one that writes logs."""
    return bool(engine.backend.is_main)


def eval_split(logged: Mapping[str, Any]) -> str:
    """The split of an evaluation's `engine.logged` (`val` for `val.loss`)."""
    return next(iter(logged), "").partition(".")[0]


def flat_config(run_config: Any) -> dict[str, Any]:
    """The run config unstructured and flattened to dotted keys with scalar values."""
    try:
        data = config_module.unstructure(run_config)
    except TypeError:
        return {}
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif value is None or isinstance(value, (list, tuple)):
            flat[prefix] = str(value)
        elif isinstance(value, float) and not math.isfinite(value):
            flat[prefix] = str(value)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:
            flat[prefix] = str(value)

    walk("", data)
    return flat


__all__ = ["LineThrottle", "TrainMetrics", "TrainMetricsConfig", "default_callbacks", "learning_rates"]
