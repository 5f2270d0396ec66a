"""Evaluation and prediction: the forwards `Engine.evaluate()` and `Engine.predict()` run.

The engine owns the run (setup, on_exception, on_teardown) and the data; an
`Evaluator` runs one evaluation set or one prediction pass over a
`DataSource` inside it: events, exact metric reductions, metric objects, and
the lockstep stand-in forwards a backend may need (`Backend.eval_lockstep`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch

from cadence.engine.backend import batch_size, restore_training_mode
from cadence.engine.data import DataSource
from cadence.engine.evaluation import MetricError, MetricSet, gather_outputs, in_lockstep, scalar
from cadence.engine.events import Event
from cadence.engine.metrics import MetricStore

if TYPE_CHECKING:
    from cadence.engine.engine import Engine


class Evaluator:
    """Runs `evaluate()` and `predict()` for one engine.

    Args:
        engine: the engine whose model, backend, callbacks and attributes
            (`batch`, `outputs`, `logged`, `eval_results`, ...) it uses.
        metric_inputs_given: whether the engine was given `metric_inputs`
            (then metrics need no outputs from `eval_fn`).
    """

    def __init__(self, engine: Engine, metric_inputs_given: bool) -> None:
        self.engine = engine
        self.metric_inputs_given = metric_inputs_given

    def schedule(self, unit: Literal["steps", "epochs"]) -> tuple[tuple[str, int], ...]:
        """(split, every) of the sets evaluated every N steps or epochs (`EngineConfig.eval_sets`, else
        `eval_every_steps` / `eval_every_epochs`)."""
        config = self.engine.config
        default = config.eval_every_steps if unit == "steps" else config.eval_every_epochs
        schedule = []
        for split in self.engine.data.eval_splits:
            own = config.eval_sets.get(split)
            every = getattr(own, f"every_{unit}") if own is not None else None
            every = default if every is None else every
            if every:
                schedule.append((split, every))
        return tuple(schedule)

    def evaluate_due(self, schedule: tuple[tuple[str, int], ...], count: int) -> None:
        """Evaluate each set of `schedule` whose interval divides `count` (the step, or the epoch)."""
        for split, every in schedule:
            if count % every == 0:
                self.engine.evaluate(split=split)

    def after_epoch(self) -> None:
        """The sets due at this epoch's end (`eval_every_epochs`), unless their step schedule evaluated them at
        this very step (the epoch's last): EarlyStopping's patience and a plateau scheduler count each once.
        Read from the schedule, not remembered, so a run resumed from that step decides the same."""
        state = self.engine.state
        evaluated = {split for split, every in self.schedule("steps") if state.step % every == 0}
        due = tuple((split, every) for split, every in self.schedule("epochs") if split not in evaluated)
        self.evaluate_due(due, state.epoch)

    def evaluate(self, source: DataSource, split: str) -> dict[str, float]:
        """One evaluation set: on_eval_start, on_eval_batch per batch, on_log, on_eval_end; returns its results."""
        engine = self.engine
        backend, metrics = engine.backend, engine.eval_metrics
        with torch.no_grad(), restore_training_mode(engine.model, False), backend.evaluation(engine):
            where = f"while evaluating split {split!r} at step {engine.state.step}"
            store = MetricStore()
            engine.metric_sink, engine.metric_prefix = store, f"{split}."
            staged = backend.eval_forward(engine)  # None: the model's own forward
            try:
                if metrics is not None:
                    metrics.reset()  # what a previous evaluation or a failed one left
                engine.bus.fire(Event.ON_EVAL_START)
                if staged is not None:
                    store.declare(f"{split}.loss")  # ranks without the loss (pipeline stages) take part
                batches = self.lockstep(source.epoch_iter(0, fresh=True), source, staged, True, split)
                means: Mapping[str, Any]  # the staged forward's loss, or what eval_fn returned
                for batch in batches:
                    engine.batch = self.place(batch)
                    if staged is not None:
                        engine.outputs, loss = staged(engine.batch)
                        means, outputs = ({} if loss is None else {"loss": loss}), engine.outputs
                    else:
                        with backend.autocast():
                            means, outputs = self.eval_step(engine.batch)
                    if metrics is not None:
                        self.update_metrics(metrics, outputs, where)
                    weight = float(batch_size(engine.batch))
                    for name, value in means.items():
                        store.log(f"{split}.{name}", value, "mean", weight)
                    engine.batch_metrics = means
                    engine.bus.fire(Event.ON_EVAL_BATCH)
                results = store.compute(backend)
                if metrics is not None:
                    values = {f"{split}.{name}": value for name, value in metrics.compute(where).items()}
                    metrics.reset()
                    clash = sorted(set(values) & set(results))
                    if clash:
                        raise ValueError(
                            f"{clash} are both metric objects and values logged by eval_fn or engine.log; rename one"
                        )
                    engine.metric_values[split] = values
                    for name, value in values.items():
                        number = scalar(value)
                        if number is not None:
                            results[name] = number
            finally:
                engine.metric_sink, engine.metric_prefix = engine.metrics, ""
            engine.eval_results[split] = results
            engine.logged = dict(results)
            engine.bus.fire(Event.ON_LOG)
            engine.bus.fire(Event.ON_EVAL_END)
        return results

    def update_metrics(self, metrics: MetricSet, outputs: Any, where: str) -> None:
        if outputs is None and not self.metric_inputs_given:
            raise MetricError(
                f"metrics need the model's outputs {where}, but eval_fn returned only a mapping of means; "
                "have eval_fn return (mapping, outputs), or pass metric_inputs=fn(outputs, batch)"
            )
        metrics.update(outputs, self.engine.batch, where)

    def predict(self, source: DataSource, gather: bool) -> Any:
        """on_predict_start, on_predict_batch per batch, on_predict_end; returns the outputs (see `Engine.predict`)."""
        engine = self.engine
        outputs: list[Any] = []
        result: Any = outputs
        with torch.no_grad(), restore_training_mode(engine.model, False), engine.backend.evaluation(engine):
            staged = engine.backend.eval_forward(engine)  # None: the model's own forward
            engine.bus.fire(Event.ON_PREDICT_START)
            batches = self.lockstep(source.epoch_iter(0, fresh=True), source, staged, False, "predict")
            indices, seen = source.sample_indices(), 0
            for batch in batches:
                engine.batch = self.place(batch)
                if indices is not None:
                    count = batch_size(engine.batch)
                    engine.batch_indices, seen = indices[seen : seen + count], seen + count
                if staged is not None:
                    engine.outputs = staged(inputs_of(engine.batch))[0]
                    engine.bus.fire(Event.ON_PREDICT_BATCH)
                    if engine.outputs is not None:
                        outputs.append(engine.outputs)
                    continue
                with engine.backend.autocast():
                    engine.outputs = engine.wrapped_model(inputs_of(engine.batch))
                engine.bus.fire(Event.ON_PREDICT_BATCH)
                outputs.append(engine.outputs)
            engine.batch_indices = None
            if gather:
                result = gather_outputs(engine.backend, outputs, indices)
            engine.bus.fire(Event.ON_PREDICT_END)
        return result

    def lockstep(
        self, batches: Iterator[Any], source: DataSource, staged: Any, evaluating: bool, split: str
    ) -> Iterator[Any]:
        """`batches` as they are, or, when the backend's forward needs every rank (`Backend.eval_lockstep`),
        with stand-in forwards after the last so that every rank runs as many."""
        backend = self.engine.backend
        domain = backend.eval_lockstep(self.engine)
        if domain is None:
            return batches
        count = len(source) if source.has_len() else None
        stand_in = partial(self.stand_in_forward, staged, evaluating)
        return in_lockstep(batches, count, backend, domain, stand_in, split)

    def stand_in_forward(self, staged: Any, evaluating: bool, batch: Any) -> None:
        """The forward `evaluate()` / `predict()` runs per batch, on `batch`, its outputs and logged values discarded."""
        engine = self.engine
        batch = self.place(batch) if evaluating else inputs_of(self.place(batch))
        outputs, sink = engine.outputs, engine.metric_sink
        engine.metric_sink = MetricStore()  # engine.log calls made in eval_fn or forward: dropped
        try:
            if staged is not None:
                staged(batch)
            else:
                with engine.backend.autocast():
                    self.eval_step(batch) if evaluating else engine.wrapped_model(batch)
        finally:
            engine.outputs, engine.metric_sink = outputs, sink

    def eval_step(self, batch: Any) -> tuple[Mapping[str, Any], Any]:
        """One evaluation batch: (per-batch means, outputs for the metric objects)."""
        engine = self.engine
        if engine.eval_fn is not None:
            result = engine.eval_fn(engine.wrapped_model, batch)
            outputs = None
            if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Mapping):
                result, outputs = result
            if not isinstance(result, Mapping):
                raise TypeError(
                    "eval_fn must return a mapping of metric name to value, or (mapping, outputs); "
                    f"got {type(result).__name__}"
                )
            engine.outputs = outputs
            return result, outputs
        engine.outputs, loss = engine.compute_loss(batch)
        return {"loss": loss}, engine.outputs

    def place(self, batch: Any) -> Any:
        """A batch on the backend's device (as given when it is already there, as on CPU)."""
        backend = self.engine.backend
        return backend.to_device(batch) if backend.moves_batches else batch


def inputs_of(batch: Any) -> Any:
    """What `predict()` feeds the model: a batch's first element when it is a tuple or list (inputs, targets)."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def split_name(split: Any) -> str:
    """`split`, checked: a non-empty name without dots other than 'train' and 'predict'."""
    if not isinstance(split, str) or not split or "." in split or split in ("train", "predict"):
        raise ValueError(
            f"evaluation split {split!r}: a split is a non-empty name without dots (metrics are named "
            "'split.metric') other than 'train' and 'predict' (e.g. 'val', 'test', 'train_eval')"
        )
    return split
