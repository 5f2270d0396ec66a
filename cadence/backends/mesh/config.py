"""`MeshConfig`: the axes of the device mesh and what is applied on it."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from cadence.backends.flight_recorder import DEFAULT_ENTRIES
from cadence.backends.float8 import Float8Config
from cadence.backends.mesh.pipeline import PipelineConfig
from cadence.backends.transforms import ActivationCheckpointConfig, CompileConfig

#: Mesh axes, in the order their sizes multiply into the world size.
AXES: tuple[str, ...] = ("replicate", "shard", "context", "pipeline", "tensor", "expert", "expert_tensor")
#: Axes carved out of the data x context ranks rather than multiplied into the world size.
BORROWED_AXES: tuple[str, ...] = ("expert", "expert_tensor")


def _axis(instance: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise ValueError(f"mesh.{attribute.name} must be a size >= 1, or -1 (the rest of the world), got {value!r}")


def _timeout(instance: Any, attribute: Any, value: float) -> None:
    if not value > 0:
        raise ValueError(f"mesh.timeout must be > 0 seconds, got {value!r}")


@attrs.define(kw_only=True)
class MeshConfig:
    """The mesh backend's options.

    Axes (sizes; their product is the world size, and one of them may be -1:
    whatever the others leave):

    - `replicate`, `shard`: the data axes. Parameters are sharded over `shard`
      (FSDP2) and replicated over `replicate` (HSDP when > 1). Together they
      are the data domain: each (replicate, shard) coordinate reads its own
      batches; metrics reduce over them.
    - `tensor`: tensor parallel, laid out by `model.parallelize(mesh)` or the
      backend's `parallelize` function. Every tensor rank of a data group reads
      the same batches.
    - `pipeline`: pipeline parallel (`torch.distributed.pipelining`), split and
      scheduled as `pipelining` says; every stage of a data group reads the
      same batches (see `cadence.backends.mesh.pipeline`).
    - `context`: context parallel (cadence/backends/mesh/context.py): the
      ranks of a context group read the same batches and each runs forward
      and backward on its slice of the sequence; parameters are sharded over
      shard x context. Needs `model.context_parallel_buffers(batch)`.
    - `expert`: expert parallel (cadence/backends/mesh/experts.py). Not a
      factor of the world size: it groups data x context ranks, each holding
      its share of every mixture-of-experts layer's experts. Needs modules
      with `num_experts` and `shard_experts(mesh)`.
    - `expert_tensor`: tensor parallel inside each expert (TorchTitan's ETP):
      each expert's hidden dimension is split over `expert_tensor` ranks,
      which exchange their tokens and sum their partial outputs. Also carved
      out of the data x context ranks (innermost: consecutive ranks), so
      expert x expert_tensor must divide shard x context. Needs modules that
      also declare `expert_hidden` (it must divide it).

    Attributes:
        precision: "fp32", or "bf16": FSDP2's `MixedPrecisionPolicy` with
            bf16 parameters in forward/backward and fp32 gradient reduction
            (`reduce_dtype`); fp32 master weights stay in the optimizer. Where
            parameters are not sharded (one process, tensor only), bf16 autocasts instead.
        reduce_dtype: dtype of the gradient reduce-scatter/all-reduce under bf16.
        reshard_after_forward: free gathered block parameters after forward
            (gathered again in backward); False keeps them until backward
            (more memory, fewer all-gathers). The root keeps its own.
        cpu_offload: FSDP2's `CPUOffloadPolicy` (parameters, gradients and
            optimizer state on the host, copied to the GPU block by block);
            needs an accelerator. Applied on one process too (FSDP2 over a
            mesh of one): a model bigger than one GPU's memory trains there.
        units: class names of the blocks to shard (and checkpoint, compile);
            default `model.fsdp_units()`.
        activation_checkpointing: see `cadence.backends.transforms.ActivationCheckpointConfig`.
        compile: see `cadence.backends.transforms.CompileConfig`.
        device: `"cuda"` is `cuda:LOCAL_RANK`; None: `cuda:LOCAL_RANK` with an NCCL group, else
            the CPU (`cadence.backends.device`).
        process_group_backend: None: "nccl" with CUDA (unless `device` is not CUDA), else "gloo".
        timeout: collective timeout in seconds, in steady state.
        init_timeout, init_steps, flight_recorder: how the process group starts (see
            `cadence.backends.process_group.GroupSettings`): a longer timeout in seconds until the first
            `init_steps` steps end (None: `timeout`), and torch's flight recorder entries (0: off).
        checkpoint: "dcp": `torch.distributed.checkpoint`, every rank writes its shards.
        context_attention: the SDPA kernel under context parallel: "auto"
            (MATH on CPU, torch's choice on CUDA), "math", "flash",
            "efficient" or "cudnn". On CPU only "math" with a non-causal mask
            works; anything else is refused at setup.
        pipelining: the pipeline axis's split and schedule (`PipelineConfig`).
        accumulation_sync: how FSDP2 syncs gradients over a step's micro-batches
            (`cadence.backends.mesh.accumulation`): "last" (unsharded gradients
            held until the last micro-batch), "every" (reduce-scatter each one:
            only the shard held), "replicate_last" (HSDP: reduce-scatter each,
            all-reduce across replicas at the last; needs replicate > 1).
        precision_overrides: `{module class, name or pattern: "fp32"}`: modules
            that compute in fp32 under bf16 (`cadence.backends.precision`): their
            own FSDP2 units with an fp32 `MixedPrecisionPolicy`, or autocast off
            where parameters are not sharded.
        float8: float8 training through torchao (`cadence.backends.float8.Float8Config`).
        loss_parallel: forward, loss and backward run inside
            `torch.distributed.tensor.parallel.loss_parallel()`: cross-entropy
            on vocabulary-sharded logits (the output projection column-wise with
            `use_local_output=False` in the model's plan). Needs tensor > 1.
    """

    replicate: int = attrs.field(default=1, validator=_axis)
    shard: int = attrs.field(default=-1, validator=_axis)
    context: int = attrs.field(default=1, validator=_axis)
    pipeline: int = attrs.field(default=1, validator=_axis)
    tensor: int = attrs.field(default=1, validator=_axis)
    expert: int = attrs.field(default=1, validator=_axis)
    expert_tensor: int = attrs.field(default=1, validator=_axis)
    precision: Literal["fp32", "bf16"] = "fp32"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    units: list[str] | None = None
    activation_checkpointing: ActivationCheckpointConfig = attrs.field(factory=ActivationCheckpointConfig)
    compile: CompileConfig = attrs.field(factory=CompileConfig)
    device: str | None = None
    process_group_backend: str | None = None
    timeout: float = attrs.field(default=300.0, validator=_timeout)
    init_timeout: float | None = None
    init_steps: int = 1
    flight_recorder: int = DEFAULT_ENTRIES
    checkpoint: Literal["dcp"] = "dcp"
    context_attention: Literal["auto", "math", "flash", "efficient", "cudnn"] = "auto"
    pipelining: PipelineConfig = attrs.field(factory=PipelineConfig)
    # -- large models (issue 35): one block, kept together --
    accumulation_sync: Literal["last", "every", "replicate_last"] = "last"
    precision_overrides: dict[str, str] = attrs.field(factory=dict)
    float8: Float8Config = attrs.field(factory=Float8Config)
    loss_parallel: bool = False

    def __attrs_post_init__(self) -> None:
        rest = [name for name in AXES if getattr(self, name) == -1]
        borrowed = [name for name in rest if name in BORROWED_AXES]
        if borrowed:
            raise ValueError(f"mesh.{borrowed[0]} must be a size >= 1 (it divides the data ranks), got -1")
        if len(rest) > 1:
            raise ValueError(f"mesh: at most one axis may be -1 (the rest of the world), got {rest}")

    def sizes(self, world_size: int) -> dict[str, int]:
        """Every axis's size on `world_size` processes (-1 resolved).

        Raises ValueError naming the axes, their product and the world size
        when they do not fit.
        """
        given = {name: getattr(self, name) for name in AXES if name not in BORROWED_AXES}
        known = math.prod(v for v in given.values() if v != -1)
        shown = " x ".join(f"{name}={value}" for name, value in given.items() if value != 1)
        rest = [name for name, value in given.items() if value == -1]
        if rest:
            if world_size % known:
                raise ValueError(
                    f"mesh axes {shown}: the fixed axes multiply to {known}, which does not divide the world size "
                    f"{world_size}, so {rest[0]}=-1 has no size; choose axes whose product divides {world_size}"
                )
            given[rest[0]] = world_size // known
        elif known != world_size:
            raise ValueError(
                f"mesh axes {shown or 'all 1'} multiply to {known}, but the world size is {world_size}; "
                f"make their product {world_size}, or set one axis to -1 (the rest of the world)"
            )
        for name in BORROWED_AXES:  # carved out of the data x context ranks, see cadence/backends/mesh/experts.py
            given[name] = getattr(self, name)
        return {name: given[name] for name in AXES}
