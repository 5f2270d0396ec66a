"""Reading tensor files: from the disk straight into page-aligned, prefaulted memory, checksummed as they arrive.

A cold restore costs memory as much as disk time: a buffered read allocates page-cache
pages and copies them, and new tensors fault their pages in one at a time (on a virtual
machine whose free memory the host takes back, both cost more than the disk). So:

- Direct I/O (`O_DIRECT`): the disk writes into the tensors' memory; no page cache, no
  copy. Used for a file larger than 8 MB that is mostly not in the page cache (`mincore`)
  on a filesystem that takes it, unless other processes of a `torch.distributed` job read
  it too (they share one cached copy); otherwise the same reads go through the page cache.
- Large tensors (1 MB and more) get their own page-aligned buffer (transparent huge pages
  where the kernel offers them); two threads fault the pages of every file's buffers in
  (`MADV_POPULATE_WRITE`, about 6x cheaper than page by page), in file order, ahead of
  the reads, and two reads are under way at once. The tensor is a view of its buffer;
  tensors start at 64-byte offsets in their file (`file_io.padded`), so it is aligned.
- Small tensors are read a run at a time into one reused buffer and copied out.
- The checksum (`TensorChecksum`) runs on each piece as it arrives (a thread for large files).

Nothing here writes into a tensor that exists: the engine takes the new tensors over (the
optimizer keeps them as its state, the model copies from them) only after every file is
verified. Measurements: docs/checkpoints.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from cadence.backends.file_io import CHUNK, TensorChecksum, _flat_bytes
from cadence.engine.checkpoint import CheckpointError

ALIGN = 4096  # file offsets, lengths and addresses of direct reads (any logical block size up to 4 KiB)
BIG = 1 << 20  # tensors of at least this many bytes get their own aligned buffer (no copy)
DIRECT_MIN = 8 << 20  # smaller files are read through the page cache
IN_FLIGHT = 2  # direct reads under way at once: the disk never waits for the next request
PREFAULT_THREADS = 2  # faulting in memory the host has taken back is CPU-bound: faster on two cores
PREFAULT_NICE = 10  # ... but it is work ahead: lower priority (Linux: per thread)
_THREADED = 8 << 20  # below this a second thread (checksum, prefault) costs more than it saves
_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_LINUX = sys.platform.startswith("linux")
_O_DIRECT = getattr(os, "O_DIRECT", 0) if _LINUX else 0
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

Entry = tuple[Any, ...]  # (index, offset, nbytes, dtype, shape)
Group = tuple[str, list[Entry]]


class TensorReads:
    """Reads the tensor files of one checkpoint, in order, into new tensors (`out`) or only checksums them.

    Planned for all files at once, so that the pages of every file's large tensors
    are faulted in ahead of the reads across file boundaries. `read(i)` reads file
    `i` and returns its checksum; use as a context manager.

    Args:
        files: `(path, entries)` per file; entries `(index, offset, nbytes, dtype, shape)`
            in file order.
        out: where the tensors go, by index; None: compute the checksums only, through
            one reused buffer.
        direct: True or False forces direct I/O on or off (True falls back to the page
            cache where the filesystem refuses it); None decides per file.
    """

    def __init__(self, files: list[tuple[Path, list[Entry]]], out: dict[int, torch.Tensor] | None, direct: bool | None):
        self.files, self.out, self.direct = files, out, direct
        self.plans: list[list[Group]] = []
        self.buffers: list[list[torch.Tensor]] = []
        pieces: list[torch.Tensor] = []
        for path, entries in files:
            position = 0
            for _, offset, nbytes, *_ in entries:
                if offset < position:
                    raise CheckpointError(f"{path.name}: tensor table out of order at byte {offset}", path=path.parent)
                position = offset + nbytes
            plan = _plan(entries, BIG if out is not None else None)
            own = [_aligned_empty(_span(group)[1] - _span(group)[0]) for kind, group in plan if kind == "own"]
            self.plans.append(plan)
            self.buffers.append(own)
            pieces += [buffer[i : i + CHUNK] for buffer in own for i in range(0, buffer.numel(), CHUNK)]
        self.prefault = _Prefault(pieces) if sum(p.numel() for p in pieces) >= _THREADED else None
        self._pool = concurrent.futures.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="cadence-read")
        self._inflight: collections.deque[tuple[concurrent.futures.Future[None], Any]] = collections.deque()

    def __enter__(self) -> TensorReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()
        if self.prefault is not None:
            self.prefault.close()

    def read(self, i: int) -> int:
        path, entries = self.files[i]
        size = entries[-1][1] + entries[-1][2] if entries else 0
        checksum = TensorChecksum(threaded=self.out is not None and size >= _THREADED)  # a reused buffer: inline
        try:
            with _Reader(path, size, self.direct) as reader:
                try:
                    self._read_groups(i, reader, checksum)
                finally:
                    self._settle(0, errors=False)  # no read may still run once the file is closed
        finally:
            value = checksum.finish()
        return value

    def _read_groups(self, i: int, reader: _Reader, checksum: TensorChecksum) -> None:
        scratch = None
        buffers = iter(self.buffers[i])
        for kind, group in self.plans[i]:
            if kind == "own":
                self._read_own(reader, group[0], next(buffers), checksum)
                continue
            self._settle(0)
            if scratch is None:
                last = self.files[i][1][-1]
                scratch = _aligned_empty(min(CHUNK, last[1] + last[2]) + 2 * ALIGN)
            if kind == "pack":
                _read_pack(reader, group, scratch, checksum, self.out)
            else:
                _read_stream(reader, group[0], scratch, checksum)
        self._settle(0)

    def _read_own(self, reader: _Reader, entry: Entry, buffer: torch.Tensor, checksum: TensorChecksum) -> None:
        """Read a large tensor into its buffer, a piece at a time with the next piece's read already under way."""
        assert self.out is not None
        index, offset, nbytes, dtype, shape = entry
        start = offset // ALIGN * ALIGN
        flat = buffer[offset - start : offset - start + nbytes]
        fed = 0

        def arrived(end: int) -> None:  # the pieces before `end` are read: checksum the tensor's pieces they hold
            nonlocal fed
            ready = min(nbytes, end - offset)
            while fed < nbytes and min(fed + CHUNK, nbytes) <= ready:  # pieces start at the tensor's start
                checksum.update(flat[fed : fed + CHUNK])
                fed += CHUNK
            if fed >= nbytes:
                assert self.out is not None
                self.out[index] = _typed(flat, dtype, shape)

        for piece in range(0, buffer.numel(), CHUNK):
            view = buffer[piece : piece + CHUNK]
            if self.prefault is not None:
                self.prefault.reached(view)
            need = min(view.numel(), offset + nbytes - start - piece)
            self._settle(IN_FLIGHT - 1)
            future = self._pool.submit(reader.read, view, start + piece, need)
            self._inflight.append((future, functools.partial(arrived, start + piece + view.numel())))

    def _settle(self, keep: int, errors: bool = True) -> None:
        """Wait for the oldest reads until at most `keep` are in flight; each one's follow-up runs in order."""
        while len(self._inflight) > keep:
            future, then = self._inflight.popleft()
            if not errors:
                future.exception()  # wait, and leave the error that is already on its way up
                continue
            future.result()
            then()


