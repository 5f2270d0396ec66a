"""The DCP store's async staging: the tensors DCP writes, copied into CPU buffers kept from save to save.

`DCPStore.write_async` hands `dcp.async_save` the flat `{key: tensor}` of
`dcp_io.split` (plain tensors and DTensors, nothing else: the rest of the
payload goes to the store's own objects file) and this stager, which DCP calls
to copy them before it writes in a thread. Each key keeps its buffer while its
shape, dtype and placement stay the same: pinned for CUDA tensors (the copies
run on a side stream and the loop waits for them, `device_copy.DeviceCopy`),
a DTensor's buffer a CPU DTensor of the same mesh and placements whose local
shard DCP writes.

Why not torch's `DefaultStager`, which the store used before: it deep-copies
the whole state dict with its `StateDictStager`'s own copy table, and
`StateDictStager.close()` clears that table. torch releases whose
`DefaultStager` closes it after every stage (added against a memory leak,
pytorch#170431; torch 2.11.0 on the GPU machine, by its symptom; not 2.13.0)
fail at the next stage: with an empty table even the top-level dict goes
through pickling's reduction, `(copyreg.__newobj__, (dict,), ...)`, and the
class object `dict` in it finds no copier: `KeyError: <class 'type'>`, the
second async save of a run. (On 2.13: stage, `close()`, stage again raises
exactly that.) That close also dropped the pinned buffers, so each save pinned
new ones. Here nothing is deep-copied: only tensors are copied, into buffers
this stager owns (docs/checkpoints.md, "Sharded checkpoints: the DCP store").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from cadence.checkpoint.dcp_io import is_dtensor
from cadence.checkpoint.device_copy import DeviceCopy

logger = logging.getLogger("cadence.checkpoint")


class DCPStager:
    """An `AsyncStager` for `dcp.async_save`: copies `{key: tensor}` into buffers kept per key.

    `stage` returns a new dict of CPU tensors (CPU DTensors for DTensors) holding
    the values at the call; it returns once they are copied, so the loop may
    change the live tensors right after. Buffers stay until a key's shape,
    dtype, device type or placements change, or `close()`.
    """

    _synchronize_after_execute = False  # `stage` returns the copies done: nothing to wait for after

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = {}  # key -> (sig, staged, local)
        self._copies = DeviceCopy()

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    @property
    def nbytes(self) -> int:
        """Bytes of the staged tensors (this rank's shards)."""
        return sum(local.numel() * local.element_size() for _, _, local in self._buffers.values())

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        check_flat(state_dict)
        staged: dict[str, torch.Tensor] = {}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for key, tensor in state_dict.items():
                source = tensor.detach()
                live = source.to_local() if is_dtensor(source) else source
                out, local = self._buffer(key, source, live)
                if live.device.type == "cuda":
                    pairs.append((local, live))
                else:
                    local.copy_(live)
                staged[key] = out
            self._buffers = {key: self._buffers[key] for key in state_dict}  # keys gone: their buffers go
            if pairs:
                self._copies.start(pairs, [])
                self._copies.wait()  # DCP's thread reads the buffers as soon as this returns
        return staged

    def _buffer(self, key: str, source: Any, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pin = live.device.type == "cuda"
        placement = (tuple(source.placements), id(source.device_mesh)) if is_dtensor(source) else None
        signature = (tuple(source.shape), source.dtype, tuple(live.shape), live.device.type, placement)
        kept = self._buffers.get(key)
        if kept is not None and kept[0] == signature:
            return kept[1], kept[2]
        if is_dtensor(source):
            out: Any = _empty_like_dtensor(source, pin)
            local = out.to_local()
        else:
            out = local = torch.empty(tuple(live.shape), dtype=live.dtype, pin_memory=pin)
        self._buffers[key] = (signature, out, local)
        return out, local

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns with the copies done."""

    def close(self) -> None:
        """Free the buffers (a later `stage` allocates them again)."""
        self._buffers = {}


def _empty_like_dtensor(source: Any, pin: bool) -> Any:
    """A CPU DTensor on `source`'s mesh with its placements, its local shard pinned when `pin`.

    `torch.empty_like` runs on the local shard (DTensor's dispatch keeps the mesh and
    placements). If the pinned one is refused: an unpinned one (the copies are then
    neither fast nor asynchronous, but correct), else torch's own way to a CPU DTensor,
    `.to("cpu")` (a copy, overwritten at every stage).
    """
    if pin:
        try:
            out = torch.empty_like(source, device="cpu", pin_memory=True)
            if out.to_local().is_pinned():  # type: ignore[attr-defined]
                return out
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            logger.warning("checkpoint: cannot pin a DTensor's staging buffer (%s); staging it unpinned", exc)
    try:
        out = torch.empty_like(source, device="cpu")
    except (RuntimeError, TypeError, NotImplementedError):
        out = source.to("cpu")
    if out.to_local().data_ptr() == source.to_local().data_ptr():  # type: ignore[attr-defined]  # `.to` of a CPU DTensor is itself
        out = source.clone()
    return out


def check_flat(state_dict: Mapping[str, Any]) -> None:
    """What the DCP store hands DCP: string keys and tensors (plain or DTensor), nothing else.

    Anything else would be deep-copied by whatever stages it; the store's split
    (`dcp_io.split`) sends every other value to its objects file.
    """
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(
                f"DCP staging: entry {key!r} is a {type(value).__name__}; the store hands DCP only tensors "
                "under string keys (dcp_io.split)"
            )
