"""DeepSpeed engine checkpoints under Cadence's names, manifests and retention.

Layout of one checkpoint, e.g. `checkpoints/latest/` (DeepSpeed's own files)::

    mp_rank_00_model_states.pt                     ZeRO 0-2: module weights + Cadence's payload (client state)
    zero_pp_rank_{r}_mp_rank_00_model_states.pt    ZeRO-3: each rank's partition + its payload
    [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   ZeRO >= 1: each rank's optimizer partition
    manifest.json                                  written last: step, epoch, ZeRO stage, data-parallel
                                                   degree, every file's size and XXH3-64 checksum

The store is collective (`collective = True`): every rank calls `write` and
`read` together. A write runs `ds.save_checkpoint` on every rank into the
temporary tag folder `.tmp-<name>.s<step>`; the main rank then checksums the
files, writes the manifest and gives the folder its name in one atomic step
(`renameat2(RENAME_EXCHANGE)` on Linux when the name exists). `link`,
`delete` and `sweep` act on the main rank only (they are no-ops elsewhere);
`names`, `manifest`, `verify` and `locate` read files only (no collective).

A read checks the manifest first (a changed ZeRO stage or data-parallel
degree is Cadence's error, before DeepSpeed loads anything), the main rank
verifies every checksum, then every rank runs `ds.load_checkpoint`, which
restores the model and optimizer itself: the payload it returns carries
`restored_by_store`, so `cadence.checkpoint.payload.restore` skips them.
`read(name, keys=["model"])` loads module weights only (`load_module_only`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from cadence.checkpoint import file_io
from cadence.checkpoint.folders import MANIFEST, FolderStore
from cadence.checkpoint.payload import RESTORED_BY_STORE
from cadence.checkpoint.store import FORMAT, VERSION, CheckpointError

#: The client-state key Cadence's payload travels under in DeepSpeed's model-states file.
CLIENT_KEY = "cadence"
ALGORITHM = file_io.ALGORITHM  # as every store's manifest; "xxh3_64" in manifests of earlier versions
_ALGORITHMS = (ALGORITHM, "xxh3_64")
_CHUNK = 8 << 20
_UNIVERSAL = (
    "convert it with DeepSpeed's universal checkpoint conversion (python -m deepspeed.checkpoint.ds_to_universal "
    "--input_folder <checkpoint> --output_folder <out>) and load that with the DeepSpeed config key "
    "checkpoint.load_universal, or resume with the saved setting"
)


def _xxhash() -> Any:
    try:
        import xxhash
    except ImportError as exc:
        raise ImportError(
            "the DeepSpeed checkpoint store checksums with xxhash, which is not installed; install it with: "
            "pip install 'cadence[deepspeed]'"
        ) from exc
    return xxhash


def file_checksum(path: str | os.PathLike[str]) -> str:
    """XXH3-64 of a file's bytes, as 16 hex digits."""
    digest = _xxhash().xxh3_64()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class DeepSpeedStore(FolderStore):
    """Checkpoints written and read by DeepSpeed's engine on every rank (see the module docstring).

    Built by `DeepSpeedBackend.checkpoint_store`; it needs the backend's
    DeepSpeed engine (`backend.ds`) and collectives.

    Args:
        directory: the folder of checkpoints (or set it later with `at`).
        backend: the `DeepSpeedBackend` whose engine saves and loads.
        durable: fsync the files and folder before a commit counts.
    """

    #: Every rank calls `write` and `read` (naming, retention and sweeping stay on the main rank).
    kind: ClassVar[str] = "deepspeed"
    collective: ClassVar[bool] = True
    #: DeepSpeed's save_checkpoint runs collectives on the training group: never from a writer thread.
    background_safe: ClassVar[bool] = False
    #: `read` restores model and optimizer itself; the payload skips them.
    restores_model: ClassVar[bool] = True

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, backend: Any, durable: bool = True) -> None:
        super().__init__(directory, durable=durable)
        self.backend = backend

    def _looks_like_data(self, filename: str) -> bool:
        return filename in ("client_state.pt", "zero_to_fp32.py") or filename.startswith("mp_rank_")

    @property
    def _main(self) -> bool:
        return bool(self.backend.is_main)

    def _agree_on_error(self, error: BaseException | None, what: str, step: int | None) -> None:
        """Raise on every rank when the main rank failed (the others wait for its answer)."""
        text = None if error is None else f"{type(error).__name__}: {error}"
        if self.backend.world_size > 1:
            text = self.backend.broadcast_object(text)
        if text is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{what} failed on the main rank: {text}", path=self.directory, step=step) from error

    # -- writing ------------------------------------------------------------------------

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Save through `ds.save_checkpoint` on every rank, then commit `name` on the main rank."""
        file_io.check_name(name)
        backend, directory = self.backend, self.folder_path()
        meta: Mapping[str, Any] = payload["meta"] if isinstance(payload.get("meta"), Mapping) else {}
        step = meta.get("step")
        tag = f".tmp-{name}.s{step}"
        tmp, final = directory / tag, directory / name
        error: BaseException | None = None
        if self._main:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a crash at this very step
            except OSError as exc:
                error = exc
        self._agree_on_error(error, f"preparing {tmp}", step)
        client = {CLIENT_KEY: {k: v for k, v in payload.items() if k not in ("model", "optimizers")}}
        adapter = meta.get("params") == "trainable"  # Checkpoint(params="trainable"): frozen weights left out
        backend.ds.save_checkpoint(
            str(directory), tag=tag, client_state=client, save_latest=False, exclude_frozen_parameters=adapter
        )
        manifest: dict[str, Any] = {}
        if self._main:
            try:
                raw = file_io.manifest_bytes(self._manifest_for(tmp, meta, payload))  # every store's format
                file_io.write_bytes(tmp / MANIFEST, raw, self.durable)
                manifest = json.loads(raw)
                if self.durable:
                    for path in tmp.rglob("*"):
                        if path.is_file():
                            file_io.fsync_file(path)
                    file_io.fsync_dir(tmp)
                self.commit_folder(tmp, final)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                error = exc
        self._agree_on_error(error, f"committing {final}", step)
        return manifest

    def _manifest_for(self, folder: Path, meta: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[str, Any]:
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            relative = path.relative_to(folder).as_posix()
            files[relative] = {"size": path.stat().st_size, "checksum": file_checksum(path), "algorithm": ALGORITHM}
        manifest = {
            "format": FORMAT,
            "version": payload.get("version", VERSION),
            "store": "deepspeed",
            "step": meta.get("step"),
            "epoch": meta.get("epoch"),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "zero_stage": self.backend.zero_stage,
            "data_size": self.backend.data_size,
            "world_size": self.backend.world_size,
            "precision": self.backend.precision_name,
            "params": meta.get("params", "all"),
            "files": files,
        }
        return manifest

    def barrier(self) -> None:
        """Every rank waits (after the main rank's naming, retention or sweep).

        Saves with this store are synchronous (`background_safe = False`), so
        the training group's barrier is safe here.
        """
        self.backend.barrier()

    def link(self, src: str, dst: str) -> None:
        """Commit `dst` as a copy of `src` made of hard links (main rank only)."""
        if self._main:
            super().link(src, dst)

    def delete(self, name: str) -> None:
        """Remove `name` (main rank only): renamed away at once, then removed."""
        if self._main:
            super().delete(name)

    def sweep(self) -> list[str]:
        """Remove folders interrupted writes left (main rank only)."""
        return super().sweep() if self._main else []

    # -- reading ------------------------------------------------------------------------

    def _check_manifest(self, folder: Path, raw: bytes, manifest: dict[str, Any]) -> None:
        if manifest.get("store") != "deepspeed":
            raise CheckpointError(
                "manifest.json is unreadable or not a manifest of a DeepSpeed checkpoint of Cadence", path=folder
            )
        super()._check_manifest(folder, raw, manifest)

    def verify(self, name: str) -> dict[str, Any]:
        """Check every file's size, then its XXH3-64 checksum, against the manifest (reads everything)."""
        manifest = self.manifest(name)
        folder, step = self.path(name), manifest.get("step")
        self.check_sizes(folder, manifest, manifest["files"])
        for file, entry in manifest["files"].items():
            value = file_checksum(folder / file)
            if entry.get("algorithm") not in _ALGORITHMS or value != entry["checksum"]:
                raise CheckpointError(
                    f"{file}: checksum mismatch (computed {value}, the manifest says {entry['checksum']}): the file is "
                    "corrupted; use another checkpoint",
                    path=folder,
                    step=step,
                )
        return manifest

    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """Load `name` into the DeepSpeed engine on every rank and return Cadence's payload.

        `keys=None`: model, optimizer and payload (marked `restored_by_store`);
        `keys=["model"]`: module weights only (`load_module_only`); keys
        without "model": the payload alone, the engine untouched.
        """
        wanted = None if keys is None else set(keys)
        module_only = wanted is not None and wanted <= {"model"}
        touches_engine = wanted is None or "model" in wanted or "optimizers" in wanted
        manifest: dict[str, Any] | None = None
        error: BaseException | None = None
        try:
            manifest = self.manifest(name)
            if touches_engine:
                self._check_fits(name, manifest, module_only)
        except CheckpointError as exc:
            error = exc
        if error is None and self._main:
            try:
                self.verify(name)
            except CheckpointError as exc:
                error = exc
        if self.backend.world_size > 1:  # one answer for every rank before anything loads
            texts = self.backend.all_gather_object(None if error is None else str(error))
            refused = next(((r, t) for r, t in enumerate(texts) if t is not None), None)
            if error is None and refused is not None:
                error = CheckpointError(f"rank {refused[0]} refused it: {refused[1]}", path=self.path(name))
        if error is not None:
            raise error
        assert manifest is not None
        folder, step = self.path(name), manifest.get("step")
        if not touches_engine:
            client = self._client_state(folder, manifest)
        elif module_only and self.backend.zero_stage == 3:
            # DeepSpeed's own module-only load at ZeRO-3 rebuilds the weights from a `latest` file
            # beside the tag folders, which Cadence's names (folders) do not have: rebuild them here.
            self.backend.load_module_weights(self.backend.ds.module, self._full_weights(folder, manifest))
            client = self._client_state(folder, manifest)
        else:
            ds = self.backend.ds
            try:
                path, states = ds.load_checkpoint(
                    str(self.folder_path()),
                    tag=name,
                    load_module_strict=manifest.get("params", "all") != "trainable",
                    load_module_only=module_only,
                    load_optimizer_states=not module_only,
                    load_lr_scheduler_states=False,
                )
            except Exception as exc:
                raise CheckpointError(
                    f"DeepSpeed failed to load it: {type(exc).__name__}: {exc}", path=folder, step=step
                ) from exc
            if path is None:
                raise CheckpointError("DeepSpeed found no checkpoint to load here", path=folder, step=step)
            client = (states or {}).get(CLIENT_KEY)
        if not isinstance(client, Mapping):
            raise CheckpointError("it holds no Cadence payload in its client state", path=folder, step=step)
        payload = dict(client)
        if touches_engine:
            payload.update({"model": {}, "optimizers": [], RESTORED_BY_STORE: True})
        if wanted is not None:
            keep = wanted | {"format", "version", "meta", RESTORED_BY_STORE}
            payload = {k: v for k, v in payload.items() if k in keep}
        return payload

    @classmethod
    def for_reading(cls) -> DeepSpeedStore:
        """A store for `manifest`, `verify` and `read_whole` without a DeepSpeed engine."""
        return cls(backend=None)

    def read_whole(self, name: str) -> dict[str, Any]:
        """Without an engine: the payload with the whole module weights (ZeRO's fp32 masters); no optimizer state."""
        manifest = self.manifest(name)
        folder = self.path(name)
        client = self._client_state(folder, manifest, rank=0)
        if not isinstance(client, Mapping):
            raise CheckpointError(
                "it holds no Cadence payload in its client state", path=folder, step=manifest.get("step")
            )
        return {**client, "model": self._full_weights(folder, manifest), "optimizers": []}

    def _check_fits(self, name: str, manifest: Mapping[str, Any], module_only: bool) -> None:
        """Cadence's own error for what DeepSpeed cannot load: a changed ZeRO stage or data-parallel degree."""
        backend, folder, step = self.backend, self.path(name), manifest.get("step")
        saved_stage, saved_size = manifest.get("zero_stage"), manifest.get("data_size")
        stage, size = backend.zero_stage, backend.data_size
        partitioned = saved_stage == 3 if module_only else (saved_stage or 0) >= 1 or stage >= 1
        if partitioned and saved_size != size:
            raise CheckpointError(
                f"it was saved with a data-parallel degree of {saved_size} at ZeRO-{saved_stage}, this run has "
                f"{size} rank(s): DeepSpeed cannot repartition ZeRO states to another degree; {_UNIVERSAL}",
                path=folder,
                step=step,
            )
        if not module_only and saved_stage != stage:
            raise CheckpointError(
                f"it was saved at ZeRO-{saved_stage}, this run uses ZeRO-{stage}: the optimizer states are laid "
                f"out differently; {_UNIVERSAL}",
                path=folder,
                step=step,
            )

    def _full_weights(self, folder: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """The whole module weights of a checkpoint (fp32 masters when ZeRO saved them)."""
        import torch

        try:
            if manifest.get("zero_stage"):
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name))
            state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            return dict(state["module"])
        except Exception as exc:
            raise CheckpointError(
                f"cannot rebuild the module weights: {type(exc).__name__}: {exc}",
                path=folder,
                step=manifest.get("step"),
            ) from exc

    def _client_state(self, folder: Path, manifest: Mapping[str, Any], rank: int | None = None) -> Any:
        import torch

        rank = min(self.backend.data_rank if rank is None else rank, int(manifest.get("data_size") or 1) - 1)
        file = (
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            if manifest.get("zero_stage") == 3
            else "mp_rank_00_model_states.pt"
        )
        try:
            state = torch.load(folder / file, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise CheckpointError(f"cannot read {file}: {exc}", path=folder, step=manifest.get("step")) from exc
        return state.get(CLIENT_KEY)
