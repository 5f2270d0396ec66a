"""Checkpoints written with `torch.distributed.checkpoint` (DCP) by every rank, committed by the main rank.

The store of sharded runs (the mesh backend; `DDPBackend(checkpoint="dcp")`).
Every rank writes its own shards, so a save takes the time of one rank's part,
and a checkpoint loads on another mesh (resharding: 2 ranks to 1, to one
process without a process group, 1 to 2, a 2-D mesh to a 1-D one).

Layout of one checkpoint, e.g. `checkpoints/latest/`::

    __0_0.distcp ...   DCP's data files: each rank's shards of the model, optimizer
                       and callback tensors (`model.*`, `optimizers.*`, `callbacks.*`)
    .metadata          DCP's index: every key's global shape, dtype and chunks (written
                       last by DCP's coordinator, after every rank's data)
    objects.pt         the rest of the payload as the main rank holds it (engine state,
                       RNG and data positions of every rank, config...), a placeholder
                       for each tensor in DCP; `torch.load(weights_only=True)`
    objects-00003.pt   only where rank 3's entries differ from the main rank's: those entries
    manifest.json      written last, by the main rank: step, epoch, world size, and every
                       file's size and XXH3-64 (DCP keeps no checksums)

Commit protocol (`write`, every rank): the ranks agree on a temporary folder
`.tmp-<name>.<pid of rank 0>.<token>` (one all-gather on the store's own gloo
group, which also tells which ranks' objects differ); each rank writes its DCP
files and objects file there, hashing every byte as it is written, fsyncs
them, and leaves a record of sizes and hashes; DCP's coordinator writes
`.metadata` after all ranks' data; then the main rank writes the manifest
from the records, fsyncs it and the folder, and renames the folder to `name`
(an atomic exchange with the old one). A folder without `manifest.json` or
without `.metadata` is never loaded; `sweep` removes temporary folders of
processes that no longer run.

Reads (`read`, every rank) check the manifest, every file's size and, split
over the ranks, every file's XXH3-64 before anything is loaded; the tensors'
keys and global shapes are checked against `.metadata` and the live tensors
the store loads into (its template); only then does DCP load.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from cadence.checkpoint import dcp_commit, dcp_io, dcp_read, file_io
from cadence.checkpoint.dcp_commit import METADATA, STORE, Prepared
from cadence.checkpoint.dcp_staging import DCPStager
from cadence.checkpoint.folders import FolderStore
from cadence.checkpoint.store import AsyncCheckpointStore, CheckpointError, PendingSave

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.checkpoint")

__all__ = ["DCPStore", "engine_template"]


def engine_template(engine: Engine) -> dict[str, Any]:
    """The live tensors a checkpoint loads into: model, optimizers and callback states.

    The model and optimizer state dicts come from the backend (DTensors with
    their global shapes on a mesh); nothing is copied.
    """
    from cadence.checkpoint.payload import stateful_callbacks

    backend = engine.backend
    return {
        "model": backend.model_state_dict(engine),
        "optimizers": backend.optimizer_state_dicts(engine),
        "callbacks": {key: callback.state_dict() for key, callback in stateful_callbacks(engine).items()},
    }


class _Shared:
    """What copies of a store (`at()`) share besides the removals: the staging buffers, the save in flight."""

    def __init__(self) -> None:
        self.stager = DCPStager()  # buffers kept from save to save (pinned for CUDA tensors)
        self.pending: PendingSave | None = None


class DCPStore(FolderStore, AsyncCheckpointStore):
    """Checkpoints written by every rank with torch.distributed.checkpoint (see the module docstring).

    A collective store: `write`, `write_async` and `read` are called by every
    rank together (same name, same order); `names`, `manifest`, `verify`,
    `link`, `delete`, `sweep` and `locate` touch only files and are called on
    the main rank (then `barrier()` on every rank). Collectives run on a gloo
    group of the store's own, so `write` may run in a writer thread beside the
    training loop. Without a process group everything runs in one process
    (DCP's `no_dist`): a sharded checkpoint then loads whole.

    Args:
        directory: the folder of checkpoints (or set it later with `at`).
        template: the live tensors `read` loads into, as a payload-shaped mapping
            (`model`, `optimizers`, `callbacks`) or a function returning one
            (`DCPStore.for_engine(engine)` uses the engine's). Tensors found there
            set the sharding (DTensor placements) and are checked against the
            checkpoint's global shapes; tensors not found load whole, on the CPU.
        load_in_place: DCP loads straight into the template's tensors (no second
            copy of the state in memory); then the model is changed before
            `restore` has checked the rest of the payload. Default False: loads into
            new tensors shaped like the template's.
        durable: fsync files and folders before a commit counts.
        thread_count: DCP's writer threads per rank.
        timeout: seconds the store's collectives wait for the other ranks.

    Example:
        >>> store = DCPStore.for_engine(engine).at("/tmp/ckpts")  # doctest: +SKIP
        >>> store.write("latest", build_payload(engine))  # every rank  # doctest: +SKIP
        >>> payload = store.read("latest")  # every rank  # doctest: +SKIP
    """

    kind: ClassVar[str] = STORE
    collective: ClassVar[bool] = True
    NO_MANIFEST: ClassVar[str] = (
        "not a complete checkpoint: manifest.json is missing (an interrupted write or a damaged copy; the step is "
        "objects.pt's, unverified); it is never loaded; use another checkpoint"
    )

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        template: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        load_in_place: bool = False,
        durable: bool = True,
        thread_count: int = 1,
        timeout: float = 1800.0,
    ) -> None:
        super().__init__(directory, durable=durable)
        if thread_count < 1:
            raise ValueError(f"DCPStore(thread_count={thread_count}): needs at least 1 writer thread")
        self.template = template
        self.load_in_place = load_in_place
        self.thread_count, self.timeout = thread_count, float(timeout)
        self._shared = _Shared()

    @classmethod
    def for_engine(cls, engine: Engine, **kwargs: Any) -> DCPStore:
        """A store that loads into `engine`'s live model, optimizers and callback states."""
        return cls(template=functools.partial(engine_template, engine), **kwargs)

    @classmethod
    def reader_for(cls, engine: Engine) -> DCPStore:
        """A sharded checkpoint loads on any backend: on its process group, or on one process without one."""
        return cls.for_engine(engine)

    def _looks_like_data(self, filename: str) -> bool:
        return filename == METADATA or filename.endswith(".distcp")

    def barrier(self) -> None:
        """Wait for every rank on the store's group (after main-only calls; safe in a writer thread)."""
        group, _, world = dcp_io.group(self.timeout)
        if world > 1:
            import torch.distributed as dist

            dist.monitored_barrier(group=group, timeout=timedelta(seconds=self.timeout), wait_all_ranks=True)

    # -- writing --------------------------------------------------------------------------------

    def _prepare(self, name: str, payload: Mapping[str, Any]) -> tuple[Any, Prepared]:
        file_io.check_name(name)
        self._settle()
        group, rank, world = dcp_io.group(self.timeout)
        prepared = dcp_commit.prepare(
            name, payload, self.path(name), group, rank, world, durable=self.durable, thread_count=self.thread_count
        )
        return group, prepared

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Every rank: save `payload` as `name` and commit it; returns the manifest on every rank.

        Raises `CheckpointError` on every rank when any rank failed (nothing is
        committed then).
        """
        group, prepared = self._prepare(name, payload)
        manifest: dict[str, Any] | None = None
        error: BaseException | None = None
        try:
            with dcp_io.quiet(group):
                import torch.distributed.checkpoint as dcp

                dcp.save(prepared.tensors, storage_writer=prepared.writer, process_group=group, no_dist=group is None)
            if prepared.rank == 0:
                manifest = dcp_commit.finish(prepared, self.durable, self.commit_folder)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
        if prepared.rank == 0 and error is not None:
            shutil.rmtree(prepared.tmp, ignore_errors=True)
        status = (manifest, None if error is None else dcp_commit.describe(error))
        manifest, failure = dcp_io.broadcast(status, group, prepared.world)
        if error is not None:
            raise dcp_commit.wrap(error, f"saving {name!r} failed", prepared.final, prepared.step) from error
        if failure is not None:
            raise CheckpointError(
                f"saving {name!r} failed on the main rank: {failure}", path=prepared.final, step=prepared.step
            )
        assert manifest is not None
        return manifest

    def write_async(
        self,
        name: str,
        payload: Mapping[str, Any],
        after_commit: Callable[[dict[str, Any]], None] | None = None,
    ) -> PendingSave:
        """Every rank: stage `payload` and return; DCP writes it in a thread, then the main rank commits.

        The loop waits only while the tensors are copied into staging buffers,
        which are kept and reused from save to save. One save is in flight at
        a time: a call while the previous save is still being written first
        waits for it (on every rank, so no save is ever dropped and every rank
        enters the same collectives). `after_commit(manifest)` runs on the main
        rank after the commit, before the next save can commit (give the
        checkpoint its other names there). Collectives run on the store's own
        gloo group (`dcp.async_save` on the training group collides with
        training collectives).
        """
        group, prepared = self._prepare(name, payload)
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if "async_stager" not in inspect.signature(dcp.async_save).parameters:
                raise RuntimeError(
                    f"async DCP saves need torch >= 2.9 (dcp.async_save(async_stager=...)), not {torch.__version__}"
                )
            with dcp_io.quiet(group):
                response = dcp.async_save(
                    prepared.tensors,
                    storage_writer=prepared.writer,
                    process_group=group,
                    async_checkpointer_type=AsyncCheckpointerType.THREAD,
                    async_stager=self._shared.stager,
                    no_dist=group is None,
                )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            if prepared.rank == 0:
                shutil.rmtree(prepared.tmp, ignore_errors=True)
            raise dcp_commit.wrap(exc, f"staging {name!r} failed", prepared.final, prepared.step) from exc
        future = getattr(response, "upload_completion", response)
        pending = PendingSave(name, prepared.step)
        thread = threading.Thread(
            target=self._complete,
            args=(future, prepared, pending, after_commit),
            name="cadence-dcp-commit",
            daemon=True,
        )
        pending.started(thread)
        self._shared.pending = pending
        thread.start()
        return pending

    def _complete(
        self,
        future: Any,
        prepared: Prepared,
        pending: PendingSave,
        after_commit: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        committed = False
        try:
            future.result()
            manifest = None
            if prepared.rank == 0:
                manifest = dcp_commit.finish(prepared, self.durable, self.commit_folder)
                committed = True
                if after_commit is not None:
                    after_commit(manifest)
            pending.set_result(manifest)
        except BaseException as exc:
            if prepared.rank == 0 and not committed:
                shutil.rmtree(prepared.tmp, ignore_errors=True)
            what = "naming it after its commit" if committed else "the background save"
            pending.set_exception(
                dcp_commit.wrap(exc, f"{what} of {pending.name!r} failed", prepared.final, pending.step)
            )

    def _settle(self) -> None:
        """Wait for the save in flight (its error is its caller's to report)."""
        pending = self._shared.pending
        if pending is not None:
            pending.wait()
            self._shared.pending = None

    def wait(self) -> None:
        """Wait for the save in flight and for removals of superseded checkpoints."""
        self._settle()
        super().wait()

    def close(self) -> None:
        """Wait for background work and free the staging buffers."""
        self.wait()
        self._shared.stager.close()

    # -- reading --------------------------------------------------------------------------------

    def _check_manifest(self, folder: Path, raw: bytes, manifest: dict[str, Any]) -> None:
        super()._check_manifest(folder, raw, manifest)
        dcp_read.check_manifest(folder, manifest)

    def _unverified_step(self, folder: Path) -> int | None:
        return dcp_read.unverified_step(folder)

    def verify(self, name: str) -> dict[str, Any]:
        """Main rank (no collectives): every file's size, then its XXH3-64, against the manifest."""
        manifest = self.manifest(name)
        folder = self.path(name)
        self.check_sizes(folder, manifest, manifest["files"])
        for file in sorted(manifest["files"]):
            dcp_read.check_checksum(folder, manifest, file)
        return manifest

    def read(
        self, name: str, keys: Iterable[str] | None = None, template: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Every rank: the payload of `name` (only the top-level `keys` if given), verified, then loaded.

        Tensors load into new tensors shaped and placed like the template's
        (`template`, else the store's), or in place with `load_in_place`;
        tensors the template lacks load whole on the CPU. Everything is
        checked first: the manifest, every file's size and checksum (the
        files split over the ranks), and each tensor's key and global shape
        against `.metadata` and the template; any problem on any rank raises
        the same `CheckpointError` on every rank, with nothing loaded.
        """
        self._settle()
        group, rank, world = dcp_io.group(self.timeout)
        folder = self.path(name)
        step: int | None = None
        problem: tuple[str, str | None, int | None] | None = None
        objects: Any = None
        destinations: dict[str, torch.Tensor] = {}
        try:
            manifest = self.manifest(name)
            step = manifest.get("step")
            files = manifest["files"]
            self.check_sizes(folder, manifest, files)
            for file in sorted(files)[rank::world]:  # each rank hashes its share
                dcp_read.check_checksum(folder, manifest, file)
            if template is None:
                template = self.template() if callable(self.template) else self.template
            objects = dcp_read.skeleton(folder, manifest, rank, template)
            if keys is not None:
                wanted = set(keys) | {"format", "version", "meta"}
                objects = {k: v for k, v in objects.items() if k in wanted}
            destinations = dcp_read.destinations(folder, manifest, objects, template, self.load_in_place)
        except CheckpointError as exc:
            problem = (dcp_commit.message(exc), exc.path, exc.step)
        except Exception as exc:
            problem = (f"reading it failed: {type(exc).__name__}: {exc}", str(folder), step)
        for other, found in enumerate(dcp_io.all_gather(problem, group, world)):
            if found is not None:
                message, path, at = found
                raise CheckpointError(message if other == rank else f"on rank {other}: {message}", path=path, step=at)
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.filesystem import FileSystemReader

            with dcp_io.quiet(group):
                dcp.load(
                    destinations, storage_reader=FileSystemReader(folder), process_group=group, no_dist=group is None
                )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise dcp_commit.wrap(exc, "torch.distributed.checkpoint could not load it", folder, step) from exc
        return file_io.rebuild(objects, destinations, dcp_io.TENSOR)
