"""Stateful metrics: `update` per batch, `compute` over the whole evaluation, exact across ranks.

A `Metric` keeps states (declared with `add_state`) that `update` changes and
`compute` reads. Before `compute`, the engine replaces every state by its
value over the whole data domain: "sum", "max" and "min" states are reduced,
"cat" states are concatenated (in rank order) from shards of any length. So
F1, AUROC, a confusion matrix or precision@k come out exactly as on one
process, without the duplicates that padded shards would add.

Pass metrics to `Engine(metrics=...)` (evaluation) or `Engine(train_metrics=...)`
(training, computed at every log interval); torchmetrics objects work the
same way (`pip install 'cadence[metrics]'`). See docs/metrics.md.

Example:
    >>> import torch
    >>> from cadence.metrics import Accuracy
    >>> accuracy = Accuracy()
    >>> accuracy.update(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    >>> float(accuracy.compute())
    0.5
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from cadence.engine.gather import gather_tensors

if TYPE_CHECKING:
    from cadence.engine.backend import Backend

StateReduce = Literal["sum", "max", "min", "cat"]
STATE_REDUCTIONS: tuple[str, ...] = ("sum", "max", "min", "cat")


class Metric:
    """Base class of a metric whose states are synchronized over the data domain.

    In `__init__`, call `super().__init__()` and declare each state with
    `add_state`; `update(...)` changes the states from one batch, `compute()`
    returns the value from them, `reset()` restores the defaults. A "cat"
    state is a list of tensors that `update` appends to; `compute` reads it
    with `torch.cat(self.name)` (synchronized, it is a list of one tensor:
    every rank's pieces in rank order).

    Outside the engine, synchronize by hand with `metric.sync(backend)`.

    Example:
        >>> import torch
        >>> from cadence.metrics import Metric
        >>> class MeanAbsoluteError(Metric):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.add_state("error", torch.tensor(0.0, dtype=torch.float64), "sum")
        ...         self.add_state("count", torch.tensor(0), "sum")
        ...     def update(self, preds, target):
        ...         self.error += (preds - target).abs().sum()
        ...         self.count += target.numel()
        ...     def compute(self):
        ...         return self.error / self.count
        >>> mae = MeanAbsoluteError()
        >>> mae.update(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
        >>> float(mae.compute())
        0.25
    """

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor | None, str]] = {}
        self._device: torch.device | None = None

    def add_state(self, name: str, default: torch.Tensor | None = None, reduce: StateReduce = "sum") -> None:
        """Declare a state: a tensor reduced with "sum", "max" or "min", or a "cat" list (default None)."""
        if reduce not in STATE_REDUCTIONS:
            raise ValueError(f"{type(self).__name__}.add_state({name!r}): reduce must be one of {STATE_REDUCTIONS}")
        if reduce == "cat":
            if default is not None:
                raise ValueError(
                    f"{type(self).__name__}.add_state({name!r}): a 'cat' state starts empty; give no default"
                )
        elif not isinstance(default, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.add_state({name!r}): a {reduce!r} state needs a tensor default, "
                f"got {type(default).__name__}"
            )
        if not hasattr(self, "_states"):
            raise RuntimeError(f"{type(self).__name__}: call super().__init__() before add_state")
        if self._device is not None and default is not None:
            default = default.to(self._device)
        self._states[name] = (default, reduce)
        setattr(self, name, [] if default is None else default.clone())

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Change the states from one batch."""
        raise NotImplementedError(f"{type(self).__name__} must define update(...)")

    def compute(self) -> Any:
        """The metric's value from the states (synchronized when the engine calls it)."""
        raise NotImplementedError(f"{type(self).__name__} must define compute()")

    def reset(self) -> None:
        """Restore every state to its default."""
        for name, (default, _) in self._states.items():
            setattr(self, name, [] if default is None else default.clone())

    def to(self, device: torch.device | str) -> Metric:
        """Move the states (and defaults) to `device`; returns the metric."""
        device = torch.device(device)
        self._device = device
        for name, (default, reduce) in self._states.items():
            if default is not None:
                self._states[name] = (default.to(device), reduce)
                setattr(self, name, getattr(self, name).to(device))
            else:
                setattr(self, name, [t.to(device) for t in getattr(self, name)])
        return self

    @property
    def state_names(self) -> tuple[str, ...]:
        """The declared states, in declaration order."""
        return tuple(self._states)

    @contextlib.contextmanager
    def sync(self, backend: Backend) -> Iterator[None]:
        """Hold every state's value over `backend`'s data domain inside the block (local again after).

        Every rank of the data domain must enter it together.
        """
        with synchronized(backend, [self]):
            yield

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- synchronization (the engine's side) -------------------------------------

    def sync_tensors(self) -> list[torch.Tensor]:
        """This rank's states as tensors, in declaration order ("cat" lists concatenated)."""
        tensors = []
        for name, (default, _) in self._states.items():
            value = getattr(self, name)
            if default is None:
                pieces = [t.reshape(1) if t.dim() == 0 else t for t in value]
                device = self._device if self._device is not None else torch.device("cpu")
                value = torch.cat(pieces) if pieces else torch.empty(0, device=device)
            tensors.append(value)
        return tensors

    def synced_states(self, gathered: Sequence[list[torch.Tensor]]) -> dict[str, Any]:
        """The states over the data domain from every rank's `sync_tensors()` (`gathered[i][rank]`)."""
        values: dict[str, Any] = {}
        for (name, (_, reduce)), per_rank in zip(self._states.items(), gathered):
            if reduce == "cat":
                pieces = [t for t in per_rank if t.numel()]  # an empty rank adds nothing (nor its dtype)
                values[name] = [torch.cat(pieces)] if pieces else []
            elif len(per_rank) == 1:
                values[name] = per_rank[0]
            else:
                stacked = torch.stack(per_rank)
                values[name] = getattr(stacked, "amax" if reduce == "max" else "amin" if reduce == "min" else "sum")(0)
        return values

    @contextlib.contextmanager
    def holding(self, states: dict[str, Any]) -> Iterator[None]:
        """Hold `states` (from `synced_states`) inside the block; the local states come back after."""
        local = {name: getattr(self, name) for name in self._states}
        try:
            for name, value in states.items():
                setattr(self, name, value)
            yield
        finally:
            for name, value in local.items():
                setattr(self, name, value)


@contextlib.contextmanager
def synchronized(backend: Backend, metrics: Sequence[Metric]) -> Iterator[None]:
    """Hold the states of every metric over the data domain (one gather for all), restored after."""
    tensors: list[torch.Tensor] = []
    for metric in metrics:
        tensors.extend(metric.sync_tensors())
    gathered = gather_tensors(backend, tensors)
    with contextlib.ExitStack() as stack:
        start = 0
        for metric in metrics:
            count = len(metric.state_names)
            stack.enter_context(metric.holding(metric.synced_states(gathered[start : start + count])))
            start += count
        yield


class Mean(Metric):
    """The (weighted) mean of every value given to `update`, in float64.

    Example:
        >>> import torch
        >>> from cadence.metrics import Mean
        >>> mean = Mean()
        >>> mean.update(torch.tensor([1.0, 2.0]))
        >>> mean.update(torch.tensor(6.0))
        >>> float(mean.compute())
        3.0
    """

    total: torch.Tensor
    weight: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), "sum")
        self.add_state("weight", torch.tensor(0.0, dtype=torch.float64), "sum")

    def update(self, value: Any, weight: Any = None) -> None:
        """Add `value` (a number or a tensor of values) with `weight` (default 1 per value)."""
        value = torch.as_tensor(value, device=self.total.device).detach().double()
        if weight is None:
            self.total += value.sum()
            self.weight += value.numel()
        else:
            weight = torch.as_tensor(weight, device=self.total.device).double().expand_as(value)
            self.total += (value * weight).sum()
            self.weight += weight.sum()

    def compute(self) -> torch.Tensor:
        return self.total / self.weight


class Accuracy(Metric):
    """The fraction of samples whose target is among the `top_k` predicted classes.

    `update(preds, target)` takes `preds` as scores of shape `(N, C, ...)` with
    integer targets `(N, ...)`, or as predicted labels of the targets' shape
    (`top_k=1` only). The counts are integers: exact on any number of ranks.

    Args:
        top_k: a sample counts as correct when its target is among its k best scores.

    Example:
        >>> import torch
        >>> from cadence.metrics import Accuracy
        >>> top2 = Accuracy(top_k=2)
        >>> top2.update(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]), torch.tensor([1, 0]))
        >>> float(top2.compute())
        0.5
    """

    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, top_k: int = 1) -> None:
        super().__init__()
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"Accuracy(top_k={top_k!r}): top_k must be an int >= 1")
        self.top_k = top_k
        self.add_state("correct", torch.tensor(0), "sum")
        self.add_state("total", torch.tensor(0), "sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Count the correct samples of one batch."""
        if preds.dim() == target.dim() + 1 and preds.shape[:1] + preds.shape[2:] == target.shape:
            if preds.shape[1] < self.top_k:
                raise ValueError(f"Accuracy(top_k={self.top_k}): preds have only {preds.shape[1]} classes")
            best = preds.topk(self.top_k, dim=1).indices  # (N, k, ...)
            correct = (best == target.unsqueeze(1)).any(dim=1)
        elif preds.shape == target.shape:
            if self.top_k != 1:
                raise ValueError(f"Accuracy(top_k={self.top_k}) needs scores of shape (N, C, ...), got labels")
            correct = preds == target
        else:
            raise ValueError(
                f"Accuracy: preds of shape {tuple(preds.shape)} do not fit targets of shape {tuple(target.shape)}; "
                "give scores (N, C, ...) or labels of the targets' shape"
            )
        self.correct += correct.sum()
        self.total += correct.numel()

    def compute(self) -> torch.Tensor:
        return self.correct.double() / self.total

    def __repr__(self) -> str:
        return f"Accuracy(top_k={self.top_k})"
