"""Bytes for the file checkpoint store: tensors to files and back, checksums, atomic filesystem steps.

Tensor bytes go straight from tensor memory to the file (no copy in Python)
while a second thread computes the checksum (`TensorChecksum`; torch and zlib release the GIL), and
`posix_fadvise(DONTNEED)` starts writeback early so the final fsync has little
left to do. Reading is in `cadence.checkpoint.file_read`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import logging
import os
import queue
import re
import shutil
import sys
import threading
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint.direct_io import host_bytes
from cadence.checkpoint.store import CheckpointError

logger = logging.getLogger("cadence.checkpoint")

TENSOR = "__cadence_tensor__"
CHUNK = 32 << 20  # unit of writes, reads and checksums: large enough to be cheap per call
BLOCK = 4096  # the checksum sums blocks of this many bytes (CHUNK is a multiple)
TENSOR_ALIGN = 64  # each tensor starts at a multiple of this in its file (zeros in between)
_BOUNCE = 1 << 20  # the checksum copies unaligned bytes through a buffer of this size
_WRITEBACK = 64 << 20  # start disk writeback every this many bytes written
_THREADED = 8 << 20  # below this a checksum thread costs more than it saves
_OWN_FILE = ("model", "optimizers")
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


# -- payload <-> files ------------------------------------------------------------------


def split(payload: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[Any, ...]], dict[str, list[torch.Tensor]]]:
    """Replace every tensor by a placeholder; tensors are grouped in one file per top-level key."""
    table: list[tuple[Any, ...]] = []
    groups: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    seen: dict[tuple[Any, ...], int] = {}

    def walk(obj: Any, file: str) -> Any:
        if isinstance(obj, torch.Tensor):
            _check_dense(obj)
            key = _identity(obj)
            if key in seen:  # tied weights and other views of one tensor are stored once
                return {TENSOR: seen[key]}
            tensor = _plain(obj)
            nbytes = tensor.numel() * tensor.element_size()
            seen[key] = len(table)
            offset = padded(sizes.get(file, 0))
            table.append((file, offset, nbytes, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            sizes[file] = offset + nbytes
            groups.setdefault(file, []).append(tensor)
            return {TENSOR: seen[key]}
        if isinstance(obj, dict):
            out: dict[Any, Any] = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
            for k, v in obj.items():
                out[k] = walk(v, file)
            if hasattr(obj, "_metadata"):  # module versions, read by load_state_dict
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list):
            return [walk(v, file) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v, file) for v in obj)
        return obj

    # The large entries get a file each (a pretrained load reads model.bin only); the small rest share one.
    tree = {key: walk(value, f"{key}.bin" if key in _OWN_FILE else "state.bin") for key, value in payload.items()}
    return tree, table, groups


def padded(position: int) -> int:
    """Where the next tensor starts: aligned, so that a tensor read straight from the file into
    page-aligned memory is aligned for vector instructions and for the checksum's int64 view."""
    return -(-position // TENSOR_ALIGN) * TENSOR_ALIGN


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _check_dense(t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_quantized or type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(
            f"the file store saves dense tensors only, got a {type(t).__name__} with layout {t.layout}; "
            "use a backend whose checkpoint store handles it (e.g. DCP for sharded tensors)"
        )


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8)


def placeholders(obj: Any) -> Iterator[int]:
    if isinstance(obj, dict):
        if len(obj) == 1 and TENSOR in obj:
            yield obj[TENSOR]
            return
        for v in obj.values():
            yield from placeholders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from placeholders(v)


def rebuild(obj: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and TENSOR in obj:
            return tensors[obj[TENSOR]]
        out = type(obj)((k, rebuild(v, tensors)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [rebuild(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(rebuild(v, tensors) for v in obj)
    return obj


class TensorChecksum:
    """The checksum of a tensor file: CRC-32 over each tensor's 4 KiB block sums.

    For every tensor, in file order: the 64-bit wrapping sum of each full
    4 KiB block of its bytes (little-endian int64 words), then the bytes of
    its last partial block; CRC-32 runs over that stream. A flipped bit
    changes one block's sum; blocks out of place or a zeroed page change the
    sums' sequence. Summing runs at ~12 GB/s per core against ~2 GB/s for a
    CRC-32 of every byte, so the checksum costs little next to the disk.
    Large files are checksummed in a second thread (torch and zlib release
    the GIL) while the next chunk is written or read.
    """

    ALGORITHM = "crc32-of-4k-sums"

    def __init__(self, threaded: bool) -> None:
        self.value = 0
        self._bounce: torch.Tensor | None = None
        self._queue: queue.SimpleQueue[torch.Tensor | None] | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="cadence-checksum", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._queue is not None
        while (chunk := self._queue.get()) is not None:
            self._add(chunk)

    def _add(self, chunk: torch.Tensor) -> None:
        full = chunk.numel() // BLOCK * BLOCK
        if full and chunk.storage_offset() % 8 == 0:
            sums = chunk[:full].view(torch.int64).view(-1, BLOCK // 8).sum(1)
            self.value = zlib.crc32(host_bytes(sums), self.value)
        elif full:  # an unaligned view cannot be read as int64: through an aligned buffer (a few tensors of old files)
            if self._bounce is None:
                self._bounce = torch.empty(_BOUNCE, dtype=torch.uint8)
            for i in range(0, full, _BOUNCE):
                piece = self._bounce[: min(_BOUNCE, full - i)]
                piece.copy_(chunk[i : i + piece.numel()])
                sums = piece.view(torch.int64).view(-1, BLOCK // 8).sum(1)
                self.value = zlib.crc32(host_bytes(sums), self.value)
        if chunk.numel() > full:
            self.value = zlib.crc32(host_bytes(chunk[full:]), self.value)

    def update(self, chunk: torch.Tensor) -> None:
        """Add the next piece of a tensor's bytes (a flat uint8 tensor; pieces are multiples of 4 KiB but its last)."""
        if self._queue is None:
            self._add(chunk)
        else:
            self._queue.put(chunk)

    def finish(self) -> int:
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
        return self.value


def write_tensors(path: Path, tensors: list[torch.Tensor], durable: bool) -> tuple[int, int]:
    """Write tensors' bytes, each from a `padded` offset; returns (size, checksum). Fsynced when `durable`."""
    checksum = TensorChecksum(threaded=sum(t.numel() * t.element_size() for t in tensors) >= _THREADED)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            written = started = 0
            for tensor in tensors:
                if padded(written) > written:  # the tensor table (`split`) places tensors at these offsets
                    _write_all(fd, memoryview(bytes(padded(written) - written)))
                    written = padded(written)
                flat = _flat_bytes(tensor)
                for i in range(0, flat.numel(), CHUNK):
                    chunk = flat[i : i + CHUNK]
                    _write_all(fd, host_bytes(chunk))
                    checksum.update(chunk)
                    written += chunk.numel()
                    if durable and written - started >= _WRITEBACK and FADVISE:
                        # Start writing these pages to disk now (without waiting) so the
                        # final fsync has little left to do.
                        os.posix_fadvise(fd, started, written - started, os.POSIX_FADV_DONTNEED)
                        started = written
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        value = checksum.finish()
    return written, value


def write_bytes(path: Path, data: Any, durable: bool) -> tuple[int, int]:
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, view)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(view), zlib.crc32(view)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


# -- filesystem helpers -----------------------------------------------------------------


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"checkpoint name {name!r}: use letters, digits, '-' and '_' only")


def manifest_crc(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    if sys.platform == "win32":  # pragma: no cover - folders cannot be fsynced there
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


FADVISE = hasattr(os, "posix_fadvise") and sys.platform.startswith("linux")
_RENAME_EXCHANGE = 2
_renameat2: Any = None


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where that is not available."""
    global _renameat2
    if not sys.platform.startswith("linux"):
        return False
    if _renameat2 is None:
        function: Any
        try:
            function = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError):
            function = False
        else:
            function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            function.restype = ctypes.c_int
        _renameat2 = function
    if _renameat2 is False:
        return False
    at_cwd = -100
    if _renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


class Reaper:
    """Removes superseded checkpoint folders in a background thread, in order.

    Removing a 1 GB folder can take a third of a second (more with online
    discard); a commit is durable before that, so the loop does not wait for it.
    The thread ends when the queue is empty; `wait()` joins it. A folder left
    by a crash keeps its temporary name and is swept at the next start.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[Path] = collections.deque()
        self._thread: threading.Thread | None = None

    def remove(self, path: Path) -> None:
        with self._lock:
            self._queue.append(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cadence-checkpoint-cleanup", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # cleanup: the loop and the saves come first (Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                path = self._queue.popleft()
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("checkpoint: cannot delete %s (%s); it is retried at the next start", path, exc)

    def wait(self) -> None:
        """Return once every queued folder is removed."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            with contextlib.suppress(RuntimeError):
                thread.join()
