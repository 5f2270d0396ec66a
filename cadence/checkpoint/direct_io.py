"""Page-aligned memory and direct I/O (Linux; elsewhere these help with nothing and cost nothing).

`aligned_empty` gives tensors' memory that direct I/O can fill, in transparent huge pages
where the kernel offers them; `Prefault` faults such memory in from other threads ahead of
its use (`MADV_POPULATE_WRITE`: one call per piece instead of one page fault per page);
`cached_fraction` says how much of a file is in the page cache (`mincore`).
`image_empty` gives memory that holds files' bytes exactly as they will be on the disk
(the async writer's staging), and `write_image` writes such a file image with direct I/O,
at the `Pace` of the thread that writes (the async writer's: a share of the time).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

ALIGN = 4096  # file offsets, lengths and addresses of direct I/O (any logical block size up to 4 KiB)
PREFAULT_THREADS = 2  # faulting in memory the host has taken back is CPU-bound: faster on two cores
PREFAULT_NICE = 10  # ... but it is work ahead: lower priority (Linux: per thread)
LINUX = sys.platform.startswith("linux")
O_DIRECT = getattr(os, "O_DIRECT", 0) if LINUX else 0
_HUGE = 2 << 20
_WRITE = 32 << 20  # bytes per direct write: few Python iterations, several requests in flight in the kernel
DIRECT_MIN = 8 << 20  # smaller images are written buffered: a direct write waits on the device, for little CPU saved
_images: dict[int, int] = {}  # start address -> length of the live buffers from `image_empty`
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_pacing = threading.local()  # the `Pace` of the thread that writes, if any


class Pace:
    """How much of the time a background write keeps the disk busy while nobody waits for it.

    After each direct write of `_WRITE` bytes that took `t` seconds, the writing
    thread rests `t * (1 / share - 1)` seconds, unless `hurry` is set (the loop
    waits for the write: a drain, a teardown, a save with no free staging
    buffer), which ends the rest at once. A durable write moves every byte
    through the host while the training step runs; spread over a longer time,
    it takes less from each step (`benchmarks/checkpoint.py`, "steps during an
    async write").
    """

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"Pace: share must be in (0, 1], got {share!r}")
        self.share = share
        self.hurry = threading.Event()

    def rest(self, busy: float) -> None:
        if self.share < 1 and not self.hurry.is_set():
            self.hurry.wait(busy * (1 / self.share - 1))


@contextlib.contextmanager
def paced(pace: Pace | None) -> Any:
    """Direct writes of this thread (`write_image`) go at `pace` inside the block."""
    before = getattr(_pacing, "pace", None)
    _pacing.pace = pace
    try:
        yield
    finally:
        _pacing.pace = before


def aligned_empty(nbytes: int) -> torch.Tensor:
    """Uninitialized bytes starting on an ALIGN boundary; huge pages advised where the kernel has them."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    buffer = raw[skip : skip + nbytes]
    if nbytes >= 2 * _HUGE:
        first = -(-buffer.data_ptr() // _HUGE) * _HUGE
        last = (buffer.data_ptr() + nbytes) // _HUGE * _HUGE
        _madvise(first, last - first, _MADV_HUGEPAGE)
    return buffer


def image_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """Page-aligned bytes (`nbytes` rounded up to ALIGN) that `image_of` recognizes as file images.

    Pinned (`pin`) for copies from a CUDA device. Uninitialized: the user zeroes what a file
    holds between its tensors. Its pages are not touched here (see `Prefault`, `populate`).
    Recognized while the returned tensor object lives (views of it alone do not count).
    """
    nbytes = -(-nbytes // ALIGN) * ALIGN
    if pin:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % ALIGN
        buffer = raw[skip : skip + nbytes]
    else:
        buffer = aligned_empty(nbytes)
    start = buffer.data_ptr()
    _images[start] = nbytes
    weakref.finalize(buffer, _images.pop, start, None)  # the registration ends with the buffer object
    return buffer


def image_of(tensors: list[torch.Tensor], offsets: list[int], size: int) -> torch.Tensor | None:
    """The bytes of a file of `size` bytes holding `tensors` at `offsets` as one page-aligned buffer
    (rounded up to ALIGN), if they lie that way in a buffer from `image_empty`; else None."""
    if not _images or not hasattr(os, "pwrite"):
        return None
    base = storage = None
    for tensor, offset in zip(tensors, offsets, strict=True):
        if not tensor.numel():
            continue
        if storage is None:
            storage, base = tensor.untyped_storage(), tensor.data_ptr() - offset
        elif tensor.data_ptr() - offset != base or tensor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
    if storage is None or base is None or base % ALIGN:
        return None
    length = -(-size // ALIGN) * ALIGN
    start = storage.data_ptr()
    inside = any(s <= base and base + length <= s + n for s, n in list(_images.items()))  # (a copy: GC may edit)
    if not inside or base + length > start + storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, base - start, (length,), (1,))


def write_image(path: Any, fd: int, image: torch.Tensor, size: int, written: Callable[[int], None]) -> None:
    """Write `image` (from `image_of`) from offset 0 of the open file `fd` at `path`, then cut the file to `size`.

    With direct I/O where the filesystem takes it: the disk reads the bytes from `image`
    itself, with no copy into the page cache. That copy and the page cache's new pages
    are most of what a buffered write costs in CPU time (0.3-2 CPU-s per GB on a virtual
    machine against 0.02-0.05), time a training loop running beside the write loses.
    Elsewhere (tmpfs, some network filesystems, not Linux), and for files under
    DIRECT_MIN (a direct write waits on the device: 0.5 MB in three files took 48 ms
    against 36 ms buffered), the same writes go through the page cache. `written(n)` is
    called as the first `n` bytes are written.
    """
    direct = -1
    if O_DIRECT and size >= DIRECT_MIN:
        with contextlib.suppress(OSError):  # EINVAL: this filesystem has no direct I/O
            direct = os.open(path, os.O_WRONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    # The image's bytes without numpy (not a declared dependency): a ctypes view of its memory.
    count = image.numel() * image.element_size()
    view = memoryview((ctypes.c_ubyte * count).from_address(image.data_ptr())).cast("B") if count else memoryview(b"")
    pace: Pace | None = getattr(_pacing, "pace", None)
    try:
        position = 0
        while position < len(view):
            start = time.perf_counter()
            try:
                position += os.pwrite(direct if direct >= 0 else fd, view[position : position + _WRITE], position)
            except OSError as exc:
                if direct < 0 or exc.errno != errno.EINVAL:
                    raise
                os.close(direct)  # an alignment this device refuses: the rest through the page cache
                direct = -1
                continue
            written(min(position, size))
            if pace is not None and position < len(view):
                pace.rest(time.perf_counter() - start)
    finally:
        if direct >= 0:
            os.close(direct)
    os.ftruncate(fd, size)


class Prefault:
    """Faults in the pages of `pieces` (of buffers from `aligned_empty`), in order, ahead of their use.

    The calling thread does the first piece (its user must not wait); `reached(piece)`
    says where the user is: pieces behind it are skipped, and a user that overtakes
    the threads faults its pages itself.
    """

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        self._order = {piece.data_ptr(): n for n, piece in enumerate(pieces)}
        self._reached = 0
        self._stop = False
        self._pending = iter(enumerate(pieces[1:], 1))
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name="cadence-prefault", daemon=True) for _ in range(PREFAULT_THREADS)
        ]
        for thread in self._threads:
            thread.start()
        if not populate(pieces[0]):  # not supported here (Linux < 5.14)
            self._stop = True

    def reached(self, piece: torch.Tensor) -> None:
        """The reads are at this piece now."""
        self._reached = self._order.get(piece.data_ptr(), self._reached)

    def _run(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # work ahead: the reads and checksums come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFAULT_NICE)
        while not self._stop:
            with self._lock:
                n, piece = next(self._pending, (0, None))
            if piece is None:
                return
            if n > self._reached:
                populate(piece)

    def close(self) -> None:
        self._stop = True
        for thread in self._threads:
            thread.join()


# -- the kernel's help (Linux; elsewhere these do nothing) ---------------------------------

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = False
        if LINUX:
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                integers = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]  # prot, flags, fd, offset
                lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *integers]
                lib.mmap.restype = ctypes.c_void_p
                lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                _libc = lib
            except (OSError, AttributeError):
                pass
    return _libc


def _madvise(address: int, length: int, advice: int) -> bool:
    """madvise on the whole pages inside [address, address + length); False if it failed."""
    lib = _lib()
    first = -(-address // ALIGN) * ALIGN
    last = (address + length) // ALIGN * ALIGN
    if not lib or last <= first:
        return bool(lib)
    return lib.madvise(first, last - first, advice) == 0  # the call releases the GIL


def populate(piece: torch.Tensor) -> bool:
    return _madvise(piece.data_ptr(), piece.numel(), _MADV_POPULATE_WRITE)


def cached_fraction(fd: int, size: int) -> float:
    """The fraction of a file's pages in the page cache (mincore on a mapping that is never touched)."""
    lib = _lib()
    if not lib or size <= 0:
        return 0.0
    prot_read, map_shared = 1, 1
    address = lib.mmap(None, size, prot_read, map_shared, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        return 0.0
    try:
        pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
        vector = ctypes.create_string_buffer(pages)
        if lib.mincore(address, size, vector) != 0:
            return 0.0
        return 1.0 - vector.raw.count(0) / pages
    finally:
        lib.munmap(address, size)
