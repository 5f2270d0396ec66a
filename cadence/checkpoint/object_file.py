"""The file store's checkpoints on object storage (`Checkpoint(dir="s3://...")` on one process and DDP).

Each save is written by the file store into a local staging folder, uploaded
under a prefix of its own with its manifest last, then named by a pointer
(the protocol of `cadence.checkpoint.object_store`). Reads download the save
and verify it as the file store does: every file's size and XXH3-64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from cadence.checkpoint import file_io
from cadence.checkpoint.object_store import ObjectStore

__all__ = ["ObjectFileStore"]


class ObjectFileStore(ObjectStore):
    """File-store checkpoints under a URL; only the main process writes (see `ObjectStore`).

    Example:
        >>> from cadence.checkpoint.file_store import FileStore
        >>> store = ObjectFileStore(FileStore(), "s3://bucket/run/checkpoints")  # doctest: +SKIP
        >>> store.write("latest", {"model": model.state_dict()})                  # doctest: +SKIP
    """

    kind: ClassVar[str] = "file"
    collective: ClassVar[bool] = False

    def write(self, name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Stage, upload (manifest last), then point `name` at the new save and drop the one it replaced."""
        file_io.check_name(name)
        save = self.new_save_id(name)
        with self.staging_store(save) as local:
            manifest = local.write(save, payload)
            self.upload(local.path(save), save)
        self.write_pointer(name, save, manifest)
        return manifest
