"""Checkpoints as folders of plain files, committed atomically (one process and DDP).

Layout of one checkpoint, e.g. `checkpoints/latest/`::

    model.bin        raw bytes of the model's tensors, each at a 64-byte offset
    optimizers.bin   ... of the optimizer state
    state.bin        ... of every other tensor (RNG, callback states such as EMA's average)
    payload.pt       everything else: the structure, with each tensor's file/offset/dtype/shape
    manifest.json    written last: step, epoch, and every file's size and checksum

A write goes to `.tmp-<name>.<pid>.<token>/` in the same folder; every file
and the folder are fsynced, then the folder takes the name in one atomic
step (`renameat2(RENAME_EXCHANGE)` on Linux when the name exists, a plain
rename otherwise) and the old one is removed. `best` and history snapshots
are folders of hard links to the files (copies where links fail). Reads check
sizes first (truncation), then checksums (XXH3-64 of each file, computed as
the bytes arrive; the zero padding between tensors, never read, as the zeros
written), and load `payload.pt` with `torch.load(weights_only=True)`; `verify`
also checks that padding, so every byte of every file is checked.
The manifest's last field is the XXH3-64 of every byte before it. The
byte-level work is in `cadence.checkpoint.file_io`.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from cadence.checkpoint import file_io, file_read
from cadence.checkpoint.folders import MANIFEST, FolderStore
from cadence.checkpoint.store import FORMAT, CheckpointError

PAYLOAD = "payload.pt"


class FileStore(FolderStore):
    """Checkpoint folders on a local or shared filesystem (see the module docstring).

    Args:
        directory: the folder of checkpoints (or set it later with `at`).
        durable: fsync files and folders before a commit counts (turn off only for scratch data).
        weights_only: load `payload.pt` with torch's safe unpickler; set False only for
            checkpoints you trust whose callback states hold arbitrary Python objects.
        direct_io: read tensor files with direct I/O (True), through the page cache (False),
            or decide per file (None: direct for a large file mostly not cached, read by one
            process); see `cadence.checkpoint.file_read`.

    Example:
        >>> store = FileStore("/tmp/ckpts")                        # doctest: +SKIP
        >>> store.write("latest", {"model": model.state_dict()})   # doctest: +SKIP
        >>> store.read("latest")["model"]                          # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        durable: bool = True,
        weights_only: bool = True,
        direct_io: bool | None = None,
    ) -> None:
        super().__init__(directory, durable=durable)
        self.weights_only, self.direct_io = weights_only, direct_io

    def _looks_like_data(self, filename: str) -> bool:
        return filename == PAYLOAD or filename.endswith(".bin")

    # -- writing ------------------------------------------------------------------------

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        file_io.check_name(name)
        with self.staged_folder(name) as tmp:
            tree, table, groups = file_io.split(payload)
            files = {}
            for file, tensors in groups.items():
                files[file] = file_io.write_tensors(tmp / file, tensors, self.durable)
            buffer = io.BytesIO()
            torch.save({"tree": tree, "tensors": table}, buffer)
            files[PAYLOAD] = file_io.write_bytes(tmp / PAYLOAD, buffer.getbuffer(), self.durable)
            meta: Mapping[str, Any] = payload["meta"] if isinstance(payload.get("meta"), Mapping) else {}
            manifest = {
                "format": FORMAT,
                "store": self.kind,
                "version": payload.get("version", 1),
                "step": meta.get("step"),
                "epoch": meta.get("epoch"),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": {
                    file: {"size": size, "checksum": file_io.hex_digest(value), "algorithm": file_io.ALGORITHM}
                    for file, (size, value) in files.items()
                },
            }
            raw = file_io.manifest_bytes(manifest)
            file_io.write_bytes(tmp / MANIFEST, raw, self.durable)
        return json.loads(raw)

    # -- reading ------------------------------------------------------------------------

    def _check_manifest(self, folder: Path, raw: bytes, manifest: dict[str, Any]) -> None:
        if file_io.MANIFEST_KEY not in manifest and "manifest_crc32" in manifest:
            algorithms = sorted({str(e.get("algorithm")) for e in manifest["files"].values() if isinstance(e, dict)})
            raise CheckpointError(
                f"written by an older cadence: its checksums are {', '.join(algorithms)} (a sum of 8-byte words "
                f"that misses compensating bit flips and swapped words); this cadence verifies {file_io.ALGORITHM} "
                "checksums only and does not load it: use the cadence version that wrote it, or a newer checkpoint",
                path=folder,
                step=manifest.get("step"),
            )
        super()._check_manifest(folder, raw, manifest)

    def _unverified_step(self, folder: Path) -> int | None:
        try:
            step = torch.load(folder / PAYLOAD, weights_only=True, map_location="cpu")["tree"]["meta"]["step"]
        except Exception:
            return None
        return step if isinstance(step, int) else None

    def verify(self, name: str) -> dict[str, Any]:
        """Every byte of every file against the manifest: its size and the XXH3-64 of the whole file.

        Stricter than `read`, which hashes the zero padding between tensors as the
        zeros the writer wrote (it never reads them): a changed padding byte
        loads the same tensors, but `verify` (and `cadence inspect`) reports it.
        """
        return self._consistent(name, self._verify)

    def _verify(self, name: str) -> dict[str, Any]:
        manifest, folder, _, table = self._skeleton(name)
        self.check_sizes(folder, manifest, manifest["files"])
        files = [file for file in manifest["files"] if file != PAYLOAD]
        self._read_files(folder, manifest, table, files, None)
        for file in files:
            self._check_padding(folder, manifest, table, file)
        return manifest

    def _check_padding(self, folder: Path, manifest: dict[str, Any], table: list[Any], file: str) -> None:
        """The bytes between tensors are the zeros the reads hash them as: the whole file's XXH3-64 is the manifest's."""
        position = 0
        with open(folder / file, "rb", buffering=0) as f:
            for start, end in sorted((entry[1], entry[1] + entry[2]) for entry in table if entry[0] == file):
                if start > position:  # at most 63 bytes before an aligned tensor
                    f.seek(position)
                    if f.read(start - position).strip(b"\0"):
                        raise CheckpointError(
                            f"{file}: checksum mismatch (the padding at bytes {position}-{start - 1} between two "
                            f"tensors is not the zeros written; {file_io.ALGORITHM} of the file differs from the "
                            "manifest's, though its tensors are intact): the file is damaged; use another checkpoint",
                            path=folder,
                            step=manifest.get("step"),
                        )
                position = max(position, end)

    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        return self._consistent(name, lambda name: self._read(name, keys))

    def _consistent(self, name: str, work: Any) -> Any:
        """`work(name)`, again if `name` was committed anew while it ran (another writer's exchange).

        A commit swaps the whole folder in one step, but a reader opens its files
        one by one: one that started on the old folder can meet the new one's
        files, which looks like damage. When the folder under `name` changed
        during the read, the read starts over on the new one; damage in a
        folder that stayed put is reported as it is.
        """
        for _ in range(_RETRIES):
            before = _identity(self.path(name))
            try:
                return work(name)
            except CheckpointError:
                if before is None or _identity(self.path(name)) == before:
                    raise
        return work(name)

    def _read(self, name: str, keys: Iterable[str] | None) -> dict[str, Any]:
        manifest, folder, tree, table = self._skeleton(name)
        if keys is not None:
            wanted = set(keys) | {"format", "version", "meta"}
            tree = {k: v for k, v in tree.items() if k in wanted}
        needed = sorted(set(file_io.placeholders(tree)))
        tensors: dict[int, torch.Tensor] = {}
        files = sorted({table[i][0] for i in needed})
        unlisted = [file for file in files if file not in manifest["files"]]
        if unlisted:
            raise CheckpointError(
                f"{unlisted} are referenced but not in the manifest", path=folder, step=manifest["step"]
            )
        self.check_sizes(folder, manifest, {file: manifest["files"][file] for file in files})  # before any read
        self._read_files(folder, manifest, table, files, tensors)
        return file_io.rebuild(tree, tensors)

    def _skeleton(self, name: str) -> tuple[dict[str, Any], Path, Any, list[Any]]:
        """The manifest, the folder, and the verified structure and tensor table of `payload.pt`."""
        manifest = self.manifest(name)
        folder, step = self.path(name), manifest.get("step")
        if PAYLOAD not in manifest["files"]:
            raise CheckpointError(
                f"the manifest lists no {PAYLOAD}: not a checkpoint of this format", path=folder, step=step
            )
        self.check_sizes(folder, manifest, {PAYLOAD: manifest["files"][PAYLOAD]})
        data = (folder / PAYLOAD).read_bytes()
        self._check_checksum(folder, manifest, PAYLOAD, file_io.digest(data))
        try:
            skeleton = torch.load(io.BytesIO(data), weights_only=self.weights_only, map_location="cpu")
        except Exception as exc:
            hint = "; if you trust this file, load it with FileStore(weights_only=False)" if self.weights_only else ""
            raise CheckpointError(f"cannot unpickle {PAYLOAD}: {exc}{hint}", path=folder, step=step) from exc
        return manifest, folder, skeleton["tree"], skeleton["tensors"]

    def _read_files(
        self,
        folder: Path,
        manifest: dict[str, Any],
        table: list[Any],
        files: list[str],
        out: dict[int, torch.Tensor] | None,
    ) -> None:
        """Read tensor files into `out` (None: only check them), comparing each one's checksum as it is read."""
        jobs = []
        for file in files:
            entries = sorted((i for i, entry in enumerate(table) if entry[0] == file), key=lambda i: table[i][1])
            jobs.append((folder / file, [(i, *table[i][1:]) for i in entries]))
        with file_read.TensorReads(jobs, out, self.direct_io) as reads:
            for n, file in enumerate(files):
                self._check_checksum(folder, manifest, file, reads.read(n))

    def _check_checksum(self, folder: Path, manifest: dict[str, Any], file: str, value: int) -> None:
        entry = manifest["files"][file]
        if entry.get("algorithm") != file_io.ALGORITHM:
            raise CheckpointError(
                f"{file}: checksum algorithm {entry.get('algorithm')!r} is not {file_io.ALGORITHM!r} (written by "
                "another cadence version?); use the cadence version that wrote it",
                path=folder,
                step=manifest.get("step"),
            )
        if file_io.hex_digest(value) != entry["checksum"]:
            raise CheckpointError(
                f"{file}: checksum mismatch ({file_io.ALGORITHM} {file_io.hex_digest(value)}, the manifest says "
                f"{entry['checksum']}): the file is corrupted; use another checkpoint",
                path=folder,
                step=manifest.get("step"),
            )


_RETRIES = 10


def _identity(folder: Path) -> tuple[int, ...] | None:
    """Which folder a name points at now, or None if none.

    The inode alone is not enough: a removed folder's inode number is reused
    by the next temporary folder, so a name can point at "the same" inode again
    after two commits; the change time tells them apart.
    """
    try:
        stat = os.stat(folder)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns, stat.st_mtime_ns
