"""Metric objects the engine updates, synchronizes and resets, and predictions gathered across ranks.

`MetricSet` holds what `Engine(metrics=...)` / `train_metrics=` were given:
`cadence.metrics.Metric`s, torchmetrics `Metric`s and `MetricCollection`s, by
name. Its `compute` synchronizes all of them in one round (`gather_tensors`:
two collectives over the backend's data domain whatever the number of
metrics), then computes each without any further communication.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from cadence.engine.gather import gather_tensors
from cadence.metrics import Metric

if TYPE_CHECKING:
    from cadence.engine.backend import Backend, Domain

MetricInputs = Callable[[Any, Any], Any]


class MetricError(RuntimeError):
    """A metric raised in `update` or `compute`; the message names the metric, the split and the step."""


def default_metric_inputs(outputs: Any, batch: Any) -> tuple[Any, Any]:
    """`(outputs, targets)` for `(inputs, targets)` batches: what `metric.update` receives by default."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return outputs, batch[1]
    raise TypeError(
        f"metrics are updated with (outputs, targets) of (inputs, targets) batches, got a {type(batch).__name__} "
        "batch; pass metric_inputs=fn(outputs, batch) returning update's arguments (a tuple, or a mapping of keywords)"
    )


def _torchmetrics_kind(obj: Any) -> str | None:
    # Only an object made by torchmetrics can be one of its classes: no import when it was never imported.
    module = sys.modules.get("torchmetrics")
    if module is None:
        return None
    if isinstance(obj, module.MetricCollection):
        return "collection"
    if isinstance(obj, module.Metric):
        return "torchmetrics"
    return None


