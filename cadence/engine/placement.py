"""Putting a step's micro-batches on the device: as they are used, or copied one ahead.

The loop asks once per fit for a `Placement` and then calls it without
branching: `placement.steps(feed.steps(...))` hands it each step's
micro-batches, and `placement.to_device` (None: nothing to do) places each one
as it is used. On the CPU both are the plain thing: the groups as they come and
no call per batch; the micro-batches the loop sees are always the host ones
the feed fetched (counted, kept as the pending step).

With prefetch (`EngineConfig.prefetch_to_device`, on by default when batches
go to a CUDA device) each micro-batch's copy is issued one ahead, the way
nanoGPT fetches its next batch before running the current one: the first
micro-batch's as soon as the step's micro-batches are fetched, the next one's
before the current one runs. On CUDA the copies run on a side stream, so the
copy engine moves the next batch while the device still computes the current
one (host batches from pinned memory make the copy asynchronous for the host
too); the compute stream waits for a batch's copy only when it uses the batch.

What the loader yields is never read ahead of the loop: the micro-batches of
a step are fetched when the step starts, as without prefetch, so the
loader's state at a save point is exactly the batches trained on (resume
stays bitwise) and `time.data_wait` measures the same fetch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

ToDevice = Callable[[Any], Any]


class Placement:
    """Batches used as they come, each placed by `to_device` when it is used (None: used as given)."""

    def __init__(self, to_device: ToDevice | None) -> None:
        #: What the loop calls on each micro-batch before `on_batch`; None: the batch is used as given.
        self.to_device = to_device

    def steps(self, groups: Iterable[Sequence[Any]]) -> Iterable[Sequence[Any]]:
        """Each step's micro-batches, as the loop iterates them (here: as the feed yields them)."""
        return groups

    @staticmethod
    def choose(to_device: ToDevice | None, device: torch.device, prefetch: bool | None) -> Placement:
        """The placement of a fit: `Prefetch` when asked for (None: when batches go to CUDA), else plain.

        Args:
            to_device: the backend's per-batch placement (`Step.to_device`), None when batches
                are used as given.
            device: where batches go.
            prefetch: `EngineConfig.prefetch_to_device`: True, False, or None (on for CUDA).
        """
        wanted = prefetch if prefetch is not None else to_device is not None and device.type == "cuda"
        if not wanted:
            return Placement(to_device)
        return Prefetch(to_device if to_device is not None else _as_given, device)


class Prefetch(Placement):
    """Copies each micro-batch one ahead of its use (on a side stream on CUDA).

    `steps()` hands the loop each step's micro-batches as the feed fetched
    them, after issuing the first one's copy; `to_device(batch)` then issues
    the next micro-batch's copy and returns `batch`'s, ready for the compute
    stream. A batch that is not the step's next (a callback placing its own)
    is copied then and there.
    """

    def __init__(self, place: ToDevice, device: torch.device) -> None:
        super().__init__(self.to_device_ahead)
        self.place = place
        self.device = device
        # A stream of its own for the copies (CUDA only): they overlap the compute stream's work.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._group: Sequence[Any] = ()
        self._next = 0  # the index in `_group` of the batch whose copy is `_ahead`
        self._ahead: tuple[Any, Any] | None = None

    def steps(self, groups: Iterable[Sequence[Any]]) -> Iterator[Sequence[Any]]:
        for group in groups:
            # The first copy goes out as soon as the step's micro-batches are fetched.
            self._group, self._next = group, 0
            self._ahead = self.copy(group[0]) if len(group) else None
            yield group
        self._group, self._ahead = (), None

    def to_device_ahead(self, batch: Any) -> Any:
        """`batch` on the device; the step's next micro-batch's copy is issued before it is returned."""
        group, index, ahead = self._group, self._next, self._ahead
        if ahead is None or index >= len(group) or group[index] is not batch:
            return self.ready(*self.copy(batch))
        self._next = index + 1
        self._ahead = self.copy(group[index + 1]) if index + 1 < len(group) else None
        return self.ready(*ahead)

    def copy(self, batch: Any) -> tuple[Any, Any]:
        """Issue `batch`'s copy; returns (the batch on the device, an event to wait for, or None)."""
        stream = self.stream
        if stream is None:
            return self.place(batch), None
        # Waits for nothing already queued on the compute stream: the copy overlaps it.
        with torch.cuda.stream(stream):
            placed = self.place(batch)
            event = torch.cuda.Event()
            event.record(stream)
        return placed, event

    def ready(self, placed: Any, event: Any) -> Any:
        """`placed`, once the compute stream may use it (it waits for the copy on the device, not the host)."""
        if event is None:
            return placed
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        # Allocated on the copy stream, used on this one: the allocator must not hand the memory
        # to the copy stream again before this stream's work on it is done.
        for tensor in _tensors(placed):
            if tensor.device.type == "cuda":
                tensor.record_stream(current)
        return placed


def _as_given(batch: Any) -> Any:
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors nested in tuples, lists and dicts (what `move_to` moves)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            yield from _tensors(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from _tensors(item)
