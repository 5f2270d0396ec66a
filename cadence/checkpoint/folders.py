"""The folder-store base: what every store that keeps one folder per named checkpoint does the same way.

A checkpoint is `<directory>/<name>/`, complete when its `manifest.json`
(written last) is there; writes happen in `.tmp-<name>.<owner>...` folders,
superseded and deleted ones wait in `.old-...` / `.trash-...` until removed.
The file, DCP and DeepSpeed stores share this layout: `FolderStore` lists
(`names`, `exists`), sweeps, locates, commits a written folder under its name
(`commit_folder`: an atomic exchange), links, deletes, frames the manifest check and
checks file sizes once; each store writes and reads its own files.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from cadence.checkpoint import file_io
from cadence.checkpoint.store import FORMAT, CheckpointError, CheckpointStore

logger = logging.getLogger("cadence.checkpoint")

MANIFEST = "manifest.json"
TEMP_PREFIXES = (".tmp-", ".old-", ".trash-")


class FolderStore(CheckpointStore):
    """A store of one folder per named checkpoint, committed by renaming a finished temporary folder.

    Subclasses write (`write`) into a temporary folder and give it its name
    with `commit_folder` (or write inside `staged_folder`); they read their own files and
    add their checks of a manifest (`_check_manifest`).

    Args:
        directory: the folder of checkpoints (or set it later with `at`).
        durable: fsync files and folders before a commit counts (turn off only for scratch data).

    Attributes:
        NO_MANIFEST: the error for a checkpoint folder without its manifest.
    """

    NO_MANIFEST: ClassVar[str] = (
        "not a complete checkpoint: manifest.json is missing (an interrupted write or a damaged copy; the step "
        "is its files' own, unverified); it is never loaded; use another checkpoint"
    )

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, durable: bool = True) -> None:
        super().__init__(directory)
        self.durable = durable
        self._reaper = Reaper()  # shared by the copies `at()` makes

    def folder_path(self) -> Path:
        if self.directory is None:
            raise ValueError(f"{type(self).__name__} has no directory: use store.at(directory)")
        return self.directory

    def _looks_like_data(self, filename: str) -> bool:
        """Whether a file of this name belongs in one of this store's checkpoints (`locate` of an incomplete one)."""
        return False

    # -- listing, sweeping, locating (main rank) -------------------------------------------

    def names(self) -> list[str]:
        """The complete checkpoints (folders with a manifest), sorted."""
        directory = self.folder_path()
        if not directory.is_dir():
            return []
        return sorted(
            e.name
            for e in os.scandir(directory)
            if not e.name.startswith(".") and e.is_dir() and os.path.exists(os.path.join(e.path, MANIFEST))
        )

    def exists(self, name: str) -> bool:
        return (self.path(name) / MANIFEST).is_file()

    def sweep(self) -> list[str]:
        """Remove what interrupted writes left; returns the removed names.

        A temporary folder of another live process (its pid in the name) is left
        alone; an `.old-` folder whose name is free again is a commit that died
        between its two renames (no atomic exchange here): it is put back.
        """
        directory = self.folder_path()
        if not directory.is_dir():
            return []
        removed = []
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if not entry.name.startswith(TEMP_PREFIXES) or not entry.is_dir():
                continue
            prefix, _, rest = entry.name[1:].partition("-")
            name, _, owner = rest.partition(".")
            pid = owner.partition(".")[0]
            if pid.isdigit() and int(pid) != os.getpid() and file_io.alive(int(pid)):
                continue  # another live process is writing it
            if prefix == "old" and not (directory / name).exists() and (Path(entry.path) / MANIFEST).exists():
                os.rename(entry.path, directory / name)  # a commit without exchange died between its renames
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
        return removed

    def locate(self, path: str | os.PathLike[str]) -> tuple[FolderStore, str]:
        """`(store at its folder, name)` for a checkpoint folder, or for a folder holding `latest`."""
        p = Path(path).expanduser().absolute()
        if not p.exists():
            raise CheckpointError("no such file or folder; check the path", path=p)
        if p.is_dir() and (p / MANIFEST).exists():
            directory, name = p.parent, p.name
        elif p.is_dir() and (p / "latest").is_dir():
            directory, name = p, "latest"
        elif p.is_dir() and any(self._looks_like_data(f.name) for f in p.iterdir()):
            raise CheckpointError(self.NO_MANIFEST, path=p, step=self._unverified_step(p))
        else:
            raise CheckpointError(
                "not a checkpoint: expected a checkpoint folder (with manifest.json) or a folder holding 'latest'",
                path=p,
            )
        other = self.at(directory)
        assert isinstance(other, FolderStore)
        return other, name

    # -- the manifest (main rank, no collective) -------------------------------------------

    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest of `name`, checked: a cadence manifest, then the store's own checks (`_check_manifest`)."""
        folder = self.path(name)
        if not folder.is_dir():
            known = ", ".join(self.names()) or "none"
            raise CheckpointError(f"no checkpoint named {name!r} in {folder.parent} (there: {known})", path=folder)
        try:
            raw = (folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise CheckpointError(self.NO_MANIFEST, path=folder, step=self._unverified_step(folder)) from None
        try:
            manifest = json.loads(raw)
        except ValueError:
            manifest = None
        if not (
            isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
        ):
            raise CheckpointError(
                f"{MANIFEST} is unreadable or not a cadence manifest: the file is damaged{claimed_step(raw)}; "
                "use another checkpoint",
                path=folder,
            )
        self._check_manifest(folder, raw, manifest)
        return manifest

    def _check_manifest(self, folder: Path, raw: bytes, manifest: dict[str, Any]) -> None:
        """The checks of a readable cadence manifest: its own checksum here, a store adds its own (its kind...).

        Every store writes one manifest format (`file_io.manifest_bytes`: the
        last field, `manifest_xxh3_64`, is the XXH3-64 of every byte before it).
        Manifests of earlier DCP and DeepSpeed stores, checksummed over their
        canonical JSON, are still accepted (`legacy_checksum_holds`).
        """
        if not (file_io.check_manifest(raw) or legacy_checksum_holds(manifest)):
            raise CheckpointError(
                f"{MANIFEST} fails its own checksum ({file_io.ALGORITHM}): the file is damaged{claimed_step(raw)}; "
                "use another checkpoint",
                path=folder,
            )

    def _unverified_step(self, folder: Path) -> int | None:
        """The step a folder without a manifest seems to hold, for the error message only (None: unknown).

        Named alike whichever way the folder is met: `manifest` (auto-resume's
        candidates) and `locate` (`resume=`, `from_checkpoint`, `cadence inspect`).
        """
        return None

    def check_sizes(self, folder: Path, manifest: dict[str, Any], files: Mapping[str, Any]) -> None:
        """Every file of `files` (manifest entries) is there with the size the manifest says."""
        for file, expected in files.items():
            try:
                size = os.stat(folder / file).st_size
            except FileNotFoundError:
                raise CheckpointError(
                    f"{file} is missing (the manifest lists it)", path=folder, step=manifest.get("step")
                ) from None
            if size != expected["size"]:
                raise CheckpointError(
                    f"{file} is {size} bytes, the manifest says {expected['size']}: the file is "
                    f"{'truncated' if size < expected['size'] else 'damaged'}; use another checkpoint",
                    path=folder,
                    step=manifest.get("step"),
                )

    # -- committing, naming, removing (main rank) ------------------------------------------

    @contextlib.contextmanager
    def staged_folder(self, name: str) -> Iterator[Path]:
        """A temporary folder beside `name`; committed in place on success, removed on error."""
        final = self.path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{name}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            yield tmp
            if self.durable:
                file_io.fsync_dir(tmp)
            self.commit_folder(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def commit_folder(self, tmp: Path, final: Path) -> None:
        """Give `tmp` the name `final` in one step; the previous `final` is removed after, in the background."""
        old: Path | None = None
        if not final.exists():
            os.rename(tmp, final)
        elif file_io.exchange(tmp, final):
            old = tmp  # the exchange left the previous checkpoint at the temporary name
        else:  # no atomic exchange here: move the old one aside first (sweep() repairs a crash in between)
            old = final.parent / f".old-{final.name}.{os.getpid()}.{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
        if self.durable:
            file_io.fsync_dir(final.parent)
        if old is not None:
            self._reaper.remove(old)

    def link(self, src: str, dst: str) -> None:
        """Commit `dst` as the same checkpoint as `src`: hard links to its files (copies where links fail)."""
        file_io.check_name(dst)
        source = self.path(src)
        self.manifest(src)  # only a complete checkpoint gets another name
        with self.staged_folder(dst) as tmp:
            for entry in sorted(os.scandir(source), key=lambda e: e.name == MANIFEST):  # manifest last
                if entry.is_dir():
                    shutil.copytree(entry.path, tmp / entry.name, copy_function=self._link_file)
                else:
                    self._link_file(entry.path, tmp / entry.name)

    def _link_file(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        try:
            os.link(src, dst)
        except OSError:  # no hard links here (another filesystem, FAT, some network mounts)
            shutil.copyfile(src, dst)
            if self.durable:
                file_io.fsync_file(Path(dst))

    def delete(self, name: str) -> None:
        """Remove `name`: it disappears at once (renamed), its files are removed in the background."""
        target = self.path(name)
        trash = target.parent / f".trash-{name}.{os.getpid()}.{secrets.token_hex(4)}"
        os.rename(target, trash)
        if self.durable:
            file_io.fsync_dir(target.parent)
        self._reaper.remove(trash)

    def wait(self) -> None:
        """Wait until superseded and deleted checkpoints are removed from the disk."""
        self._reaper.wait()


def legacy_checksum_holds(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest of an earlier DCP or DeepSpeed store holds its own checksum (over its canonical JSON).

    The DCP store wrote `manifest_xxh3_64` over the compact sorted JSON of the
    other fields, the DeepSpeed store `manifest_xxh3` over the sorted JSON with
    default separators; both still load. New manifests are checked byte for byte
    (`file_io.check_manifest`).
    """
    import xxhash

    for key, separators in (("manifest_xxh3_64", (",", ":")), ("manifest_xxh3", (", ", ": "))):
        value = manifest.get(key)
        if isinstance(value, str) and manifest.get("store") in ("dcp", "deepspeed"):
            body = {k: v for k, v in manifest.items() if k != key}
            text = json.dumps(body, sort_keys=True, separators=separators).encode()
            if xxhash.xxh3_64_hexdigest(text) == value:
                return True
    return False


def claimed_step(raw: bytes) -> str:
    """What a damaged manifest seems to say about its step (for the error message only)."""
    found = re.search(rb'"step": (\d+)', raw)
    return f" (it says step {int(found.group(1))}, which cannot be trusted)" if found else " (its step is unreadable)"


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
