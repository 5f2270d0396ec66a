"""Checkpoints on object storage (`s3://...` and other fsspec URLs): a prefix per save, the manifest last, names as pointers.

Object stores have no rename, no hard links and no fsync, so the folder
stores' commit (an atomic rename of a finished folder) does not apply. Layout
under the checkpoint URL, e.g. `s3://bucket/run/checkpoints/`::

    .saves/<id>/...            one save, as the local store writes it (the file or DCP layout);
                               its manifest.json is uploaded last: the commit marker
    latest/pointer.json        a name: {"save": "<id>", "step": ..., "epoch": ...}
    ckpt-s000000000040/pointer.json
    best/pointer.json

A save (`write`) gets a new, unique prefix `<id>` (`<ms since epoch>-<pid>-<token>-<name>-<host>`);
the local store writes it into a staging folder on this host (`scratch`),
its files are uploaded, then its manifest, then the name's pointer is
replaced (one PUT: atomic). Only then is the save the name pointed at before
deleted, if no other name points at it. A reader goes from the pointer to a
save whose manifest exists, so a save is complete or invisible: an upload
killed at any point leaves an unreferenced prefix without a manifest, which
`sweep` removes. `link` writes a pointer (no copy); `delete` removes the
pointer, then the save once no pointer refers to it (retention by listing).

Reads download the save into a cache folder of this process and read it with
the local store, which checks the manifest, every file's size and checksum
as it does on a disk. See docs/checkpoints.md, "Remote storage".
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import xxhash

from cadence.checkpoint import file_io
from cadence.checkpoint.folders import MANIFEST, FolderStore
from cadence.checkpoint.object_paths import ObjectPath, maybe_writing, new_id
from cadence.checkpoint.store import CheckpointError, CheckpointStore

SAVES = ".saves"
POINTER = "pointer.json"
POINTER_FORMAT = "cadence-checkpoint-pointer"
#: Files up to this size are downloaded with a manifest (`manifest()`); larger ones when verified or read.
SMALL = 1 << 20


class _Shared:
    """What copies of a store (`at()`) share: the saves being written by this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: set[str] = set()


