"""Metrics logged during a run, reduced across ranks only when read."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from cadence.engine.backend import Backend

Reduction = Literal["mean", "sum", "max", "min", "last"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min", "last")


class _Series:
    __slots__ = ("reduce", "values", "weights")

    def __init__(self, reduce: str) -> None:
        self.reduce = reduce
        self.values: list[Any] = []
        self.weights: list[float] = []


class MetricStore:
    """Accumulates logged values without a host sync; reduces them on demand.

    `log` only keeps a reference to the value (a device tensor or a number).
    `compute` packs every pending metric into one float64 vector and does a
    single `all_gather` over the data domain, then reduces each metric with its
    own rule: `mean` is exact (sum of value * weight over sum of weights, on
    every rank), `sum`, `max`, `min` reduce across ranks, `last` takes rank 0's.

    Values a callback aggregates itself (per-step sums, timings) join the
    reductions through a collector (`add_collector`), which the engine calls
    right before each one: at every log interval and at the end of a fit.
    """

    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}
        self._collectors: list[Callable[[], None]] = []

    def log(self, name: str, value: Any, reduce: Reduction = "mean", weight: float = 1.0) -> None:
        series = self._series.get(name)
        if series is None:
            if reduce not in REDUCTIONS:
                raise ValueError(f"metric {name!r}: reduce must be one of {REDUCTIONS}, got {reduce!r}")
            series = self._series[name] = _Series(reduce)
        elif series.reduce != reduce:
            raise ValueError(f"metric {name!r} was logged with reduce={series.reduce!r}, now {reduce!r}")
        series.values.append(value)
        series.weights.append(weight)

    def declare(self, name: str, reduce: Reduction = "mean") -> None:
        """Make `name` part of the next reduction even if this rank logs no value."""
        if name not in self._series:
            self.log(name, 0.0, reduce, weight=0.0)
            self._series[name].values.clear()
            self._series[name].weights.clear()

    def add_collector(self, collect: Callable[[], None]) -> Collector:
        """Have `collect()` log its values (through `log`) right before each reduction.

        The engine reduces the training metrics at every `log_interval` and at
        the end of a fit that stopped between two intervals; a callback that
        keeps its own running sums logs them from a collector and so takes
        part in both without knowing when they come. Collectors run in the
        order they were added; `remove()` on the returned handle stops one.
        """
        if not callable(collect):
            raise TypeError(f"add_collector needs a callable, got {type(collect).__name__}")
        self._collectors.append(collect)
        return Collector(self, collect)

    def collect(self) -> None:
        """Run the collectors: each logs its pending values into this store."""
        for collect in tuple(self._collectors):
            collect()

    def __bool__(self) -> bool:
        return bool(self._series)

    def names(self) -> list[str]:
        return sorted(self._series)

    def reset(self) -> None:
        self._series.clear()

    def compute(self, backend: Backend, *, reset: bool = True) -> dict[str, float]:
        """Reduce every pending metric across the data domain (one collective)."""
        # A handful of tensor ops per call whatever the number of values: one
        # device-to-host copy of every logged tensor (the sync point), local
        # reductions in Python float64, one all_gather of the packed pairs.
        names = self.names()
        values = self._host_values(names)
        if backend.world_size == 1:  # one rank: nothing to gather or compare
            result = {name: _one_rank(self._series[name], values[name]) for name in names}
        else:
            pairs = [_local_pair(self._series[name], values[name]) for name in names]
            result = self._gather(backend, names, pairs)
        if reset:
            self.reset()
        return result

    def _gather(self, backend: Backend, names: list[str], pairs: list[tuple[float, float]]) -> dict[str, float]:
        device = backend.device
        dtype = torch.float32 if device.type == "mps" else torch.float64
        packed = [float(zlib.crc32("\0".join(names).encode())), *(x for pair in pairs for x in pair)]
        rows = backend.all_gather(torch.tensor(packed, dtype=dtype, device=device), domain="data").tolist()
        # Against this rank's names too: a backend may hand every rank other ranks' rows (pipeline stages get the last's).
        if any(row[0] != packed[0] for row in rows):
            raise RuntimeError(
                f"ranks logged different metrics since the last reduction (this rank: {names}); "
                "log the same names on every rank, or declare them with engine.metrics.declare()"
            )
        result = {}
        for i, name in enumerate(names):
            a = [row[1 + 2 * i] for row in rows]
            b = [row[2 + 2 * i] for row in rows]
            result[name] = _finish(self._series[name].reduce, a, b)
        return result

    def __contains__(self, name: object) -> bool:
        """Whether `name` has a value pending since the last reduction."""
        series = self._series.get(name) if isinstance(name, str) else None
        return series is not None and bool(series.values)

    def _host_values(self, names: list[str]) -> dict[str, list[float]]:
        """The pending values of every metric as floats; tensors copied in one go per device."""
        result: dict[str, list[Any]] = {}
        by_device: dict[torch.device, tuple[list[tuple[list[Any], int]], list[torch.Tensor]]] = {}
        for name in names:
            values = result[name] = list(self._series[name].values)
            for i, value in enumerate(values):
                if isinstance(value, torch.Tensor):
                    if value.dim():
                        if value.numel() != 1:
                            raise ValueError(
                                f"metric {name!r}: engine.log needs a scalar, got a tensor of shape "
                                f"{tuple(value.shape)}; log a reduced value such as tensor.mean()"
                            )
                        value = value.reshape(())
                    slots, tensors = by_device.setdefault(value.device, ([], []))
                    slots.append((values, i))
                    tensors.append(value)
                else:
                    try:
                        values[i] = float(value)
                    except (TypeError, ValueError):
                        raise TypeError(
                            f"metric {name!r}: engine.log needs a number or a scalar tensor, "
                            f"got {type(value).__name__} {value!r}"
                        ) from None
        for slots, tensors in by_device.values():
            # One copy (and sync) per device; detach so no graph is built for it.
            for (values, i), host in zip(slots, torch.stack([t.detach() for t in tensors]).tolist()):
                values[i] = float(host)
        return result


def _one_rank(series: _Series, values: list[float]) -> float:
    """A metric reduced on a single rank: `_finish` of `_local_pair`, short for one value."""
    if len(values) == 1 and (series.reduce != "mean" or series.weights[0] > 0):
        return values[0]  # the mean of one weighted value is the value (not value * weight / weight)
    a, b = _local_pair(series, values)
    return _finish(series.reduce, [a], [b])


def _local_pair(series: _Series, values: list[float]) -> tuple[float, float]:
    """This rank's (value, weight) for one metric; weight 0 means "not logged here"."""
    if not values:
        return 0.0, 0.0
    if series.reduce == "mean":
        return math.fsum(v * w for v, w in zip(values, series.weights)), math.fsum(series.weights)
    if series.reduce == "sum":
        return math.fsum(values), 1.0
    if series.reduce == "max":
        return max(values), 1.0
    if series.reduce == "min":
        return min(values), 1.0
    return values[-1], 1.0


def _finish(kind: str, a: list[float], b: list[float]) -> float:
    if kind == "mean":
        total = math.fsum(b)
        return float("nan") if total == 0 else math.fsum(a) / total
    present = [x for x, w in zip(a, b) if w > 0]  # ranks that logged this metric at all
    if not present:
        return float("nan")
    if kind == "sum":
        return math.fsum(present)
    if kind == "max":
        return max(present)
    if kind == "min":
        return min(present)
    return present[0]


class Collector:
    """Returned by `MetricStore.add_collector`; `remove()` stops the collector."""

    def __init__(self, store: MetricStore, collect: Callable[[], None]) -> None:
        self._store, self.collect = store, collect

    def remove(self) -> None:
        """Stop calling the collector (no error if already removed)."""
        collectors = self._store._collectors
        if self.collect in collectors:
            collectors.remove(self.collect)
