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

import concurrent.futures
import contextlib
import functools
import inspect
import json
import logging
import os
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import xxhash

from cadence.checkpoint import dcp_io, file_io, folders
from cadence.checkpoint.dcp_staging import DCPStager
from cadence.checkpoint.folders import MANIFEST
from cadence.checkpoint.store import FORMAT, CheckpointError, CheckpointStore

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

logger = logging.getLogger("cadence.checkpoint")

METADATA = ".metadata"
OBJECTS = "objects.pt"
STORE = "dcp"
MANIFEST_KEY = "manifest_xxh3_64"
_NO_MANIFEST = (
    "not a complete checkpoint: manifest.json is missing (an interrupted write or a damaged copy; the step is "
    "objects.pt's, unverified); it is never loaded; use another checkpoint"
)
_QUIET = "torch.distributed is (disabled, )?unavailable or uninitialized"


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


class PendingSave:
    """An asynchronous DCP save (`DCPStore.write_async`): staged, being written, then committed.

    `result()` waits and returns the manifest on the main rank (None on the
    others), or raises `CheckpointError`.
    """

    def __init__(self, name: str, step: int | None) -> None:
        self.name, self.step = name, step
        self._future: concurrent.futures.Future[dict[str, Any] | None] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None

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


@attrs.define
class _Prepared:
    """One save, agreed by every rank: where it goes, what DCP writes, and what is known of it."""

    tmp: Path
    final: Path
    tensors: dict[str, torch.Tensor]
    writer: Any
    step: int | None
    epoch: int | None
    version: int
    rank: int
    world: int


class _Shared:
    """What copies of a store (`at()`) share: background removals, the staging buffers, the save in flight."""

    def __init__(self) -> None:
        self.reaper = file_io.Reaper()
        self.stager = DCPStager()  # buffers kept from save to save (pinned for CUDA tensors)
        self.pending: PendingSave | None = None


