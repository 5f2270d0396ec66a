"""Pipeline parallel on the mesh's `pipeline` axis (`torch.distributed.pipelining`).

The model is split into model parts (stages) by module FQNs; each rank keeps
its own stages' layers and removes the others (FQNs are never renumbered, so a
stage's state dict holds the whole model's keys for its layers and
checkpoints move between stages and the whole model). Training runs a
`torch.distributed.pipelining` schedule through the backend's `forward_backward`
(the `Step`'s `schedule` slot): the step's gradient-accumulation
micro-batches are the pipeline's micro-batches. Evaluation and prediction run
forward only, one whole batch at a time, stage after stage (see `eval_forward`).
See docs/backends.md, "Pipeline parallel".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from cadence.backends.mesh.stages import prune, shell
from cadence.engine.events import Event

if TYPE_CHECKING:
    from cadence.engine.engine import Engine

#: `split(model, parts) -> [[fqn, ...], ...]`: the module FQNs of each model part, in pipeline order.
SplitFn = Callable[[torch.nn.Module, int], Sequence[Sequence[str]]]

#: Schedule names (case-insensitive) -> (torch class name, stages per rank by default, stage placement).
#: "loop": stage s on pipeline rank s % size; "v": ranks hold stages r and 2 x size - 1 - r.
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "loopedbfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleavedzerobubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbvzerobubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


def _schedule_name(instance: Any, attribute: Any, value: str) -> None:
    if value.lower() not in SCHEDULES:
        raise ValueError(
            f"mesh.pipelining.schedule={value!r} is not a known schedule; choose one of "
            "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"
        )


@attrs.define(kw_only=True)
class PipelineConfig:
    """How the mesh's `pipeline` axis splits and schedules the model.

    Attributes:
        schedule: GPipe, 1F1B (default), Interleaved1F1B, LoopedBFS,
            InterleavedZeroBubble, ZBVZeroBubble or DualPipeV
            (`torch.distributed.pipelining`'s schedules; all but the first two
            hold several stages per rank, the last two V-shaped: rank r holds
            stages r and 2 x pipeline - 1 - r, the last stage on rank 0).
        stages_per_rank: model parts per pipeline rank (None: 1 for GPipe and
            1F1B, 2 for the others; V-shaped schedules need 2).
        module_fqns_per_model_part: the module FQNs of each model part, in
            pipeline order (`[["tok_embeddings", "layers.0"], ["layers.1",
            "norm", "output"]]`); None: the backend's `pipeline_split`
            function, else `model.pipeline_split(parts)`.
    """

    schedule: str = attrs.field(default="1F1B", validator=_schedule_name)
    stages_per_rank: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    module_fqns_per_model_part: list[list[str]] | None = None

    def parts_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return SCHEDULES[self.schedule.lower()][1]


def resolve_split(
    model: torch.nn.Module, config: PipelineConfig, size: int, split_fn: SplitFn | None
) -> list[list[str]]:
    """The model parts' FQNs, checked against the model (no collective; raises ValueError naming the problem)."""
    parts = size * config.parts_per_rank()
    single = SCHEDULES[config.schedule.lower()][1] == 1
    if single and config.parts_per_rank() != 1:
        raise ValueError(
            f"mesh.pipelining: schedule {config.schedule!r} runs one stage per rank, got "
            f"stages_per_rank={config.stages_per_rank}; use Interleaved1F1B (or another multi-stage schedule) for several"
        )
    given: Sequence[Sequence[str]]
    if config.module_fqns_per_model_part is not None:
        given, where = config.module_fqns_per_model_part, "mesh.pipelining.module_fqns_per_model_part"
    elif split_fn is not None:
        given, where = split_fn(model, parts), "the pipeline_split function"
    elif callable(getattr(model, "pipeline_split", None)):
        given, where = model.pipeline_split(parts), f"{type(model).__name__}.pipeline_split({parts})"  # type: ignore[operator]
    else:
        raise ValueError(
            f"mesh: pipeline={size} needs a split of the model into {parts} parts: set "
            "mesh.pipelining.module_fqns_per_model_part (a list of module FQNs per part), pass "
            f"MeshBackend(pipeline_split=fn), or give {type(model).__name__} a pipeline_split(parts) method"
        )
    split = [list(part) for part in given]
    if len(split) != parts:
        raise ValueError(
            f"{where} has {len(split)} model parts, but pipeline={size} x stages_per_rank="
            f"{config.parts_per_rank()} needs {parts}"
        )
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    for index, part in enumerate(split):
        if not part:
            raise ValueError(f"{where}: model part {index} is empty; every stage needs at least one module")
        for fqn in part:
            if fqn not in modules or fqn == "":
                close = [name for name in modules if name and name.split(".")[-1] == fqn.split(".")[-1]][:5]
                raise ValueError(
                    f"{where}: model part {index} names module {fqn!r}, which {type(model).__name__} does not "
                    f"have" + (f" (similar: {close})" if close else "") + "; use FQNs from model.named_modules()"
                )
            if fqn in owner:
                raise ValueError(f"{where}: module {fqn!r} is in model parts {owner[fqn]} and {index}")
            owner[fqn] = index
    # Every parameter in exactly one part: none left out (it would never train), none shared.
    for name, _ in model.named_parameters():
        holders = {i for fqn, i in owner.items() if name.startswith(fqn + ".")}
        if not holders:
            raise ValueError(
                f"{where}: parameter {name!r} is in no model part; add its module to one part "
                "(parameters directly on a module that is split are not supported)"
            )
        if len(holders) > 1:
            raise ValueError(f"{where}: parameter {name!r} is in model parts {sorted(holders)}; give it to one")
    return split


