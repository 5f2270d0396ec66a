"""The DCP store's checkpoints on object storage (`Checkpoint(dir="s3://...")` on sharded backends).

Every rank writes its shards with the DCP store into a staging folder on
this host (the ranks share it, as the DCP store shares its folder), then the
main rank uploads the save under a prefix of its own with the manifest last
and points the name at it (the protocol of `cadence.checkpoint.object_store`).
Every rank downloads the save to read it, and the DCP store verifies every
file's size and XXH3-64 before anything loads. Collectives run on the DCP
store's own gloo group, so saves may run in the writer thread (async saves).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from cadence.checkpoint import dcp_io, file_io
from cadence.checkpoint.object_store import ObjectStore
from cadence.checkpoint.store import CheckpointError

__all__ = ["ObjectDCPStore"]


class ObjectDCPStore(ObjectStore):
    """DCP checkpoints under a URL; `write` and `read` are collectives of every rank (see `ObjectStore`).

    The staging folder (`scratch`) must be one folder for every rank: one
    host, or a shared filesystem (the DCP store's ranks meet there).
    """

    kind: ClassVar[str] = "dcp"
    collective: ClassVar[bool] = True

    def _group(self) -> tuple[Any, int, int]:
        return dcp_io.group(float(getattr(self.inner, "timeout", 1800.0)))

    def barrier(self) -> None:
        self.inner.barrier()

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Every rank: write the shards; the main rank uploads and names the save; any error is raised on every rank."""
        file_io.check_name(name)
        group, rank, world = self._group()
        save = dcp_io.broadcast(self.new_save_id(name) if rank == 0 else None, group, world)
        with self.staging_store(save) as local:
            manifest = local.write(save, payload)  # every rank, together
            problem = None
            if rank == 0:
                try:
                    self.upload(local.path(save), save)
                    self.write_pointer(name, save, manifest)
                except Exception as exc:
                    problem = f"{type(exc).__name__}: {exc}"
            problem = dcp_io.broadcast(problem, group, world)  # the others keep the staged files until here
        if problem is not None:
            raise CheckpointError(
                f"uploading {name!r} failed on the main rank: {problem}",
                path=self.path(name),
                step=manifest.get("step"),
            )
        return manifest

    def read(self, name: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """Every rank: download the save, then the DCP store's verified, collective read."""
        group, rank, world = self._group()
        problem = None
        try:
            self.fetch(name, True)
        except CheckpointError as exc:
            problem = exc.reason
        for other, found in enumerate(dcp_io.all_gather(problem, group, world)):
            if found is not None:
                raise CheckpointError(found if other == rank else f"on rank {other}: {found}", path=self.path(name))
        return super().read(name, keys)