def _plan(entries: list[Entry], own_min: int | None) -> list[Group]:
    """Groups in file order: "own" (one large tensor, its own buffer), "pack" (a run of small
    tensors read in one go through the scratch buffer), "stream" (one tensor larger than it)."""
    groups: list[Group] = []
    pack: list[Entry] = []
    for entry in entries:
        offset, nbytes = entry[1], entry[2]
        if own_min is not None and nbytes >= own_min:
            kind = "own"
        elif nbytes > CHUNK:
            kind = "stream"
        else:
            if pack and offset + nbytes - pack[0][1] > CHUNK:
                groups.append(("pack", pack))
                pack = []
            pack.append(entry)
            continue
        if pack:
            groups.append(("pack", pack))
            pack = []
        groups.append((kind, [entry]))
    if pack:
        groups.append(("pack", pack))
    return groups


def _span(group: list[Entry]) -> tuple[int, int]:
    """The aligned file range holding a group's bytes."""
    start, end = group[0][1], group[-1][1] + group[-1][2]
    return start // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN


def _read_pack(
    reader: _Reader, group: list[Entry], scratch: torch.Tensor, checksum: TensorChecksum, out: dict[int, Any] | None
) -> None:
    start, end = _span(group)
    last = group[-1]
    reader.read(scratch[: end - start], start, last[1] + last[2] - start)
    for index, offset, nbytes, dtype, shape in group:
        data = scratch[offset - start : offset - start + nbytes]
        if out is None:
            checksum.update(data)  # inline: the scratch buffer is reused
            continue
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        flat = _flat_bytes(tensor)
        flat.copy_(data)
        checksum.update(flat)
        out[index] = tensor


