"""Distributed data parallel: one model replica per process, gradients all-reduced.

Every rank holds the whole model and optimizer; `DistributedDataParallel` averages gradients during backward
(only on the last micro-batch of a step: the others run with `require_backward_grad_sync` off). Data is sharded
by the engine from `data_rank`/`data_size`: training data with torchdata's `StatefulDistributedSampler` (padded,
so every rank takes the same steps), evaluation and prediction data with `ExactShardSampler` (each sample once,
no padding, so means are exact). The data and optimizer domains are both the whole world.

With `ft` (TorchFT, see `cadence.backends.ft` and docs/fault-tolerance.md) the
world is one replica group: gradients are all-reduced across replica groups by
TorchFT's Manager, data is sharded over all of them, and metrics, evaluation
and control requests stay inside the group.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from cadence.backends.device import choose_process_group_backend, resolve_device
from cadence.backends.flight_recorder import DEFAULT_ENTRIES, FlightRecorder
from cadence.backends.local import LocalBackend, Precision
from cadence.backends.process_group import GroupSettings, TimeoutSwitch, start_group
from cadence.backends.transforms import ModelTransforms, UnitsFn
from cadence.engine.backend import Domain, ReduceOp
from cadence.engine.step import Step

if TYPE_CHECKING:
    from cadence.backends.ft import FaultTolerance, FTConfig
    from cadence.engine.control import Requests
    from cadence.engine.engine import Engine

#: Default collective timeout. A rank that dies or hangs makes the others raise
#: within this time instead of waiting forever (a dead peer's closed
#: connection usually fails them at once). Raise it when one rank legitimately
#: works alone for longer (a first `torch.compile`, a huge checkpoint save).
DEFAULT_TIMEOUT = timedelta(seconds=300)

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class DDPBackend(LocalBackend):
    """`DistributedDataParallel` over a torch.distributed process group.

    Joins the process group from the environment `torchrun` or `cadence.launch` set (unless one is already
    initialized), and destroys it at `engine.close()` only if it created it.

    Args:
        backend: process-group backend; None: "nccl" with CUDA, else "gloo".
        timeout: collective timeout (`timedelta` or seconds) in steady state; default 300 s.
        init_timeout, init_steps: a longer timeout until the first `init_steps` steps end (None: `timeout`);
            flight_recorder: torch's flight recorder entries (`cadence.backends.process_group.GroupSettings`).
        find_unused_parameters: passed to DDP (for models that skip parameters).
        broadcast_buffers: sync buffers (BatchNorm stats) from rank 0 every forward.
        gradient_as_bucket_view: gradients alias DDP's buckets (saves a copy).
        device: `"cuda"` is `cuda:LOCAL_RANK`; None: that GPU with NCCL, the CPU with gloo (`cadence.backends.device`).
        precision: "fp32", "bf16" or "fp16" (CUDA), as in `LocalBackend`.
        checkpoint: "file": the main process writes one file checkpoint; "dcp": every rank writes its part with
            torch.distributed.checkpoint (`DCPStore`; async saves through DCP's own staging, a checkpoint that
            loads on any number of ranks).
        ft: TorchFT fault tolerance across replica groups (`FTConfig` or a mapping of its fields); this launch
            is one replica group, which must be one process (`WORLD_SIZE=1`). See docs/fault-tolerance.md.
        compile, activation_checkpointing, units, units_fn, precision_overrides, float8: model transforms
            applied before the DDP wrap, as in `LocalBackend`.

    Example:
        >>> import torch, cadence
        >>> def train():
        ...     model = torch.nn.Linear(4, 1)
        ...     data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        ...     with cadence.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...                         loss_fn=torch.nn.functional.mse_loss, backend="ddp", seed=0,
        ...                         train=cadence.DataConfig(batch_size=16)) as engine:
        ...         engine.fit(epochs=1)   # each rank sees 32 of the 64 samples: 2 steps
        ...         return engine.state.step
        >>> cadence.launch(train, nprocs=2)
        2
    """

    name = "ddp"
    #: TorchFT fault tolerance (`ft=`), None without it; a class default, so subclasses that set up
    #: their own attributes (mesh, DeepSpeed) inherit "none".
    ft: FaultTolerance | None = None
    #: torch's flight recorder (`cadence.backends.flight_recorder`) once this backend started its process group.
    flight_recorder: FlightRecorder | None = None
    _switch: TimeoutSwitch | None = None

    def __init__(
        self,
        backend: str | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
        device: str | None = None,
        precision: str = "fp32",
        checkpoint: str = "file",
        *,
        init_timeout: timedelta | float | None = None,
        init_steps: int = 1,
        flight_recorder: int = DEFAULT_ENTRIES,
        ft: FTConfig | Mapping[str, Any] | None = None,
        compile: Any = None,
        activation_checkpointing: Any = None,
        units: list[str] | None = None,
        units_fn: UnitsFn | None = None,
        precision_overrides: dict[str, str] | None = None,
        float8: Any = None,
    ) -> None:
        if checkpoint not in ("file", "dcp"):
            raise ValueError(f"DDPBackend(checkpoint={checkpoint!r}): expected 'file' or 'dcp'")
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"DDPBackend(precision={precision!r}): expected 'fp32', 'bf16' or 'fp16'")
        self.process_group_backend = backend
        self.group_settings = GroupSettings.build("DDPBackend", timeout, init_timeout, init_steps, flight_recorder)
        self.ddp_options: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            **_buffer_sync_option(broadcast_buffers),
        }
        self.requested_device = device
        self.precision_name = precision
        self.checkpoint_format = checkpoint
        self.created_group = False
        self.group: Any = None
        self.set_precision("fp32", torch.device("cpu"))  # replaced in setup
        self._wrapped: Any = None
        # The agreement buffer: one int64 slot per request kind, reused every step.
        self._agree_host: torch.Tensor | None = None
        self._agree_device: torch.Tensor | None = None
        self._agree_view: Any = None
        self._overlapped = OverlappedAllReduce()
        more = {"precision_overrides": precision_overrides, "float8": float8}
        self.transforms = ModelTransforms.build(compile, activation_checkpointing, units, type(self).name, **more)
        self.units_fn = units_fn
        self.ft: FaultTolerance | None = None
        if ft is not None:
            from cadence.backends.ft import FaultTolerance, make_config, unsupported

            if checkpoint != "file":
                raise unsupported(
                    f"checkpoint={checkpoint!r}",
                    "per-replica-group data states are written beside file checkpoints; use 'file'",
                )
            if precision == "fp16":
                raise unsupported(
                    "precision='fp16'", "the GradScaler's own skips are not voted across groups; use bf16"
                )
            config = make_config(ft)
            assert config is not None
            self.ft = FaultTolerance(config)  # validates replica ids and the lighthouse address

    @property
    def timeout(self) -> timedelta:
        """The timeout of collectives now: `init_timeout` until the first steps ended, then `timeout`."""
        return self._switch.current if self._switch is not None else self.group_settings.first_timeout

    # -- lifecycle --------------------------------------------------------

    def setup(self, engine: Engine) -> None:
        if not dist.is_available():
            raise RuntimeError("DDPBackend: this torch build has no torch.distributed support")
        if not dist.is_initialized():  # what setup would refuse after the group started is refused before it:
            device = resolve_device(
                self.requested_device, process_group=self.process_group_backend_name(), current=False
            )
            Precision.create(self.precision_name, device)  # a device not here, fp16 without CUDA: no group left
            self.transforms.check(device, type(self).name)  # float8 without a capable GPU
            self.start_process_group()
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.data_rank, self.data_size = self.rank, self.world_size
        if self.ft is not None:
            from cadence.backends.ft import unsupported

            if self.world_size != 1:
                raise unsupported(
                    f"the ddp backend on {self.world_size} processes per replica group",
                    "a replica group of the ddp backend is one process (WORLD_SIZE=1); start one launch per "
                    "replica group, or use the mesh backend (MeshBackend(ft=...): FSDP2 inside a group)",
                )
            self.data_rank, self.data_size = self.ft.data_shard(self.rank, self.world_size)
        self.device = self.rank_device()
        self.set_precision(self.precision_name, self.device)
        forward = self.prepare_model(engine)  # checkpointing, compile (cadence.backends.transforms)
        engine.model.to(self.device)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device] if self.device.type == "cuda" else None
        if self.ft is not None:
            from cadence.backends.ft import wrap_ddp

            # TorchFT's DDP: the replica groups start equal when the first quorum heals them.
            self.ft.start(engine, self.rank, self.world_size, self.device.type)
            self._wrapped = wrap_ddp(self.ft.manager, forward, device_ids=device_ids, **self.ddp_options)
        else:
            # DDP broadcasts rank 0's parameters and buffers here: every replica starts equal.
            self._wrapped = DistributedDataParallel(forward, device_ids=device_ids, **self.ddp_options)
        engine.wrapped_model = self._wrapped

    def rank_device(self) -> torch.device:
        """This rank's device (`cadence.backends.device`), made current; after the group exists."""
        return resolve_device(
            self.requested_device, local_rank=self.local_rank, rank=self.rank, process_group=dist.get_backend()
        )

    def process_group_backend_name(self) -> str:
        """The process-group backend this backend creates: as given, else NCCL for a CUDA device, else gloo."""
        # Before any group, no device asked for means the local-rank GPU when there is one.
        device = resolve_device(self.requested_device, current=False)
        return choose_process_group_backend(self.process_group_backend, device)

    def start_process_group(self) -> None:
        self.flight_recorder = start_group(
            self.process_group_backend_name(), self.group_settings, self.requested_device
        )
        self.created_group = True

    def teardown(self) -> None:
        # Drop every reference to the process group (the DDP wrapper's reducer holds one, so does `self.group`):
        # destroy_process_group() only shuts a group down, and one whose last reference goes at interpreter exit
        # can abort the process there (gloo: "terminate called without an active exception"). A group the user
        # created is the user's to destroy, but it must not be kept alive by us either.
        if self.ft is not None:
            self.ft.shutdown()
        self._overlapped.close(destroy=not self.created_group)
        self._wrapped, self.group = None, None
        if self.created_group and dist.is_initialized():
            dist.destroy_process_group()
        self.created_group = False

    def build_step(self, engine: Engine) -> Step:
        step = super().build_step(engine)
        self.arm_timeout_switch(engine)
        return step if self.ft is None else self.ft.build_step(engine, step)

    def agreement_mode(self, engine: Engine) -> Literal["inline", "blocking", "overlapped"]:
        """Overlapped over several ranks, blocking on one; with ft, blocking in a group of several, else inline."""
        if self.ft is not None:
            return "inline" if self.world_size == 1 else "blocking"
        if self.world_size == 1:
            return "blocking"
        self._overlapped.join(self.group, self.timeout)
        return "overlapped"

    def data_shard(self, split: str) -> tuple[int, int]:
        """Training data over every rank (with ft: of every replica group); with ft, evaluation and prediction inside the group."""
        if self.ft is not None and split != "train":
            return self.rank, self.world_size
        return self.data_rank, self.data_size

    @property
    def writes_checkpoint(self) -> bool:
        """True; with ft, only in the replica group that is participating rank 0 in the last quorum."""
        return self.ft is None or self.ft.writes_checkpoint

    def set_gradient_sync(self, enabled: bool) -> None:
        # What DistributedDataParallel.no_sync() sets and restores, set per micro-batch.
        self._wrapped.require_backward_grad_sync = enabled

    # -- collectives --------------------------------------------------------

    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", domain: Domain = "data") -> torch.Tensor:
        """All-reduce a copy of `tensor` over `domain` (both are the world for DDP)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce(op={op!r}): expected one of {sorted(REDUCE_OPS)}")
        result = tensor.detach().clone()
        if op == "mean" and not result.is_floating_point():
            result = result.double()
        dist.all_reduce(result, op=REDUCE_OPS[op], group=self.group)
        if op == "mean":
            result /= self.world_size
        return result

    def all_gather(self, tensor: torch.Tensor, domain: Domain = "data") -> torch.Tensor:
        """Stack `tensor` from every rank along a new first dimension (one collective)."""
        tensor = tensor.detach().contiguous()
        out = torch.empty((self.world_size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor.reshape(-1), group=self.group)
        return out.view(self.world_size, *tensor.shape)

    def all_gather_object(self, obj: Any, domain: Domain = "data") -> list[Any]:
        """Every rank's picklable `obj`, in rank order (both domains are the world)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0, domain: Domain = "optimizer") -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self.group)
        return holder[0]

    def process_group(self, domain: Domain = "data") -> Any:
        """The world group: DDP's data and optimizer domains are both every rank."""
        return self.group

    def barrier(self, timeout: float | None = None) -> None:
        """Wait for every rank; on gloo, a rank missing after `timeout` s is named in the error."""
        if dist.get_backend(self.group) == "gloo":
            wait = self.timeout if timeout is None else timedelta(seconds=timeout)
            dist.monitored_barrier(group=self.group, timeout=wait, wait_all_ranks=True)
        elif self.device.type == "cuda":
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)

    def agree(self, requests: Requests) -> None:
        """One MAX all-reduce of every request slot over the optimizer domain.

        The result is read on the host (a device sync on CUDA): the loop
        branches on it (skip the optimizer step, stop, save) and every rank
        must take the same branch, so the decision cannot stay on the device.
        It is the only collective the engine adds to a step, and only while a
        registered callback may raise requests (`Callback.raises_requests`).
        """
        if self._agree_host is None or self._agree_host.numel() != len(requests.pending):
            self._allocate_agreement(len(requests.pending))
        view = self._agree_view
        view[:] = requests.pending
        if self._agree_device is None:
            dist.all_reduce(self._agree_host, op=dist.ReduceOp.MAX, group=self.group)  # type: ignore[arg-type]
        else:
            self._agree_device.copy_(self._agree_host, non_blocking=True)  # type: ignore[arg-type]
            dist.all_reduce(self._agree_device, op=dist.ReduceOp.MAX, group=self.group)
            self._agree_host.copy_(self._agree_device)  # type: ignore[union-attr]
        requests.accept(view[:])

    def agree_start(self, requests: Requests) -> None:
        self._overlapped.start(requests)

    def agree_finish(self, requests: Requests) -> None:
        self._overlapped.finish(requests)

    def arm_timeout_switch(self, engine: Engine) -> None:
        """At a fit's start: `init_timeout` until the first steps end on the groups this backend created (the
        world, and the agreement's own group when it has one)."""
        if self.created_group:
            self._switch = (self._switch or TimeoutSwitch(self.group_settings, self._timeout_groups)).arm(engine)

    def _timeout_groups(self) -> list[Any]:
        return [dist.group.WORLD] + ([self._overlapped.group] if self._overlapped.owned else [])

    def _allocate_agreement(self, slots: int) -> None:
        # Grows when a callback registers a request kind; every rank registers the same kinds: equal sizes.
        on_host = self.device.type == "cpu" or dist.get_backend(self.group) == "gloo"
        pin = not on_host and self.device.type == "cuda"
        self._agree_host, self._agree_view = _slots(slots, pin)
        self._agree_device = None if on_host else torch.zeros(slots, dtype=torch.int64, device=self.device)

    # -- state ------------------------------------------------------------
    # Model and optimizer state come from the unwrapped `engine.model`
    # (inherited): keys carry no "module." prefix, so a checkpoint made on W
    # ranks loads on W' ranks, or on one process with the local backend.

    def checkpoint_store(self, engine: Engine) -> Any:
        """The file store (the main process writes), or with checkpoint="dcp" the DCP store (every rank).

        With ft, wrapped in a `ReplicaStore`: one replica group writes the run's
        checkpoint, every group its own data state beside it.
        """
        if self.checkpoint_format == "dcp":
            from cadence.checkpoint.dcp_store import DCPStore

            store = DCPStore.for_engine(engine)
        else:
            store = super().checkpoint_store(engine)
        if self.ft is None:
            return store
        from cadence.checkpoint.replica import ReplicaStore

        return ReplicaStore(store, self.ft.replica_id, self.ft.group_size)

    def describe(self) -> str:
        pg = dist.get_backend(self.group) if self.group is not None and dist.is_initialized() else "uninitialized"
        ft = f", {self.ft.describe()}" if self.ft is not None else ""
        return f"ddp(rank={self.rank}/{self.world_size}, {pg}, device={self.device}{ft})"


