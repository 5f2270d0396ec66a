"""Bytes for the file checkpoint store: tensors to files and back, checksums, atomic filesystem steps.

Tensor bytes go straight from tensor memory to the file (no copy in Python; staged
copies laid out as the file, with direct I/O: `direct_io.write_image`)
while a second thread computes the checksum (`Checksum`: XXH3-64 of the file's
bytes; xxhash releases the GIL), and `posix_fadvise(DONTNEED)` starts writeback
early so the final fsync has little left to do. Reading is in
`cadence.checkpoint.file_read`.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import json
import logging
import os
import queue
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from cadence.checkpoint import direct_io
from cadence.checkpoint.store import CheckpointError

logger = logging.getLogger("cadence.checkpoint")

TENSOR = "__cadence_tensor__"
CHUNK = 32 << 20  # unit of writes, reads and checksums: large enough to be cheap per call
TENSOR_ALIGN = 64  # each tensor starts at a multiple of this in its file (zeros in between)
ALGORITHM = "xxh3-64"  # every file's checksum, and the manifest's own: XXH3-64 of the file's bytes
MANIFEST_KEY = "manifest_xxh3_64"  # the manifest's last field: XXH3-64 of every byte before it
_ZEROS = bytes(TENSOR_ALIGN)
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

    tree = {key: walk(value, file_for(key)) for key, value in payload.items()}
    return tree, table, groups


def file_for(key: Any) -> str:
    """The file that holds the tensors under a payload's top-level `key`."""
    # The large entries get a file each (a pretrained load reads model.bin only); the small rest share one.
    return f"{key}.bin" if key in _OWN_FILE else "state.bin"


def padded(position: int) -> int:
    """Where the next tensor starts: aligned, so that a tensor read straight from the file into
    page-aligned memory is aligned for vector instructions."""
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


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8)


