"""The backend contract: how the loop talks to a distribution strategy.

The loop never branches on which backend it has. A backend places and wraps
the model, builds once per fit what a step calls (`build_step`: batch placement,
autocast, gradient sync, backward, optimizer step; or its own schedule over
a step's micro-batches) and says how control requests are agreed
(`agreement_mode`), answers collectives over two domains, and saves and
loads checkpoints. `Backend` implements everything for one process; a
distributed backend overrides what differs. See docs/backends.md.

Domains: ``"data"`` is the group of ranks that see different data (metrics are
reduced over it, data positions are gathered over it); ``"optimizer"`` is the
group that must take the same optimizer decision (control requests are agreed
over it). They coincide for DDP; on a mesh the data domain is the replicate x
shard ranks and the optimizer domain the world; under TorchFT both stay inside
a replica group.

Callbacks reach parameters and gradients through the backend
(`local_parameters`, `local_gradients`): plain tensors holding this rank's part
(a DTensor's local shard, a DeepSpeed partition), so checks and averages work on
every backend and never silently on nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import torch

from cadence.engine.step import NULL_CONTEXT, Step

if TYPE_CHECKING:
    from cadence.engine.control import Requests
    from cadence.engine.engine import Engine

ReduceOp = Literal["sum", "mean", "max", "min"]
Domain = Literal["data", "optimizer"]


@attrs.frozen
class LocalParameter:
    """One trainable parameter as a callback sees it on this rank.

    Attributes:
        name: its name in the plain (unwrapped) module, as in checkpoints.
        param: the parameter the model holds (a DTensor on a mesh).
        local: this rank's part of it as a plain tensor sharing its storage
            (the parameter itself on one process and DDP): in-place writes to
            `local` change the parameter.
    """

    name: str
    param: torch.Tensor
    local: torch.Tensor


class Backend:
    """Base backend: one process, no collectives. Subclasses override.

    Attributes:
        rank: global rank of this process.
        world_size: number of processes.
        local_rank: rank on this node.
        data_rank: rank within the data domain (which shard of data this sees).
        data_size: size of the data domain (how many shards).
        device: where the model and batches live.
    """

    name: ClassVar[str] = "base"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    data_rank: int = 0
    data_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on the global main process (rank 0): it writes logs and files."""
        return self.rank == 0

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this rank's replica group writes the run's checkpoint at this save; asked at every save.

        True without replica groups (the main process then writes with a file
        store, every rank with a collective store). Under TorchFT only the
        replica group that is participating rank 0 in the last quorum writes,
        so the writer can change during a run; the other groups write only
        their own data state (`CheckpointStore.write_replica`). Every rank of a
        group must give the same answer.
        """
        return True

    # -- lifecycle --------------------------------------------------------

    def setup(self, engine: Engine) -> None:
        """Join the process group, choose the device, place and wrap the model.

        Sets `engine.wrapped_model` (what forward calls). Called once, before the
        engine builds its data loaders and fires `on_setup`.
        """
        engine.model.to(self.device)
        engine.wrapped_model = engine.model

    def teardown(self) -> None:
        """Release what `setup` acquired (process groups it created)."""

    # -- the step ---------------------------------------------------------

    def build_step(self, engine: Engine) -> Step:
        """The step's calls for the coming fit (`cadence.engine.step.Step`), built at every fit's start.

        The base calls this backend's own methods; `forward_backward` becomes
        the step's schedule only when a subclass overrides it.
        """
        return Step(
            optimizer_step=functools.partial(self.optimizer_step, engine),
            autocast=self.autocast(),
            to_device=self.to_device if self.moves_batches else None,
            gradient_sync=self.set_gradient_sync,
            backward=self.backward,
            finish_gradients=self.finish_gradients,
            skip_step=functools.partial(self.skip_step, engine),
            zero_grad=functools.partial(self.zero_grad, engine),
            schedule=self.forward_backward if self._overrides("forward_backward") else None,
        )

    def agreement_mode(self, engine: Engine) -> Literal["inline", "blocking", "overlapped"]:
        """How this fit agrees control requests (`cadence.engine.agreement`); asked at every fit's start, on every rank.

        "inline": one rank in the optimizer domain (the base); "blocking":
        `agree` before the optimizer step; "overlapped": `agree_start` after
        on_step_start and `agree_finish` before the optimizer step (the engine
        falls back to `agree` while a callback requests inside the step). A
        backend may prepare what the overlapped way needs here (a group).
        """
        return "blocking" if self._overrides("agree") else "inline"

    def _overrides(self, name: str, base: type[Backend] | None = None) -> bool:
        """Whether this backend's class redefines `name` below `base` (default: `Backend`)."""
        return getattr(type(self), name) is not getattr(base or Backend, name)

    def forward_backward(self, engine: Engine, micro_batches: Sequence[Any]) -> None:
        """Run all of one optimizer step's micro-batches on the backend's own schedule.

        Only for backends that must (pipeline parallel): the engine calls this
        only when a backend overrides it, and otherwise runs the micro-batches
        itself (for each: `to_device`, on_batch, forward under `autocast()`,
        on_forward, `backward` after `set_gradient_sync(last)`, on_backward). An
        override sets `engine.batch`, `engine.outputs` and `engine.loss` and
        fires on_batch, on_forward and on_backward where its schedule allows.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.forward_backward: the engine runs micro-batches itself unless a backend "
            "overrides this method to run its own schedule"
        )

    @property
    def moves_batches(self) -> bool:
        """Whether batches need `to_device` before forward (False: used as given)."""
        return True

    def to_device(self, batch: Any) -> Any:
        """Move a batch (tensors in tuples, lists, dicts) to `device`."""
        return move_to(batch, self.device, non_blocking=self.device.type == "cuda")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context for forward; `NULL_CONTEXT` when there is none.

        The engine asks once per fit and enters the same context around every
        micro-batch's forward, so it must be re-enterable (torch.autocast is).
        """
        return NULL_CONTEXT

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward synchronizes gradients across ranks.

        Called before every micro-batch: False on all but a step's last, so
        gradients accumulate locally and sync once per step (DDP's
        `require_backward_grad_sync`, FSDP2's `set_requires_gradient_sync`).
        A flag rather than a context, so the usual step enters no context.
        """

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        """Backpropagate one micro-batch's loss (averaged over the step's `micro_batches`)."""
        (loss / micro_batches if micro_batches > 1 else loss).backward()

    def finish_gradients(self, engine: Engine) -> None:
        """Make gradients final before on_before_optimizer_step (e.g. unscale fp16)."""

    def optimizer_step(self, engine: Engine) -> bool | None:
        """Step every optimizer; return False only when the update was not applied.

        False makes the loop count the step as an agreed skip (the LR scheduler
        does not step, EMA does not average, `state.skipped_steps` counts it).
        Every rank of the optimizer domain must return the same answer.
        """
        for optimizer in engine.optimizers:
            optimizer.step()
        return None

    def skip_step(self, engine: Engine) -> None:
        """Called instead of `optimizer_step` on a step whose skip was agreed.

        Gradients were finished (`finish_gradients`) but are not applied; a
        backend with per-step bookkeeping closes the step here (the fp16
        GradScaler's `update()`).
        """

    def zero_grad(self, engine: Engine) -> None:
        for optimizer in engine.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, engine: Engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients of the model together; returns the pre-clip total norm.

        The norm is a plain tensor over every parameter of the model on every
        rank (a backend with sharded gradients combines its shards' norms).
        """
        return torch.nn.utils.clip_grad_norm_(
            [p for p in engine.model.parameters() if p.grad is not None], max_norm, norm_type=norm_type, foreach=True
        )

    # -- what callbacks see ------------------------------------------------

    def local_parameters(self, engine: Engine) -> list[LocalParameter]:
        """This rank's part of every trainable parameter, with its name (see `LocalParameter`).

        Callbacks that average or inspect parameters (EMA) call it once per fit
        and keep the list: parameters are not replaced while a fit runs.
        """
        return [LocalParameter(n, p, p) for n, p in engine.model.named_parameters() if p.requires_grad]

    def local_gradients(self, engine: Engine) -> list[torch.Tensor]:
        """This rank's part of every gradient that exists, as plain tensors.

        Called once per step by callbacks that check gradients (NonFiniteSkip),
        after `finish_gradients`: the gradients the optimizer step will use.
        Backends whose gradients are not plain tensors on the parameters
        (DTensor shards, DeepSpeed partitions) override it.
        """
        return [p.grad for p in engine.model.parameters() if p.grad is not None]

    @property
    def checks_gradients_itself(self) -> bool:
        """Whether the optimizer step detects non-finite gradients itself and skips.

        True for an fp16 GradScaler and DeepSpeed ZeRO >= 1; such a skip comes
        back from `optimizer_step` as False. Callbacks then check only the loss.
        """
        return False

    def evaluation(self, engine: Engine) -> contextlib.AbstractContextManager[Any]:
        """The context `evaluate()` and `predict()` run in (`NULL_CONTEXT`: none).

        Ranks may hold one evaluation batch more or fewer than others; a backend
        whose forward needs every rank (FSDP2 gathers parameters in each
        forward) holds what it needs here so that uneven shards finish.
        """
        return NULL_CONTEXT

    def eval_lockstep(self, engine: Engine) -> Domain | None:
        """The domain whose ranks must all run the same number of evaluation forwards, or None (the default).

        Asked once per `evaluate()` / `predict()`, inside `evaluation()`. A
        backend whose every forward runs collectives that parameters held
        gathered cannot avoid (the all-to-alls of expert parallel) names the
        domain spanning those collectives' groups. The engine then agrees on
        the largest batch count over that domain (one all-reduce per
        evaluation, from each rank's loader length; one small all-reduce per
        batch when the data has no length), and a rank that runs out of
        batches runs the same forward on a stand-in (its last batch) until
        that count: outputs discarded, counted nowhere (no metric update, no
        `engine.log`, no on_eval_batch / on_predict_batch, no prediction),
        so metrics stay the exact dataset values. None: nothing is agreed or
        added per batch.
        """
        return None

    def data_shard(self, split: str) -> tuple[int, int]:
        """`(rank, size)` that shards the data of `split` ("train", an evaluation split such as "val", "predict").

        `(data_rank, data_size)` for every split by default. Under TorchFT the
        training data is sharded over every replica group while evaluation and
        prediction are sharded inside the group, so that every group computes
        the same evaluation metrics (its reductions never cross groups).
        """
        return self.data_rank, self.data_size

    def eval_forward(self, engine: Engine) -> Callable[[Any], tuple[Any, torch.Tensor | None]] | None:
        """The forward `evaluate()` and `predict()` run per batch, or None: they call the model themselves.

        Asked once per evaluation/prediction. A backend whose ranks hold parts
        of the model (pipeline stages) returns `fn(batch) -> (outputs, loss)`,
        both None on ranks without them (only the last stage has the
        outputs and the loss; the loss is None when the batch has no targets).
        """
        return None

    # -- collectives --------------------------------------------------------

    def process_group(self, domain: Domain = "data") -> Any:
        """The `torch.distributed` group of `domain`, or None with one process (for torchmetrics and the like)."""
        return None

    def reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", domain: Domain = "data") -> torch.Tensor:
        """All-reduce `tensor` over `domain`; returns the result (the input here)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, domain: Domain = "data") -> torch.Tensor:
        """Stack `tensor` from every rank of `domain` along a new first dimension."""
        return tensor.unsqueeze(0)

    def agree(self, requests: Requests) -> None:
        """Agree every pending control request across the optimizer domain (MAX), then `requests.accept(values)`.

        A backend with one rank in that domain leaves this as it is (its
        `agreement_mode` is then "inline": the loop accepts what is pending itself).
        """
        if requests.any_pending or requests.any_agreed:
            requests.accept(requests.pending)

    def agree_start(self, requests: Requests) -> None:
        """Start agreeing what is pending, without waiting (overlapped with the step's forward and backward).

        Called right after `on_step_start` on every rank, in a fit whose
        `agreement_mode` is "overlapped" while no callback requests inside the
        step; `agree_finish` ends it before the optimizer step.
        """

    def agree_finish(self, requests: Requests) -> None:
        """Wait for the agreement `agree_start` began and accept its result, as `agree` would."""

    def barrier(self, timeout: float | None = None) -> None:
        """Wait for every rank."""

    def broadcast_object(self, obj: Any, src: int = 0, domain: Domain = "optimizer") -> Any:
        """Send a picklable object from `src` (a rank within `domain`) to every rank of `domain`; returns it."""
        return obj

    def all_gather_object(self, obj: Any, domain: Domain = "data") -> list[Any]:
        """Every `domain` rank's picklable `obj`, in domain-rank order (checkpoints gather data positions)."""
        return [obj]

    # -- state ------------------------------------------------------------

    def model_state_dict(self, engine: Engine) -> dict[str, Any]:
        return engine.model.state_dict()

    def load_model_state_dict(self, engine: Engine, state: dict[str, Any], strict: bool = True) -> Any:
        return engine.model.load_state_dict(state, strict=strict)

    def optimizer_state_dicts(self, engine: Engine) -> list[dict[str, Any]]:
        return [optimizer.state_dict() for optimizer in engine.optimizers]

    def load_optimizer_state_dicts(self, engine: Engine, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != len(engine.optimizers):
            raise ValueError(
                f"checkpoint has {len(states)} optimizer states, the engine has {len(engine.optimizers)} optimizers"
            )
        for optimizer, state in zip(engine.optimizers, states):
            optimizer.load_state_dict(state)

    def checkpoint_store(self, engine: Engine) -> Any:
        """The store that writes and reads checkpoints for this backend."""
        raise NotImplementedError(f"backend {self.name!r} provides no checkpoint store")

    def describe(self) -> str:
        return f"{self.name}(rank={self.rank}/{self.world_size}, device={self.device})"


def move_to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move tensors nested in tuples, lists, dicts and attrs/dataclass-free containers."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple):
        moved = [move_to(x, device, non_blocking) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, list):
        return [move_to(x, device, non_blocking) for x in batch]
    if isinstance(batch, dict):
        return type(batch)((k, move_to(v, device, non_blocking)) for k, v in batch.items())
    return batch


_Tensor = torch.Tensor


def batch_size(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor (1 if none)."""
    # The loop counts every step's samples: `(inputs, targets)` with a plain tensor first
    # takes the short way (a third of the bytecode of the walk below).
    if type(batch) is tuple and batch and type(batch[0]) is _Tensor:
        shape = batch[0].shape
        return shape[0] if shape else 1
    while True:
        kind = type(batch)
        # Exact types first: the loop counts every step's samples, and an
        # `isinstance(batch, torch.Tensor)` that fails costs ~90 ns.
        if kind is tuple or kind is list:
            if not batch:
                return 1
            batch = batch[0]
        elif isinstance(batch, torch.Tensor):
            shape = batch.shape
            return shape[0] if shape else 1
        elif isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            return 1


@contextlib.contextmanager
def restore_training_mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)