def stage_ranks(size: int, parts: int, placement: str) -> list[int]:
    """The pipeline rank of each stage."""
    if placement == "v":
        return [s if s < size else 2 * size - 1 - s for s in range(parts)]
    return [s % size for s in range(parts)]


def refuse_short_steps(engine: Engine, accum: int) -> None:
    """A clear error, before the fit's first step, when the train data gives a step fewer micro-batches or a partial batch."""
    source = engine.data.get("train")
    if source is None or not source.has_len():
        return  # unsized data: the first short step raises (`Pipeline.forward_backward`)
    batches = len(source)
    if batches % accum:
        raise ValueError(
            f"pipeline: the train data gives {batches} batches per epoch (per data rank), not a multiple of "
            f"grad_accum={accum}, the pipeline's fixed micro-batch count; the epoch's last step would be short. "
            "Use a number of batches divisible by grad_accum (drop_last=True and fewer samples), or change grad_accum"
        )
    loader = source.loader
    dataset = getattr(loader, "dataset", None)
    batch = getattr(loader, "batch_size", None)
    drop_last = getattr(loader, "drop_last", True)
    sampler = source.sampler if source.sampler is not None else getattr(loader, "sampler", None)
    try:
        samples = len(sampler) if sampler is not None else len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return
    if batch and not drop_last and samples % batch:
        raise ValueError(
            f"pipeline: the train data's last batch is partial ({samples % batch} of batch_size={batch} samples "
            "per data rank), and a pipeline's micro-batches have a fixed shape; set drop_last=True on the train "
            f"data (with grad_accum={accum} dividing the batches per epoch)"
        )