def memory(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU uint8 tensor's bytes, without a copy (and without numpy).

    The view does not keep the tensor alive: use it only while `t` is referenced.
    """
    n = t.numel()
    if not n:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


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


def rebuild(obj: Any, tensors: Mapping[Any, Any], marker: str = TENSOR) -> Any:
    """The payload's structure with each placeholder `{marker: key}` replaced by `tensors[key]`.

    The one rebuild of every store that saves a payload's structure apart from its
    tensors: the file store (`TENSOR`, keys into the tensor table) and the DCP store
    (`dcp_io.TENSOR`, DCP's flat keys).
    """
    if isinstance(obj, dict):
        if len(obj) == 1 and marker in obj:
            return tensors[obj[marker]]
        out = type(obj)((k, rebuild(v, tensors, marker)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [rebuild(v, tensors, marker) for v in obj]
    if isinstance(obj, tuple):
        return tuple(rebuild(v, tensors, marker) for v in obj)
    return obj


class Checksum:
    """XXH3-64 (xxhash) of a file's bytes, fed in order, optionally from a second thread.

    `update` takes the next piece (a flat uint8 tensor or bytes); large files are
    hashed in a second thread (xxhash releases the GIL) while the next chunk is
    written or read. XXH3 runs at memory speed (about 29 GB/s on one core here,
    0.04 s per GB; a CRC-32 of the same bytes 4.2 GB/s), and unlike a sum of
    words it sees compensating bit flips, swapped words and moved blocks.
    """

    ALGORITHM = ALGORITHM

    def __init__(self, threaded: bool) -> None:
        self._hash = xxhash.xxh3_64()
        self._queue: queue.SimpleQueue[Any] | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="cadence-checksum", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._queue is not None
        while (piece := self._queue.get()) is not None:
            self._add(piece)

    def _add(self, piece: Any) -> None:
        self._hash.update(memory(piece) if isinstance(piece, torch.Tensor) else piece)

    def update(self, piece: torch.Tensor | bytes) -> None:
        """Add the next piece of the file's bytes (a flat uint8 CPU tensor, or bytes)."""
        if self._queue is None:
            self._add(piece)
        else:
            self._queue.put(piece)

    @property
    def value(self) -> int:
        """The checksum of what was added (unthreaded; a threaded one: `finish`)."""
        return self._hash.intdigest()

    def finish(self) -> int:
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
        return self._hash.intdigest()


def digest(data: Any) -> int:
    """XXH3-64 of bytes in memory (`payload.pt`)."""
    return xxhash.xxh3_64_intdigest(data)


def hex_digest(value: int) -> str:
    """How a checksum is written in the manifest: 16 hex digits."""
    return f"{value:016x}"


def write_tensors(path: Path, tensors: list[torch.Tensor], durable: bool) -> tuple[int, int]:
    """Write tensors' bytes, each from a `padded` offset; returns (size, XXH3-64 of the file). Fsynced when `durable`.

    Tensors that already lie in memory as the file will (the async writer's staging, see
    `direct_io.image_of`) are written as that one buffer, with direct I/O where the
    filesystem has it; others chunk by chunk through the page cache.
    """
    checksum = Checksum(threaded=sum(t.numel() * t.element_size() for t in tensors) >= _THREADED)
    offsets, size = [], 0
    for tensor in tensors:
        offsets.append(padded(size))
        size = offsets[-1] + tensor.numel() * tensor.element_size()
    image = direct_io.image_of(tensors, offsets, size)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if image is not None:
                _write_image(path, fd, image, size, checksum)
            else:
                _write_chunks(fd, tensors, checksum, durable)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        value = checksum.finish()
    return size, value


def _write_image(path: Path, fd: int, image: torch.Tensor, size: int, checksum: Checksum) -> None:
    fed = 0

    def written(end: int) -> None:  # the checksum reads the file's bytes, in order, as they are written
        nonlocal fed
        if end > fed:
            checksum.update(image[fed:end])
            fed = end

    direct_io.write_image(path, fd, image, size, written)
    written(size)


def _write_chunks(fd: int, tensors: list[torch.Tensor], checksum: Checksum, durable: bool) -> None:
    written = started = 0
    for tensor in tensors:
        if padded(written) > written:  # the tensor table (`split`) places tensors at these offsets
            gap = _ZEROS[: padded(written) - written]
            _write_all(fd, memoryview(gap))
            checksum.update(gap)
            written = padded(written)
        flat = flat_bytes(tensor)
        for i in range(0, flat.numel(), CHUNK):
            chunk = flat[i : i + CHUNK]
            _write_all(fd, memory(chunk))
            checksum.update(chunk)
            written += chunk.numel()
            if durable and written - started >= _WRITEBACK and FADVISE:
                # Start writing these pages to disk now (without waiting) so the
                # final fsync has little left to do.
                os.posix_fadvise(fd, started, written - started, os.POSIX_FADV_DONTNEED)
                started = written


def write_bytes(path: Path, data: Any, durable: bool) -> tuple[int, int]:
    """Write `data` (bytes-like) as a new file; returns (size, XXH3-64). Fsynced when `durable`."""
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, view)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(view), digest(view)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


# -- filesystem helpers -----------------------------------------------------------------


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"checkpoint name {name!r}: use letters, digits, '-' and '_' only")


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """The manifest as written: JSON whose last field, `manifest_xxh3_64`, is the XXH3-64 of every byte before it.

    So any changed byte of the file is seen, whitespace included (`check_manifest`).
    """
    text = json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_KEY}, indent=1).encode()
    head = text[:-2]  # without the closing "\n}"
    return head + _manifest_tail(head)


def _manifest_tail(head: bytes) -> bytes:
    return b',\n "%s": "%s"\n}\n' % (MANIFEST_KEY.encode(), hex_digest(digest(head)).encode())


def check_manifest(raw: bytes) -> bool:
    """Whether `raw` is exactly what `manifest_bytes` wrote for its content (its own checksum holds)."""
    cut = raw.rfind(b',\n "%s": "' % MANIFEST_KEY.encode())
    return cut > 0 and raw[cut:] == _manifest_tail(raw[:cut])


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
