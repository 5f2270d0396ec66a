"""The mesh backend: FSDP2 / HSDP, tensor and pipeline parallel on one named `DeviceMesh`.

Setup, in this order (see docs/backends.md, "Mesh backend"):

1. Validate, before any process group exists: the axes' product against the
   world size, the context axis's kernel and mask (`context.validate`), the
   expert and expert_tensor axes against the model's experts and the data
   ranks (`experts.validate`), a
   tensor axis without `model.parallelize(mesh)` or a `parallelize` function,
   a pipeline axis without a valid split (`cadence.backends.mesh.pipeline`),
   `CPUOffloadPolicy` on a machine without an accelerator.
2. Join the process group; `init_device_mesh` with the named dimensions
   `("replicate", "shard")`, plus `"pipeline"` (first) and `"tensor"` (last) when
   they are > 1; with a pipeline, rank 0's whole model is broadcast and each
   rank keeps its stages' layers (`Pipeline`). The data domain is
   the flattened replicate x shard group; the optimizer domain is the world.
3. Keep rank 0's full state (to broadcast in 6).
4. Transforms: parallelize (tensor axis), float8 and per-module precision,
   activation checkpointing, compile (`cadence.backends.transforms`), then
   FSDP2 `fully_shard` on every unit, fp32 module and on the root over the
   data sub-mesh (1-D `shard`, or 2-D `replicate x shard`: HSDP) when the data
   domain has more than one rank (`cadence.backends.mesh.sharding`).
5. Point the optimizers at the new (DTensor) parameters, by name.
6. Broadcast rank 0's state (`set_model_state_dict(..., broadcast_from_rank0=True)`):
   replicas built from different seeds start equal (FSDP2 does not broadcast).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from cadence.backends import float8
from cadence.backends.ddp import REDUCE_OPS, DDPBackend, OverlappedAllReduce
from cadence.backends.device import resolve_device
from cadence.backends.mesh import accumulation, sharding
from cadence.backends.mesh.config import MeshConfig
from cadence.backends.mesh.norms import clip_grad_norm, local_tensors
from cadence.backends.mesh.pipeline import Pipeline, SplitFn, refuse_short_steps, resolve_split
from cadence.backends.precision import find_overridden
from cadence.backends.process_group import GroupSettings
from cadence.backends.transforms import (
    UnitsFn,
    apply_activation_checkpointing,
    apply_compile,
    apply_precision,
    find_units,
    unwrap_compiled,
)
from cadence.engine.backend import NULL_CONTEXT, Domain, LocalParameter, ReduceOp, Step
from cadence.engine.step import nothing
from cadence.run import config as config_module

if TYPE_CHECKING:
    from cadence.engine.engine import Engine, EngineConfig

#: `parallelize(model, mesh)`: lays tensor-parallel placements on the model (returns None or the model).
ParallelizeFn = Callable[[torch.nn.Module, Any], Any]


class MeshBackend(DDPBackend):
    """FSDP2, HSDP and tensor parallel over a named `DeviceMesh`.

    Args:
        config: a `MeshConfig`, or a mapping of its fields (merged with keywords).
        parallelize: `fn(model, mesh)` applying tensor parallelism, used instead
            of `model.parallelize(mesh)`; `mesh` is the whole `DeviceMesh`
            (`mesh["tensor"]` is the tensor axis).
        units_fn: `fn(model) -> [modules]`: the blocks to shard, checkpoint
            and compile, instead of `model.fsdp_units()` / `config.units`.
        pipeline_split: `fn(model, parts) -> [[fqn, ...], ...]`: the module
            FQNs of each pipeline stage, instead of `model.pipeline_split(parts)`
            (`config.pipelining.module_fqns_per_model_part` comes first).
        ft: TorchFT fault tolerance across replica groups (`FTConfig` or a
            mapping of its fields): this launch is one replica group running
            FSDP2/HSDP over its replicate and shard axes (always sharded, also
            on one process); each gradient shard is averaged across replica
            groups through the Manager (FSDP2's all-reduce hook). Other axes
            are refused. See docs/fault-tolerance.md.
        **kwargs: `MeshConfig` fields (`shard=2, tensor=2, precision="bf16"`, ...).

    Example:
        >>> import torch, cadence
        >>> def train():
        ...     model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        ...     data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        ...     with cadence.Engine(model, torch.optim.AdamW(model.parameters()), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, seed=0,
        ...                         backend=MeshBackend(shard=2, units=["Linear"]),
        ...                         train=cadence.DataConfig(batch_size=16)) as engine:
        ...         engine.fit(steps=2)
        ...         return engine.backend.data_size
        >>> cadence.launch(train, nprocs=2)  # doctest: +SKIP
        2
    """

    name = "mesh"

    def __init__(
        self,
        config: MeshConfig | Mapping[str, Any] | None = None,
        *,
        parallelize: ParallelizeFn | None = None,
        units_fn: UnitsFn | None = None,
        pipeline_split: SplitFn | None = None,
        ft: Any = None,
        **kwargs: Any,
    ) -> None:
        self.config = config_module.configure(MeshConfig, config, kwargs, "mesh")
        self.ft = None
        if ft is not None:  # TorchFT: axes checked here, before any group or lighthouse (cadence.backends.ft)
            from cadence.backends.ft import FaultTolerance, check_mesh_axes, make_config

            check_mesh_axes(attrs.asdict(self.config))
            ft_config = make_config(ft)
            assert ft_config is not None
            self.ft = FaultTolerance(ft_config)  # validates replica ids and the lighthouse address
        self.parallelize_fn = parallelize
        self.units_fn = units_fn
        self.process_group_backend = self.config.process_group_backend
        self.group_settings = GroupSettings.of("mesh", self.config)  # timeouts, flight recorder
        self.requested_device = self.config.device
        self.precision_name = "fp32"
        self.created_group = False
        self.group: Any = None
        self.set_precision("fp32", torch.device("cpu"))
        self._wrapped: Any = None
        self._agree_host: torch.Tensor | None = None
        self._agree_device: torch.Tensor | None = None
        self._agree_view: Any = None
        self._overlapped = OverlappedAllReduce()
        #: The `DeviceMesh` (dims "replicate", "shard" and "tensor" when > 1), set in setup.
        self.mesh: Any = None
        #: Every axis's resolved size.
        self.sizes: dict[str, int] = {}
        self.data_group: Any = None
        self.sharded = False  # whether fully_shard is applied (a data domain of several ranks, ft, cpu_offload)
        self._fsdp_modules: list[tuple[Any, bool]] = []  # (FSDPModule, its reshard_after_forward)
        self._sync: accumulation.GradientSync | None = None  # config.accumulation_sync over the root, when sharded
        # Context and expert parallel (cadence/backends/mesh/context.py, experts.py), set in setup.
        self.context_mesh: Any = None
        self.expert_mesh: Any = None
        self._expert_params: list[torch.Tensor] = []
        # Meshes whose DTensor gradients are sharded over several dims -> one group spanning them (for norms).
        self._norm_groups: dict[Any, Any] = {}
        # -- pipeline axis (cadence.backends.mesh.pipeline) --
        self.pipeline_split_fn = pipeline_split
        self._split: list[list[str]] | None = None
        #: This rank's stages and schedule when the pipeline axis is > 1, else None.
        self.pipeline: Pipeline | None = None

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> MeshBackend:
        if config.precision not in ("fp32", "bf16"):
            raise ValueError(
                f"precision={config.precision!r} is not supported by the mesh backend (fp16 needs a sharded "
                "grad scaler); use 'bf16' or 'fp32'"
            )
        return cls(device=config.device, precision=config.precision)

    # -- lifecycle --------------------------------------------------------

    def setup(self, engine: Engine) -> None:
        if not dist.is_available():
            raise RuntimeError("MeshBackend: this torch build has no torch.distributed support")
        plain, forward = unwrap_compiled(engine.model)
        if forward is not plain:
            raise ValueError(
                "mesh: the model is already torch.compile'd; pass the plain module and set "
                "`compile={'enabled': True}` on the backend, which compiles each block before sharding it"
            )
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self.sizes = self.config.sizes(world)
        self._validate(engine.model)  # all before any process group or collective
        if self.sizes["pipeline"] > 1:
            self._validate_pipeline(engine)
        if not dist.is_initialized():
            self._init_group()
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = self.rank_device()  # `cuda` is this rank's local GPU (cadence.backends.device)
        self._build_mesh()
        if self.ft is not None:  # the Manager joins the lighthouse; the first quorum heals the groups equal
            self.ft.start(engine, self.rank, self.world_size, self.device.type)
        model = engine.model
        if not self.config.cpu_offload:
            model.to(self.device)
        if self._split is not None:
            self._setup_pipeline(engine)
        full = model.state_dict() if self.rank == 0 and self.pipeline is None else {}
        names = {id(p): n for n, p in model.named_parameters()}
        self._transform(model)
        sharding.rebind_optimizers(engine.optimizers, names, dict(model.named_parameters()))
        if self.world_size > 1 and self.pipeline is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # FSDP2 does not broadcast: ranks seeded differently would start apart.
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        if self.sharded and self.config.float8.enabled and self.config.float8.fsdp_all_gather:
            from cadence.engine.order import Order

            float8.register_scale_precompute(engine, order=Order.EMA + 1)
        engine.wrapped_model = model

    def _validate(self, model: torch.nn.Module) -> None:
        sizes, config = self.sizes, self.config
        if sizes["tensor"] > 1 and self.parallelize_fn is None and not callable(getattr(model, "parallelize", None)):
            raise ValueError(
                f"mesh: tensor={sizes['tensor']} needs `model.parallelize(mesh)` ({type(model).__name__} has none) "
                "or `MeshBackend(parallelize=fn)`; without one the tensor axis would be silently unused"
            )
        # Unit class names and checkpointing without blocks: wrong before anything is joined.
        units = find_units(model, config.units, self.units_fn)
        if config.activation_checkpointing.mode != "none" and not units:
            apply_activation_checkpointing(units, config.activation_checkpointing)  # raises, naming the fix
        group = dist.get_backend() if dist.is_initialized() else self.process_group_backend_name()
        _check_large_model_options(
            model, config, sizes, resolve_device(self.requested_device, process_group=group, current=False)
        )
        if sizes["context"] > 1:
            from cadence.backends.mesh import context

            if sizes["pipeline"] > 1:
                raise NotImplementedError(
                    f"mesh: context={sizes['context']} with pipeline={sizes['pipeline']} is not supported yet "
                    "(each runs the step's micro-batches its own way); set one of them to 1"
                )
            context.validate(model, sizes["context"], config.context_attention, self._expected_device_type())
        from cadence.backends.mesh import experts

        experts.validate(model, sizes)
        if config.cpu_offload and not _has_accelerator():
            raise ValueError(
                "mesh: cpu_offload=True (FSDP2's CPUOffloadPolicy) needs an accelerator (CUDA, ...) to offload from, "
                "and this machine has none; set cpu_offload=False"
            )

    def _expected_device_type(self) -> str:
        """The device type setup will choose, known before any process group (for validation)."""
        group = dist.get_backend() if dist.is_initialized() else self.process_group_backend_name()
        return resolve_device(self.requested_device, process_group=group, current=False).type

    def _init_group(self) -> None:
        if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
            # One process started as a plain script: a group of one, no launcher needed.
            backend = self.process_group_backend_name()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
            self.created_group = True
        else:
            self.start_process_group()

    def _build_mesh(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes
        names = (["pipeline"] if sizes["pipeline"] > 1 else []) + ["replicate", "shard"]
        names += [n for n in ("context", "tensor") if sizes[n] > 1]
        self.mesh = init_device_mesh(self.device.type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
        data = self.mesh["replicate", "shard"]._flatten("data")
        self.data_group = data.get_group()
        self.data_rank, self.data_size = data.get_local_rank(), data.size()
        if sizes["context"] > 1:
            self.context_mesh = self.mesh["context"]
        # fully_shard over a data domain of several ranks; under ft always, also on one rank (the all-reduce
        # hook across replica groups is FSDP2's); with cpu_offload too (CPUOffloadPolicy is FSDP2's).
        self.sharded = self.data_size * sizes["context"] > 1 or self.ft is not None or self.config.cpu_offload
        # bf16 is FSDP2's MixedPrecisionPolicy when parameters are sharded; autocast otherwise (one GPU, TP only).
        self.set_precision("fp32" if self.sharded else self.config.precision, self.device)

    def _transform(self, model: torch.nn.Module) -> None:
        config = self.config
        if self.sizes["tensor"] > 1:
            if self.parallelize_fn is not None:
                self.parallelize_fn(model, self.mesh)
            else:
                model.parallelize(self.mesh)  # type: ignore[operator]
        units = find_units(model, config.units, self.units_fn)
        # Where parameters are not sharded the run autocasts, and fp32 modules run with autocast off.
        autocast = None if self.sharded or config.precision == "fp32" else self.device.type
        units, fp32_modules = apply_precision(
            model, units, config.precision_overrides, config.float8, where="mesh",
            autocast_device=autocast, fsdp=self.sharded, strict=self.pipeline is None,
        )  # fmt: skip
        apply_activation_checkpointing(units, config.activation_checkpointing)
        apply_compile(model, units, config.compile)
        if self.sizes["expert"] * self.sizes["expert_tensor"] > 1:
            from cadence.backends.mesh import experts

            self.expert_mesh, self._expert_params, norm_group = experts.build(
                model, self.device.type, self.world_size, self.sizes["expert"], self.sizes["expert_tensor"]
            )
            self._norm_groups = {self._expert_params[0].device_mesh: norm_group}  # type: ignore[attr-defined]
        if self.sharded:  # decided in _build_mesh
            self._fsdp_modules = sharding.shard(
                model, units, fp32_modules, mesh=self._data_mesh(), config=config, ignored_params=self._expert_params
            )
            self._sync = accumulation.GradientSync(model, config.accumulation_sync)
        if self.ft is not None:
            hook = self.ft.all_reduce_hook()
            for module, _ in self._fsdp_modules:
                module.set_all_reduce_hook(hook)

    def _data_mesh(self) -> Any:
        """The mesh FSDP2 shards over: `shard` (with a context axis, shard x context flattened), with `replicate` for HSDP."""
        if self.sizes["context"] > 1:  # parameters sharded over shard x context: gradients averaged over both
            flat = self.mesh["shard", "context"]._flatten("shard_context")
            # Slicing a flattened dim from the root warns (deprecated); the 1-D case keeps the flattened mesh.
            return self.mesh["replicate", "shard_context"] if self.sizes["replicate"] > 1 else flat
        return self.mesh["replicate", "shard"] if self.sizes["replicate"] > 1 else self.mesh["shard"]

    # -- pipeline axis (cadence.backends.mesh.pipeline) ----------------------

    def _validate_pipeline(self, engine: Engine) -> None:
        """Everything a pipeline axis needs that can be checked before any process group exists."""
        sizes = self.sizes
        if sizes["tensor"] > 1:
            raise NotImplementedError(
                f"mesh: pipeline={sizes['pipeline']} with tensor={sizes['tensor']} is not supported yet "
                "(pipeline runs with the data axes, replicate and shard); set tensor=1"
            )
        if engine.step_fn is not None or engine.loss_fn is None:
            raise ValueError(
                "mesh: a pipeline computes the loss on its last stage as loss_fn(outputs, targets) over "
                "(inputs, targets) batches: pass loss_fn= to the Engine (step_fn and a model returning its "
                "own loss need the whole model)"
            )
        if engine.eval_fn is not None:
            raise ValueError(
                "mesh: eval_fn(model, batch) needs the whole model, which a pipeline stage does not hold; "
                "evaluation logs loss_fn's loss (read engine.outputs on the last stage in on_eval_batch for more)"
            )
        self._split = resolve_split(engine.model, self.config.pipelining, sizes["pipeline"], self.pipeline_split_fn)

    def _setup_pipeline(self, engine: Engine) -> None:
        """Equal start (rank 0's whole model), then this rank's stages; optimizers keep only their parameters."""
        assert self._split is not None
        model = engine.model
        if self.world_size > 1:
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor, src=0, group=self.group)
        before = {id(p) for p in model.parameters()}
        pp_mesh = self.mesh["pipeline"]
        gather = self.mesh["pipeline", "replicate", "shard"]._flatten("pipeline_data")
        self.pipeline = Pipeline(
            engine,
            self._split,
            self.config.pipelining,
            group=pp_mesh.get_group(),
            gather_group=gather.get_group(),
            device=self.device,
        )
        kept = {id(p) for p in model.parameters()}
        for optimizer in engine.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in kept or id(p) not in before]
            for p in list(optimizer.state):
                if id(p) not in kept and id(p) in before:
                    del optimizer.state[p]

    def teardown(self) -> None:
        # The model outlives the backend, and its FSDP2 state and DeviceMesh hold the
        # process groups: a gloo group whose last reference goes at interpreter exit
        # can abort the process there ("terminate called without an active
        # exception", 1-2 runs in 10 under torchrun). Destroy the groups, then let go
        # of those references while the interpreter is fully alive.
        # A group the user created stays theirs, and so does what uses it.
        holders = [module for module, _ in self._fsdp_modules]
        mesh, destroyed = self.mesh, self.created_group
        self.pipeline = None
        self._sync, self._fsdp_modules, self.mesh, self.data_group = None, [], None, None
        self.context_mesh, self.expert_mesh, self._expert_params, self._norm_groups = None, None, [], {}
        super().teardown()
        if destroyed:
            sharding.release_groups(holders, mesh)

    # -- the step ---------------------------------------------------------

    def build_step(self, engine: Engine) -> Step:
        step = super().build_step(engine)
        if self._sync is not None:
            self._sync.reset()
        if not self.sharded:  # tensor-only mesh: gradients are complete after backward
            step = attrs.evolve(step, gradient_sync=nothing)
        if self.pipeline is not None:  # the schedule runs the micro-batches (and syncs gradients itself)
            refuse_short_steps(engine, engine.config.grad_accum)
            step = attrs.evolve(step, schedule=self.pipeline.forward_backward, gradient_sync=nothing)
        return self._context_expert_step(step)

    def _context_expert_step(self, step: Step) -> Step:
        """Context parallel runs the micro-batches (`context.ContextSchedule`); expert gradients get finished."""
        if self._expert_params:
            from cadence.backends.mesh import experts

            groups = self.data_size * self.sizes["context"]
            finish_experts = experts.ExpertGradients(self._expert_params, self.expert_mesh, groups)
            finish_step = step.finish_gradients

            def finish(engine: Engine) -> None:
                finish_step(engine)
                finish_experts()

            step = attrs.evolve(step, finish_gradients=finish)
        if self.context_mesh is not None:
            from cadence.backends.mesh import context

            kernel = context.resolve_kernel(self.config.context_attention, self.device.type)
            step = attrs.evolve(step, schedule=context.ContextSchedule(self.context_mesh, kernel, step))
        return step

    def data_shard(self, split: str) -> tuple[int, int]:
        """The data ranks; with ft, training data over the data ranks of every replica group."""
        if self.ft is not None and split == "train":
            return self.ft.data_shard(self.data_rank, self.data_size)
        return self.data_rank, self.data_size

    def eval_forward(self, engine: Engine) -> Callable[[Any], tuple[Any, torch.Tensor | None]] | None:
        """With a pipeline axis: each evaluation/prediction batch runs forward stage after stage (see `Pipeline.eval_forward`)."""
        return self.pipeline.eval_forward if self.pipeline is not None else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's autocast (not under FSDP2: its policy casts); with `loss_parallel`, inside torch's `loss_parallel()`."""
        context = super().autocast()
        if not self.config.loss_parallel:
            return context
        from cadence.backends.mesh.loss import LossParallelContext

        return LossParallelContext(context)

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        """Backpropagate `loss / micro_batches`; with `loss_parallel`, inside its context (the sharded loss needs it)."""
        if not self.config.loss_parallel:
            return super().backward(loss, micro_batches)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(loss, micro_batches)

    def set_gradient_sync(self, enabled: bool) -> None:
        # As config.accumulation_sync says (cadence.backends.mesh.accumulation); FSDP2 is told only of changes.
        self._sync is None or self._sync(enabled)  # None: parameters not sharded, nothing to sync

    def clip_grad_norm_(self, engine: Engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient together; returns the pre-clip total norm as a plain tensor (`norms.clip_grad_norm`)."""
        grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
        combine = self.pipeline.combine_norm if self.pipeline is not None else None
        return clip_grad_norm(
            grads, max_norm, norm_type, norm_groups=self._norm_groups, combine=combine, device=self.device
        )

    # -- what callbacks see ------------------------------------------------

    def local_parameters(self, engine: Engine) -> list[LocalParameter]:
        """Each trainable parameter with its local shard (`DTensor.to_local()`, sharing its storage)."""
        with torch.no_grad():
            return [
                LocalParameter(name, p, p.to_local() if hasattr(p, "to_local") else p)
                for name, p in engine.model.named_parameters()
                if p.requires_grad
            ]

    def local_gradients(self, engine: Engine) -> list[torch.Tensor]:
        """This rank's part of every existing gradient (DTensor shards as plain tensors)."""
        return local_tensors([p.grad for p in engine.model.parameters() if p.grad is not None])

    def evaluation(self, engine: Engine) -> contextlib.AbstractContextManager[Any]:
        """Keep gathered parameters through evaluation, so unequal batch counts finish.

        Every FSDP2 forward all-gathers its parameters: a rank with one batch
        more would wait for peers that are done. Inside this context no module
        reshards after forward, so each rank's first forward gathers (every
        rank has at least one batch) and later forwards need no collective;
        parameters are resharded on exit (no collective). Gathering at the
        first forward, not on entry, lets `on_eval_start` callbacks (EMA) swap
        parameters in first.
        """
        return self._gathered() if self._fsdp_modules else NULL_CONTEXT

    def eval_lockstep(self, engine: Engine) -> Domain | None:
        """The data domain with expert axes: every mixture-of-experts forward runs all-to-alls on its expert group.

        The expert groups are made of data (x context) ranks, whose exact
        evaluation shards may differ by a batch; no parameter held gathered
        avoids the exchange of tokens. Agreeing over the data domain covers
        every expert group (context ranks of one data rank read the same
        batches). A context axis alone needs nothing: evaluation runs whole
        sequences on each context rank, with no collective in its forward but
        FSDP2's gathers, which `evaluation()` holds.
        """
        return "data" if self.expert_mesh is not None and self.data_size > 1 else None

    @contextlib.contextmanager
    def _gathered(self) -> Iterator[None]:
        modules = self._fsdp_modules
        for module, _ in modules:
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for module, reshard in modules:
                module.reshard()
                module.set_reshard_after_forward(reshard, recurse=False)

    # -- collectives --------------------------------------------------------

    def _group(self, domain: Domain) -> tuple[Any, int]:
        if domain == "data":
            return self.data_group, self.data_size
        if domain == "optimizer":
            return self.group, self.world_size
        raise ValueError(f"unknown domain {domain!r}: expected 'data' or 'optimizer'")

    def process_group(self, domain: Domain = "data") -> Any:
        """The data domain's group (flattened replicate x shard), or the world for "optimizer"."""
        return self._group(domain)[0]

    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", domain: Domain = "data") -> torch.Tensor:
        """All-reduce a copy of `tensor` over `domain` (no collective when it has one rank)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce(op={op!r}): expected one of {sorted(REDUCE_OPS)}")
        group, size = self._group(domain)
        result = tensor.detach().clone()
        if op == "mean" and not result.is_floating_point():
            result = result.double()
        if size > 1:
            dist.all_reduce(result, op=REDUCE_OPS[op], group=group)
            if op == "mean":
                result /= size
        return result

    def all_gather(self, tensor: torch.Tensor, domain: Domain = "data") -> torch.Tensor:
        """Stack `tensor` from every rank of `domain` along a new first dimension (one collective).

        With a pipeline axis, `"data"` gathers the last stage's data ranks on
        every stage: metrics (the loss lives on the last stage) reduce to the
        same values everywhere.
        """
        if self.pipeline is not None and domain == "data":
            return self.pipeline.gather_last_stage(tensor, self.data_size)
        group, size = self._group(domain)
        tensor = tensor.detach().contiguous()
        if size == 1:
            return tensor.unsqueeze(0)
        out = torch.empty((size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor.reshape(-1), group=group)
        return out.view(size, *tensor.shape)

    def all_gather_object(self, obj: Any, domain: Domain = "data") -> list[Any]:
        group, size = self._group(domain)
        if size == 1:
            return [obj]
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, obj, group=group)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0, domain: Domain = "optimizer") -> Any:
        group, size = self._group(domain)
        if size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, group_src=src, group=group)
        return holder[0]

    # -- state ------------------------------------------------------------
    # `torch.distributed.checkpoint.state_dict`: parameter names of the plain
    # module (FQNs), DTensor values with their global shape. The model state
    # aliases the live parameters: loading in place writes into the model.

    def model_state_dict(self, engine: Engine) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(engine.model)

    def load_model_state_dict(self, engine: Engine, state: dict[str, Any], strict: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.pipeline is not None:  # a whole model's state: this rank's stages take their own keys
            state = self.pipeline.own_keys(state)

        return set_model_state_dict(engine.model, state, options=StateDictOptions(strict=strict))

    def optimizer_state_dicts(self, engine: Engine) -> list[dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return [get_optimizer_state_dict(engine.model, optimizer) for optimizer in engine.optimizers]

    def load_optimizer_state_dicts(self, engine: Engine, states: Sequence[dict[str, Any]]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if len(states) != len(engine.optimizers):
            raise ValueError(
                f"checkpoint has {len(states)} optimizer states, the engine has {len(engine.optimizers)} optimizers"
            )
        for optimizer, state in zip(engine.optimizers, states):
            set_optimizer_state_dict(engine.model, optimizer, state)

    def checkpoint_store(self, engine: Engine) -> Any:
        """The DCP store (`cadence.checkpoint.dcp_store.DCPStore`): every rank writes its shards.

        Built for `engine` (`DCPStore.for_engine`): it loads into the live
        (sharded) model, optimizers and callback states. With ft, wrapped in a
        `ReplicaStore`: every rank of the replica group that `writes_checkpoint`
        names writes the run's DCP checkpoint (its collectives on a gloo group
        of this replica group's own world, never across groups); every group
        writes its own data state beside it (group rank 0: the train positions
        of the group's data ranks, indexed by `data_rank` as `restore` reads
        them).
        """
        from cadence.checkpoint.dcp_store import DCPStore

        store = DCPStore.for_engine(engine)
        if self.ft is None:
            return store
        from cadence.checkpoint.replica import ReplicaStore

        ft = self.ft
        return ReplicaStore(
            store, ft.replica_id, ft.group_size, main=self.rank == 0, positions=(0, self.data_size), ft=ft
        )

    def describe(self) -> str:
        axes = " x ".join(f"{n}={s}" for n, s in self.sizes.items() if s > 1) or "one process"
        pg = dist.get_backend(self.group) if self.group is not None and dist.is_initialized() else "uninitialized"
        ft = f", {self.ft.describe()}" if self.ft is not None else ""
        return f"mesh(rank={self.rank}/{self.world_size}, {axes}, {pg}, device={self.device}{ft})"


def _check_large_model_options(
    model: torch.nn.Module, config: MeshConfig, sizes: dict[str, int], device: torch.device
) -> None:
    """Accumulation, per-module precision, float8 and loss parallel options, on the whole model (docs/backends.md)."""
    accumulation.validate(config.accumulation_sync, sizes["replicate"])
    find_overridden(model, config.precision_overrides, "mesh.precision_overrides")
    if config.loss_parallel and sizes["tensor"] == 1:
        raise ValueError(
            "mesh.loss_parallel computes the loss on vocabulary-sharded logits, which needs a tensor axis > 1; "
            "set mesh.tensor, or loss_parallel=False"
        )
    if config.float8.enabled and sizes["tensor"] > 1:
        raise NotImplementedError(
            f"mesh: float8 with tensor={sizes['tensor']} is not supported yet (its tensor-parallel styles are "
            "torchao's float8 ones); set tensor=1 or float8.enabled=False"
        )
    float8.require_device(config.float8, device, "mesh")


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()
