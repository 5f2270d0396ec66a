"""Context parallel on the mesh: each rank of a context group runs forward and backward on its slice of the sequence.

The model declares what depends on the sequence position:

- `model.context_parallel_buffers(batch)`: a list of `(tensor, seq_dim)`
  pairs: the batch's tensors (tokens, targets) and the model's positional
  buffers (rotary tables), each with its sequence dimension. They are sharded
  in place for the micro-batch (torch's `context_parallel`); the model's own
  buffers are restored afterwards, the batch's tensors stay this rank's slice.
- `model.causal`: whether its attention is causal (the mask decides which
  kernels can run, see below).

The backend runs the step's micro-batches itself (`Backend.forward_backward`,
only on meshes with a context axis), because the sharding has to cover forward
*and* backward: autograd saved the sharded buffers. Each micro-batch is placed,
fires on_batch, is sharded, runs forward under the SDPA kernel chosen here and
the backend's autocast, fires on_forward, backpropagates the rank's own loss
and fires on_backward. `engine.loss` is the whole sequence's loss (the mean of
the context ranks' losses, detached: one small all-reduce per micro-batch);
gradients are averaged over shard x context by FSDP2, which shards parameters
over that flattened axis.

What runs where (torch 2.13; `docs/backends.md`, "Context parallel"): torch
dispatches SDPA to ring attention only for the CUDA flash, efficient and cuDNN
kernels. Elsewhere attention is decomposed into DTensor ops, which works for
the MATH kernel with a non-causal mask only. Everything else is refused at
setup with the kernel and the mask named, not left to fail in the first
backward.

Evaluation and prediction run whole sequences on every context rank (the
context ranks of a data group read the same batches), so their metrics need
no reduction over the context group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from cadence.engine.engine import Engine
    from cadence.engine.step import Step

#: `MeshConfig.context_attention` values and the SDPA backend each enables (None: torch's own choice).
KERNELS: dict[str, str | None] = {"auto": None, "math": "MATH", "flash": "FLASH_ATTENTION",
                                  "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}  # fmt: skip

_FLASH_CPU = (
    "torch registers no sharding strategy for the CPU flash-attention kernel (its backward fails with "
    "'Operator aten._scaled_dot_product_flash_attention_for_cpu_backward.default does not have a sharding "
    "strategy registered')"
)
_CAUSAL_MATH = (
    "the decomposed MATH kernel's causal mask fails inside torch's context parallel ('aten.add.Tensor got "
    "mixed torch.Tensor and DTensor'), and ring attention exists only for the CUDA flash, efficient and "
    "cuDNN kernels"
)


def resolve_kernel(requested: str, device_type: str) -> str:
    """The kernel `MeshConfig.context_attention` means on `device_type` ("auto": MATH on CPU, torch's choice on CUDA)."""
    if requested not in KERNELS:
        raise ValueError(f"mesh.context_attention must be one of {sorted(KERNELS)}, got {requested!r}")
    if requested == "auto":
        return "math" if device_type != "cuda" else "auto"
    return requested


def validate(model: torch.nn.Module, size: int, kernel: str, device_type: str) -> None:
    """Refuse, before any process group exists, a context axis this machine cannot run.

    Raises ValueError when the model declares no sequence buffers or no mask,
    NotImplementedError naming the kernel and the mask when the combination
    cannot run on `device_type`.
    """
    name = type(model).__name__
    if not callable(getattr(model, "context_parallel_buffers", None)):
        raise ValueError(
            f"mesh: context={size} needs `model.context_parallel_buffers(batch)` returning the (tensor, seq_dim) "
            f"pairs to shard along the sequence (the batch's tokens and targets, positional buffers); {name} "
            "declares none, so nothing would be split; add it or set context=1"
        )
    causal = getattr(model, "causal", None)
    if not isinstance(causal, bool):
        raise ValueError(
            f"mesh: context={size} needs `model.causal` (True or False: whether its attention is causal) to "
            f"choose an attention path; {name}.causal is {causal!r}"
        )
    mask = "causal" if causal else "non-causal"
    resolved = resolve_kernel(kernel, device_type)
    if device_type != "cuda" and resolved != "math":
        reason = _FLASH_CPU if resolved == "flash" else f"the {resolved} SDPA kernel needs CUDA"
        raise NotImplementedError(
            f"mesh: context={size} with the {resolved} attention kernel and a {mask} mask cannot run on "
            f"{device_type}: {reason}; set mesh.context_attention='math' (with a non-causal model) or use a GPU"
        )
    if causal and resolved == "math":
        raise NotImplementedError(
            f"mesh: context={size} with the math attention kernel and a causal mask ({name}.causal=True) cannot "
            f"run: {_CAUSAL_MATH}; on {device_type} use a non-causal model"
            + (" or context_attention='flash'/'efficient'/'cudnn'" if device_type == "cuda" else ", or a GPU")
        )


class ContextSchedule:
    """Runs a step's micro-batches with the sequence sharded over the context group.

    Args:
        mesh: the 1-D context `DeviceMesh`.
        kernel: the resolved kernel name ("auto", "math", "flash", ...).
        step: the step the backend would use otherwise (placement,
            gradient sync, autocast, backward are taken from it).
    """

    def __init__(self, mesh: Any, kernel: str, step: Step) -> None:
        self.mesh, self.group, self.size = mesh, mesh.get_group(), mesh.size()
        self.kernel = kernel
        self.to_device: Callable[[Any], Any] | None = step.to_device
        self.sync: Callable[[bool], None] = step.gradient_sync
        self.backward: Callable[[torch.Tensor, int], None] = step.backward
        self.autocast = step.autocast

    def _attention(self) -> contextlib.AbstractContextManager[Any]:
        backend = KERNELS[self.kernel]
        if backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, backend))

    def buffers(self, engine: Engine, batch: Any) -> tuple[list[torch.Tensor], list[int], set[torch.Tensor]]:
        """The tensors to shard, their sequence dims, and those not to restore (the batch's)."""
        pairs = engine.model.context_parallel_buffers(batch)  # type: ignore[operator]
        tensors, dims = [], []
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)):
                raise TypeError(
                    f"{type(engine.model).__name__}.context_parallel_buffers(batch) must return (tensor, seq_dim) "
                    f"pairs; got an item {type(item).__name__}"
                )
            tensors.append(item[0])
            dims.append(int(item[1]))
        if not tensors:
            raise ValueError(f"{type(engine.model).__name__}.context_parallel_buffers(batch) returned no tensors")
        own = {id(b) for b in engine.model.buffers()}
        return tensors, dims, {t for t in tensors if id(t) not in own}

    def __call__(self, engine: Engine, micro_batches: Sequence[Any]) -> None:
        from torch.distributed.tensor.experimental import context_parallel

        from cadence.engine.events import Event

        fire = engine.fire
        to_device, sync, backward = self.to_device, self.sync, self.backward
        n = len(micro_batches)
        for i, batch in enumerate(micro_batches, 1):
            engine.batch = batch if to_device is None else to_device(batch)
            fire(Event.ON_BATCH)
            sync(i == n)
            tensors, dims, keep = self.buffers(engine, engine.batch)
            with (
                context_parallel(self.mesh, buffers=tensors, buffer_seq_dims=dims, no_restore_buffers=keep),
                self._attention(),
            ):
                engine.outputs = None  # as the engine's loop: the last outputs do not live through this forward
                with self.autocast:
                    engine.outputs, loss = engine.compute_loss(engine.batch)
                whole = loss.detach().clone()
                dist.all_reduce(whole, group=self.group)
                engine.loss = whole.div_(self.size)  # the whole sequence's loss, for callbacks and metrics
                fire(Event.ON_FORWARD)
                backward(loss, n)
            fire(Event.ON_BACKWARD)
