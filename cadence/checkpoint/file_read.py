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
- The checksum (`file_io.Checksum`, XXH3-64 of the file) runs on each piece as it arrives (a thread
  for large files); the zero padding between tensors, which is never read, is hashed as the zeros
  the writer wrote.

Nothing here writes into a tensor that exists: the engine takes the new tensors over (the
optimizer keeps them as its state, the model copies from them) only after every file is
verified. Measurements: docs/checkpoints.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.direct_io import ALIGN, LINUX, O_DIRECT, Prefault, aligned_empty, cached_fraction
from cadence.checkpoint.file_io import CHUNK, Checksum, flat_bytes, memory
from cadence.checkpoint.store import CheckpointError

BIG = 1 << 20  # tensors of at least this many bytes get their own aligned buffer (no copy)
DIRECT_MIN = 8 << 20  # smaller files are read through the page cache
IN_FLIGHT = 2  # direct reads under way at once: the disk never waits for the next request
_THREADED = 8 << 20  # below this a second thread (checksum, prefault) costs more than it saves
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_PREADV = hasattr(os, "preadv")

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
        self.files, self.out = files, out
        self.plans: list[list[Group]] = []
        self.buffers: list[list[torch.Tensor]] = []
        self.direct: list[bool] = []
        pieces: list[torch.Tensor] = []
        scratch = 0
        for path, entries in files:
            position = 0
            for _, offset, nbytes, *_ in entries:
                if offset < position:
                    raise CheckpointError(f"{path.name}: tensor table out of order at byte {offset}", path=path.parent)
                position = offset + nbytes
            plan = _plan(entries, BIG if out is not None else None)
            own = [aligned_empty(_span(group)[1] - _span(group)[0]) for kind, group in plan if kind == "own"]
            self.plans.append(plan)
            self.buffers.append(own)
            pieces += [buffer[i : i + CHUNK] for buffer in own for i in range(0, buffer.numel(), CHUNK)]
            self.direct.append(_choose_direct(path, position, direct))
            if any(kind != "own" for kind, _ in plan):
                scratch = max(scratch, min(CHUNK, position) + 2 * ALIGN)
        # What maps memory (allocations, mincore) comes before the prefault threads hold the process's memory
        # map for long stretches; so do the other threads, which start slowly once those compete for the CPU.
        self.scratch = aligned_empty(scratch) if scratch else None
        self._pool = concurrent.futures.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="cadence-read")
        self._sums = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cadence-checksum")
        if out is not None:  # start every thread now (a pool starts one per busy submit)
            for future in [self._pool.submit(time.sleep, 0.001) for _ in range(IN_FLIGHT)] + [self._sums.submit(int)]:
                future.result()
        self._inflight: collections.deque[tuple[concurrent.futures.Future[None], Any]] = collections.deque()
        self.prefault = Prefault(pieces) if sum(p.numel() for p in pieces) >= _THREADED else None

    def __enter__(self) -> TensorReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()
        self._sums.shutdown()
        if self.prefault is not None:
            self.prefault.close()

    def read(self, i: int) -> int:
        path, entries = self.files[i]
        size = entries[-1][1] + entries[-1][2] if entries else 0
        checksum = Checksum(threaded=False)
        sums: list[concurrent.futures.Future[None]] = []
        update: Callable[[Any], None] = checksum.update  # inline: small files, and a check's reused buffer
        if self.out is not None and size >= _THREADED:  # in the checksum thread, in order, as pieces arrive
            update = lambda piece: sums.append(self._sums.submit(checksum.update, piece))  # noqa: E731
        feed = _InOrder(update)
        try:
            with _Reader(path, self.direct[i]) as reader:
                try:
                    self._read_groups(i, reader, feed)
                finally:
                    self._settle(0, errors=False)  # no read may still run once the file is closed
        finally:
            concurrent.futures.wait(sums)
        for future in sums:
            future.result()
        return checksum.value

    def _read_groups(self, i: int, reader: _Reader, feed: _InOrder) -> None:
        buffers = iter(self.buffers[i])
        for kind, group in self.plans[i]:
            if kind == "own":
                self._read_own(reader, group[0], next(buffers), feed)
                continue
            self._settle(0)
            assert self.scratch is not None
            if kind == "pack":
                _read_pack(reader, group, self.scratch, feed, self.out)
            else:
                _read_stream(reader, group[0], self.scratch, feed)
        self._settle(0)

    def _read_own(self, reader: _Reader, entry: Entry, buffer: torch.Tensor, feed: _InOrder) -> None:
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
                feed(offset + fed, flat[fed : fed + CHUNK])
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


