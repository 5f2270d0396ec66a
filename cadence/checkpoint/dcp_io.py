"""Pieces of the DCP store: the payload split for `torch.distributed.checkpoint`, hashing writes, its process group.

- `split` (put back by `file_io.rebuild(..., TENSOR)`): the payload's tensors
  under `model`, `optimizers` and `callbacks` (and every DTensor) go to DCP
  under flat keys named like DCP's own flattening (`model.0.weight`,
  `optimizers.0.state.0.exp_avg`); the rest of the payload, with a placeholder
  for each of those tensors, is the *skeleton*, saved with `torch.save` beside
  DCP's files.
- `quiet`: DCP's warning that it assumes one process, silenced where that is the intent.
- `Writer`: DCP's `FileSystemWriter`, hashing every byte it writes (XXH3-64,
  as the bytes go out, no second read) and writing the rank's objects file;
  each rank leaves a record of its files' sizes and checksums for the main
  rank's manifest.
- `checkpoint_group` (with `group`, `all_gather`, `broadcast` on it): one gloo
  group of all ranks for checkpoint collectives, never the group the training
  loop uses (an async save runs its collectives in a thread, beside the loop's).
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import xxhash

from cadence.checkpoint import file_io

ALGORITHM = "xxh3-64"
TENSOR = "__cadence_dcp__"  # {TENSOR: key}: a tensor saved through DCP under `key`
SECTIONS = ("model", "optimizers", "callbacks")  # top-level entries whose tensors go through DCP
RECORD_PREFIX = ".cadence-rank-"  # each rank's record of the files it wrote (removed before the commit)
CHUNK = 8 << 20


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def split(payload: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """`(skeleton, tensors)`: tensors of `SECTIONS` and every DTensor replaced by `{TENSOR: key}`.

    Keys join the path with dots, as DCP flattens nested state dicts, so
    `dcp.load({"model": model.state_dict()}, checkpoint_id=folder)` reads the
    model of a checkpoint without Cadence. Two paths giving one key are an
    error (a dict key with a dot beside a nested dict of the same name).
    """
    tensors: dict[str, torch.Tensor] = {}
    paths: dict[str, tuple[Any, ...]] = {}

    def walk(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            if not (is_dtensor(obj) or (path and path[0] in SECTIONS)):
                return obj  # kept in the skeleton, per rank
            local = obj.to_local() if is_dtensor(obj) else obj  # type: ignore[attr-defined]
            if local.layout != torch.strided:
                raise ValueError(
                    f"checkpoint entry {'.'.join(map(str, path))}: {local.layout} tensors cannot be saved with "
                    "torch.distributed.checkpoint; convert it to a dense tensor in its state_dict"
                )
            key = ".".join(str(p) for p in path)
            if key in tensors:
                raise ValueError(
                    f"checkpoint entries {paths[key]} and {path} both flatten to the key {key!r}; rename one"
                )
            tensors[key], paths[key] = obj, path
            return {TENSOR: key}
        if isinstance(obj, dict):
            out: dict[Any, Any] = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
            for k, v in obj.items():
                out[k] = walk(v, (*path, k))
            if hasattr(obj, "_metadata"):
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(obj, list):
            return [walk(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(walk(v, (*path, i)) for i, v in enumerate(obj))
        return obj

    skeleton = walk(dict(payload), ())
    return skeleton, tensors


def placeholders(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """`(key, path)` of every DCP tensor in a skeleton."""
    if isinstance(obj, dict):
        if len(obj) == 1 and TENSOR in obj:
            yield obj[TENSOR], path
            return
        for k, v in obj.items():
            yield from placeholders(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from placeholders(v, (*path, i))


def lookup(tree: Any, path: tuple[Any, ...]) -> Any:
    """The value at `path` in nested dicts/lists, or None."""
    for part in path:
        if isinstance(tree, Mapping):
            if part in tree:
                tree = tree[part]
            elif str(part) in tree:
                tree = tree[str(part)]
            else:
                return None
        elif isinstance(tree, (list, tuple)) and isinstance(part, int) and part < len(tree):
            tree = tree[part]
        else:
            return None
    return tree


class _DigestPickler(pickle.Pickler):
    """Pickles tensors by dtype, shape and a hash of their bytes (a tensor's own pickle is not deterministic)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and not is_dtensor(obj):
            data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            return ("tensor", str(obj.dtype), tuple(obj.shape), xxhash.xxh3_64_hexdigest(bytes(file_io.memory(data))))
        return None


def entry_digests(skeleton: Mapping[str, Any]) -> dict[str, str]:
    """A digest of each top-level entry, to find the entries in which a rank differs from the main rank."""
    out = {}
    for key, value in skeleton.items():
        buffer = io.BytesIO()
        try:
            _DigestPickler(buffer, protocol=4).dump(value)
            out[key] = xxhash.xxh3_64_hexdigest(buffer.getvalue())
        except Exception:  # not picklable the plain way: count it as different (saved per rank)
            out[key] = os.urandom(8).hex()
    return out


def serialize(obj: Any) -> bytes:
    """`torch.save` bytes of `obj`, views of larger storages (async staging) as copies (`_own_storage`)."""
    buffer = io.BytesIO()
    torch.save(_own_storage(obj), buffer)
    return buffer.getvalue()


def _own_storage(obj: Any) -> Any:
    """torch.save keeps a view's whole storage, and `torch.set_rng_state` crashes on a loaded view's offset."""
    if isinstance(obj, torch.Tensor):
        whole = obj.storage_offset() == 0 and obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        return obj if whole or obj.is_meta else obj.clone()
    if isinstance(obj, dict):  # copied only where a tensor in it was (state dicts keep `_metadata`)
        items = {k: _own_storage(v) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else {**obj, **items}
    values = [_own_storage(v) for v in obj] if type(obj) in (list, tuple) else None
    return obj if values is None or all(a is b for a, b in zip(values, obj)) else type(obj)(values)


# -- hashing writes ------------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write-only file that hashes (XXH3-64) and counts every byte written through it."""

    def __init__(self, raw: Any, done: Any) -> None:
        super().__init__()
        self.raw, self._done = raw, done
        self.hash, self.size = xxhash.xxh3_64(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        if written is None or written != len(view):  # a short write would leave the hash out of step
            raise OSError(f"short write to {self.raw.name}: {written} of {len(view)} bytes")
        self.hash.update(view)
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self._done(self)
            self.raw.close()
        super().close()


def _filesystem_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's local filesystem, recording `(size, xxh3)` of every file written (by name)."""

        def __init__(self) -> None:
            super().__init__()
            self.records: dict[str, tuple[int, str]] = {}
            self._lock = threading.Lock()

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            name = Path(path).name

            def done(stream: _HashingStream) -> None:
                with self._lock:
                    self.records[name] = (stream.size, stream.hash.hexdigest())

            with open(path, mode) as raw:
                stream = _HashingStream(raw, done)
                try:
                    yield stream
                finally:
                    stream.close()

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            with self._lock:
                record = self.records.pop(Path(path).name, None)
                if record is not None:
                    self.records[Path(new_path).name] = record

    return HashingFileSystem


_ZIP_CRC_LOCK = threading.Lock()
_ZIP_CRC_USERS = 0


@contextlib.contextmanager
def no_zip_crc() -> Iterator[None]:
    """Turn off the CRC-32 `torch.save` computes for its zip records while DCP writes tensors.

    DCP writes each tensor with `torch.save`; the zip CRC-32 tripled the time of a
    save here (0.3 against 1.1 GB/s) and nothing reads it. Every file's XXH3-64 in
    the manifest is what is checked. The switch is process-wide: a `torch.save`
    in another thread meanwhile also skips its CRC (its file still loads).
    """
    global _ZIP_CRC_USERS
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - older torch: nothing to switch
        yield
        return
    with _ZIP_CRC_LOCK:
        if _ZIP_CRC_USERS == 0:
            _no_zip_crc_saved[0] = config.save.compute_crc32
            config.save.compute_crc32 = False
        _ZIP_CRC_USERS += 1
    try:
        yield
    finally:
        with _ZIP_CRC_LOCK:
            _ZIP_CRC_USERS -= 1
            if _ZIP_CRC_USERS == 0:
                config.save.compute_crc32 = _no_zip_crc_saved[0]


_no_zip_crc_saved = [True]


def writer(path: Path, *, objects: tuple[str, bytes] | None, durable: bool, thread_count: int) -> Any:
    """A DCP storage writer into `path` that hashes what it writes and leaves this rank's record."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            fs: Any = self.fs
            if objects is not None:
                name, data = objects
                with fs.create_stream(Path(self.path) / name, "wb") as stream:
                    stream.write(data)
                    if durable:
                        stream.flush()
                        os.fsync(stream.fileno())
            with no_zip_crc():
                future: Any = super().write_data(plan, planner)
                future.wait() if hasattr(future, "wait") else future.result()
            record = {name: list(value) for name, value in fs.records.items()}
            rank = self.rank if self.rank is not None else 0
            Path(self.path, f"{RECORD_PREFIX}{rank}.json").write_text(json.dumps(record))
            return future

    instance = Writer(path, sync_files=durable, thread_count=thread_count)
    instance.fs = _filesystem_class()()
    return instance


def file_digest(path: Path) -> tuple[int, str]:
    """`(size, XXH3-64 hex)` of a file, read in chunks."""
    digest, size = xxhash.xxh3_64(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


_QUIET = "torch.distributed is (disabled, )?unavailable or uninitialized"


@contextlib.contextmanager
def quiet(group: Any) -> Iterator[None]:
    """Without a process group, DCP warns that it assumes one process at every call: that is the intent here."""
    if group is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QUIET)
        yield


# -- the checkpoint process group ------------------------------------------------------------

_GROUP_LOCK = threading.Lock()
_GROUP: tuple[Any, Any] | None = None  # (weakref to the default group, weakref to ours)


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def checkpoint_group(timeout: float) -> Any:
    """A gloo group of every rank for checkpoint collectives (None without a process group).

    Created once per default group, on first use (every rank reaches it in the
    same collective call); torch holds it, we keep only weak references, so
    `destroy_process_group()` releases it with the others.
    """
    global _GROUP
    import torch.distributed as dist

    if not distributed():
        return None
    world = dist.group.WORLD
    with _GROUP_LOCK:
        if _GROUP is not None and _GROUP[0]() is world and _GROUP[1]() is not None:
            return _GROUP[1]()
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        _GROUP = (weakref.ref(world), weakref.ref(group))
        return group


def group(timeout: float) -> tuple[Any, int, int]:
    """`(group, rank, world)` of the store's own gloo group (`checkpoint_group`); `(None, 0, 1)` without one."""
    import torch.distributed as dist

    found = checkpoint_group(timeout)
    if found is None:
        return None, 0, 1
    return found, dist.get_rank(found), dist.get_world_size(found)


def all_gather(obj: Any, group: Any, world: int) -> list[Any]:
    """`obj` of every rank of `group` (itself alone without a process group)."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, group: Any, world: int) -> Any:
    """Rank 0's `obj` of `group`, on every rank."""
    if world == 1:
        return obj
    import torch.distributed as dist

    holder = [obj]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]
