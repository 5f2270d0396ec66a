"""Metrics logged during a run, reduced across ranks only when read."""

from __future__ import annotations

import zlib
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
    """

    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}

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

    def __bool__(self) -> bool:
        return bool(self._series)

    def names(self) -> list[str]:
        return sorted(self._series)

    def reset(self) -> None:
        self._series.clear()

    def compute(self, backend: Backend, *, reset: bool = True) -> dict[str, float]:
        """Reduce every pending metric across the data domain (one collective)."""
        names = self.names()
        local = self._pack(names, backend.device)
        gathered = backend.all_gather(local, domain="data")
        if bool((gathered[:, 0] != gathered[0, 0]).any()):
            raise RuntimeError(
                f"ranks logged different metrics since the last reduction (this rank: {names}); "
                "log the same names on every rank, or declare them with engine.metrics.declare()"
            )
        result = {}
        for i, name in enumerate(names):
            a, b = gathered[:, 1 + 2 * i], gathered[:, 2 + 2 * i]
            result[name] = _finish(self._series[name].reduce, a, b)
        if reset:
            self.reset()
        return result

    def _pack(self, names: list[str], device: torch.device) -> torch.Tensor:
        dtype = torch.float32 if device.type == "mps" else torch.float64
        packed = torch.zeros(1 + 2 * len(names), dtype=dtype, device=device)
        packed[0] = zlib.crc32("\0".join(names).encode())
        columns: list[torch.Tensor] = []
        for name in names:
            series = self._series.get(name)
            columns.extend(_local_pair(series, dtype, device))
        if columns:
            packed[1 : 1 + 2 * len(names)] = torch.stack(columns)
        return packed


def _as_tensor(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.stack([torch.as_tensor(v, device=device).detach().reshape(()).to(dtype) for v in values])


def _local_pair(series: _Series | None, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    zero = torch.zeros((), dtype=dtype, device=device)
    if series is None or not series.values:
        return [zero, zero]
    values = _as_tensor(series.values, dtype, device)
    if series.reduce == "mean":
        weights = torch.tensor(series.weights, dtype=dtype, device=device)
        return [(values * weights).sum(), weights.sum()]
    one = torch.ones((), dtype=dtype, device=device)
    if series.reduce == "sum":
        return [values.sum(), one]
    if series.reduce == "max":
        return [values.max(), one]
    if series.reduce == "min":
        return [values.min(), one]
    return [values[-1], one]


def _finish(kind: str, a: torch.Tensor, b: torch.Tensor) -> float:
    present = b > 0  # ranks that logged this metric at all
    if kind == "mean":
        total = b.sum()
        return float("nan") if total.item() == 0 else (a.sum() / total).item()
    if not bool(present.any()):
        return float("nan")
    a = a[present]
    if kind == "sum":
        return a.sum().item()
    if kind == "max":
        return a.max().item()
    if kind == "min":
        return a.min().item()
    return a[0].item()
