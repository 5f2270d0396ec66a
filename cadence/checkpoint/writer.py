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
import contextlib
import copy
import os
import threading
from collections.abc import Callable
from typing import Any

import attrs
import torch

from cadence.checkpoint import direct_io, file_io


class Staging:
    """CPU copies of a payload's tensors, kept and reused while shapes and dtypes stay the same.

    The copies live in a page-aligned buffer (`direct_io.image_empty`), laid out as the
    file store's files hold them: the tensors of each file (`file_io.file_for` of their
    top-level key) in walk order, each at the `file_io.padded` offset the file gives it,
    zeros in between, each file starting on a page. The store then writes each file as
    one buffer with direct I/O (`direct_io.write_image`): no copy into the page cache in
    the background, where it would take CPU time from the training loop. Other stores
    see ordinary tensors.

    `reserve(nbytes)` allocates the buffer ahead of the first save and faults its pages
    in from a low-priority thread, so that the first save copies into memory that is
    ready, as every later one does (see docs/checkpoints.md, "Async saves").
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.busy = False
        self._pools: list[torch.Tensor] = []  # usually one; more when the payload outgrew a reserve
        self._layout: tuple[Any, ...] | None = None
        self._prefault: threading.Thread | None = None
        self._prefault_lock = threading.Lock()
        self._prefault_stop = False

    @property
    def nbytes(self) -> int:
        return sum(pool.numel() for pool in self._pools)

    def reserve(self, nbytes: int, pin: bool = False) -> None:
        """Allocate `nbytes` of staging now and fault its pages in, in the background (no-op once allocated)."""
        if self._pools or nbytes <= 0:
            return
        self._pools = [direct_io.image_empty(nbytes, pin=pin)]
        self._prefault_stop = False
        self._prefault = threading.Thread(
            target=self._fault_in, args=(self._pools[0],), name="cadence-staging-prefault", daemon=True
        )
        self._prefault.start()

    def _fault_in(self, pool: torch.Tensor) -> None:
        with contextlib.suppress(AttributeError, OSError):  # work ahead of need: the loop comes first (Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), direct_io.PREFAULT_NICE)
        for i in range(0, pool.numel(), _PREFAULT_PIECE):
            with self._prefault_lock:
                if self._prefault_stop:
                    return
                piece = pool[i : i + _PREFAULT_PIECE]
                if not direct_io.populate(piece):
                    piece.zero_()  # no MADV_POPULATE_WRITE (Linux < 5.14): touch the pages (nothing is staged yet)

    def close(self) -> None:
        """Stop faulting in the reserved buffer (it stays allocated)."""
        with self._prefault_lock:
            self._prefault_stop = True
        if self._prefault is not None:
            self._prefault.join()
            self._prefault = None

    def stage(self, payload: Any) -> Any:
        """A copy of `payload` whose tensors live in this staging's buffer (other leaves deep-copied)."""
        sources = _sources(payload)
        self.close()  # the copies below write the buffer (and fault in what the thread has not)
        staged = self._place(list(sources.values()))
        synchronize = False
        for identity, (_, _, source) in sources.items():
            cuda = source.device.type == "cuda"
            # Device-to-host copies run asynchronously into pinned memory; one sync below.
            staged[identity].copy_(source, non_blocking=cuda)
            synchronize = synchronize or cuda
        if synchronize:
            torch.cuda.synchronize()

        def build(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                source = obj.detach()
                if not _plain(source):
                    return source.clone()  # sparse or subclass tensors: a plain copy, not a reused buffer
                return staged[_identity(source)]  # tied weights stay tied
            if isinstance(obj, dict):
                out: dict[Any, Any] = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
                for key, value in obj.items():
                    out[key] = build(value)
                if hasattr(obj, "_metadata"):
                    out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
                return out
            if isinstance(obj, list):
                return [build(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(build(v) for v in obj)
            return copy.deepcopy(obj)

        return build(payload)

    def _place(self, sources: list[Source]) -> dict[tuple[Any, ...], torch.Tensor]:
        """A buffer for each source, by identity: the previous ones while the layout is the same."""
        layout = tuple((path, file, tuple(s.shape), s.dtype, s.device.type == "cuda") for path, file, s in sources)
        if layout != self._layout:
            self._layout = None
            offsets, sizes = _layout(sources)
            images = {file: _page(size) for file, size in sizes.items()}
            pin = any(cuda for *_, cuda in layout)
            pools = [pool for pool in self._pools if pool.is_pinned() or not pin]
            starts: dict[str, tuple[int, int]] = {}  # file -> (pool, start): the files in order, each in one pool
            k = used = 0
            for n, (file, length) in enumerate(images.items()):
                while k < len(pools) and used + length > pools[k].numel():
                    k, used = k + 1, 0
                if k == len(pools):  # no room left (a reserve too small): one more buffer for the files left
                    pools.append(direct_io.image_empty(sum(list(images.values())[n:]), pin=pin))
                starts[file], used = (k, used), used + length
            self._pools = pools[: k + 1]
            placed: dict[str, int] = {}
            buffers = {}
            for path, file, source in sources:
                n = placed.get(file, 0)
                placed[file] = n + 1
                k, base = starts[file]
                start = base + offsets[file][n]
                nbytes = source.numel() * source.element_size()
                buffers[path] = self._pools[k][start : start + nbytes].view(source.dtype).view(source.shape)
                end = base + (offsets[file][n + 1] if n + 1 < len(offsets[file]) else images[file])
                self._pools[k][start + nbytes : end].zero_()  # what the file holds after the tensor: zeros
            self.buffers = buffers
            self._layout = layout
        return {_identity(source): self.buffers[path] for path, _, source in sources}


_PREFAULT_PIECE = 64 << 20
_SLACK = 1 << 20  # `reserve`: room for the small tensors a payload adds (RNG states)

Source = tuple[tuple[Any, ...], str, torch.Tensor]  # path in the payload, file, tensor


def staged_size(payload: Any) -> int:
    """The bytes a `Staging` of `payload` takes, plus room for the small entries of a full payload (RNG states)."""
    return sum(map(_page, _layout(list(_sources(payload).values()))[1].values())) + _SLACK


def _sources(payload: Any) -> dict[tuple[Any, ...], Source]:
    """The payload's plain tensors, each once (by identity), in walk order."""
    sources: dict[tuple[Any, ...], Source] = {}

    def collect(obj: Any, path: tuple[Any, ...]) -> None:
        if isinstance(obj, torch.Tensor):
            source = obj.detach()
            if _plain(source):
                sources.setdefault(_identity(source), (path, file_io.file_for(path[0]) if path else "", source))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                collect(value, (*path, key))
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                collect(value, (*path, i))

    collect(payload, ())
    return sources


def _layout(sources: list[Source]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Each file's tensor offsets (as `file_io.split` lays them out) and size, files in order of appearance."""
    offsets: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for _, file, source in sources:
        offset = file_io.padded(sizes.get(file, 0))
        offsets.setdefault(file, []).append(offset)
        sizes[file] = offset + source.numel() * source.element_size()
    return offsets, sizes


def _page(size: int) -> int:
    return -(-size // direct_io.ALIGN) * direct_io.ALIGN


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and type(t) is torch.Tensor and not t.is_quantized


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


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
        share: the share of the time the thread's direct writes keep the disk
            busy while nobody waits for them (`direct_io.Pace`); 1: full speed.
            Whoever waits for the thread (`drain`, `close`, a `submit` that
            must wait for a job to be taken) makes it write at full speed.
    """

    def __init__(self, commit: Callable[[Job], None], supersede: bool = True, share: float = 1.0) -> None:
        self._commit = commit
        self.supersede = supersede
        self._pace = direct_io.Pace(share)
        self._waiters = 0  # threads waiting for the writer: it writes at full speed meanwhile
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

    @property
    def staged(self) -> bool:
        """Whether a staging buffer is allocated (by a save or `reserve`)."""
        return any(s.nbytes for s in self._stagings)

    def reserve(self, nbytes: int, pin: bool = False) -> None:
        """Allocate a staging buffer of `nbytes` ahead of the first save, faulted in from a background thread."""
        with self._cond:
            staging = next((s for s in self._stagings if not s.busy), None)
        if staging is not None and not self.staged:
            staging.reserve(nbytes, pin)

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
            if self._queued is not None:
                self._wait_for(lambda: self._queued is None, None)
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
                if not self._waiters:
                    self._pace.hurry.clear()
                self._cond.notify_all()
            error: BaseException | None = None
            try:
                with direct_io.paced(self._pace):
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
            return self._wait_for(lambda: self._queued is None and self._inflight is None, timeout)

    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """`self._cond.wait_for`, held: the write in flight goes at full speed while someone waits."""
        if timeout is not None and timeout <= 0:  # a look, not a wait
            return predicate()
        self._waiters += 1
        self._pace.hurry.set()
        try:
            return self._cond.wait_for(predicate, timeout)
        finally:
            self._waiters -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Drain, then stop the thread; False if writes were still running after `timeout` s."""
        drained = self.drain(timeout)
        for staging in self._stagings:
            staging.close()
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
