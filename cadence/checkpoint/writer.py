"""The Checkpoint callback's background writer: reused CPU staging buffers, one write in flight.

The loop only waits for the payload's tensors to be copied into staging
buffers (`Staging`, reused from save to save); a thread commits them. At most
one job is written while at most one waits: a newer `latest`-only job replaces
a waiting one, a job that makes `best` or a history snapshot is never dropped
(the loop waits for the writer to take it instead). Whether a job still waits
depends on the thread's timing, so for a collective store, whose ranks must
enter the same writes, nothing is superseded (`supersede=False`): every rank
writes every job, in submission order. Errors are kept for the loop to raise
at its next step.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable
from typing import Any

import attrs
import torch


class Staging:
    """CPU copies of a payload's tensors, kept and reused while shapes and dtypes stay the same."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.busy = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, payload: Any) -> Any:
        """A copy of `payload` whose tensors live in this staging's buffers (other leaves deep-copied)."""
        used: set[tuple[Any, ...]] = set()
        seen: dict[tuple[Any, ...], torch.Tensor] = {}
        synchronize = False

        def walk(obj: Any, path: tuple[Any, ...]) -> Any:
            nonlocal synchronize
            if isinstance(obj, torch.Tensor):
                source = obj.detach()
                if source.layout != torch.strided or type(source) is not torch.Tensor:
                    return source.clone()  # sparse or subclass tensors: a plain copy, not a reused buffer
                identity = (
                    source.device,
                    source.untyped_storage().data_ptr(),
                    source.storage_offset(),
                    tuple(source.shape),
                    tuple(source.stride()),
                    source.dtype,
                )
                if identity in seen:  # tied weights stay tied
                    return seen[identity]
                buffer = self.buffers.get(path)
                if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                    pin = source.device.type == "cuda"
                    buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
                    self.buffers[path] = buffer
                # Device-to-host copies run asynchronously into pinned memory; one sync below.
                buffer.copy_(source, non_blocking=source.device.type == "cuda")
                synchronize = synchronize or source.device.type == "cuda"
                used.add(path)
                seen[identity] = buffer
                return buffer
            if isinstance(obj, dict):
                out: dict[Any, Any] = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
                for key, value in obj.items():
                    out[key] = walk(value, (*path, key))
                if hasattr(obj, "_metadata"):
                    out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
                return out
            if isinstance(obj, list):
                return [walk(v, (*path, i)) for i, v in enumerate(obj)]
            if isinstance(obj, tuple):
                return tuple(walk(v, (*path, i)) for i, v in enumerate(obj))
            return copy.deepcopy(obj)

        staged = walk(payload, ())
        for path in set(self.buffers) - used:  # the payload changed shape: free what is gone
            del self.buffers[path]
        if synchronize:
            torch.cuda.synchronize()
        return staged


@attrs.define
class Job:
    """One commit: write `payload` as `primary` (None: no write), then give it the names in `links`.

    `full` False: this rank's replica group does not write the run's checkpoint
    at this save (TorchFT: another group does); only its own data state is
    written (`CheckpointStore.write_replica`), and no name is linked.
    """

    payload: Any
    primary: str | None
    links: tuple[str, ...]
    step: int
    epoch: int
    reason: str
    staging: Staging | None = None
    full: bool = True

    @property
    def droppable(self) -> bool:
        """Only `latest` would change: a newer job may replace it."""
        return self.primary == "latest" and not self.links

    @property
    def names(self) -> tuple[str, ...]:
        return ((self.primary,) if self.primary else ()) + self.links


class AsyncWriter:
    """A thread that runs `commit(job)` for submitted jobs, one at a time.

    Args:
        commit: writes one job (in the thread).
        supersede: a newer `latest`-only job replaces a waiting one, and a job
            that only adds names joins the waiting job. False: every job is
            committed as submitted, so the jobs do not depend on the thread's
            timing (the same on every rank of a collective store).
    """

    def __init__(self, commit: Callable[[Job], None], supersede: bool = True) -> None:
        self._commit = commit
        self.supersede = supersede
        self._cond = threading.Condition()
        self._queued: Job | None = None
        self._inflight: Job | None = None
        self._stagings = [Staging(), Staging()]
        self._thread: threading.Thread | None = None
        self._closing = False
        self.error: BaseException | None = None
        self.failed: Job | None = None
        self.done: list[Job] = []

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="cadence-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Stage `job.payload` and queue the job (waits while a job it may not replace is waiting)."""
        with self._cond:
            staging = None
            queued = self._queued
            if queued is not None and job.payload is None and self.supersede:
                # Only new names for the state last submitted, which is the waiting job: add them to it.
                queued.links = tuple(dict.fromkeys(queued.links + job.links))
                return
            if queued is not None and queued.droppable and job.primary == "latest" and self.supersede:
                staging, self._queued = queued.staging, None  # superseded by a newer save
            while self._queued is not None:
                self._cond.wait()
            if staging is None and job.payload is not None:
                free = [s for s in self._stagings if not s.busy]
                staging = max(free, key=lambda s: s.nbytes)  # the one with buffers already allocated
            if staging is not None:
                staging.busy = True
        try:
            if job.payload is not None and staging is not None:
                job.payload, job.staging = staging.stage(job.payload), staging
            elif staging is not None:
                staging.busy = False
        except BaseException:
            if staging is not None:
                staging.busy = False
            raise
        with self._cond:
            self._queued = job
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._closing:
                    self._cond.wait()
                if self._queued is None:
                    return
                job, self._queued = self._queued, None
                self._inflight = job
                self._cond.notify_all()
            error: BaseException | None = None
            try:
                self._commit(job)
            except BaseException as exc:
                error = exc
            with self._cond:
                self._inflight = None
                if job.staging is not None:
                    job.staging.busy = False
                    job.payload = None
                if error is None:
                    self.done.append(job)
                elif self.error is None:
                    self.error, self.failed = error, job
                self._cond.notify_all()

    def pending(self) -> bool:
        with self._cond:
            return self._queued is not None or self._inflight is not None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job is committed (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued is None and self._inflight is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Drain, then stop the thread; False if writes were still running after `timeout` s."""
        drained = self.drain(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if drained and self._thread is not None:
            self._thread.join()
            self._thread = None
        return drained

    def take(self) -> tuple[list[Job], BaseException | None, Job | None]:
        """Committed jobs since the last call, and the first error (each reported once)."""
        with self._cond:
            done, self.done = self.done, []
            error, failed, self.error, self.failed = self.error, self.failed, None, None
        return done, error, failed