class DCPStore(CheckpointStore):
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
    stages_itself: ClassVar[bool] = True  # async saves go through `write_async` (a `DCPStager`), not a Staging copy

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
        super().__init__(directory)
        if thread_count < 1:
            raise ValueError(f"DCPStore(thread_count={thread_count}): needs at least 1 writer thread")
        self.template = template
        self.load_in_place, self.durable = load_in_place, durable
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

    def _folder(self) -> Path:
        if self.directory is None:
            raise ValueError("DCPStore has no directory: use DCPStore(directory) or store.at(directory)")
        return self.directory

    # -- collectives ----------------------------------------------------------------------------

    def _group(self) -> tuple[Any, int, int]:
        """`(group, rank, world)`; `(None, 0, 1)` without a process group."""
        import torch.distributed as dist

        group = dcp_io.checkpoint_group(self.timeout)
        if group is None:
            return None, 0, 1
        return group, dist.get_rank(group), dist.get_world_size(group)

    def barrier(self) -> None:
        """Wait for every rank on the store's group (after main-only calls; safe in a writer thread)."""
        group, _, world = self._group()
        if world > 1:
            import torch.distributed as dist

            dist.monitored_barrier(group=group, timeout=timedelta(seconds=self.timeout), wait_all_ranks=True)

    # -- writing --------------------------------------------------------------------------------

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Every rank: save `payload` as `name` and commit it; returns the manifest on every rank.

        Raises `CheckpointError` on every rank when any rank failed (nothing is
        committed then).
        """
        file_io.check_name(name)
        self._settle()
        group, rank, world = self._group()
        prepared = self._prepare(name, payload, group, rank, world)
        manifest: dict[str, Any] | None = None
        error: BaseException | None = None
        try:
            with _quiet(group):
                import torch.distributed.checkpoint as dcp

                dcp.save(prepared.tensors, storage_writer=prepared.writer, process_group=group, no_dist=group is None)
            if rank == 0:
                manifest = self._finish(prepared)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
        if rank == 0 and error is not None:
            shutil.rmtree(prepared.tmp, ignore_errors=True)
        status = (manifest, None if error is None else _describe(error))
        manifest, failure = dcp_io.broadcast(status, group, world)
        if error is not None:
            raise _wrap(error, f"saving {name!r} failed", prepared.final, prepared.step) from error
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
        file_io.check_name(name)
        self._settle()
        group, rank, world = self._group()
        prepared = self._prepare(name, payload, group, rank, world)
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if "async_stager" not in inspect.signature(dcp.async_save).parameters:
                raise RuntimeError(
                    f"async DCP saves need torch >= 2.9 (dcp.async_save(async_stager=...)), not {torch.__version__}"
                )
            with _quiet(group):
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
            if rank == 0:
                shutil.rmtree(prepared.tmp, ignore_errors=True)
            raise _wrap(exc, f"staging {name!r} failed", prepared.final, prepared.step) from exc
        future = getattr(response, "upload_completion", response)
        pending = PendingSave(name, prepared.step)
        thread = threading.Thread(
            target=self._complete,
            args=(future, prepared, pending, after_commit),
            name="cadence-dcp-commit",
            daemon=True,
        )
        pending._thread = thread
        self._shared.pending = pending
        thread.start()
        return pending

    def _complete(
        self,
        future: Any,
        prepared: _Prepared,
        pending: PendingSave,
        after_commit: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        committed = False
        try:
            future.result()
            manifest = None
            if prepared.rank == 0:
                manifest = self._finish(prepared)
                committed = True
                if after_commit is not None:
                    after_commit(manifest)
            pending._future.set_result(manifest)
        except BaseException as exc:
            if prepared.rank == 0 and not committed:
                shutil.rmtree(prepared.tmp, ignore_errors=True)
            what = "naming it after its commit" if committed else "the background save"
            pending._future.set_exception(
                _wrap(exc, f"{what} of {pending.name!r} failed", prepared.final, pending.step)
            )

    def _settle(self) -> None:
        """Wait for the save in flight (its error is its caller's to report)."""
        pending = self._shared.pending
        if pending is not None:
            pending.wait()
            self._shared.pending = None

    def _prepare(self, name: str, payload: Mapping[str, Any], group: Any, rank: int, world: int) -> _Prepared:
        """Split the payload and agree on the temporary folder (one all-gather)."""
        meta = payload.get("meta") if isinstance(payload.get("meta"), Mapping) else {}
        step, epoch = meta.get("step"), meta.get("epoch")  # type: ignore[union-attr]
        final = self.path(name)
        problem, digests, skeleton, tensors = None, None, None, None
        try:
            skeleton, tensors = dcp_io.split(payload)
            digests = dcp_io.entry_digests(skeleton)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        everyone = dcp_io.all_gather((os.getpid(), secrets.token_hex(4), digests, problem), group, world)
        for other, (_, _, _, text) in enumerate(everyone):
            if text is not None:
                raise CheckpointError(f"rank {other} cannot save {name!r}: {text}", path=final, step=step)
        assert skeleton is not None and tensors is not None and digests is not None
        pid, token, main_digests, _ = everyone[0]
        tmp = final.parent / f".tmp-{name}.{pid}.{token}"
        if rank == 0:
            final.parent.mkdir(parents=True, exist_ok=True)
            objects: tuple[str, bytes] | None = (OBJECTS, dcp_io.serialize(skeleton))
        else:
            differing = {k: v for k, v in skeleton.items() if main_digests.get(k) != digests[k]}
            objects = (_objects_file(rank), dcp_io.serialize(differing)) if differing else None
        writer = dcp_io.writer(tmp, objects=objects, durable=self.durable, thread_count=self.thread_count)
        version = payload.get("version", 1)
        return _Prepared(
            tmp, final, tensors, writer, step, epoch, version if isinstance(version, int) else 1, rank, world
        )

    def _finish(self, prepared: _Prepared) -> dict[str, Any]:
        """Main rank, after every rank's DCP write: manifest from the ranks' records, then the commit."""
        tmp, step = prepared.tmp, prepared.step
        records: dict[str, list[Any]] = {}
        for rank in range(prepared.world):
            path = tmp / f"{dcp_io.RECORD_PREFIX}{rank}.json"
            try:
                records.update(json.loads(path.read_text()))
            except FileNotFoundError:
                raise CheckpointError(
                    f"rank {rank} left no record of its files in {tmp.name}", path=prepared.final, step=step
                ) from None
        files: dict[str, dict[str, Any]] = {}
        for entry in sorted(os.scandir(tmp), key=lambda e: e.name):
            if entry.name.startswith(dcp_io.RECORD_PREFIX):
                continue
            size = entry.stat().st_size
            record = records.get(entry.name)
            if record is None or record[0] != size:  # not written through the hashing writer: read it
                record = list(dcp_io.file_digest(Path(entry.path)))
            files[entry.name] = {"size": size, "checksum": record[1], "algorithm": dcp_io.ALGORITHM}
        for needed in (METADATA, OBJECTS):
            if needed not in files:
                raise CheckpointError(
                    f"the save left no {needed} in {tmp.name}: not committed", path=prepared.final, step=step
                )
        for rank in range(prepared.world):
            (tmp / f"{dcp_io.RECORD_PREFIX}{rank}.json").unlink()
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "store": STORE,
            "version": prepared.version,
            "step": step,
            "epoch": prepared.epoch,
            "world_size": prepared.world,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        manifest[MANIFEST_KEY] = _manifest_digest(manifest)
        file_io.write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode(), self.durable)
        if self.durable:
            file_io.fsync_dir(tmp)
        self._commit(tmp, prepared.final)
        return manifest

    def _commit(self, tmp: Path, final: Path) -> None:
        """Give `tmp` the name `final` in one step; the previous `final` is removed after (as the file store)."""
        old: Path | None = None
        if not final.exists():
            os.rename(tmp, final)
        elif file_io.exchange(tmp, final):
            old = tmp
        else:
            old = final.parent / f".old-{final.name}.{os.getpid()}.{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
        if self.durable:
            file_io.fsync_dir(final.parent)
        if old is not None:
            self._shared.reaper.remove(old)

    def link(self, src: str, dst: str) -> None:
        """Main rank: commit `dst` as the same checkpoint as `src` (hard links; copies where links fail)."""
        file_io.check_name(dst)
        source = self.path(src)
        self.manifest(src)  # only a complete checkpoint gets another name
        final = self.path(dst)
        tmp = final.parent / f".tmp-{dst}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            for entry in sorted(os.scandir(source), key=lambda e: e.name == MANIFEST):  # manifest last
                try:
                    os.link(entry.path, tmp / entry.name)
                except OSError:
                    shutil.copyfile(entry.path, tmp / entry.name)
                    if self.durable:
                        file_io.fsync_file(tmp / entry.name)
            if self.durable:
                file_io.fsync_dir(tmp)
            self._commit(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def delete(self, name: str) -> None:
        """Main rank: `name` disappears at once (renamed), its files are removed in the background."""
        target = self.path(name)
        trash = target.parent / f".trash-{name}.{os.getpid()}.{secrets.token_hex(4)}"
        os.rename(target, trash)
        if self.durable:
            file_io.fsync_dir(target.parent)
        self._shared.reaper.remove(trash)

    def wait(self) -> None:
        """Wait for the save in flight and for removals of superseded checkpoints."""
        self._settle()
        self._shared.reaper.wait()

    def close(self) -> None:
        """Wait for background work and free the staging buffers."""
        self.wait()
        self._shared.stager.close()

    def sweep(self) -> list[str]:
        """Main rank: remove temporary folders of interrupted writes (of processes no longer running)."""
        return folders.sweep(self._folder())

    # -- reading --------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return folders.names(self._folder())

    def exists(self, name: str) -> bool:
        return folders.exists(self.path(name))

    def locate(self, path: str | os.PathLike[str]) -> tuple[DCPStore, str]:
        directory, name = folders.locate(path, lambda f: f == METADATA or f.endswith(".distcp"), _NO_MANIFEST)
        return self.at(directory), name  # type: ignore[return-value]

    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest of `name`, checked (its own checksum, written by this store, `.metadata` present)."""
        folder = self.path(name)
        if not folder.is_dir():
            known = ", ".join(self.names()) or "none"
            raise CheckpointError(f"no checkpoint named {name!r} in {folder.parent} (there: {known})", path=folder)
        try:
            text = (folder / MANIFEST).read_text()
        except FileNotFoundError:
            raise CheckpointError(_NO_MANIFEST, path=folder, step=_unverified_step(folder)) from None
        try:
            manifest = json.loads(text)
            ok = (
                isinstance(manifest, dict)
                and manifest.get("format") == FORMAT
                and isinstance(manifest.get("files"), dict)
            )
        except ValueError:
            ok, manifest = False, None
        if not ok:
            raise CheckpointError(
                f"{MANIFEST} is unreadable or not a cadence manifest: the file is damaged", path=folder
            )
        step = manifest.get("step")
        if manifest.get(MANIFEST_KEY) != _manifest_digest(manifest):
            raise CheckpointError(
                f"{MANIFEST} fails its own checksum: the file is damaged (the step it names cannot be trusted)",
                path=folder,
                step=step if isinstance(step, int) else None,
            )
        if manifest.get("store") != STORE:
            raise CheckpointError(
                f"not a DCP checkpoint (written by the {manifest.get('store', 'file')!r} store): load it with that "
                "store, e.g. a backend with checkpoint='file'",
                path=folder,
                step=step,
            )
        if METADATA not in manifest["files"] or not (folder / METADATA).is_file():
            raise CheckpointError(
                f"{METADATA} is missing (DCP's index of the tensors): not a complete checkpoint, it is never loaded; "
                "use another checkpoint",
                path=folder,
                step=step,
            )
        return manifest

    def verify(self, name: str) -> dict[str, Any]:
        """Main rank (no collectives): every file's size, then its XXH3-64, against the manifest."""
        manifest = self.manifest(name)
        folder = self.path(name)
        self._check_sizes(folder, manifest, manifest["files"])
        for file in sorted(manifest["files"]):
            self._check_checksum(folder, manifest, file)
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
        group, rank, world = self._group()
        folder = self.path(name)
        step: int | None = None
        problem: tuple[str, str | None, int | None] | None = None
        skeleton: Any = None
        destinations: dict[str, torch.Tensor] = {}
        try:
            manifest = self.manifest(name)
            step = manifest.get("step")
            files = manifest["files"]
            self._check_sizes(folder, manifest, files)
            for file in sorted(files)[rank::world]:  # each rank hashes its share
                self._check_checksum(folder, manifest, file)
            skeleton = self._skeleton(folder, manifest, rank)
            if keys is not None:
                wanted = set(keys) | {"format", "version", "meta"}
                skeleton = {k: v for k, v in skeleton.items() if k in wanted}
            destinations = self._destinations(folder, manifest, skeleton, template)
        except CheckpointError as exc:
            problem = (_message(exc), exc.path, exc.step)
        except Exception as exc:
            problem = (f"reading it failed: {type(exc).__name__}: {exc}", str(folder), step)
        problems = dcp_io.all_gather(problem, group, world)
        for other, found in enumerate(problems):
            if found is not None:
                message, path, at = found
                raise CheckpointError(message if other == rank else f"on rank {other}: {message}", path=path, step=at)
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.filesystem import FileSystemReader

            with _quiet(group):
                dcp.load(
                    destinations, storage_reader=FileSystemReader(folder), process_group=group, no_dist=group is None
                )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise _wrap(exc, "torch.distributed.checkpoint could not load it", folder, step) from exc
        return dcp_io.rebuild(skeleton, destinations)

    def _skeleton(self, folder: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any]:
        """The main rank's objects, with this rank's own entries over them (where it saved some)."""
        step = manifest.get("step")
        parts = [OBJECTS] + ([_objects_file(rank)] if _objects_file(rank) in manifest["files"] else [])
        skeleton: dict[str, Any] = {}
        for part in parts:
            try:
                loaded = torch.load(folder / part, weights_only=True, map_location="cpu")
            except Exception as exc:
                raise CheckpointError(f"cannot unpickle {part}: {exc}", path=folder, step=step) from exc
            if not isinstance(loaded, dict):
                raise CheckpointError(f"{part} holds no payload structure", path=folder, step=step)
            skeleton.update(loaded)
        return skeleton

    def _destinations(
        self, folder: Path, manifest: dict[str, Any], skeleton: Any, template: Mapping[str, Any] | None
    ) -> dict[str, torch.Tensor]:
        """The tensors DCP loads into, each checked against `.metadata` (key present, same global shape)."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        step = manifest.get("step")
        try:
            metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
        except Exception as exc:
            raise CheckpointError(
                f"cannot read {METADATA}: {type(exc).__name__}: {exc}", path=folder, step=step
            ) from exc
        if template is None:
            template = self.template() if callable(self.template) else self.template
        out: dict[str, torch.Tensor] = {}
        for key, path in dcp_io.placeholders(skeleton):
            saved = metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(
                    f"tensor {key} is in {OBJECTS} but not in {METADATA}: the checkpoint is damaged",
                    path=folder,
                    step=step,
                )
            live = dcp_io.lookup(template, path) if template is not None else None
            if isinstance(live, torch.Tensor):
                if tuple(live.shape) != tuple(saved.size):
                    raise CheckpointError(
                        f"tensor {key} has shape {tuple(saved.size)} in the checkpoint and {tuple(live.shape)} in this "
                        "run (global shapes); load a checkpoint of this model",
                        path=folder,
                        step=step,
                    )
                out[key] = live.detach() if self.load_in_place else torch.empty_like(live)
            else:
                out[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        return out

    def _check_sizes(self, folder: Path, manifest: dict[str, Any], files: Mapping[str, Any]) -> None:
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

    def _check_checksum(self, folder: Path, manifest: dict[str, Any], file: str) -> None:
        entry, step = manifest["files"][file], manifest.get("step")
        if entry.get("algorithm") != dcp_io.ALGORITHM:
            raise CheckpointError(
                f"{file}: checksum algorithm {entry.get('algorithm')!r} is not {dcp_io.ALGORITHM!r}",
                path=folder,
                step=step,
            )
        try:
            _, value = dcp_io.file_digest(folder / file)
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing (the manifest lists it)", path=folder, step=step) from None
        if value != entry["checksum"]:
            raise CheckpointError(
                f"{file}: checksum mismatch (XXH3-64 {value}, the manifest says {entry['checksum']}): the file is "
                "corrupted; use another checkpoint",
                path=folder,
                step=step,
            )


def _unverified_step(folder: Path) -> int | None:
    """The step `objects.pt` names, for the message about a folder without a manifest (not trusted otherwise)."""
    try:
        step = torch.load(folder / OBJECTS, weights_only=True, map_location="cpu")["meta"]["step"]
    except Exception:
        return None
    return step if isinstance(step, int) else None


def _objects_file(rank: int) -> str:
    return f"objects-{rank:05d}.pt"


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_KEY}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _describe(exc: BaseException) -> str:
    return _message(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _message(exc: CheckpointError) -> str:
    text = str(exc)
    head = f"checkpoint {exc.path}" if exc.path else "checkpoint"
    head += f" (step {'unknown' if exc.step is None else exc.step}): "
    return text[len(head) :] if text.startswith(head) else text


def _wrap(exc: BaseException, what: str, path: Path, step: int | None) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"{what}: {type(exc).__name__}: {exc}", path=path, step=step)


@contextlib.contextmanager
def _quiet(group: Any) -> Iterator[None]:
    """Without a process group, DCP warns that it assumes one process at every call: that is the intent here."""
    if group is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QUIET)
        yield
