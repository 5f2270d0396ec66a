"""Built-in training metrics (loss, learning rate, timing, throughput, MFU) and the default sinks.

By default nothing runs per step: a collector, called right before the
engine reduces the metrics (every `log_interval`, and at the end of a fit),
reads the logged step's loss, the clock and the counters. The interval's mean
loss (`loss_mean=True`) costs a hook per step, the data wait (`data_wait=True`)
two. See docs/observability.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from cadence.callbacks.memory import CudaMemory
from cadence.engine.bus import Handle
from cadence.engine.callback import Callback
from cadence.engine.events import Event
from cadence.engine.metrics import Collector
from cadence.engine.order import Order
from cadence.run import config as config_module

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
        loss: log `loss`: the logged step's loss (the mean over its micro-batches and the
            data ranks), as TorchTitan and Lightning log it.
        loss_mean: log the mean loss over every micro-batch of the interval instead of the
            logged step's. It keeps each step's loss from a hook (on_step_end, or on_forward
            under gradient accumulation): about 1% of a tiny CPU step, so it is off by default.
        learning_rate: log `lr` (`lr.<group>` / `lr.opt<i>.<group>` for several groups / optimizers).
        grad_norm: log `grad_norm` from `engine.grad_norm` (set by `GradClip`) if nobody logged it.
        timing: log `time.step`: the interval's wall time over its steps, from the previous
            reduction to this one (fetching the micro-batches and the loop's own work
            included; evaluation and `engine.long_operation`s such as checkpoint saves
            excluded).
        data_wait: also log `time.data_wait`, the part of `time.step` spent between a
            step's end and the next step's on_step_start (fetching the micro-batches). It
            costs two hooks and clock reads per step (about 1-2% of a tiny CPU step), so
            it is off by default.
        throughput: log `throughput.samples_per_sec` and, once `state.tokens_seen`
            advances, `throughput.tokens_per_sec` (summed over the data ranks).
        flops_per_sample: training FLOPs per sample (forward + backward, about 6 x parameters x tokens
            for a transformer); enables `throughput.tflops` per device.
        flops_per_token: the same per token (give one of the two).
        peak_flops: peak FLOP/s of one device (e.g. 989e12 for an H100 in bf16); enables `mfu`.
        memory: on a CUDA device, log `memory.peak_allocated_gib`, `memory.peak_reserved_gib` and
            `memory.alloc_retries` per interval (`cadence.callbacks.memory.CudaMemory`).
    """

    loss: bool = True
    loss_mean: bool = False
    learning_rate: bool = True
    grad_norm: bool = True
    timing: bool = True
    data_wait: bool = False
    throughput: bool = True
    flops_per_sample: float | None = attrs.field(default=None, validator=_positive)
    flops_per_token: float | None = attrs.field(default=None, validator=_positive)
    peak_flops: float | None = attrs.field(default=None, validator=_positive)
    memory: bool = True

    def __attrs_post_init__(self) -> None:
        if self.flops_per_sample is not None and self.flops_per_token is not None:
            raise ValueError("TrainMetrics: give flops_per_sample or flops_per_token, not both")
        if self.peak_flops is not None and self.flops_per_sample is None and self.flops_per_token is None:
            raise ValueError(
                f"TrainMetrics: peak_flops={self.peak_flops!r} needs flops_per_sample or flops_per_token to compute MFU"
            )


