"""The checkpoint store contract and its error.

A checkpoint is a named snapshot (`latest`, `best`, `ckpt-s000000000040`, ...)
in a folder, committed atomically by a `CheckpointStore`: either complete or
invisible. A backend says how it is written (`Backend.checkpoint_store`): the
file store for one process and DDP, DCP or DeepSpeed stores for the others.
The `Checkpoint` callback (cadence/callbacks/checkpoint.py) decides when;
`cadence.checkpoint.payload` builds and restores what is saved.
"""

from __future__ import annotations

import abc
import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from cadence.engine.bus import CadenceError

FORMAT = "cadence-checkpoint"
VERSION = 1


class CheckpointError(CadenceError, RuntimeError):
    """A checkpoint is missing, damaged, or does not fit this run.

    The message names the checkpoint (`path`) and its step when known; the
    engine is left as it was. Raised in a hook (`Checkpoint(resume=...)`), it
    propagates as itself, the hook named in a note (see `cadence.CadenceError`).
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, step: int | None = None) -> None:
        self.path = None if path is None else str(path)
        self.step = step
        where = f"checkpoint {self.path}" if self.path else "checkpoint"
        super().__init__(f"{where} (step {'unknown' if step is None else step}): {message}")


class CheckpointStore(abc.ABC):
    """Where and how checkpoints are written: one folder of named checkpoints.

    `write` commits a name atomically (a reader sees the old checkpoint or the
    new one, never a mix); `link` makes another name for a committed one;
    `sweep` removes what interrupted writes left. Reads verify the manifest
    (every file's size and checksum) and raise `CheckpointError`.

    Attributes:
        all_ranks_write: every rank calls `write` (sharded stores); when False,
            only the main process writes and the others wait at a barrier.
    """

    all_ranks_write: ClassVar[bool] = False

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = None if directory is None else Path(directory)

    def at(self, directory: str | os.PathLike[str]) -> CheckpointStore:
        """This store, working in `directory`."""
        other = copy.copy(self)
        other.directory = Path(directory)
        return other

    def path(self, name: str) -> Path:
        if self.directory is None:
            raise ValueError(f"{type(self).__name__} has no directory: use store.at(directory)")
        return self.directory / name

    @abc.abstractmethod
    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Commit `payload` as `name` atomically; returns its manifest."""

    @abc.abstractmethod
    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """The payload of `name` (only the top-level `keys` if given), verified."""

    @abc.abstractmethod
    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest of `name` (step, epoch, files); raises if it is not a complete checkpoint."""

    @abc.abstractmethod
    def verify(self, name: str) -> dict[str, Any]:
        """Check every file of `name` against its manifest; returns the manifest."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """The committed checkpoints in the directory, sorted."""

    def exists(self, name: str) -> bool:
        return name in self.names()

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove `name` (it disappears atomically, then its files are removed)."""

    @abc.abstractmethod
    def link(self, src: str, dst: str) -> None:
        """Commit `dst` as the same checkpoint as `src` (hard links when the store can)."""

    def wait(self) -> None:
        """Wait for background work of the store (removing superseded checkpoints)."""
        return None

    @abc.abstractmethod
    def sweep(self) -> list[str]:
        """Remove leftovers of interrupted writes; returns what was removed."""

    @abc.abstractmethod
    def locate(self, path: str | os.PathLike[str]) -> tuple[CheckpointStore, str]:
        """`(store at its folder, name)` for a checkpoint path or a folder holding `latest`."""