class OverlappedAllReduce:
    """The step's agreement sent without waiting: one MAX all-reduce, on a gloo group.

    `start` writes what is pending into a CPU buffer and launches the
    all-reduce (`async_op=True`) right after `on_step_start`; `finish` waits
    for it before the optimizer step. In between the ranks run forward and
    backward, whose own collectives bring them together, so the all-reduce is
    done by then and no rank waits at the agreement for another one to get
    there.

    The group: where training's own group is a gloo one (on the CPU), that
    group, whose worker threads are busy with training's collectives anyway:
    the agreement is sent at the same point of the step on every rank, so it
    keeps the group's order. On two busy cores a group of its own measured
    about 0.5% slower on a tensor-parallel step, within the noise (its idle
    threads woken for every step's agreement); it is also one group fewer.
    Otherwise (NCCL) a gloo group of its own, over the same ranks: a CPU
    tensor needs no device sync. `own_group=True` always makes one.
    """

    def __init__(self, own_group: bool = False) -> None:
        self.own_group = own_group
        self.group: Any = None
        self.owned = False  # whether `group` was made here (and is destroyed here)
        self.work: Any = None
        self.buffer: torch.Tensor | None = None
        self.view: Any = None

    def join(self, group: Any, timeout: timedelta) -> None:
        """Take the group to agree on (once until `close`; every rank calls this at the same point)."""
        if self.group is not None:
            return
        if not self.own_group and dist.get_backend(group) == "gloo":
            self.group, self.owned = group, False
        else:
            ranks = dist.get_process_group_ranks(group)
            self.group, self.owned = dist.new_group(ranks, timeout=timeout, backend="gloo"), True

    def start(self, requests: Requests) -> None:
        slots = len(requests.pending)
        if self.buffer is None or self.buffer.numel() != slots or self.work is not None:
            # A new kind grew the vector, or a step left early kept its all-reduce out: a fresh buffer.
            self.work = None
            self.buffer, self.view = _slots(slots)
        self.view[:] = requests.pending
        self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def finish(self, requests: Requests) -> None:
        work, self.work = self.work, None
        work.wait()
        requests.accept(self.view[:])

    def close(self, destroy: bool) -> None:
        """Let go of the group (destroying one made here when nobody destroys every group)."""
        group, self.group, self.work = self.group, None, None
        if destroy and self.owned and group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


def _slots(slots: int, pin: bool = False) -> tuple[torch.Tensor, Any]:
    """An int64 host tensor of `slots` zeros and a ctypes array over its memory: the pending values are
    written in and read back without a new tensor (and without numpy)."""
    tensor = torch.zeros(slots, dtype=torch.int64, pin_memory=pin)
    return tensor, (ctypes.c_int64 * slots).from_address(tensor.data_ptr())


def _buffer_sync_option(sync: bool) -> dict[str, bool]:
    # torch >= 2.13 renamed DDP's `broadcast_buffers` (per-forward sync) to
    # `forward_sync_buffers`; buffers are synced at construction either way.
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}
