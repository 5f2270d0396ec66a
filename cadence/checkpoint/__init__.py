"""Everything about a checkpoint's bytes: the store contract, the payload, the saver and the stores.

- `store`: `CheckpointStore` (the contract every store keeps), `AsyncCheckpointStore`
  (a store that stages its own async saves), `CheckpointError`, and `STORES` (the store
  class of each manifest's `"store"` kind).
- `payload`: `build_payload` / `restore` / `load_pretrained`.
- `launch_modes`: `from_checkpoint` (an engine restored at construction), `load_checkpoint`,
  auto-resume's pick of the newest complete checkpoint, pretrained weights.
- `saver`: every write path of the `Checkpoint` callback (sync, the async writer, a store's
  own async saves, TorchFT's replica path), the main-only protocol and the status exchange.
- `writer`: the async writer; `staging` (with `device_copy` for CUDA tensors): the reused
  buffers it writes from.
- `folders`: `FolderStore`, the base of the stores below (one folder per checkpoint: names,
  sweep, locate, the atomic commit, links, the manifest's frame).
- `file_store` (with `file_io`, `file_read`, `direct_io`): folders of plain files,
  one writer (one process and DDP).
- `dcp_store` (with `dcp_io`, `dcp_commit`, `dcp_read`, `dcp_staging`): torch.distributed.checkpoint,
  every rank writes its shards (meshes; DDP with `checkpoint="dcp"`).
- `deepspeed_store`: DeepSpeed's engine checkpoints; `replica`: TorchFT replica groups.

The `Checkpoint` callback (`cadence.callbacks.checkpoint`) holds the policy:
when to save, which names, retention, best. A backend chooses its store
(`Backend.checkpoint_store`).

Example:
    >>> from cadence.checkpoint import from_checkpoint
    >>> engine = from_checkpoint("runs/x/checkpoints/latest", model, optimizer, data)  # doctest: +SKIP
"""

from cadence.checkpoint.launch_modes import from_checkpoint, load_checkpoint
from cadence.checkpoint.store import (
    FORMAT,
    STORES,
    VERSION,
    AsyncCheckpointStore,
    CheckpointError,
    CheckpointStore,
    store_errors,
)

__all__ = [
    "FORMAT",
    "STORES",
    "VERSION",
    "AsyncCheckpointStore",
    "CheckpointError",
    "CheckpointStore",
    "from_checkpoint",
    "load_checkpoint",
    "store_errors",
]