class TrainMetrics(Callback):
    """Logs the built-in training metrics through `engine.log`.

    Nothing runs per step by default. At each reduction (every log interval,
    and the end of a fit that stopped between two), a collector
    (`MetricStore.add_collector`) logs the logged step's loss, learning rates,
    gradient norm, mean step time, samples/s, tokens/s, TFLOP/s, MFU (and on
    CUDA peak memory, `CudaMemory`), over the steps since the previous
    reduction. The interval's time is read from
    the clock then: from the previous reduction to this one, less the time in
    evaluation (`on_eval_start` to `on_eval_end`) and in
    `engine.long_operation`s (checkpoint saves). Throughput divides the
    interval's samples by that time.

    The loss is the logged step's (`engine.loss` at the reduction; under
    gradient accumulation the mean of that step's micro-batch losses, kept
    from on_forward). `loss_mean=True` logs the mean over every micro-batch of
    the interval instead, kept from on_step_end (or on_forward), weighted by
    their count. On an accelerator a loss is kept as a reference to the
    detached tensor (no copy, no host sync) and the kept losses are averaged
    on the device once; on the CPU, where the value is ready when the loss is
    returned, it is read and summed as a float. `data_wait=True` adds a clock
    read at on_step_end and on_step_start for `time.data_wait`.

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
        self._collector: Collector | None = None
        self._handles: list[Handle] = []  # this fit's per-step handlers (loss_mean, data_wait, accumulation)
        # The interval runs from the previous reduction (or the fit's start) to this one,
        # less the time in evaluation and in the engine's long operations: no clock per step.
        self._window_start = 0.0
        self._window_gaps = 0.0  # `_gap_time` at the window's start
        self._eval_time = 0.0  # seconds in evaluation, summed
        self._eval_start = 0.0
        self._loss_at_reduction = False  # read `engine.loss` in the collector (the step's only loss)
        self._loss_step = -1  # the step whose micro-batch losses are kept (without loss_mean)
        self._losses: list[torch.Tensor] = []  # the kept losses (off the CPU)
        self._loss_sum = 0.0  # ... or their sum and count, read as they come (on the CPU)
        self._loss_count = 0
        self._read_losses = False
        self._no_loss = False  # this rank saw `engine.loss is None` (a pipeline stage without the loss)
        self._last_end = 0.0  # data_wait: the last step's end, and `_gap_time` then
        self._end_gaps = 0.0
        self._data_time = 0.0
        self._step0 = self._samples0 = self._tokens0 = 0
        self._memory: CudaMemory | None = None  # read at each reduction, on CUDA only

    def _gap_time(self, engine: Engine) -> float:
        """Seconds so far that are not step time: evaluation and the engine's long operations."""
        return self._eval_time + engine.long_operation_time

    def _reset_window(self, engine: Engine, now: float) -> None:
        state = engine.state
        self._window_start, self._window_gaps = now, self._gap_time(engine)
        self._data_time = 0.0
        self._step0, self._samples0, self._tokens0 = state.step, state.samples_seen, state.tokens_seen

    def on_fit_start(self, engine: Engine) -> None:
        config = self.config
        if self._collector is None:
            self._collector = engine.metrics.add_collector(partial(self._collect, engine))
        now = perf_counter()
        self._reset_window(engine, now)  # the first step's time includes opening the epoch
        self._last_end, self._end_gaps = now, self._window_gaps
        # A CPU loss is computed by the time it is returned: reading it waits for
        # nothing, and costs less than keeping an interval's tensors alive. On an
        # accelerator it would wait for the device: keep references instead.
        self._read_losses = engine.backend.device.type == "cpu"
        self._memory = CudaMemory.started(engine.backend.device) if config.memory else None
        accumulating = engine.config.grad_accum > 1
        # One loss per step: read at the reduction, or kept at on_step_end for the interval's
        # mean. Several: each micro-batch's, kept from on_forward.
        self._loss_at_reduction = config.loss and not config.loss_mean and not accumulating
        self._loss_step = -1
        if config.loss and accumulating:
            self._handles.append(engine.add_handler(Event.ON_FORWARD, self._keep_loss, order=self.order))
        elif config.loss_mean and config.loss:
            self._handles.append(engine.add_handler(Event.ON_STEP_END, self._keep_loss, order=self.order))
        if config.timing and config.data_wait:
            self._handles.append(engine.add_handler(Event.ON_STEP_START, self._step_started, order=self.order))
            self._handles.append(engine.add_handler(Event.ON_STEP_END, self._step_ended, order=self.order))

    def _step_started(self, engine: Engine) -> None:
        gaps = self._gap_time(engine)
        self._data_time += perf_counter() - self._last_end - (gaps - self._end_gaps)

    def _step_ended(self, engine: Engine) -> None:
        self._last_end, self._end_gaps = perf_counter(), self._gap_time(engine)

    def _keep_loss(self, engine: Engine) -> None:
        loss = engine.loss
        if loss is None:  # a pipeline stage before the last: the loss is logged from the last stage
            self._no_loss = True
            return
        if not self.config.loss_mean:  # the logged step's micro-batches only
            step = engine.state.step
            if step != self._loss_step:  # a new step: drop the last one's
                self._losses, self._loss_sum, self._loss_count = [], 0.0, 0
                self._loss_step = step
        if self._read_losses:
            self._loss_sum += loss.item()
            self._loss_count += 1
        else:  # a reference to the detached loss: no copy, no host sync until the interval
            self._losses.append(loss.detach())

    # -- time that is not step time ---------------------------------------------

    def on_eval_start(self, engine: Engine) -> None:
        self._eval_start = perf_counter()

    def on_eval_end(self, engine: Engine) -> None:
        self._eval_time += perf_counter() - self._eval_start

    def on_load(self, engine: Engine) -> None:
        # A restore moved the step and sample counts: the window starts again from here.
        self._reset_window(engine, perf_counter())

    def on_teardown(self, engine: Engine) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._collector is not None:
            self._collector.remove()
            self._collector = None

    # -- per reduction (the collector) ------------------------------------------

    def _collect(self, engine: Engine) -> None:
        now = perf_counter()
        config, state = self.config, engine.state
        steps = state.step - self._step0
        if self._loss_at_reduction and steps:
            self._keep_loss(engine)  # the logged step's loss
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
            grad_norm = engine.grad_norm
            if grad_norm is not None and "grad_norm" not in engine.metrics:
                engine.log("grad_norm", grad_norm, "max")  # as GradClip logs it
        if steps:
            elapsed = now - self._window_start - (self._gap_time(engine) - self._window_gaps)
            if config.timing:
                engine.log("time.step", elapsed / steps, "mean")
                if config.data_wait:
                    engine.log("time.data_wait", self._data_time / steps, "mean")
            if config.throughput and elapsed > 0:
                self._log_throughput(engine, elapsed)
        if self._memory is not None:
            self._memory.log(engine)
        self._reset_window(engine, now)

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
