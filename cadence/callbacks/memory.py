"""CUDA memory figures for `TrainMetrics`, read at each reduction (nothing in the step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

_GIB = float(2**30)


class CudaMemory:
    """The caching allocator's peaks and retries on one CUDA device, per log interval.

    At each reduction `log` reads `torch.cuda.memory_stats` once (host-side
    counters: no device sync), logs

    - `memory.peak_allocated_gib`: the most memory tensors held at once in the
      interval (`allocated_bytes.all.peak`),
    - `memory.peak_reserved_gib`: the most the allocator reserved from the
      driver (`reserved_bytes.all.peak`; above the allocated peak by the
      allocator's cache and fragmentation),
    - `memory.alloc_retries`: how often an allocation failed, the cache was
      freed and the allocation retried (`num_alloc_retries`; each one a costly
      synchronize: a sign the run is near its memory limit),

    the peaks as the maximum over ranks and the retries summed, then resets
    the peaks (`torch.cuda.reset_peak_memory_stats`) so that each interval
    reports its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._retries = 0  # the cumulative count at the last reading

    @classmethod
    def started(cls, device: torch.device) -> CudaMemory | None:
        """A reader for `device` with its first interval started, or None when it is not a CUDA device."""
        if device.type != "cuda":
            return None
        reader = cls(device)
        reader.start()
        return reader

    def start(self) -> None:
        """Begin an interval here (a fit's start): peaks reset, retries counted from now."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._retries = int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def log(self, engine: Engine) -> None:
        """Log the interval's figures through `engine.log` and start the next interval."""
        stats = torch.cuda.memory_stats(self.device)
        engine.log("memory.peak_allocated_gib", stats.get("allocated_bytes.all.peak", 0) / _GIB, "max")
        engine.log("memory.peak_reserved_gib", stats.get("reserved_bytes.all.peak", 0) / _GIB, "max")
        retries = int(stats.get("num_alloc_retries", 0))
        engine.log("memory.alloc_retries", float(retries - self._retries), "sum")
        self._retries = retries
        torch.cuda.reset_peak_memory_stats(self.device)
