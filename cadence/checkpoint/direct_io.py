"""Page-aligned memory and direct I/O (Linux; elsewhere these help with nothing and cost nothing).

`aligned_empty` gives tensors' memory that direct I/O can fill, in transparent huge pages
where the kernel offers them; `Prefault` faults such memory in from other threads ahead of
its use (`MADV_POPULATE_WRITE`: one call per piece instead of one page fault per page);
`cached_fraction` says how much of a file is in the page cache (`mincore`); `host_bytes`
is a CPU tensor's memory as a buffer that file and checksum calls take.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Any

import torch

ALIGN = 4096  # file offsets, lengths and addresses of direct I/O (any logical block size up to 4 KiB)
PREFAULT_THREADS = 2  # faulting in memory the host has taken back is CPU-bound: faster on two cores
PREFAULT_NICE = 10  # ... but it is work ahead: lower priority (Linux: per thread)
LINUX = sys.platform.startswith("linux")
O_DIRECT = getattr(os, "O_DIRECT", 0) if LINUX else 0
_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable memoryview, without a copy.

    What `tensor.numpy()` gave, without needing numpy (not a dependency): the
    view keeps the tensor alive.
    """
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._tensor = tensor  # type: ignore[attr-defined]  # the memory's owner lives as long as the view
    return memoryview(array).cast("B")


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