def _read_stream(reader: _Reader, entry: Entry, scratch: torch.Tensor, checksum: TensorChecksum) -> None:
    """Checksum one tensor larger than the scratch buffer, a piece at a time (checking only)."""
    _, offset, nbytes, *_ = entry
    for piece in range(0, nbytes, CHUNK):
        length = min(CHUNK, nbytes - piece)
        start = (offset + piece) // ALIGN * ALIGN
        skip = offset + piece - start
        reader.read(scratch[: -(-(skip + length) // ALIGN) * ALIGN], start, skip + length)
        checksum.update(scratch[skip : skip + length])


def _typed(flat: torch.Tensor, dtype: str, shape: Any) -> torch.Tensor:
    kind = getattr(torch, dtype)
    try:
        return flat.view(kind).view(shape)
    except RuntimeError:  # an offset that is no multiple of the element size: a copy of its own
        tensor = torch.empty(shape, dtype=kind)
        _flat_bytes(tensor).copy_(flat)
        return tensor


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """Uninitialized bytes starting on an ALIGN boundary; huge pages advised where the kernel has them."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    buffer = raw[skip : skip + nbytes]
    if nbytes >= 2 * _HUGE:
        first = -(-buffer.data_ptr() // _HUGE) * _HUGE
        last = (buffer.data_ptr() + nbytes) // _HUGE * _HUGE
        _madvise(first, last - first, _MADV_HUGEPAGE)
    return buffer


class _Reader:
    """Reads aligned ranges of one file, directly or through the page cache (thread-safe)."""

    def __init__(self, path: Path, size: int, direct: bool | None) -> None:
        self.path = path
        self.plain = os.open(path, os.O_RDONLY | _CLOEXEC)
        self.direct: int | None = None
        self.refused = False
        try:
            if _O_DIRECT and size and direct is not False and (direct or _direct_pays(self.plain, size)):
                try:
                    self.direct = os.open(path, os.O_RDONLY | _O_DIRECT | _CLOEXEC)
                except OSError:  # a filesystem without direct I/O (tmpfs, some network mounts)
                    pass
            if self.direct is None and _LINUX:  # a larger readahead window for this long sequential read
                os.posix_fadvise(self.plain, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            os.close(self.plain)
            raise

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in (self.plain, self.direct):
            if fd is not None:
                os.close(fd)

    def read(self, view: torch.Tensor, offset: int, need: int) -> None:
        """Read into `view` (ALIGN-sized, from an aligned `offset`) at least `need` bytes, or raise."""
        memory = memoryview(view.numpy())  # type: ignore[arg-type]
        done = 0
        while done < need:
            direct = self.direct is not None and not self.refused and done % ALIGN == 0  # else a short read left it
            try:
                n = os.preadv(self.direct if direct else self.plain, [memory[done:]], offset + done)  # type: ignore[arg-type]
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                self.refused = True  # the filesystem took O_DIRECT at open but not these reads
                continue
            if not n:
                raise CheckpointError(f"{self.path.name} ends early: the file is truncated", path=self.path.parent)
            done += n


class _Prefault:
    """Faults in the pages of the buffers the reads will fill, in their order, ahead of the reads.

    The calling thread does the first piece (the first read must not wait); reads
    that overtake the threads fault their pages themselves, and pieces behind them
    are skipped.
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
        if not _populate(pieces[0]):  # not supported here (Linux < 5.14)
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
                _populate(piece)

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
        if _LINUX:
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


def _populate(piece: torch.Tensor) -> bool:
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


def _direct_pays(fd: int, size: int) -> bool:
    """Direct I/O for a large file that is mostly not cached, unless other ranks read it too."""
    if size < DIRECT_MIN:
        return False
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        return False  # the processes of one job share the cached copy
    return cached_fraction(fd, size) < 0.5
