"""The checkpoint store contract, its error, and the stores by the kind their manifests name.

A checkpoint is a named snapshot (`latest`, `best`, `ckpt-s000000000040`, ...)
in a folder, committed atomically by a `CheckpointStore`: either complete or
invisible. A backend says how it is written (`Backend.checkpoint_store`): the
file store for one process and DDP, DCP or DeepSpeed stores for the others.
A store that stages its own asynchronous saves (DCP's `async_save`) is an
`AsyncCheckpointStore`. The `Checkpoint` callback (cadence/callbacks/checkpoint.py)
decides when; the saver (`cadence.checkpoint.saver`) writes;
`cadence.checkpoint.payload` builds and restores what is saved.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import copy
import importlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cadence.engine.bus import CadenceError

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

FORMAT = "cadence-checkpoint"
VERSION = 1

#: The store class that reads a checkpoint, by the `"store"` field of its manifest (`"file"` where
#: the manifest has none), as `module:Class`: imported when a checkpoint of that kind is met.
STORES: dict[str, str] = {
    "file": "cadence.checkpoint.file_store:FileStore",
    "dcp": "cadence.checkpoint.dcp_store:DCPStore",
    "deepspeed": "cadence.checkpoint.deepspeed_store:DeepSpeedStore",
}

#: The store that keeps a kind's checkpoints on object storage (a `dir` or checkpoint path that is a URL,
#: `s3://...`), as `module:Class`; built around the backend's local store (`for_location`).
OBJECT_STORES: dict[str, str] = {
    "file": "cadence.checkpoint.object_file:ObjectFileStore",
    "dcp": "cadence.checkpoint.object_dcp:ObjectDCPStore",
}


class CheckpointError(CadenceError, RuntimeError):
    """A checkpoint is missing, damaged, or does not fit this run.

    The message names the checkpoint (`path`) and its step when known; the
    engine is left as it was. Raised in a hook (`Checkpoint(resume=...)`), it
    propagates as itself, the hook named in a note (see `cadence.CadenceError`).
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, step: int | None = None) -> None:
        self.path = None if path is None else str(path)
        self.step = step
        self.reason = message
        where = f"checkpoint {self.path}" if self.path else "checkpoint"
        super().__init__(f"{where} (step {'unknown' if step is None else step}): {message}")