class Pipeline:
    """This rank's stages, their schedule, and the forward-only path.

    Built by `MeshBackend.setup` when the mesh has a pipeline axis > 1.
    """

    def __init__(
        self,
        engine: Engine,
        split: list[list[str]],
        config: PipelineConfig,
        *,
        group: Any,
        gather_group: Any,
        device: torch.device,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules

        self.group, self.gather_group, self.device = group, gather_group, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        name = config.schedule.lower()
        class_name, _, placement = SCHEDULES[name]
        self.parts = len(split)
        self.owner = stage_ranks(self.size, self.parts, placement)
        self.indices = [s for s in range(self.parts) if self.owner[s] == self.rank]
        self.has_first, self.has_last = 0 in self.indices, self.parts - 1 in self.indices
        self.accum = engine.config.grad_accum
        model = engine.model
        mine = [fqn for s in self.indices for fqn in split[s]]
        self.foreign = tuple(f"{fqn}." for s in range(self.parts) if s not in self.indices for fqn in split[s])
        prune(model, mine)  # the rank's model: its stages' layers, whole-model FQNs
        self.modules = [model] if len(self.indices) == 1 else [shell(model, split[s]) for s in self.indices]
        stages = [
            PipelineStage(module, s, self.parts, device, group=group) for s, module in zip(self.indices, self.modules)
        ]
        self.stages = stages
        cls = getattr(torch_schedules, class_name)
        self.loss_fn = loss_fn = engine.loss_fn
        try:
            if len(stages) == 1 and SCHEDULES[name][1] == 1:
                self.schedule = cls(stages[0], n_microbatches=self.accum, loss_fn=loss_fn, scale_grads=True)
            else:
                self.schedule = cls(stages, n_microbatches=self.accum, loss_fn=loss_fn, scale_grads=True)
        except (ValueError, AssertionError, RuntimeError) as error:
            raise ValueError(
                f"mesh.pipelining: schedule {config.schedule} with {self.parts} stages on {self.size} ranks and "
                f"grad_accum={self.accum} micro-batches: {error}"
            ) from error
        self._shape: Any = None
        self._losses: list[torch.Tensor] = []

    def own_keys(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` without the keys of other ranks' stages (a whole model's state loads into a stage)."""
        return {k: v for k, v in state.items() if not k.startswith(self.foreign)}

    # -- training ----------------------------------------------------------------

    def forward_backward(self, engine: Engine, micro_batches: Sequence[Any]) -> None:
        """Run one step's micro-batches through the schedule, then fire their events.

        on_batch fires for every micro-batch before the schedule runs (a
        callback may still replace `engine.batch`); on_forward and on_backward
        fire per micro-batch after it, with `engine.loss` that micro-batch's
        loss on the last stage and None elsewhere. `engine.outputs` is None.
        """
        n = len(micro_batches)
        if n != self.accum:
            raise ValueError(
                f"pipeline: a step with {n} micro-batches, but the schedule is built for grad_accum={self.accum}; "
                "the train data's epoch ended inside a step: make the batches per epoch a multiple of grad_accum "
                "(drop_last=True on the train data)"
            )
        batches = list(micro_batches)
        for i, batch in enumerate(batches):
            engine.batch = batch
            engine.fire(Event.ON_BATCH)
            batches[i] = engine.batch
        inputs = [b[0] for b in batches]
        shape = inputs[-1].shape
        if self._shape is None:
            self._shape = inputs[0].shape
        if shape != self._shape or (n > 1 and inputs[0].shape != shape):
            raise ValueError(
                f"pipeline: a micro-batch of shape {tuple(shape)} after {tuple(self._shape)}; a pipeline's "
                "micro-batches have a fixed shape: set drop_last=True on the train data (and fixed-length samples)"
            )
        losses = self._losses
        losses.clear()
        if self.has_first:
            x = inputs[0] if n == 1 else torch.cat(inputs)
            if self.has_last:
                y = batches[0][1] if n == 1 else torch.cat([b[1] for b in batches])
                self.schedule.step(x, target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step(x, return_outputs=False)
        elif self.has_last:
            y = batches[0][1] if n == 1 else torch.cat([b[1] for b in batches])
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        engine.outputs = None
        for i, batch in enumerate(batches):
            engine.batch = batch
            engine.loss = losses[i].detach() if losses else None
            engine.fire(Event.ON_FORWARD)
            engine.fire(Event.ON_BACKWARD)

    # -- evaluation and prediction --------------------------------------------------

    def eval_forward(self, batch: Any) -> tuple[Any, torch.Tensor | None]:
        """Forward one whole batch through every stage; `(outputs, loss)` on the last stage, `(None, None)` elsewhere.

        Stage after stage, each boundary sending a small shape header and
        the activation (point-to-point on the pipeline group), so any batch
        size runs, a partial last batch included, and the loss is the whole
        batch's: evaluation means are exact. The training schedule is not
        touched (its buffers are shaped for the training micro-batches).
        """
        if isinstance(batch, (tuple, list)):
            inputs, targets = batch[0], (batch[1] if len(batch) > 1 else None)
        else:
            inputs, targets = batch, None
        x: Any = None
        for s in range(self.parts):
            if self.owner[s] != self.rank:
                continue
            if s == 0:
                x = inputs
            elif self.owner[s - 1] != self.rank:
                x = self._recv(self.owner[s - 1])
            x = self.modules[self.indices.index(s)](x)
            if s < self.parts - 1 and self.owner[s + 1] != self.rank:
                self._send(x, self.owner[s + 1])
        if not self.has_last:
            return None, None
        loss = None
        if targets is not None and self.loss_fn is not None:
            loss = self.loss_fn(x, targets)
        return x, loss

    def _send(self, x: torch.Tensor, peer: int) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"pipeline: a stage returned {type(x).__name__}; stages must pass one tensor on")
        header = torch.zeros(10, dtype=torch.int64, device=self.device)
        header[0] = _DTYPES.index(x.dtype)
        header[1] = x.dim()
        header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        dist.send(header, group=self.group, group_dst=peer)
        dist.send(x.contiguous(), group=self.group, group_dst=peer)

    def _recv(self, peer: int) -> torch.Tensor:
        header = torch.empty(10, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.group, group_src=peer)
        values = header.tolist()
        x = torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=self.device)
        dist.recv(x, group=self.group, group_src=peer)
        return x

    # -- collectives --------------------------------------------------------------

    def combine_norm(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The total gradient norm over every stage, from this rank's stages' norm."""
        norm = norm.detach().to(torch.float64 if norm.device.type != "mps" else torch.float32)
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.group)
            return norm.float()
        power = norm**norm_type
        dist.all_reduce(power, group=self.group)
        return (power ** (1.0 / norm_type)).float()

    def gather_last_stage(self, tensor: torch.Tensor, data_size: int) -> torch.Tensor:
        """The last stage's data ranks' `tensor`, stacked, on every stage (one all_gather over pipeline x data)."""
        tensor = tensor.detach().contiguous()
        size = dist.get_world_size(self.gather_group)
        out = torch.empty((size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor.reshape(-1), group=self.gather_group)
        # Pipeline-major: the last data_size rows are the last stage's.
        last = self.owner[-1]
        return out.view(size // data_size, data_size, *tensor.shape)[last]


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]
