"""The engine: one loop that fires events to ordered callbacks."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch

from cadence.engine import agreement as agreements
from cadence.engine import checks, forward, sources
from cadence.engine.backend import Backend, batch_size
from cadence.engine.bus import Callbacks, EventBus, Handle, as_event, callback_key
from cadence.engine.config import EngineConfig, EvalSetConfig, build_config, check_budget, fit_target, make_backend
from cadence.engine.context import ContextField, StepContext
from cadence.engine.control import Requests
from cadence.engine.evaluation import MetricInputs, MetricSet
from cadence.engine.evaluator import Evaluator, split_name
from cadence.engine.events import Event
from cadence.engine.feed import TrainFeed
from cadence.engine.metrics import MetricStore, Reduction
from cadence.engine.placement import Placement
from cadence.engine.state import State, seed_everything
from cadence.engine.step import Step, as_given
from cadence.run import registry, rundir

__all__ = ["Engine", "EngineConfig", "EvalSetConfig"]

logger = logging.getLogger("cadence")

StepFn = Callable[[torch.nn.Module, Any], Any]
HookFn = TypeVar("HookFn", bound=Callable[..., Any])


class Engine:
    """Trains, evaluates and predicts by firing `Event`s to ordered callbacks.

    Args:
        model: the `torch.nn.Module` to train.
        optimizer: one optimizer or a sequence of them (None for evaluation only).
        train_data: a `Dataset` (the engine builds a seeded StatefulDataLoader),
            a `DataLoader`, or any iterable of batches (used as given).
        loss_fn: `loss_fn(model(inputs), targets)` for batches `(inputs, targets)`.
        step_fn: `step_fn(model, batch)` returning the loss, or a mapping with
            a `"loss"` key; use it for anything beyond inputs/targets. Without
            `loss_fn` or `step_fn`, `model(batch)` must return the loss (or a
            mapping / object with a `loss`).
        eval_fn: `eval_fn(model, batch)` returning a mapping of per-batch mean
            metrics, or `(mapping, outputs)` where `outputs` feed `metrics`;
            the default is the training loss (and the model's outputs).
            Evaluation reduces the means exactly (weighted by batch size) across ranks.
        scheduler: an LR scheduler stepped every optimizer step (register
            `cadence.callbacks.LRScheduler` yourself for other intervals).
        eval_data: like `train_data` (the `val` split), or a mapping of split
            names to data (`{"val": ..., "test": ...}`): each set is evaluated
            on its schedule (`EngineConfig.eval_sets`) and logged under its
            split (`val.loss`, `test.loss`).
        predict_data: like `train_data`.
        metrics: metric objects updated on every evaluation batch and computed
            once per evaluation over every rank's samples, exactly (see
            docs/metrics.md): a `cadence.metrics.Metric`, a torchmetrics
            `Metric` or `MetricCollection`, or a mapping of names to them;
            logged as `split.name`, reset for every evaluation.
        train_metrics: the same for training: updated on every micro-batch,
            computed and reset at every log interval, logged by name (through a
            `MetricUpdates` callback that the engine registers).
        metric_inputs: `metric_inputs(outputs, batch)` gives what a metric's
            `update` receives: a tuple of arguments or a mapping of keywords;
            default `(outputs, targets)` of `(inputs, targets)` batches.
        callbacks: callback instances, registered in this order.
        backend: a `Backend` instance or a name (`"auto"`, `"local"`, `"ddp"`, ...).
        config: an `EngineConfig` or a mapping structured into one.
        run_config: the whole configuration of the run (any attrs object),
            recorded in checkpoints and the run directory; default `config`.
        **overrides: `EngineConfig` fields, e.g. `epochs=3`.

    Example:
        >>> import torch, cadence
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(10)]
        >>> engine = cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, seed=0)
        >>> engine.fit(steps=5)
        >>> engine.state.step
        5
    """

    batch = ContextField[Any]()
    outputs = ContextField[Any]()
    loss = ContextField[torch.Tensor | None]()
    batch_metrics = ContextField[Mapping[str, Any]]()
    batch_indices = ContextField[list[int] | None]()
    grad_norm = ContextField[torch.Tensor | None]()
    logged = ContextField[dict[str, float]]()

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        train_data: Any = None,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        step_fn: StepFn | None = None,
        eval_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
        scheduler: Any = None,
        eval_data: Any = None,
        predict_data: Any = None,
        metrics: Any = None,
        train_metrics: Any = None,
        metric_inputs: MetricInputs | None = None,
        callbacks: Iterable[Any] = (),
        backend: Backend | str | None = None,
        config: EngineConfig | Mapping[str, Any] | None = None,
        run_config: Any = None,
        **overrides: Any,
    ) -> None:
        self.config = build_config(config, overrides, backend)
        self._run_config = run_config
        optimizers, schedulers = _as_list(optimizer), _as_list(scheduler)
        # Everything that can be checked is checked here, before the backend
        # starts (under DDP, a process group): a wrong argument must not leave one behind.
        checks.check_model(model, optimizers, loss_fn, step_fn)
        checks.check_schedulers(schedulers)
        for split, data in (("train", train_data), ("predict", predict_data)):
            if data is not None:
                checks.check_data(split, data, getattr(self.config, split))
        self.model = model
        self.wrapped_model: torch.nn.Module = model
        self.optimizers: list[torch.optim.Optimizer] = optimizers
        self.schedulers: list[Any] = schedulers
        self.loss_fn, self.step_fn, self.eval_fn = loss_fn, step_fn, eval_fn
        self.state = State()
        self.requests: Requests = self.state.requests
        self.metrics = MetricStore()
        #: The values of the batch being run; `engine.batch`, `.outputs`, `.loss`, ... are its fields.
        self.context = StepContext()
        self.eval_results: dict[str, dict[str, float]] = {}
        #: Each split's metric values as computed (tensors of any shape: a confusion matrix), by `split.name`.
        self.metric_values: dict[str, dict[str, Any]] = {}
        self.eval_metrics = MetricSet(metrics, metric_inputs) if metrics is not None else None
        eval_sets = sources.eval_sets(eval_data)
        sources.check_eval_sets(self.config, eval_sets)  # before any process group starts
        #: Runs evaluate() and predict() (`cadence.engine.evaluator`).
        self.evaluator = Evaluator(self, metric_inputs_given=metric_inputs is not None)
        self.exception: BaseException | None = None
        #: The event bus: registered callbacks in their order, and `bus.fire(event)`, the one dispatch.
        self.bus = EventBus(self)
        self._running = False
        self._setup_done = False
        self.feed = TrainFeed()  # the train data's open epoch and unfinished step
        #: Where `engine.log` records: `metrics`, or during evaluation that evaluation's store.
        self.metric_sink: MetricStore = self.metrics
        #: What `engine.log` puts before a name: "" in training, "split." during evaluation.
        self.metric_prefix = ""
        self._run_dir: Path | None = None
        self._run_info: rundir.RunInfo | None = None
        self.long_operation_name: str | None = None
        #: Seconds spent in `long_operation`s (the outermost ones), summed: step timings leave them out.
        self.long_operation_time = 0.0
        self.fit_target: tuple[float, float] = (math.inf, math.inf)
        self.restored_from: str | None = None  # the checkpoint the state was last restored from
        #: The data by split (`engine.data["train"]`), each a `DataSource` on this process's data shard.
        self.data = sources.DataSources(self)
        # Callbacks are built and ordered (config errors, duplicate keys, cycles) before the backend starts.
        for callback in callbacks:
            self.add_callback(callback)
        if train_metrics is not None:
            updates = registry.callbacks.resolve("metric_updates")
            self.add_callback(updates(train_metrics, inputs=metric_inputs))
        # An LRScheduler() the user registered already steps engine.schedulers (its documented attribute).
        scheduler_callback = registry.callbacks.resolve("lr_scheduler")
        stepping = self.callbacks.find(scheduler_callback)
        if self.schedulers and not (stepping is not None and stepping.steps_engine_schedulers):
            self.add_callback(scheduler_callback())
        self.add_callback(rundir.RunRecorder())  # records attempts.jsonl once the run directory is open
        if self.config.deterministic:  # before the backend touches CUDA
            rundir.enable_determinism()
        self.backend = make_backend(backend if backend is not None else self.config.backend, self.config)
        try:
            self.backend.setup(self)
            self._seed_given = self.config.seed  # a drawn seed is not part of the run's identity
            if self.config.seed is None:  # a retry reuses the seed its run directory recorded
                seed = self.backend.broadcast_object(rundir.draw_seed(self))
                self.config = attrs.evolve(self.config, seed=seed)
            self.seed: int = self.config.seed  # type: ignore[assignment]
            seed_everything(self.seed + self.backend.rank)
            if self.eval_metrics is not None:
                self.eval_metrics.bind(self.backend)
            for split, data in (("train", train_data), ("predict", predict_data), *eval_sets.items()):
                if data is not None:
                    self.data.add(split, data)
        except BaseException:
            self.close()  # what setup acquired (a process group it created, DDP's wrapper) is released
            raise

    # -- callbacks --------------------------------------------------------

    def add_callback(self, callback: Any) -> Handle:
        """Register a callback; returns a handle whose `remove()` unregisters it.

        A config entry (`"name"` or `{"name": ..., **arguments}`, see
        `cadence.run.registry.build_callback`) is built first.
        """
        if isinstance(callback, (str, Mapping)):
            callback = registry.build_callback(callback)
        return self.bus.add(callback)

    def on(
        self,
        event: Event | str,
        *,
        every: int | None = None,
        once: int | None = None,
        when: Callable[[Engine], bool] | None = None,
        order: int = 50,
    ) -> Callable[[HookFn], HookFn]:
        """Decorator registering a function `fn(engine)` on one event; it returns `fn` itself.

        The decorated name stays a plain function (callable, registrable on
        another engine). For a handle with `remove()`, register with
        `add_handler`; `remove_handler(fn)` unregisters a decorated function.

        Example:
            >>> @engine.on(cadence.Event.ON_STEP_END, every=2)   # doctest: +SKIP
            ... def report(engine):
            ...     print(engine.state.step)
        """
        event = as_event(event)  # an unknown name fails here, before the decorated function

        def register(fn: HookFn) -> HookFn:
            self.bus.add_function(event, fn, every=every, once=once, when=when, order=order)
            return fn

        return register

    def add_handler(
        self,
        event: Event | str,
        fn: Callable[[Engine], Any],
        *,
        every: int | None = None,
        once: int | None = None,
        when: Callable[[Engine], bool] | None = None,
        order: int = 50,
    ) -> Handle:
        """Register `fn(engine)` on one event, as `on` does; returns a handle whose `remove()` unregisters it."""
        return self.bus.add_function(event, fn, every=every, once=once, when=when, order=order)

    def remove_handler(self, fn: Callable[[Engine], Any], event: Event | str | None = None) -> None:
        """Unregister `fn`, registered with `on` or `add_handler` (from `event` only, when given)."""
        self.bus.remove_function(fn, event)

    @property
    def callbacks(self) -> Callbacks:
        """Registered callbacks in their resolved order (the order of every event); `.find(kind)` finds one by type."""
        return self.bus.ordered

    @property
    def running(self) -> bool:
        """True inside a run: `fit()`, `evaluate()` or `predict()` (an evaluate() inside fit() is part of the fit's)."""
        return self._running

    @property
    def seed_was_drawn(self) -> bool:
        """True when no seed was configured and the engine drew one (`config.seed` then holds it): a drawn
        seed is not part of the run's identity (`cadence.run.rundir`), and a retry reuses the recorded one."""
        return self._seed_given is None

    @property
    def eval_splits(self) -> tuple[str, ...]:
        """The evaluation sets' split names, in the order they are evaluated."""
        return self.data.eval_splits

    def hooks(self, event: Event | str) -> tuple[Callable[[Engine], None], ...]:
        """The bound hooks an event calls, in order."""
        return self.bus.registered[Event(event)]

    # -- the run ------------------------------------------------------------

    @property
    def run_config(self) -> Any:
        """The configuration this run is recorded under (checkpoints, run directory)."""
        return self._run_config if self._run_config is not None else self.config

    @property
    def run_dir(self) -> Path:
        """This run's directory, `workspace/lineage[-code_id]/run_id/` (see docs/run-directory.md).

        The first access creates it and, on the main process, writes `metadata/`.
        """
        if self._run_dir is None:
            self._run_dir = rundir.open_run_dir(self)
        return self._run_dir

    @property
    def run_info(self) -> rundir.RunInfo:
        """The run's ids (run_id, config_id, code_id), git state and attempt timestamp; writes nothing."""
        if self._run_info is None:
            self._run_info = rundir.resolve_run(self)
        return self._run_info

    @property
    def attempt_timestamp(self) -> str:
        """This attempt's start (`YYYYmmdd-HHMMSS`): names `logs/{timestamp}.log` and `tensorboard/{timestamp}/`."""
        return self.run_info.timestamp

    @contextlib.contextmanager
    def long_operation(self, name: str) -> Iterator[None]:
        """Mark a long blocking operation (a checkpoint save) so watchdogs pause.

        Its time is added to `long_operation_time`, so step timings (`TrainMetrics`'
        `time.step` and throughput) leave it out.
        """
        previous, self.long_operation_name = self.long_operation_name, name
        started = time.perf_counter()
        try:
            yield
        finally:
            self.long_operation_name = previous
            if previous is None:  # the outermost one: a nested operation's time is inside it
                self.long_operation_time += time.perf_counter() - started

    # -- control ------------------------------------------------------------

    def request(self, name: str, value: int = 1, reason: str | None = None) -> None:
        """Raise a control request; it takes effect once agreed across ranks."""
        self.requests.request(name, value, reason)

    def request_skip(self, reason: str | None = None) -> None:
        """Skip this optimizer step on every rank (agreed before the step)."""
        self.requests.request("skip", 1, reason)

    def request_stop(self, reason: str | None = None) -> None:
        """Stop fitting on every rank after the step at which it is agreed."""
        self.requests.request("stop", 1, reason)

    def request_save(self, reason: str | None = None) -> None:
        """Ask the checkpoint callback to save at the step at which it is agreed."""
        self.requests.request("save", 1, reason)

    def agreed(self, name: str) -> int:
        """The value of a request agreed at the last agreement (0: not requested)."""
        return self.requests.get(name)

    def log(self, name: str, value: Any, reduce: Reduction = "mean", weight: float = 1.0) -> None:
        """Record a metric; reduced across ranks at the next log interval.

        Inside evaluation the name is prefixed with the split (`val.`).
        Values stay on the device until then: no host sync per call.
        """
        self.metric_sink.log(self.metric_prefix + name, value, reduce, weight)

    # -- running ------------------------------------------------------------

    def fit(self, steps: int | None = None, epochs: int | None = None) -> None:
        """Train for `steps` more steps or `epochs` more epochs, counted from where the state is: after any restore.

        With neither, train to `config.steps` / `config.epochs`: absolute, so a resumed run (a TorchFT group
        restored from any step) ends at the job's step. With both, the first bound reached stops it.
        `fit(steps=100)` twice trains 200 steps; `setup()` first shows the restored `state.step`.
        """
        check_budget(self.config, steps, epochs)
        with self._run():  # on_setup may restore a checkpoint: targets count from there
            # Absolute (step, epoch) this fit trains to (inf: unbounded); progress bars read it.
            self.fit_target = fit_target(self.config, self.state, steps, epochs)
            self._fit(*self.fit_target)

    def _fit(self, stop_step: float, stop_epoch: float) -> None:
        """The loop of `Event`'s docstring, one line per event.

        Control requests are agreed once per step: `agreement.send` right after
        on_step_start (an overlapped agreement's all-reduce goes out there and
        runs under forward and backward), `agreement.take` right before the
        update, whose skip or stop every rank then sees alike.
        """
        state, requests, feed = self.state, self.requests, self.feed
        step, placement = self._build_step()
        agreement = agreements.choose(self)  # none, inline, blocking or overlapped: decided once per fit
        source, accum, stop = self.data.train(), self.config.grad_accum, requests.index["stop"]
        evaluations = self.evaluator.schedule("steps")  # (split, every N steps) of the evaluation sets
        first_step = state.step
        requests.clear_agreed()
        requests.in_step = False
        self.bus.fire(Event.ON_FIT_START)
        while state.step < stop_step and state.epoch < stop_epoch and not requests.agreed[stop]:
            if state.batch_in_epoch == 0:
                self.bus.fire(Event.ON_EPOCH_START)
            for micro_batches in placement.steps(feed.steps(source, state, accum)):
                self.bus.fire(Event.ON_STEP_START)
                agreement.send(requests)
                step.micro_batches(self, micro_batches)  # on_batch, forward, on_forward, backward, on_backward
                step.finish(self)  # gradients final: synced, unscaled
                self.bus.fire(Event.ON_BEFORE_OPTIMIZER_STEP)
                agreement.take(requests)
                if step.apply_update(requests):
                    self.bus.fire(Event.ON_OPTIMIZER_STEP)
                step.zero_grad()
                self._count_step(micro_batches)
                self.bus.fire(Event.ON_STEP_END)
                self._log_due()  # on_log
                self.evaluator.evaluate_due(evaluations, state.step)
                self.bus.fire(Event.ON_SAVE_POINT)  # checkpoint, preemption
                if requests.agreed[stop] or state.step >= stop_step:
                    break
            if feed.epoch_over(source, state, accum):
                self._end_epoch()
        if state.step % self.config.log_interval and state.step > first_step:
            self._log_metrics()  # the steps since the last interval: every fit ends logged
        requests.closed = False  # requests raised at the fit's end wait for the next fit's agreement
        self.bus.fire(Event.ON_FIT_END)

    def _build_step(self) -> tuple[Step, Placement]:
        """This fit's step (`Backend.build_step`) and the placement of its micro-batches.

        Each micro-batch is placed as it is used, or copied one ahead
        (`cadence.engine.placement`); a backend's schedule places its own.
        """
        step = self.backend.build_step(self)
        prefetch = self.config.prefetch_to_device if step.schedule is None else False
        placement = Placement.choose(step.to_device, self.backend.device, prefetch)
        return attrs.evolve(step, place=placement.to_device or as_given), placement

    def _count_step(self, micro_batches: Sequence[Any]) -> None:
        """The counters of a finished step, its skip (agreed, or an update not applied) included."""
        state, n = self.state, len(micro_batches)
        state.micro_step += n
        state.batch_in_epoch += n
        state.samples_seen += sum(map(batch_size, micro_batches))
        skipped = self.requests.agreed[self.requests.index["skip"]]
        state.skipped_steps += 1 if skipped else 0
        state.consecutive_skips = state.consecutive_skips + 1 if skipped else 0
        state.step += 1
        self.feed.pending = None

    def _log_due(self) -> None:
        if self.state.step % self.config.log_interval == 0:
            self._log_metrics()

    def fire(self, event: Event) -> None:
        """Call every hook of `event`, in the callbacks' order (`EventBus.fire`, which the loop calls directly)."""
        self.bus.fire(event)

    def instrument(self, make_context: Callable[[Event], Any] | None) -> None:
        """Run each event's hooks inside `make_context(event)` from now on (None: stop).

        Costs nothing per event while unset; the profiler puts each event in a
        named `record_function` range with it while it records.
        """
        self.bus.instrument(make_context)

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.state.batch_in_epoch = 0
        self.evaluator.after_epoch()
        self.bus.fire(Event.ON_EPOCH_END)
        # Requests raised at epoch end (early stopping after evaluation) are agreed here: stop before another epoch.
        stop = self.requests.index["stop"]
        stopping = self.requests.agreed[stop]
        self.backend.agree(self.requests)
        if stopping:  # a stop agreed at the epoch's last step still holds
            self.requests.agreed[stop] = max(stopping, self.requests.agreed[stop])
            self.requests.any_agreed = True
        # After the agreement: a save requested at epoch end is taken here, and
        # a checkpoint holds the state an uninterrupted run goes on from.
        self.bus.fire(Event.ON_SAVE_POINT)

    def _log_metrics(self) -> None:
        self.metrics.collect()  # values callbacks aggregate themselves (TrainMetrics)
        if self.metrics:
            self.logged = self.metrics.compute(self.backend)
            self.bus.fire(Event.ON_LOG)

    def evaluate(self, data: Any = None, split: str | None = None) -> dict[str, float]:
        """Evaluate on `data` or an evaluation set; returns `{split.name: value}`.

        Without arguments every evaluation set is evaluated in turn (each fires
        its own events and `on_log`); `split=` picks one set, or names the
        results of `data` (default `val`) or of the only set. Metrics from `eval_fn` (default: the
        loss) and from `engine.log` calls made during evaluation are reduced
        exactly across ranks: the sum of value x batch size over the sum of
        batch sizes, not a mean of means. The `metrics` objects are reset,
        updated on every batch and computed once over every rank's samples;
        their scalar values join the results, and every value, whatever its
        shape, is kept in `engine.metric_values[split]`.
        """
        if data is None and split is None:
            if not self.eval_splits:
                raise ValueError("no eval data: pass eval_data to Engine(...) or data to this call")
            results: dict[str, float] = {}
            for each in self.eval_splits:
                results.update(self.evaluate(split=each))
            return results
        split = split_name("val" if split is None else split)
        source = self.data.evaluation(data, split)
        with self._run():
            return self.evaluator.evaluate(source, split)

    def predict(self, data: Any = None, *, gather: bool = False) -> Any:
        """Run the model on every batch of `data` (default: predict data).

        Returns this rank's outputs, one per batch; with `gather=True`, every
        data rank's outputs joined along the first dimension in dataset order
        (each sample once: evaluation shards have no padding) on the main
        process, and None on the others. Outputs are tensors or tuples, lists
        and dicts of them. For outputs too big to gather, register
        `cadence.callbacks.PredictionWriter`, which writes per-rank shards.
        Dataset order needs the sample indices (`engine.batch_indices`): known
        for Datasets the engine builds loaders for; for other data the shares
        are joined in rank order. Under pipeline parallel only the last stage
        has outputs: the other stages return an empty list (`engine.outputs` is
        None there in on_predict_batch).
        """
        source = self.data.predict(data)
        with self._run():
            return self.evaluator.predict(source, gather)

    def setup(self) -> None:
        """Fire `on_setup` now, once (else the first run does): `Checkpoint` restores there, so `state.step` shows it."""
        checks.check_order_targets(self.callbacks, callback_key)
        if not self._setup_done:
            self._setup_done = True
            self.bus.fire(Event.ON_SETUP)

    @contextlib.contextmanager
    def _run(self) -> Iterator[None]:
        """One top-level run: setup once, on_exception on error, on_teardown always."""
        if self._running:  # evaluate() inside fit()
            yield
            return
        self.setup()
        self._running = True
        try:
            yield
        except BaseException as exc:
            self.requests.in_step = self.requests.closed = False  # left mid-fit: on_exception may request
            clearer = checks.explain(self, exc)
            self.exception = exc if clearer is None else clearer
            for error in self.bus.fire_all(Event.ON_EXCEPTION):
                logger.error("%s (while handling %r)", error, exc)
            with contextlib.suppress(Exception):
                self.backend.zero_grad(self)
            if clearer is not None:
                raise clearer from exc
            raise
        finally:
            self._running = False
            errors = self.bus.fire_all(Event.ON_TEARDOWN)
            failed, self.exception = self.exception, None
            if errors and failed is None:
                raise errors[0]
            for error in errors:
                logger.error("%s", error)

    def close(self) -> None:
        """Release the backend's resources (its model wrapper first, then its process groups: destroyed while the
        interpreter is fully alive, not at exit) and the run directory's lease. `engine.model` stays usable."""
        self.wrapped_model = self.model
        self.backend.teardown()
        rundir.release_run_dir(self)  # its lease: another launch of this run may take the directory now

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the forward pass ----------------------------------------------------

    def compute_loss(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """Forward one batch; returns `(outputs, loss)` (`cadence.engine.forward`). The step runs it under autocast."""
        return forward.compute_loss(self.wrapped_model, batch, self.step_fn, self.loss_fn)

    def state_dict(self) -> dict[str, Any]:
        """The engine's counters (with the last loss as a float)."""
        if self.loss is not None:
            self.state.last_loss = float(self.loss.detach())
        return self.state.state_dict()

    def __repr__(self) -> str:
        return f"Engine(step={self.state.step}, epoch={self.state.epoch}, backend={self.backend.describe()}, callbacks={len(self.callbacks)})"


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]
