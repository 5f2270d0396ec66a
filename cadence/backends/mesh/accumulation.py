"""How FSDP2 synchronizes gradients across a step's micro-batches (`MeshConfig.accumulation_sync`).

Three modes, chosen by what a step may hold between micro-batches:

- ``"last"``: every micro-batch but the step's last skips the gradient sync
  (`FSDPModule.set_requires_gradient_sync(False)`): gradients accumulate
  *unsharded* on every rank (the whole model's gradients, in the parameters'
  dtype), and the last micro-batch reduce-scatters (and, under HSDP,
  all-reduces) them once. The least communication, the most memory: a rank
  holds what FSDP exists to remove.
- ``"every"``: every micro-batch reduce-scatters (FSDP2's default, TorchTitan's
  choice): a rank holds only its gradient *shard* between micro-batches, at one
  reduce-scatter per micro-batch.
- ``"replicate_last"`` (HSDP: a replicate axis > 1): every micro-batch
  reduce-scatters within its shard group, and the all-reduce across replicas
  runs only at the last (`FSDPModule.set_requires_all_reduce`): the shard's
  memory, with the cross-replica (often inter-node) traffic once per step.

`"replicate_last"` without a replicate axis is refused at setup (before any
process group): there is no all-reduce to defer, so it would be `"every"` under
another name. Every mode gives the same gradients (tested within 1e-6 of one
process).
"""

from __future__ import annotations

from typing import Any, Literal

AccumulationSync = Literal["last", "every", "replicate_last"]
MODES: tuple[str, ...] = ("last", "every", "replicate_last")

__all__ = ["MODES", "AccumulationSync", "GradientSync", "validate"]


def validate(mode: str, replicate: int) -> None:
    """Raise ValueError when `mode` cannot apply to a mesh with `replicate` replicas."""
    if mode not in MODES:
        raise ValueError(f"mesh.accumulation_sync={mode!r}: expected one of {list(MODES)}")
    if mode == "replicate_last" and replicate < 2:
        raise ValueError(
            f"mesh.accumulation_sync='replicate_last' defers HSDP's all-reduce across replicas, but this mesh has "
            f"replicate={replicate} (no replicas to all-reduce over); use 'every' (reduce-scatter each micro-batch) "
            "or give the mesh a replicate axis > 1"
        )


class GradientSync:
    """`set_gradient_sync(enabled)` for one mode over the root `FSDPModule`.

    FSDP2 walks every FSDP module on each setting: it is changed only when the
    value changes (once or twice a step, never per micro-batch of a step).
    """

    def __init__(self, root: Any, mode: str) -> None:
        validate(mode, replicate=2)  # the replicate axis was checked at setup
        self.root, self.mode = root, mode
        self.current: bool | None = None

    def reset(self) -> None:
        """Forget the last setting (a new fit sets it again on its first micro-batch)."""
        self.current = None

    def __call__(self, last: bool) -> None:
        if last is self.current or self.mode == "every":  # "every": FSDP2's default, never changed
            return
        if self.mode == "last":
            self.root.set_requires_gradient_sync(last)
        else:  # replicate_last: reduce-scatter always, all-reduce across replicas at the last
            self.root.set_requires_all_reduce(last)
        self.current = last