@contextlib.contextmanager
def store_errors(action: str, path: str | os.PathLike[str] | None, step: int | None = None) -> Iterator[None]:
    """Turn any error a store raises into a `CheckpointError` naming `path` and `step`.

    The one place where store errors are converted: the `Checkpoint` callback
    and `load_checkpoint` wrap every store call in it. It catches
    `BaseException` because `torch.distributed.checkpoint`'s
    `CheckpointException` derives from it (not from `Exception`); only
    `KeyboardInterrupt`, `SystemExit` and `GeneratorExit` pass through. A
    `CheckpointError` without a path or step gets them.
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except CheckpointError as exc:
        if (exc.path is None and path is not None) or (exc.step is None and step is not None):
            raise CheckpointError(
                exc.reason, path=exc.path if exc.path is not None else path, step=step if exc.step is None else exc.step
            ) from exc
        raise
    except BaseException as exc:
        raise CheckpointError(f"{action} failed: {type(exc).__name__}: {exc}", path=path, step=step) from exc


class CheckpointStore(abc.ABC):
    """Where and how checkpoints are written: one folder of named checkpoints.

    `write` commits a name atomically (a reader sees the old checkpoint or the
    new one, never a mix); `link` makes another name for a committed one;
    `sweep` removes what interrupted writes left. Reads verify the manifest
    (every file's size and checksum) and raise `CheckpointError`.

    Who calls what (the `Checkpoint` callback keeps this):

    - Non-collective stores (`collective = False`, the file store): only the
      main process writes, links, deletes and sweeps; every rank reads the
      same files (`read` involves no other rank).
    - Collective stores (`collective = True`: DCP, DeepSpeed): `write` and
      `read` are collectives, called by every rank together, with the same
      name, in the same order. `names`, `link`, `delete`, `sweep`, `manifest`,
      `verify` and `locate` are called on the main rank only and must not
      involve other ranks (auto-resume checks candidates with `manifest` and
      `verify` on the main rank, then every rank `read`s the pick together);
      after them the callback calls `barrier()` on every rank. `write` and
      `barrier` may run in the callback's writer thread (async saves), so a
      collective store uses a process group of its own, never the one the
      training loop uses. Errors, whatever their type (DCP's
      `CheckpointException` is a `BaseException`), are turned into
      `CheckpointError` by the caller (`store_errors`).

    Attributes:
        kind: the manifest's `"store"` field of the checkpoints it writes
            (`"file"` where the manifest has none; `STORES` maps it to the
            class). A non-collective store's `load_checkpoint` reads a
            checkpoint of another kind with that kind's `reader_for(engine)`
            (the DCP store's: a sharded checkpoint loads on one process).
        collective: `write` and `read` are collectives of every rank (see above).
        background_safe: `write` may run in the callback's writer thread while
            the loop trains (async saves). False for a store whose writes run
            collectives on the training group (DeepSpeed's `save_checkpoint`):
            `Checkpoint(async_mode="async")` is then refused at setup.
        restores_model: `read` puts model and optimizer back itself (DeepSpeed's
            engine loads its own files) and marks the payload
            `restored_by_store`; payloads for `write` may leave them out
            (`build_payload(engine, model=False)`).
    """

    kind: ClassVar[str] = "file"
    collective: ClassVar[bool] = False
    background_safe: ClassVar[bool] = True
    restores_model: ClassVar[bool] = False

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = None if directory is None else Path(directory)

    def at(self, directory: str | os.PathLike[str]) -> CheckpointStore:
        """This store, working in `directory`."""
        other = copy.copy(self)
        other.directory = Path(directory)
        return other

    @classmethod
    def for_reading(cls) -> CheckpointStore:
        """A store of this kind that reads without an engine (`locate`, `manifest`, `verify`, `read_whole`).

        For tools that look at a checkpoint outside a run: `cadence export`, `cadence inspect`.
        """
        return cls()

    @classmethod
    def reader_for(cls, engine: Engine) -> CheckpointStore | None:
        """A store of this kind that reads its checkpoints into `engine` on any backend; None: only its own.

        `load_checkpoint` asks it for a checkpoint of this kind (the manifest's
        `"store"`) found where the backend's own, non-collective store is of
        another kind.
        """
        return None

    def path(self, name: str) -> Path:
        if self.directory is None:
            raise ValueError(f"{type(self).__name__} has no directory: use store.at(directory)")
        return self.directory / name

    @abc.abstractmethod
    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Commit `payload` as `name` atomically; returns its manifest (collective stores: every rank, together)."""

    @abc.abstractmethod
    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """The payload of `name` (only the top-level `keys` if given), verified (collective stores: every rank, together)."""

    def read_whole(self, name: str) -> dict[str, Any]:
        """The payload of `name`, every tensor whole on the CPU, in one process without an engine (`cadence export`).

        The model's full weights under `"model"`; `"optimizers"` is empty where
        the store keeps them in a form of its own (DeepSpeed's partitions).
        Stores whose `read` needs an engine override it.
        """
        return self.read(name)

    @abc.abstractmethod
    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest of `name` (step, epoch, files); raises if it is not a complete checkpoint. Main rank only."""

    @abc.abstractmethod
    def verify(self, name: str) -> dict[str, Any]:
        """Check every file of `name` against its manifest; returns the manifest. Main rank only, no collective."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """The committed checkpoints in the directory, sorted. Main rank only."""

    def exists(self, name: str) -> bool:
        return name in self.names()

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove `name` (it disappears atomically, then its files are removed). Main rank only."""

    @abc.abstractmethod
    def link(self, src: str, dst: str) -> None:
        """Commit `dst` as the same checkpoint as `src` (hard links when the store can). Main rank only."""

    def wait(self) -> None:
        """Wait for background work of the store (removing superseded checkpoints)."""
        return None

    def write_replica(self, name: str, payload: Mapping[str, Any]) -> None:
        """Write only this replica group's data state of `payload` (TorchFT: a group that does not write the run's checkpoint at this save).

        Stores without replica groups have nothing to write.
        """
        return None

    def barrier(self) -> None:
        """Wait for every rank, after main-only calls (collective stores; callable from the writer thread).

        Non-collective stores are never asked; a collective store implements it
        on its own process group.
        """
        if self.collective:
            raise NotImplementedError(f"{type(self).__name__} is collective: implement barrier() on its own group")

    @abc.abstractmethod
    def sweep(self) -> list[str]:
        """Remove leftovers of interrupted writes; returns what was removed. Main rank only."""

    @abc.abstractmethod
    def locate(self, path: str | os.PathLike[str]) -> tuple[CheckpointStore, str]:
        """`(store at its folder, name)` for a checkpoint path or a folder holding `latest`.

        Collective stores: main rank only (`payload.locate` tells the others).
        """


class PendingSave:
    """An asynchronous save (`AsyncCheckpointStore.write_async`): staged, being written, then committed.

    `result()` waits and returns the manifest on the committing rank (None on
    the others), or raises `CheckpointError`. The store completes it
    (`set_result` / `set_exception`) from the thread `started` in.
    """

    def __init__(self, name: str, step: int | None) -> None:
        self.name, self.step = name, step
        self._future: concurrent.futures.Future[dict[str, Any] | None] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None

    def started(self, thread: threading.Thread) -> None:
        """The thread that completes this save (joined by `wait`, `result` and `exception`)."""
        self._thread = thread

    def set_result(self, manifest: dict[str, Any] | None) -> None:
        self._future.set_result(manifest)

    def set_exception(self, error: BaseException) -> None:
        self._future.set_exception(error)

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save is committed or failed (no error raised); False on timeout."""
        concurrent.futures.wait([self._future], timeout)
        if self._future.done() and self._thread is not None:
            self._thread.join()
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict[str, Any] | None:
        value = self._future.result(timeout)
        if self._thread is not None:
            self._thread.join()
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = self._future.exception(timeout)
        if self._thread is not None:
            self._thread.join()
        return error


class AsyncCheckpointStore(CheckpointStore):
    """A store that stages its own asynchronous saves (the DCP store: `dcp.async_save` with its stager).

    `Checkpoint(async_mode="async")` saves through `write_async` instead of the
    saver's `AsyncWriter` and its staging: every rank calls it in the loop, in
    the same order (collective stores).
    """

    @abc.abstractmethod
    def write_async(
        self,
        name: str,
        payload: Mapping[str, Any],
        after_commit: Callable[[dict[str, Any]], None] | None = None,
    ) -> PendingSave:
        """Stage `payload` and return; it is written in the background, then committed as `name`.

        One save is in flight at a time: a call while the previous one is being
        written first waits for it (no save is dropped). `after_commit(manifest)`
        runs on the committing rank after the commit, before the next save can
        commit (give the checkpoint its other names there).
        """


def store_class(kind: str) -> type[CheckpointStore] | None:
    """The store class of checkpoints whose manifest says `"store": kind` (`STORES`); None for an unknown kind."""
    target = STORES.get(kind)
    if target is None:
        return None
    module, _, name = target.partition(":")
    found: type[CheckpointStore] = getattr(importlib.import_module(module), name)
    return found


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether `location` is a URL with a scheme other than `file` (`s3://...`, `gs://...`, `memory://...`)."""
    text = os.fspath(location)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.isidentifier() and scheme != "file"


def for_location(store: CheckpointStore, location: str | os.PathLike[str]) -> CheckpointStore:
    """`store` for a local `location`; for a URL, the object store of `store`'s kind around it (`OBJECT_STORES`).

    Not yet at `location`: call `.at(...)` or `.locate(...)`. Raises ValueError for a store kind that
    cannot live on object storage.
    """
    if not is_url(location):
        return store
    target = OBJECT_STORES.get(store.kind)
    if target is None:
        raise ValueError(
            f"checkpoint location {os.fspath(location)!r}: the {type(store).__name__} ({store.kind!r}) keeps "
            f"checkpoints on a filesystem only; object storage takes the {' and '.join(OBJECT_STORES)} stores"
        )
    module, _, name = target.partition(":")
    wrap: Callable[[CheckpointStore], CheckpointStore] = getattr(importlib.import_module(module), name)
    return wrap(store)  # an object store takes the local store it keeps saves with