class ObjectStore(CheckpointStore):
    """A local folder store's checkpoints kept on object storage (see the module docstring).

    Subclasses write (`ObjectFileStore`: the main process; `ObjectDCPStore`: every
    rank writes its shards, the main rank uploads) with the pieces here: a new
    save id (`_new_id`), the local store in the staging folder (`_staging`), the
    upload with the manifest last (`_upload`), the pointer (`_point`).

    Args:
        inner: the local store that writes and reads one save's files.
        directory: the checkpoint URL (or set it later with `at`).
        scratch: a local folder for staging saves and caching reads (default: under the temp folder,
            one per user and URL); it holds up to one checkpoint's files.
        storage_options: passed to fsspec for the URL's filesystem (credentials, endpoint...).
    """

    def __init__(
        self,
        inner: FolderStore,
        directory: str | None = None,
        *,
        scratch: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(None)
        self.inner = copy.copy(inner)
        self.inner.durable = False  # the staged copy is uploaded, then removed: nothing to fsync
        self.scratch = None if scratch is None else Path(scratch)  # None: one folder per URL (`_local`)
        self.storage_options = dict(storage_options or {})
        self.fs: Any = None
        self._shared = _Shared()
        if directory is not None:
            self._open(directory)

    def _open(self, url: str) -> None:
        try:
            import fsspec

            self.fs, _ = fsspec.core.url_to_fs(url, **self.storage_options)
        except ImportError as exc:
            raise ImportError(
                f"checkpoints at {url!r} need fsspec and the filesystem of its scheme ({exc}); "
                "for s3:// install the extra: pip install 'cadence[s3]'"
            ) from exc
        self.directory = cast(Path, ObjectPath(url, self.fs))  # names like a Path (ObjectPath)

    def at(self, directory: str | os.PathLike[str]) -> ObjectStore:
        other = copy.copy(self)
        other._open(os.fspath(directory))
        return other

    # -- where things are ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.directory is None:
            raise ValueError(f"{type(self).__name__} has no directory: use store.at(url)")
        return str(self.directory)

    def path(self, name: str) -> Path:
        return cast(Path, ObjectPath(f"{self.url}/{name}", self.fs))

    def _save_url(self, save: str) -> str:
        return f"{self.url}/{SAVES}/{save}"

    def _local(self) -> Path:
        """The local folder of this URL's staging and cache (the ranks of one host share it)."""
        if self.scratch is not None:
            return self.scratch
        key = xxhash.xxh3_64_hexdigest(self.url.encode())
        return Path(tempfile.gettempdir()) / f"cadence-objects-{os.getuid()}" / key

    # -- pointers and saves -------------------------------------------------------------------

    def target(self, name: str) -> str | None:
        """The save `name` points at (None: no such name)."""
        try:
            raw = self.fs.cat_file(f"{self.url}/{name}/{POINTER}")
        except FileNotFoundError:
            return None
        try:
            pointer = json.loads(raw)
            save = pointer["save"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{POINTER} is damaged: {raw[:80]!r}", path=self.path(name)) from None
        return str(save)

    def _pointers(self) -> dict[str, str]:
        """Every name and the save it points at (one listing, then the pointers read together)."""
        self.fs.invalidate_cache()
        found = self.fs.glob(f"{self.url}/*/{POINTER}")
        if not found:
            return {}
        contents = self.fs.cat([self.fs.unstrip_protocol(p) for p in found], on_error="omit")
        pointers = {}
        for key, raw in contents.items():
            name = key.rstrip("/").rsplit("/", 2)[-2]
            with contextlib.suppress(ValueError, KeyError, TypeError):
                pointers[name] = str(json.loads(raw)["save"])
        return pointers

    def _saves(self) -> dict[str, bool]:
        """Every save prefix and whether it is complete (has its manifest)."""
        self.fs.invalidate_cache()
        if not self.fs.exists(f"{self.url}/{SAVES}"):
            return {}
        saves = {self.fs.unstrip_protocol(p).rsplit("/", 1)[-1]: False for p in self.fs.ls(f"{self.url}/{SAVES}")}
        for found in self.fs.glob(f"{self.url}/{SAVES}/*/{MANIFEST}"):
            saves[found.rstrip("/").rsplit("/", 2)[-2]] = True
        return saves

    def write_pointer(self, name: str, save: str, manifest: Mapping[str, Any]) -> None:
        """Make `name` point at `save` (one PUT), then remove the save it pointed at if nothing else does."""
        file_io.check_name(name)
        before = self.target(name)
        pointer = {"format": POINTER_FORMAT, "save": save, "step": manifest.get("step"), "epoch": manifest.get("epoch")}
        self.fs.pipe_file(f"{self.url}/{name}/{POINTER}", json.dumps(pointer).encode())
        if before is not None and before != save:
            self._release(before)

    def _release(self, save: str) -> None:
        """Remove `save` if no pointer refers to it and this process is not writing it."""
        with self._shared.lock:
            if save in self._shared.active:
                return
        if save in self._pointers().values():
            return
        self.fs.rm(self._save_url(save), recursive=True)

    # -- writing (the subclasses' `write` frames `_upload`) ---------------------------------------

    def new_save_id(self, name: str) -> str:
        return new_id(name)

    @contextlib.contextmanager
    def staging_store(self, save: str) -> Iterator[FolderStore]:
        """The local store writing into the staging folder; the staged copy is removed at exit."""
        stage = self._local() / "stage"
        stage.mkdir(parents=True, exist_ok=True)
        with self._shared.lock:
            self._shared.active.add(save)
        try:
            yield cast(FolderStore, self.inner.at(stage))
        finally:
            shutil.rmtree(stage / save, ignore_errors=True)
            with self._shared.lock:
                self._shared.active.discard(save)

    def upload(self, folder: Path, save: str) -> None:
        """Upload one staged save: every file, then its manifest (the commit marker)."""
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        data = [file for file in files if file != MANIFEST]
        if MANIFEST not in files:
            raise CheckpointError("the local store left no manifest to upload", path=self._save_url(save))
        remote = self._save_url(save)
        if data:
            self.fs.put([str(folder / f) for f in data], [f"{remote}/{f}" for f in data])
        self.fs.put_file(str(folder / MANIFEST), f"{remote}/{MANIFEST}")

    # -- reading --------------------------------------------------------------------------------

    def _cache(self) -> Path:
        return self._local() / f"cache-{os.getpid()}"

    def fetch(self, name: str, files: bool) -> tuple[str, FolderStore]:
        """Download `name`'s save into this process's cache; the local store there.

        `files=False`: the manifest and the small files (up to `SMALL` bytes: the local store's manifest checks
        may read them, such as DCP's `.metadata`); True: every file.
        """
        save = self.target(name)
        if save is None:
            known = ", ".join(self.names()) or "none"
            raise CheckpointError(f"no checkpoint named {name!r} in {self.url} (there: {known})", path=self.path(name))
        cache = self._cache()
        local, remote = cache / save, self._save_url(save)
        if not (local / MANIFEST).is_file():
            for other in cache.iterdir() if cache.is_dir() else ():
                if other.name != save:
                    shutil.rmtree(other, ignore_errors=True)  # keep one save's files
            local.mkdir(parents=True, exist_ok=True)
            try:
                raw = self.fs.cat_file(f"{remote}/{MANIFEST}")
            except FileNotFoundError:
                raise CheckpointError(FolderStore.NO_MANIFEST, path=self.path(name)) from None
            (local / ".manifest.part").write_bytes(raw)
            os.replace(local / ".manifest.part", local / MANIFEST)  # the cache never holds part of a manifest
        try:
            listed = json.loads((local / MANIFEST).read_bytes())["files"]
            sizes = {f: int(entry["size"]) for f, entry in listed.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            sizes = {}  # a damaged manifest: the local store reports it
        wanted = [
            f
            for f, size in sizes.items()
            if (files or size <= SMALL) and (not (local / f).is_file() or (local / f).stat().st_size != size)
        ]
        if wanted:
            with contextlib.suppress(FileNotFoundError):  # a missing file: the local store names it
                self.fs.get([f"{remote}/{f}" for f in wanted], [str(local / f) for f in wanted])
        return save, cast(FolderStore, self.inner.at(cache))

    def _reading(self, name: str, files: bool, work: Any) -> Any:
        """`work(save, local_store)` on `name`'s downloaded save; errors name the URL. Again if the pointer moved."""
        for attempt in range(3):
            save, local = self.fetch(name, files)
            try:
                return work(save, local)
            except CheckpointError as exc:
                if attempt < 2 and not self.collective and self.target(name) != save:
                    continue  # committed anew while it was read
                raise CheckpointError(exc.reason, path=self.path(name), step=exc.step) from exc
        raise AssertionError("unreachable")

    def manifest(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._reading(name, False, lambda save, local: local.manifest(save))
        return result

    def verify(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._reading(name, True, lambda save, local: local.verify(save))
        return result

    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._reading(name, True, lambda save, local: local.read(save, keys))
        return result

    # -- names, retention, sweeping (main rank) -------------------------------------------------

    def names(self) -> list[str]:
        """The names whose pointer leads to a complete save, sorted."""
        complete = {save for save, done in self._saves().items() if done}
        return sorted(name for name, save in self._pointers().items() if save in complete)

    def exists(self, name: str) -> bool:
        save = self.target(name)
        return save is not None and bool(self.fs.exists(f"{self._save_url(save)}/{MANIFEST}"))

    def link(self, src: str, dst: str) -> None:
        """Point `dst` at `src`'s save (no copy)."""
        file_io.check_name(dst)
        manifest = self.manifest(src)  # only a complete checkpoint gets another name
        save = self.target(src)
        assert save is not None
        self.write_pointer(dst, save, manifest)

    def delete(self, name: str) -> None:
        """Remove the pointer `name`, then its save once no other pointer refers to it."""
        save = self.target(name)
        self.fs.rm(f"{self.url}/{name}/{POINTER}")
        if save is not None:
            self._release(save)

    def sweep(self) -> list[str]:
        """Remove saves no pointer refers to (interrupted uploads, superseded saves a crash left), and stale local copies.

        A save another live process of this host is writing or committing is
        left alone, and one from another host until it is `STALE_AFTER`
        seconds old.
        """
        removed = []
        referenced = set(self._pointers().values())
        with self._shared.lock:
            active = set(self._shared.active)
        for save in sorted(self._saves()):
            if save in referenced or save in active or maybe_writing(save):
                continue
            self.fs.rm(self._save_url(save), recursive=True)
            removed.append(f"{SAVES}/{save}")
        local = self._local()
        for entry in sorted(local.iterdir()) if local.is_dir() else ():
            pid = entry.name.partition("-")[2]
            if entry.name.startswith("cache-") and pid.isdigit() and not file_io.alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
        stage = local / "stage"
        for entry in sorted(stage.iterdir()) if stage.is_dir() else ():
            if entry.name.startswith(".") or entry.name in active or maybe_writing(entry.name):
                continue
            shutil.rmtree(entry, ignore_errors=True)
        if stage.is_dir():
            self.inner.at(stage).sweep()
        return removed

    def locate(self, path: str | os.PathLike[str]) -> tuple[CheckpointStore, str]:
        """`(store at its URL, name)` for a checkpoint's URL, or for a checkpoint URL holding `latest`."""
        url = os.fspath(path).rstrip("/")
        parent, _, name = url.rpartition("/")
        at = self.at(parent)
        if at.target(name) is not None:
            return at, name
        at = self.at(url)
        if at.target("latest") is not None:
            return at, "latest"
        raise CheckpointError(
            f"not a checkpoint: no {name}/{POINTER} (a name) or latest/{POINTER} (a checkpoint folder) there",
            path=url,
        )