class _InOrder:
    """Feeds one file's tensor bytes to its checksum in file order, `(offset, piece)` at a time.

    The padding before a tensor (zeros, at most 63 bytes, never read) goes in as the
    zeros the writer wrote, so the value is the XXH3-64 of the whole file.
    """

    def __init__(self, update: Callable[[Any], None]) -> None:
        self.update, self.position = update, 0

    def __call__(self, offset: int, piece: torch.Tensor) -> None:
        if offset > self.position:
            self.update(bytes(offset - self.position))
        self.update(piece)
        self.position = offset + piece.numel()


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


def _read_pack(reader: _Reader, group: list[Entry], scratch: torch.Tensor, feed: _InOrder, out: Any) -> None:
    start, end = _span(group)
    last = group[-1]
    reader.read(scratch[: end - start], start, last[1] + last[2] - start)
    for index, offset, nbytes, dtype, shape in group:
        data = scratch[offset - start : offset - start + nbytes]
        if out is None:
            feed(offset, data)  # inline: the scratch buffer is reused
            continue
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        flat = flat_bytes(tensor)
        flat.copy_(data)
        feed(offset, flat)
        out[index] = tensor


def _read_stream(reader: _Reader, entry: Entry, scratch: torch.Tensor, feed: _InOrder) -> None:
    """Checksum one tensor larger than the scratch buffer, a piece at a time (checking only)."""
    _, offset, nbytes, *_ = entry
    for piece in range(0, nbytes, CHUNK):
        length = min(CHUNK, nbytes - piece)
        start = (offset + piece) // ALIGN * ALIGN
        skip = offset + piece - start
        reader.read(scratch[: -(-(skip + length) // ALIGN) * ALIGN], start, skip + length)
        feed(offset + piece, scratch[skip : skip + length])


def _typed(flat: torch.Tensor, dtype: str, shape: Any) -> torch.Tensor:
    kind = getattr(torch, dtype)
    try:
        return flat.view(kind).view(shape)
    except RuntimeError:  # an offset that is no multiple of the element size: a copy of its own
        tensor = torch.empty(shape, dtype=kind)
        flat_bytes(tensor).copy_(flat)
        return tensor


class _Reader:
    """Reads aligned ranges of one file, directly or through the page cache (thread-safe)."""

    def __init__(self, path: Path, direct: bool) -> None:
        self.path = path
        self.plain = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | _CLOEXEC)
        self.direct: int | None = None
        self.refused = False
        self._seek = threading.Lock()  # where there is no positioned read (Windows)
        try:
            if direct:
                try:
                    self.direct = os.open(path, os.O_RDONLY | O_DIRECT | _CLOEXEC)
                except OSError:  # a filesystem without direct I/O (tmpfs, some network mounts)
                    pass
            if self.direct is None and LINUX:  # a larger readahead window for this long sequential read
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
        target = memory(view)
        done = 0
        while done < need:
            fd = self.direct if self.direct is not None and not self.refused and done % ALIGN == 0 else None
            direct = fd is not None  # else a short read left it unaligned
            try:
                n = self._pread(self.plain if fd is None else fd, target[done:], offset + done)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                self.refused = True  # the filesystem took O_DIRECT at open but not these reads
                continue
            if not n:
                raise CheckpointError(f"{self.path.name} ends early: the file is truncated", path=self.path.parent)
            done += n

    def _pread(self, fd: int, target: memoryview, offset: int) -> int:
        if _PREADV:
            return os.preadv(fd, [target], offset)
        with self._seek:
            os.lseek(fd, offset, os.SEEK_SET)
            data = os.read(fd, len(target))
        target[: len(data)] = data
        return len(data)


def _choose_direct(path: Path, size: int, direct: bool | None) -> bool:
    if not O_DIRECT or not size or direct is False:
        return False
    if direct:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return False  # the read says what is wrong
    try:
        return _direct_pays(fd, size)
    finally:
        os.close(fd)


def _direct_pays(fd: int, size: int) -> bool:
    """Direct I/O for a large file that is mostly not cached, unless other ranks read it too."""
    if size < DIRECT_MIN:
        return False
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        return False  # the processes of one job share the cached copy
    return cached_fraction(fd, size) < 0.5