class MetricSet:
    """Named metric objects updated per batch and computed (synchronized) together.

    Args:
        metrics: a `cadence.metrics.Metric`, a torchmetrics `Metric` or
            `MetricCollection`, or a mapping of names to them. A metric given
            alone is named after its class; a collection's results keep the
            collection's names; a result that is a mapping is flattened as
            `name.key`.
        inputs: `inputs(outputs, batch)` gives update's arguments (a tuple, a
            mapping of keywords, or one value); default `(outputs, targets)`.
        argument: the Engine argument the metrics came from, for errors.
    """

    def __init__(self, metrics: Any, inputs: MetricInputs | None = None, *, argument: str = "metrics") -> None:
        if inputs is not None and not callable(inputs):
            raise TypeError(f"metric_inputs must be a function (outputs, batch) -> arguments, got {inputs!r}")
        self.inputs: MetricInputs = inputs or default_metric_inputs
        self.entries: list[tuple[str | None, Any, str]] = []  # (name, object, kind); name None: a bare collection
        given = metrics.items() if isinstance(metrics, Mapping) else [(None, metrics)]
        for name, obj in given:
            kind = "cadence" if isinstance(obj, Metric) else _torchmetrics_kind(obj)
            if kind is None:
                what = f"{argument}[{name!r}]" if name is not None else argument
                raise TypeError(
                    f"{what}: {type(obj).__name__} is not a metric the engine can synchronize across ranks; "
                    "give a cadence.metrics.Metric subclass, a torchmetrics Metric or MetricCollection, "
                    "or a mapping of names to them"
                )
            if name is not None and (not isinstance(name, str) or not name):
                raise ValueError(f"{argument}: metric names must be non-empty strings, got {name!r}")
            if name is None and kind != "collection":
                name = type(obj).__name__
            self.entries.append((name, obj, kind))
        self.backend: Backend | None = None

    def bind(self, backend: Backend) -> None:
        """Move the metrics to the backend's device and sync torchmetrics over its data-domain group."""
        self.backend = backend
        distributed = backend.data_size > 1
        for _, obj, kind in self.entries:
            obj.to(backend.device)
            if kind != "cadence":
                for metric in _members(obj):
                    # Public torchmetrics options: a compute() called outside the engine syncs over the
                    # data domain's group too, and never over a world that is not the data domain.
                    metric.process_group = backend.process_group("data")
                    metric.distributed_available_fn = _Answer(distributed)

    def describe(self, name: str | None, obj: Any) -> str:
        if name is None:
            return f"MetricCollection {sorted(obj.keys())}"
        return f"{name!r} ({type(obj).__name__})"

    def update(self, outputs: Any, batch: Any, where: str | Callable[[], str]) -> None:
        """Update every metric from one batch; `where` says when, for errors (a string or a function giving it)."""
        try:
            args = self.inputs(outputs, batch)
        except Exception as exc:
            raise MetricError(
                f"metric_inputs(outputs, batch) failed {_text(where)}: {type(exc).__name__}: {exc}"
            ) from exc
        with torch.no_grad():
            for name, obj, _ in self.entries:
                try:
                    if isinstance(args, tuple):
                        obj.update(*args)
                    elif isinstance(args, Mapping):
                        obj.update(**args)
                    else:
                        obj.update(args)
                except Exception as exc:
                    raise MetricError(
                        f"metric {self.describe(name, obj)} failed in update() {_text(where)}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc

    def reset(self) -> None:
        for _, obj, _ in self.entries:
            obj.reset()

    def compute(self, where: str) -> dict[str, Any]:
        """Every metric's value over the data domain, by name (one synchronization for all)."""
        assert self.backend is not None, "MetricSet.bind(backend) first"
        cadence_metrics = [obj for _, obj, kind in self.entries if kind == "cadence"]
        # Local states of every metric, each distinct torchmetrics state once (compute groups share them).
        tensors: list[torch.Tensor] = []
        for metric in cadence_metrics:
            tensors.extend(metric.sync_tensors())
        shared: dict[int, int] = {}  # id(state object) -> its position in `tensors`
        order: list[tuple[Any, list[int]]] = []
        for _, obj, kind in self.entries:
            if kind == "cadence":
                continue
            for metric in _members(obj):
                positions = []
                for value in metric.metric_state.values():
                    if id(value) not in shared:
                        shared[id(value)] = len(tensors)
                        tensors.append(_torchmetrics_local(metric, value))
                    positions.append(shared[id(value)])
                order.append((metric, positions))
        gathered = gather_tensors(self.backend, tensors)
        results: dict[str, Any] = {}
        start = 0
        states: dict[int, dict[str, Any]] = {}
        for metric in cadence_metrics:
            count = len(metric.state_names)
            states[id(metric)] = metric.synced_states(gathered[start : start + count])
            start += count
        previous = []
        for metric, positions in order:
            previous.append((metric, metric.dist_sync_fn))
            metric.dist_sync_fn = _Lookup([gathered[p] for p in positions], type(metric).__name__)
        try:
            for name, obj, kind in self.entries:
                try:
                    if kind == "cadence":
                        with obj.holding(states[id(obj)]):
                            value = obj.compute()
                    else:
                        value = obj.compute()
                except Exception as exc:
                    raise MetricError(
                        f"metric {self.describe(name, obj)} failed in compute() {where}: {type(exc).__name__}: {exc}"
                    ) from exc
                if name is None:  # a bare collection: its own names
                    results.update(value)
                elif isinstance(value, Mapping):
                    results.update({f"{name}.{key}": v for key, v in value.items()})
                else:
                    results[name] = value
        finally:
            for metric, sync_fn in previous:
                metric.dist_sync_fn = sync_fn
        return results


def _text(where: str | Callable[[], str]) -> str:
    return where if isinstance(where, str) else where()


def scalar(value: Any) -> float | None:
    """A metric value as a float when it is a number or a one-element tensor; else None."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _members(obj: Any) -> list[Any]:
    """The torchmetrics metrics holding states: a collection's members (sharing states in compute groups)."""
    if _torchmetrics_kind(obj) == "collection":
        return [metric for _, metric in obj.items(keep_base=True, copy_state=False)]
    return [obj]


def _torchmetrics_local(metric: Any, value: Any) -> torch.Tensor:
    """The tensor torchmetrics hands its `dist_sync_fn` for one state (lists are concatenated first)."""
    if isinstance(value, torch.Tensor):
        return value
    if not value:
        return torch.tensor([], device=metric.device, dtype=metric.dtype)
    if len(value) == 1:
        return value[0]
    from torchmetrics.utilities import dim_zero_cat

    return dim_zero_cat(value)


class _Answer:
    """A picklable constant function (torchmetrics' `distributed_available_fn`)."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __call__(self) -> bool:
        return self.value


class _Lookup:
    """A torchmetrics `dist_sync_fn` that hands back states the engine already gathered.

    torchmetrics calls it once per state, in declaration order (`metric_state`).
    """

    def __init__(self, gathered: list[list[torch.Tensor]], metric: str) -> None:
        self.gathered, self.metric, self.calls = gathered, metric, 0

    def __call__(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        if self.calls >= len(self.gathered):
            raise RuntimeError(
                f"{self.metric}: torchmetrics synchronized more states ({self.calls + 1}) than it declares "
                f"({len(self.gathered)}); this torchmetrics version syncs differently from what cadence expects"
            )
        per_rank = self.gathered[self.calls]
        self.calls += 1
        return list(per_rank)


def concat_outputs(outputs: list[Any], what: str = "predict(gather=True)") -> Any:
    """Per-batch outputs joined along the first dimension, leaf by leaf (tensors in tuples, lists, dicts)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([o.reshape(1) if o.dim() == 0 else o for o in outputs])
    if isinstance(first, Mapping):
        return type(first)((key, concat_outputs([o[key] for o in outputs], what)) for key in first)  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        joined = [concat_outputs([o[i] for o in outputs], what) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    raise TypeError(
        f"{what} joins tensor outputs (or tuples, lists, dicts of tensors), got {type(first).__name__}; "
        "use gather=False, or write them per rank with cadence.callbacks.PredictionWriter"
    )


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [leaf for key in tree for leaf in _leaves(tree[key])]
    return [leaf for item in tree for leaf in _leaves(item)]


def _rebuild(tree: Any, leaves: list[torch.Tensor]) -> Any:
    it = iter(leaves)

    def build(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return next(it)
        if isinstance(node, Mapping):
            return type(node)((key, build(node[key])) for key in node)  # type: ignore[call-arg]
        items = [build(item) for item in node]
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)

    return build(tree)


def gather_outputs(backend: Backend, outputs: list[Any], indices: list[int] | None) -> Any:
    """Every data rank's outputs, joined in dataset order (by `indices`), on the main rank; None elsewhere.

    When some rank does not know its samples' dataset indices, the shares are
    joined in rank order.
    """
    tree = concat_outputs(outputs) if outputs else None
    leaves = _leaves(tree) if outputs else []
    rows = leaves[0].shape[0] if leaves else 0
    device = leaves[0].device if leaves else backend.device
    known = indices is not None
    index = torch.tensor(indices[:rows] if known else [], dtype=torch.int64, device=device)  # type: ignore[index]
    flag = torch.tensor([int(known)], dtype=torch.int64, device=device)
    try:
        gathered = gather_tensors(backend, [*leaves, index, flag])
    except RuntimeError as exc:
        raise RuntimeError(
            f"predict(gather=True): the ranks' outputs differ in structure (this rank: {len(outputs)} batches, "
            f"{len(leaves)} tensors per output); every rank needs a batch and outputs of the same kind: {exc}"
        ) from exc
    if not backend.is_main:
        return None
    *per_leaf, per_rank_index, flags = gathered
    joined = [torch.cat(pieces) for pieces in per_leaf]
    if all(int(f) == 1 for f in flags):
        order = torch.cat(per_rank_index).argsort()
        joined = [leaf[order.to(leaf.device)] for leaf in joined]
    return _rebuild(tree, joined)


def in_lockstep(
    batches: Iterable[Any],
    count: int | None,
    backend: Backend,
    domain: Domain,
    stand_in: Callable[[Any], None],
    split: str,
) -> Iterator[Any]:
    """`batches`, then `stand_in(last batch)` until this rank has run as many forwards as every rank of `domain`.

    For backends whose evaluation forward runs collectives (`Backend.eval_lockstep`).
    With `count` (this rank's number of batches) the ranks agree on the largest
    count once, before the first batch (one all-reduce MAX); without it, each
    batch is agreed as it comes (one small all-reduce MAX per batch: does any
    rank still have one). The stand-in forwards run after this rank's last
    batch went through the loop; what they compute is discarded by
    `stand_in`. Every rank raises the same error when a rank has no batch to
    stand in while others have some.
    """
    last: Any = None
    if count is not None:
        agreed = backend.reduce(torch.tensor([count, -count], dtype=torch.int64, device=backend.device), "max", domain)
        most, fewest = (int(v) for v in agreed.tolist())
        if -fewest == 0 and most > 0:
            raise ValueError(_no_batch(split))
        for batch in batches:
            last = batch
            yield batch
        for _ in range(most - count):
            stand_in(last)
        return
    iterator, end = iter(batches), object()
    while True:
        batch = next(iterator, end)
        has = batch is not end
        flags = torch.tensor([int(has), int(not has and last is None)], dtype=torch.int64, device=backend.device)
        anyone, stranded = backend.reduce(flags, "max", domain).tolist()
        if stranded and anyone:
            raise ValueError(_no_batch(split))
        if not anyone:
            return
        if has:
            last = batch
            yield batch
        else:
            stand_in(last)


def _no_batch(split: str) -> str:
    return (
        f"{split} data: a rank has no batch while others have some, and this backend's forward runs collectives "
        "every rank must join (it needs a batch to run them on); give every data rank at least one batch "
        "(more samples, or a Dataset the engine shards)"
    )
