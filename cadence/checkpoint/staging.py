"""The async writer's staging: CPU copies of a payload's tensors, laid out as the file store's files.

`Staging` keeps page-aligned buffers from save to save (`direct_io.image_empty`),
pinned when the payload has CUDA tensors. CPU tensors are copied in the loop;
CUDA tensors are copied on a side stream (`device_copy.DeviceCopy`), so the
loop goes on while the state crosses to the host, and the writer thread waits
for those copies (`Staging.wait_copied`) before it reads the buffers. See
docs/checkpoints.md, "Async saves" and "Async saves on GPUs".
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import threading
from collections.abc import Collection
from typing import Any

import torch

from cadence.checkpoint import direct_io, file_io
from cadence.checkpoint.device_copy import DeviceCopy


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
        self.copies: DeviceCopy | None = None  # the CUDA tensors' copies (created at the first)

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

    def stage(self, payload: Any, late: Collection[int] = ()) -> Any:
        """A copy of `payload` whose tensors live in this staging's buffer (other leaves deep-copied).

        CPU tensors are copied before it returns; CUDA tensors are copied on a side
        stream, after the work already queued on their device (`DeviceCopy.start`):
        the device's current stream waits for the copies at once, but for the
        tensors whose storage (`untyped_storage().data_ptr()`) is in `late`, the
        ones only the next optimizer step writes, which it waits for at `release()`.
        The buffers hold the values once `wait_copied()` returns.
        """
        sources = _sources(payload)
        self.close()  # the copies below write the buffer (and fault in what the thread has not)
        staged = self._place(list(sources.values()))
        early: list[tuple[torch.Tensor, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for identity, (_, _, source) in sources.items():
            if source.device.type == "cuda":
                (later if source.untyped_storage().data_ptr() in late else early).append((staged[identity], source))
            else:
                staged[identity].copy_(source)
        if early or later:
            if self.copies is None:
                self.copies = DeviceCopy()
            self.copies.start(early, later)

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

    def wait_copied(self) -> None:
        """Block until the CUDA copies of the last `stage` are in the buffers (the writer thread, before it reads)."""
        if self.copies is not None:
            self.copies.wait()

    def release(self) -> None:
        """Make the devices' current streams wait for the last `stage`'s late copies (on the GPU, no host wait)."""
        if self.copies is not None:
            self.copies.release()

    def _place(self, sources: list[Source]) -> dict[tuple[Any, ...], torch.Tensor]:
        """A buffer for each source, by identity: the previous ones while the layout is the same."""
        layout = tuple((path, file, tuple(s.shape), s.dtype, s.device.type == "cuda") for path, file, s in sources)
        if layout != self._layout:
            self._layout = None
            offsets, sizes = _layout(sources)
            images = {file: _page(size) for file, size in sizes.items()}
            pin = any(cuda for *_, cuda in layout)
            pools = [pool for pool in self._pools if not pin or pool.is_pinned()]  # (asked only with CUDA)
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
