"""What every store that keeps one folder per named checkpoint does the same way.

A checkpoint is `<directory>/<name>/`, complete when its `manifest.json`
(written last) is there; writes happen in `.tmp-<name>.<pid>...` folders,
superseded and deleted ones wait in `.old-...` / `.trash-...` until removed.
The file, DCP and DeepSpeed stores share this layout: listing, sweeping and
locating are here once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from cadence.checkpoint import file_io
from cadence.checkpoint.store import CheckpointError

MANIFEST = "manifest.json"
TEMP_PREFIXES = (".tmp-", ".old-", ".trash-")


def names(directory: Path) -> list[str]:
    """The complete checkpoints in `directory` (folders with a manifest), sorted."""
    if not directory.is_dir():
        return []
    return sorted(
        e.name
        for e in os.scandir(directory)
        if not e.name.startswith(".") and e.is_dir() and os.path.exists(os.path.join(e.path, MANIFEST))
    )


def exists(folder: Path) -> bool:
    """Whether `folder` is a complete checkpoint."""
    return (folder / MANIFEST).is_file()


def sweep(directory: Path) -> list[str]:
    """Remove what interrupted writes left in `directory`; returns the removed names.

    A temporary folder of another live process (its pid in the name) is left
    alone; an `.old-` folder whose name is free again is a commit that died
    between its two renames (no atomic exchange here): it is put back.
    """
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


def locate(path: str | os.PathLike[str], looks_like_data: Callable[[str], bool], no_manifest: str) -> tuple[Path, str]:
    """`(directory, name)` for a checkpoint folder, or for a folder holding `latest`.

    A folder of checkpoint files without a manifest (`looks_like_data` of one
    of its file names) is an incomplete checkpoint: `no_manifest` says so.
    """
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise CheckpointError("no such file or folder; check the path", path=p)
    if p.is_dir() and (p / MANIFEST).exists():
        return p.parent, p.name
    if p.is_dir() and (p / "latest").is_dir():
        return p, "latest"
    if p.is_dir() and any(looks_like_data(f.name) for f in p.iterdir()):
        raise CheckpointError(no_manifest, path=p)
    raise CheckpointError(
        "not a checkpoint: expected a checkpoint folder (with manifest.json) or a folder holding 'latest'", path=p
    )
